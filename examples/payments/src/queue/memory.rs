//! The queue in memory: one process, the consumer-group contract of a Redis Stream.
//!
//! Time is [`tokio::time::Instant`], so tests on paused time drive `min_idle` and `block`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{ConsumerConfig, Delivery};

/// An in-memory queue with one consumer group; clones share it.
#[derive(Clone, Default)]
pub struct MemoryQueue {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    /// Wakes the consumers waiting in `receive` when a message is published.
    published: Notify,
}

#[derive(Default)]
struct State {
    next_id: u64,
    published: usize,
    /// Every message not acknowledged yet.
    messages: HashMap<u64, Message>,
    /// Messages never delivered, oldest first.
    ready: VecDeque<u64>,
    /// Messages delivered and not acknowledged, by id.
    pending: BTreeMap<u64, Pending>,
}

struct Message {
    payload: String,
    deliveries: u64,
}

struct Pending {
    consumer: String,
    since: Instant,
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a message; returns its id (`<n>-0`, as a stream's ids look).
    pub fn publish(&self, payload: &str) -> String {
        let id = {
            let mut state = self.lock();
            state.next_id += 1;
            state.published += 1;
            let id = state.next_id;
            state.messages.insert(
                id,
                Message {
                    payload: payload.to_owned(),
                    deliveries: 0,
                },
            );
            state.ready.push_back(id);
            id
        };
        self.inner.published.notify_waiters();
        format!("{id}-0")
    }

    /// A consumer of the group.
    pub fn consumer(&self, name: &str, config: ConsumerConfig) -> MemoryConsumer {
        MemoryConsumer {
            queue: self.clone(),
            name: name.to_owned(),
            config,
        }
    }

    /// Messages not delivered yet, plus pending ones.
    pub fn backlog(&self) -> usize {
        let state = self.lock();
        state.ready.len() + state.pending.len()
    }

    /// How many times the pending message `id` was delivered.
    pub fn delivery_count(&self, id: &str) -> Option<u64> {
        let state = self.lock();
        let id = parse_id(id)?;
        state.pending.get(&id)?;
        state.messages.get(&id).map(|message| message.deliveries)
    }

    /// How many messages were ever published.
    pub fn published(&self) -> usize {
        self.lock().published
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// Takes over messages pending for `min_idle` or longer; or else takes new ones.
    fn take(&mut self, consumer: &str, config: &ConsumerConfig, now: Instant) -> Vec<Delivery> {
        let stale: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, pending)| now.duration_since(pending.since) >= config.min_idle)
            .map(|(id, _)| *id)
            .take(config.batch)
            .collect();
        let ids = if stale.is_empty() {
            let n = config.batch.min(self.ready.len());
            self.ready.drain(..n).collect()
        } else {
            stale
        };
        ids.into_iter()
            .filter_map(|id| {
                let message = self.messages.get_mut(&id)?;
                message.deliveries += 1;
                self.pending.insert(
                    id,
                    Pending {
                        consumer: consumer.to_owned(),
                        since: now,
                    },
                );
                Some(Delivery {
                    id: format!("{id}-0"),
                    payload: Some(message.payload.clone()),
                })
            })
            .collect()
    }

    /// When the oldest pending message can be taken over.
    fn next_stale(&self, config: &ConsumerConfig) -> Option<Instant> {
        self.pending
            .values()
            .map(|pending| pending.since + config.min_idle)
            .min()
    }
}

/// A consumer of a [`MemoryQueue`]. Dropping it leaves its pending messages pending, as a
/// crashed process would.
pub struct MemoryConsumer {
    queue: MemoryQueue,
    name: String,
    config: ConsumerConfig,
}

impl MemoryConsumer {
    /// Stale pending messages, taken over; or else new ones, waiting up to `block`.
    pub async fn receive(&mut self) -> Vec<Delivery> {
        // A receive is a round trip to a real queue: let the other tasks (consumers) in.
        tokio::task::yield_now().await;
        let deadline = Instant::now() + self.config.block;
        loop {
            let published = self.queue.inner.published.notified();
            tokio::pin!(published);
            // Registered before looking, so a publish between the look and the wait still wakes.
            published.as_mut().enable();
            let wake_at = {
                let mut state = self.queue.lock();
                let now = Instant::now();
                let taken = state.take(&self.name, &self.config, now);
                if !taken.is_empty() || now >= deadline {
                    return taken;
                }
                state
                    .next_stale(&self.config)
                    .map_or(deadline, |stale| stale.min(deadline))
            };
            tokio::select! {
                () = &mut published => {}
                () = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }

    /// Acknowledges message `id`; nothing happens when it is not pending.
    pub fn ack(&mut self, id: &str) {
        let Some(id) = parse_id(id) else { return };
        let mut state = self.queue.lock();
        if state.pending.remove(&id).is_some() {
            state.messages.remove(&id);
        }
    }
}

fn parse_id(id: &str) -> Option<u64> {
    id.strip_suffix("-0")?.parse().ok()
}

impl fmt::Debug for MemoryQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("MemoryQueue")
            .field("ready", &state.ready.len())
            .field("pending", &state.pending.len())
            .finish()
    }
}

impl fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("name", &self.name)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Who holds each pending message (for debugging).
impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}
