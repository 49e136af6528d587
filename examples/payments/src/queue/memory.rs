//! The queue in memory: one process, a Redis consumer group's contract. Its clock is tokio's,
//! so tests on paused time drive `min_idle` and `block`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{ConsumerConfig, Delivery, Queue, QueueConsumer, QueueError};

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
    /// Every message not acknowledged yet: its payload.
    messages: HashMap<u64, String>,
    /// Messages never delivered, oldest first.
    ready: VecDeque<u64>,
    /// Messages delivered and not acknowledged: since when.
    pending: BTreeMap<u64, Instant>,
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        (self.inner.state.lock()).unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl Queue for MemoryQueue {
    async fn publish(&self, payload: &str) -> Result<String, QueueError> {
        let id = {
            let mut state = self.lock();
            state.next_id += 1;
            let id = state.next_id;
            state.messages.insert(id, payload.to_owned());
            state.ready.push_back(id);
            id
        };
        self.inner.published.notify_waiters();
        // As a stream's ids look.
        Ok(format!("{id}-0"))
    }

    async fn consumer(
        &self,
        _name: &str,
        config: ConsumerConfig,
    ) -> Result<Box<dyn QueueConsumer>, QueueError> {
        Ok(Box::new(MemoryConsumer {
            queue: self.clone(),
            config,
        }))
    }
}

impl State {
    /// Takes over messages pending for `min_idle` or longer; or else takes new ones.
    fn take(&mut self, config: &ConsumerConfig, now: Instant) -> Vec<Delivery> {
        let stale: Vec<u64> = (self.pending.iter())
            .filter(|(_, since)| now.duration_since(**since) >= config.min_idle)
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
                let payload = self.messages.get(&id)?.clone();
                self.pending.insert(id, now);
                Some(Delivery {
                    id: format!("{id}-0"),
                    payload: Some(payload),
                })
            })
            .collect()
    }

    /// When the oldest pending message can be taken over.
    fn next_stale(&self, config: &ConsumerConfig) -> Option<Instant> {
        self.pending
            .values()
            .map(|since| *since + config.min_idle)
            .min()
    }
}

/// A consumer of a [`MemoryQueue`].
struct MemoryConsumer {
    queue: MemoryQueue,
    config: ConsumerConfig,
}

#[async_trait]
impl QueueConsumer for MemoryConsumer {
    async fn receive(&mut self) -> Result<Vec<Delivery>, QueueError> {
        // A receive is a round trip to a real queue: let the other tasks (consumers) in.
        tokio::task::yield_now().await;
        let deadline = Instant::now() + self.config.block;
        loop {
            let published = self.queue.inner.published.notified();
            tokio::pin!(published);
            // Registered before looking, so that a publish between the look and the wait wakes.
            published.as_mut().enable();
            let wake_at = {
                let mut state = self.queue.lock();
                let now = Instant::now();
                let taken = state.take(&self.config, now);
                if !taken.is_empty() || now >= deadline {
                    return Ok(taken);
                }
                (state.next_stale(&self.config)).map_or(deadline, |stale| stale.min(deadline))
            };
            tokio::select! {
                () = &mut published => {}
                () = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }

    async fn ack(&mut self, id: &str) -> Result<(), QueueError> {
        let id = id.strip_suffix("-0").and_then(|id| id.parse().ok());
        let mut state = self.queue.lock();
        if let Some(id) = id
            && state.pending.remove(&id).is_some()
        {
            state.messages.remove(&id);
        }
        Ok(())
    }

    async fn close(self: Box<Self>) {}
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
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
