//! An at-least-once queue: a Redis Stream with a consumer group, or the same behaviour in memory.
//!
//! Both keep the contract of a Redis consumer group:
//! - a message is delivered to one consumer of the group, and stays *pending* (delivered, not
//!   acknowledged) until that consumer acks it;
//! - a message left pending for `min_idle` (its consumer died, or failed to process it) is taken
//!   over by the next consumer that receives (`XAUTOCLAIM`): it is delivered again, to whichever
//!   consumer asks first;
//! - so every message is delivered at least once, and sometimes more than once: the consumer must
//!   make its effects idempotent (see `consumer.rs`).
//!
//! The queue carries strings; it knows nothing of payments.

mod memory;
mod redis;

use std::time::Duration;

use tower_idempotency_redis::RedisStoreError;

pub use memory::{MemoryConsumer, MemoryQueue};
pub use redis::{RedisConsumer, RedisQueue};

/// One delivery of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The message's id in the queue (a stream entry id in Redis), for [`QueueConsumer::ack`].
    /// Two publishes of one payload are two messages with two ids.
    pub id: String,
    /// The message; `None` when it was deleted (trimmed from the stream) while pending.
    pub payload: Option<String>,
}

/// How a consumer receives; each setting has a builder method that states its default.
#[derive(Debug, Clone, Copy)]
pub struct ConsumerConfig {
    /// How long a message stays pending with one consumer before another may take it over.
    pub min_idle: Duration,
    /// How long a receive waits for a new message.
    pub block: Duration,
    /// How many messages a receive takes at most.
    pub batch: usize,
}

impl Default for ConsumerConfig {
    /// `min_idle` 5 s, `block` 1 s, `batch` 16.
    fn default() -> Self {
        Self {
            min_idle: Duration::from_secs(5),
            block: Duration::from_secs(1),
            batch: 16,
        }
    }
}

impl ConsumerConfig {
    /// Sets how long a message stays pending before another consumer may take it over. Default:
    /// 5 seconds. Keep it above the time a message normally takes.
    pub fn min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// Sets how long a receive waits for a new message. Default: 1 second.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Sets how many messages a receive takes at most. Default: 16.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }
}

/// The queue failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// Redis failed or was unreachable.
    #[error("the event stream is unavailable")]
    Redis(#[from] RedisStoreError),
}

/// Where messages go: in memory (one process) or a Redis Stream (shared). Clones share it.
#[derive(Debug, Clone)]
pub enum Queue {
    Memory(MemoryQueue),
    Redis(RedisQueue),
}

impl Queue {
    /// A new, empty in-memory queue.
    pub fn memory() -> Self {
        Queue::Memory(MemoryQueue::new())
    }

    /// Appends a message; returns its id.
    pub async fn publish(&self, payload: &str) -> Result<String, QueueError> {
        match self {
            Queue::Memory(queue) => Ok(queue.publish(payload)),
            Queue::Redis(queue) => queue.publish(payload).await,
        }
    }

    /// A consumer of the group, named `name` (unique per process: a restarted process is a new
    /// consumer, and the group's pending messages of the old one are taken over).
    pub async fn consumer(
        &self,
        name: &str,
        config: ConsumerConfig,
    ) -> Result<QueueConsumer, QueueError> {
        Ok(match self {
            Queue::Memory(queue) => QueueConsumer::Memory(queue.consumer(name, config)),
            Queue::Redis(queue) => {
                QueueConsumer::Redis(Box::new(queue.consumer(name, config).await?))
            }
        })
    }

    /// How many messages are not acknowledged yet: not delivered, or pending.
    #[allow(dead_code)] // for tests
    pub async fn backlog(&self) -> Result<usize, QueueError> {
        match self {
            Queue::Memory(queue) => Ok(queue.backlog()),
            Queue::Redis(queue) => queue.backlog().await,
        }
    }

    /// How many times the pending message `id` was delivered; `None` when it is not pending.
    #[allow(dead_code)] // for tests
    pub async fn delivery_count(&self, id: &str) -> Result<Option<u64>, QueueError> {
        match self {
            Queue::Memory(queue) => Ok(queue.delivery_count(id)),
            Queue::Redis(queue) => queue.delivery_count(id).await,
        }
    }

    /// How many messages were ever published.
    #[allow(dead_code)] // for tests
    pub async fn published(&self) -> Result<usize, QueueError> {
        match self {
            Queue::Memory(queue) => Ok(queue.published()),
            Queue::Redis(queue) => queue.published().await,
        }
    }
}

/// One consumer of the group. Dropping it without [`QueueConsumer::close`] is a consumer that
/// died: its pending messages wait for `min_idle`, then another consumer takes them over.
#[derive(Debug)]
pub enum QueueConsumer {
    Memory(MemoryConsumer),
    Redis(Box<RedisConsumer>),
}

impl QueueConsumer {
    /// The next messages: first the ones pending for `min_idle` or longer (any consumer's, this
    /// one's included), taken over; else new ones, waiting up to `block` for one. May be empty.
    /// Cancel-safe: a message received but never returned stays pending and comes back.
    pub async fn receive(&mut self) -> Result<Vec<Delivery>, QueueError> {
        match self {
            QueueConsumer::Memory(consumer) => Ok(consumer.receive().await),
            QueueConsumer::Redis(consumer) => consumer.receive().await,
        }
    }

    /// Acknowledges message `id`: it is done, and never delivered again.
    pub async fn ack(&mut self, id: &str) -> Result<(), QueueError> {
        match self {
            QueueConsumer::Memory(consumer) => {
                consumer.ack(id);
                Ok(())
            }
            QueueConsumer::Redis(consumer) => consumer.ack(id).await,
        }
    }

    /// Leaves the group at a graceful stop. A consumer with messages still pending stays in the
    /// group, so that they are taken over after `min_idle`.
    pub async fn close(self) {
        match self {
            QueueConsumer::Memory(_) => {}
            QueueConsumer::Redis(consumer) => consumer.close().await,
        }
    }
}
