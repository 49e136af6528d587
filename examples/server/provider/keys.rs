//! The provider's idempotency keys: for the dedup window, each remembers the request it was used
//! for and the reply that request got.
//!
//! - In memory: a map under one lock, and the keys in the order they were first used, so that
//!   the expired ones are dropped from the front.
//! - In Redis: one key per idempotency key, `<prefix><key>`, holding the JSON of [`Used`], written
//!   with `SET NX PX <window> GET`: one command claims a vacant key or returns what it holds, so
//!   every instance on that Redis shares one table and two of them never both win a key.
//! - In PostgreSQL: one row per idempotency key in `provider_keys` (`pg/schema.sql`), written
//!   with one `INSERT ... ON CONFLICT` that claims a vacant or expired key or returns the live row;
//!   the primary key lets only one of two instances win a key. (A real provider keeps its keys in
//!   its own database: the table stands for that outside service, so that every instance of the
//!   example, and a restarted one, calls one provider.)

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower_idempotency::deadpool_redis::redis;
#[cfg(feature = "postgres")]
use tower_idempotency::store::sqlx::{self, PgPool, Row};

use super::super::redis_conn::{RedisConn, RedisFailure};

/// What an idempotency key was used for, and what it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Used {
    /// The operation and its parameters, as [`super::Request::describe`] writes them.
    pub request: String,
    /// The id the call answered with: the payment's, or the refund's.
    pub id: String,
}

/// The key table could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyTableError {
    /// Redis failed, or did not answer in time.
    #[error("the provider's key table is unavailable")]
    Redis(#[from] RedisFailure),
    /// A key holds something that is not a [`Used`].
    #[error("the provider's key table holds an unreadable record")]
    Unreadable(#[from] serde_json::Error),
    /// PostgreSQL failed.
    #[cfg(feature = "postgres")]
    #[error("the provider's key table is unavailable")]
    Postgres(#[from] sqlx::Error),
}

/// The idempotency keys, in memory or in Redis; clones share them.
#[derive(Debug, Clone)]
pub struct KeyTable {
    window: Duration,
    backend: Backend,
}

#[derive(Clone)]
enum Backend {
    Memory(Arc<Mutex<MemoryKeys>>),
    Redis {
        conn: RedisConn,
        prefix: Arc<str>,
    },
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
}

#[derive(Debug, Default)]
struct MemoryKeys {
    used: HashMap<String, (Instant, Used)>,
    /// Each key with the deadline it was given, first used first: with one window for every
    /// key, that is also the order in which they expire.
    order: VecDeque<(Instant, String)>,
}

impl KeyTable {
    /// Keys in memory, each remembered for `window`.
    pub fn memory(window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Memory(Arc::default()),
        }
    }

    /// Keys in the Redis of `conn`, under `prefix`, each remembered for `window`.
    pub fn redis(conn: RedisConn, prefix: &str, window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Redis {
                conn,
                prefix: prefix.into(),
            },
        }
    }

    /// Keys in the `provider_keys` table of `pool`'s database, each remembered for `window`.
    #[cfg(feature = "postgres")]
    pub fn postgres(pool: PgPool, window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Postgres(pool),
        }
    }

    /// How long a key is remembered after its first use.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// What `key` was used for within the window, if it was.
    pub async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => Ok(lock(keys).live(key, Instant::now()).cloned()),
            Backend::Redis { conn, prefix } => {
                let mut get = redis::cmd("GET");
                get.arg(format!("{prefix}{key}"));
                let held: Option<String> = conn
                    .run(move |mut c| async move { get.query_async(&mut c).await })
                    .await?;
                Ok(held.as_deref().map(serde_json::from_str).transpose()?)
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres(pool) => {
                let row = sqlx::query(
                    "SELECT request, id FROM provider_keys
                     WHERE key = $1 AND expires_at > statement_timestamp()",
                )
                .bind(key)
                .fetch_optional(pool)
                .await?;
                Ok(row.map(|row| Used {
                    request: row.get(0),
                    id: row.get(1),
                }))
            }
        }
    }

    /// Records `used` under `key` unless the key was used within the window: `None` when `used`
    /// is recorded now, or else what the key was used for.
    pub async fn insert(&self, key: &str, used: &Used) -> Result<Option<Used>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let now = Instant::now();
                let mut keys = lock(keys);
                keys.forget_expired(now);
                if let Some(earlier) = keys.live(key, now) {
                    return Ok(Some(earlier.clone()));
                }
                let deadline = now + self.window;
                keys.used.insert(key.to_owned(), (deadline, used.clone()));
                keys.order.push_back((deadline, key.to_owned()));
                Ok(None)
            }
            Backend::Redis { conn, prefix } => {
                let window = u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX);
                let mut set = redis::cmd("SET");
                set.arg(format!("{prefix}{key}"))
                    .arg(serde_json::to_string(used)?)
                    .arg("NX")
                    .arg("PX")
                    .arg(window.max(1))
                    .arg("GET");
                let held: Option<String> = conn
                    .run(move |mut c| async move { set.query_async(&mut c).await })
                    .await?;
                Ok(held.as_deref().map(serde_json::from_str).transpose()?)
            }
            #[cfg(feature = "postgres")]
            Backend::Postgres(pool) => {
                let window = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
                // A live row is left as it is (the update rewrites it with its own values, which
                // takes its lock and returns it); an expired one is taken over. The new id is
                // unique, so getting it back means this call won the key.
                let row = sqlx::query(
                    "INSERT INTO provider_keys AS k (key, request, id, expires_at)
                     VALUES ($1, $2, $3, statement_timestamp() + $4::int8 * interval '1 millisecond')
                     ON CONFLICT (key) DO UPDATE SET
                         request = CASE WHEN k.expires_at > statement_timestamp()
                                        THEN k.request ELSE excluded.request END,
                         id = CASE WHEN k.expires_at > statement_timestamp()
                                   THEN k.id ELSE excluded.id END,
                         expires_at = CASE WHEN k.expires_at > statement_timestamp()
                                           THEN k.expires_at ELSE excluded.expires_at END
                     RETURNING request, id",
                )
                .bind(key)
                .bind(&used.request)
                .bind(&used.id)
                .bind(window.max(1))
                .fetch_one(pool)
                .await?;
                let held = Used {
                    request: row.get(0),
                    id: row.get(1),
                };
                Ok((held.id != used.id).then_some(held))
            }
        }
    }
}

impl MemoryKeys {
    /// The record of `key`, unless it expired.
    fn live(&self, key: &str, now: Instant) -> Option<&Used> {
        self.used
            .get(key)
            .filter(|(deadline, _)| *deadline > now)
            .map(|(_, used)| used)
    }

    fn forget_expired(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.order.front() {
            if *deadline > now {
                break;
            }
            let Some((deadline, key)) = self.order.pop_front() else {
                break;
            };
            // The key may have been used again since, with a later deadline: keep that record.
            if self.used.get(&key).is_some_and(|(at, _)| *at == deadline) {
                self.used.remove(&key);
            }
        }
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Memory(keys) => f
                .debug_struct("Memory")
                .field("keys", &lock(keys).used.len())
                .finish(),
            Backend::Redis { conn, prefix } => f
                .debug_struct("Redis")
                .field("conn", conn)
                .field("prefix", prefix)
                .finish(),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => f.debug_struct("Postgres").finish_non_exhaustive(),
        }
    }
}

fn lock(keys: &Mutex<MemoryKeys>) -> std::sync::MutexGuard<'_, MemoryKeys> {
    keys.lock().unwrap_or_else(PoisonError::into_inner)
}
