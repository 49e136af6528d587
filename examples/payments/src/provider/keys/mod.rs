//! The provider's idempotency keys and payments: the [`KeyTable`] trait, one implementation per
//! backend (`memory.rs`, `redis.rs`, `postgres.rs`). For the window, each key remembers the
//! request it was used for, the reply it got, and the largest fence a call with it carried; the
//! check and raise of the fence, the claim of the key and the call's effect (a payment recorded,
//! a refund taken from what is left of its payment) are one atomic step.
//!
//! The tables stand for an outside service's own records: in Redis or PostgreSQL, every instance
//! of the example (and a restarted one) calls one provider.

mod memory;
mod postgres;
mod redis;

use std::fmt;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tower_idempotency_redis::RedisStoreError;

pub use memory::MemoryKeys;
pub use postgres::PgKeys;
pub use redis::{PROVIDER_PREFIX, RedisKeys};

use super::{Effect, PaymentRecord, ProviderError};

/// The provider's keys and payments.
#[async_trait]
pub trait KeyTable: fmt::Debug + Send + Sync {
    /// What `key` was used for within the window, if it was.
    async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError>;

    /// Records `used` under `key` and makes `effect`, unless the key was used within the window:
    /// `Ok(Ok(None))` when recorded now, `Ok(Ok(Some(_)))` with what the key was used for (its
    /// fence raised to `used.fence` when it was used for the same request), or a refund's
    /// refusal (nothing recorded). One atomic step.
    async fn insert(
        &self,
        key: &str,
        used: &Used,
        effect: Effect,
    ) -> Result<Result<Option<Used>, ProviderError>, KeyTableError>;

    /// Up to `limit` payments made since `since` (ms since the epoch), oldest first.
    async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, KeyTableError>;

    /// Deletes the keys whose window ended, where they do not go by themselves; how many went.
    async fn sweep(&self) -> Result<u64, KeyTableError>;
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// What an idempotency key was used for, and what it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Used {
    /// The operation and its parameters, as [`super::Request::describe`] writes them.
    pub request: String,
    /// The id the call answered with: the payment's, or the refund's.
    pub id: String,
    /// The largest fence a call with the key carried, as 20 decimal digits: the Redis script
    /// compares two as strings, exactly, and no Lua number (a double) ever holds one.
    #[serde(default, with = "fence_digits")]
    pub fence: u64,
}

mod fence_digits {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(fence: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format!("{fence:020}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        let digits = String::deserialize(deserializer)?;
        digits.parse().map_err(D::Error::custom)
    }
}

/// The key table could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyTableError {
    /// Redis failed, or did not answer in time.
    #[error("the provider's key table is unavailable")]
    Redis(#[from] RedisStoreError),
    /// A key holds something that is not a [`Used`].
    #[error("the provider's key table holds an unreadable record")]
    Unreadable(#[from] serde_json::Error),
    /// PostgreSQL failed.
    #[error("the provider's key table is unavailable")]
    Postgres(#[from] sqlx::Error),
}
