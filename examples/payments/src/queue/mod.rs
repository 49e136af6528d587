//! An at-least-once queue with the contract of a Redis consumer group: the [`Queue`] trait, on a
//! Redis Stream (`redis.rs`) or in memory (`memory.rs`). (On PostgreSQL the events go to an
//! outbox table instead: `outbox.rs`.)
//!
//! - a message is delivered to one consumer of the group and stays *pending* until it is acked;
//! - one pending for `min_idle` (its consumer died, or failed) is taken over by the next consumer
//!   that receives (`XAUTOCLAIM`);
//! - so every message is delivered at least once, sometimes more: the consumer makes its effects
//!   idempotent (`consumer.rs`).
//!
//! The queue carries strings; it knows nothing of payments.

mod memory;
mod redis;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use tower_idempotency_redis::RedisStoreError;

pub use memory::MemoryQueue;
pub use redis::RedisQueue;

/// Where messages go; shared by its clones and every consumer.
#[async_trait]
pub trait Queue: fmt::Debug + Send + Sync {
    /// Appends a message; returns its id.
    async fn publish(&self, payload: &str) -> Result<String, QueueError>;

    /// A consumer of the group named `name`: unique per process, so that a restarted process
    /// is a new consumer and takes over what the old one left pending.
    async fn consumer(
        &self,
        name: &str,
        config: ConsumerConfig,
    ) -> Result<Box<dyn QueueConsumer>, QueueError>;
}

/// One consumer of the group. Dropping it without [`QueueConsumer::close`] is a consumer that
/// died: its pending messages wait for `min_idle`, then another consumer takes them over.
#[async_trait]
pub trait QueueConsumer: fmt::Debug + Send {
    /// Messages pending for `min_idle` or longer (anyone's), taken over; else new ones, waiting
    /// up to `block` for one. Cancel-safe: a message received but not returned comes back.
    async fn receive(&mut self) -> Result<Vec<Delivery>, QueueError>;

    /// Acknowledges message `id`: done, never delivered again.
    async fn ack(&mut self, id: &str) -> Result<(), QueueError>;

    /// Leaves the group at a graceful stop, unless messages are still pending for it.
    async fn close(self: Box<Self>);
}

/// One delivery of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The message's id (a stream entry id), for [`QueueConsumer::ack`]. Two publishes of one
    /// payload are two messages.
    pub id: String,
    /// The message; `None` when it was deleted (trimmed from the stream) while pending.
    pub payload: Option<String>,
}

/// How a consumer receives.
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
    /// 5 s; keep it above the time a message normally takes.
    pub fn min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// Sets how long a receive waits for a new message. Default: 1 s.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
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
