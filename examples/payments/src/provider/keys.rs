//! The provider's idempotency keys: for the dedup window, each remembers the request it was used
//! for, the reply that request got, and the largest fence a call with it carried.
//!
//! The fence is the caller's claim number ([`tower_idempotency::Fence`]): a call whose fence is
//! smaller than one the key has seen comes from a run that another run took over, and is refused
//! (`Provider` answers it [`ProviderError::Superseded`](super::ProviderError::Superseded)). The
//! check and the raise of the fence are one atomic step with the claim of the key:
//!
//! - In memory: a map under one lock, and the keys in the order they were first used, so that
//!   the expired ones are dropped from the front.
//! - In Redis: one key per idempotency key, `<prefix><key>`, holding the JSON of [`Used`], written
//!   by one Lua script that sets a vacant key (`PX <window>`) or returns what it holds, raising its
//!   fence (`KEEPTTL`): one key per script, so it runs on a Redis Cluster as on one server, and
//!   every instance on that Redis shares one table and two of them never both win a key. Redis
//!   drops a key when its window ends.
//! - In PostgreSQL: one row per idempotency key in `provider_keys` (`pg/schema.sql`), written
//!   with one `INSERT ... ON CONFLICT` that claims a vacant or expired key or returns the live row
//!   with its fence raised; the primary key lets only one of two instances win a key, and
//!   [`KeyTable::sweep`] deletes the expired rows. (A real provider keeps its keys in its own
//!   database: the table stands for that outside service, so that every instance of the example,
//!   and a restarted one, calls one provider.)

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_redis::redis;
use serde::{Deserialize, Serialize};
use sqlx::{self, PgPool, Row};
use tokio::time::Instant;

use super::super::redis_conn::{RedisConn, RedisFailure};

/// What an idempotency key was used for, and what it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Used {
    /// The operation and its parameters, as [`super::Request::describe`] writes them.
    pub request: String,
    /// The id the call answered with: the payment's, or the refund's.
    pub id: String,
    /// The largest fence a call with the key carried (0 for a record written before fences).
    /// Written as 20 decimal digits, so that the Redis script compares two as strings, exactly.
    #[serde(default, with = "fence_digits")]
    pub fence: u64,
}

/// A fence as 20 decimal digits, zero-padded: string order is number order, and no Lua number
/// (a double) ever holds it.
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

/// Sets a vacant key to `ARGV[1]` for `ARGV[4]` ms, or returns what it holds; a live key used for
/// the same request (`ARGV[2]`) with a smaller fence gets the call's fence (`ARGV[3]`, 20 digits)
/// and keeps its expiry. Returns the key's record as it was before, or nil for a vacant key.
const INSERT: &str = r"
local held = redis.call('GET', KEYS[1])
if not held then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
    return false
end
local used = cjson.decode(held)
local fence = used.fence or '00000000000000000000'
if used.request == ARGV[2] and ARGV[3] > fence then
    used.fence = ARGV[3]
    redis.call('SET', KEYS[1], cjson.encode(used), 'KEEPTTL')
end
return held
";

/// Expired rows deleted per [`KeyTable::sweep`] statement, so that one sweep never holds many
/// locks at once.
const SWEEP_BATCH: i64 = 1000;

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
        insert: Arc<redis::Script>,
    },
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
                insert: Arc::new(redis::Script::new(INSERT)),
            },
        }
    }

    /// Keys in the `provider_keys` table of `pool`'s database, each remembered for `window`.
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
            Backend::Redis { conn, prefix, .. } => {
                let mut get = redis::cmd("GET");
                get.arg(format!("{prefix}{key}"));
                let held: Option<String> = conn
                    .run(move |mut c| async move { get.query_async(&mut c).await })
                    .await?;
                Ok(held.as_deref().map(serde_json::from_str).transpose()?)
            }
            Backend::Postgres(pool) => {
                let row = sqlx::query(
                    "SELECT request, id, fence::text FROM provider_keys
                     WHERE key = $1 AND expires_at > statement_timestamp()",
                )
                .bind(key)
                .fetch_optional(pool)
                .await?;
                Ok(row.map(|row| read_used(&row)).transpose()?)
            }
        }
    }

    /// Records `used` under `key` unless the key was used within the window: `None` when `used`
    /// is recorded now, or else what the key was used for. A key used for the same request keeps
    /// the larger of its fence and `used.fence`, in the same step; the fence answered is larger
    /// than `used.fence` exactly when the key had seen a larger one.
    pub async fn insert(&self, key: &str, used: &Used) -> Result<Option<Used>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let now = Instant::now();
                let mut keys = lock(keys);
                keys.forget_expired(now);
                if let Some((_, earlier)) = keys.used.get_mut(key).filter(|(at, _)| *at > now) {
                    let before = earlier.clone();
                    if earlier.request == used.request {
                        earlier.fence = earlier.fence.max(used.fence);
                    }
                    return Ok(Some(before));
                }
                let deadline = now + self.window;
                keys.used.insert(key.to_owned(), (deadline, used.clone()));
                keys.order.push_back((deadline, key.to_owned()));
                Ok(None)
            }
            Backend::Redis {
                conn,
                prefix,
                insert,
            } => {
                let window = u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX);
                let mut invocation = insert.key(format!("{prefix}{key}"));
                invocation
                    .arg(serde_json::to_string(used)?)
                    .arg(&used.request)
                    .arg(format!("{:020}", used.fence))
                    .arg(window.max(1));
                let held: Option<String> = conn
                    .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
                    .await?;
                Ok(held.as_deref().map(serde_json::from_str).transpose()?)
            }
            Backend::Postgres(pool) => {
                let window = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
                // A live row keeps its request and id, and takes the larger fence when it was used
                // for the same request (the update takes its lock, so two calls raise it in
                // turn); an expired one is taken over. The row comes back as written: its fence
                // is larger than the call's exactly when it was before. The new id is unique, so
                // finding it in the row means this call won the key.
                let row = sqlx::query(
                    "INSERT INTO provider_keys AS k (key, request, id, fence, expires_at)
                     VALUES ($1, $2, $3, $5::numeric, statement_timestamp() + $4::int8 * interval '1 millisecond')
                     ON CONFLICT (key) DO UPDATE SET
                         request = CASE WHEN k.expires_at > statement_timestamp()
                                        THEN k.request ELSE excluded.request END,
                         id = CASE WHEN k.expires_at > statement_timestamp()
                                   THEN k.id ELSE excluded.id END,
                         fence = CASE WHEN k.expires_at <= statement_timestamp()
                                      THEN excluded.fence
                                      WHEN k.request = excluded.request
                                      THEN greatest(k.fence, excluded.fence)
                                      ELSE k.fence END,
                         expires_at = CASE WHEN k.expires_at > statement_timestamp()
                                           THEN k.expires_at ELSE excluded.expires_at END
                     RETURNING request, id, fence::text",
                )
                .bind(key)
                .bind(&used.request)
                .bind(&used.id)
                .bind(window.max(1))
                // As text: a fence is a u64, which no integer type of PostgreSQL holds whole.
                .bind(used.fence.to_string())
                .fetch_one(pool)
                .await?;
                let held = read_used(&row)?;
                Ok((held.id != used.id).then_some(held))
            }
        }
    }

    /// Deletes the keys whose window ended (PostgreSQL; in memory and in Redis they go by
    /// themselves); returns how many went.
    #[allow(dead_code)] // with the postgres feature
    pub async fn sweep(&self) -> Result<u64, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let mut keys = lock(keys);
                let before = keys.used.len();
                keys.forget_expired(Instant::now());
                Ok((before - keys.used.len()) as u64)
            }
            Backend::Redis { .. } => Ok(0),
            Backend::Postgres(pool) => {
                let deleted = sqlx::query(
                    "DELETE FROM provider_keys WHERE key IN (
                         SELECT key FROM provider_keys
                         WHERE expires_at <= statement_timestamp()
                         LIMIT $1 FOR UPDATE SKIP LOCKED)",
                )
                .bind(SWEEP_BATCH)
                .execute(pool)
                .await?;
                Ok(deleted.rows_affected())
            }
        }
    }
}

/// A [`Used`] from a row of `request, id, fence::text`.
fn read_used(row: &sqlx::postgres::PgRow) -> Result<Used, sqlx::Error> {
    let fence: String = row.try_get(2)?;
    let fence = fence.parse().map_err(|err| {
        sqlx::Error::Decode(format!("a provider key's fence {fence:?}: {err}").into())
    })?;
    Ok(Used {
        request: row.try_get(0)?,
        id: row.try_get(1)?,
        fence,
    })
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
            Backend::Redis { conn, prefix, .. } => f
                .debug_struct("Redis")
                .field("conn", conn)
                .field("prefix", prefix)
                .finish(),
            Backend::Postgres(_) => f.debug_struct("Postgres").finish_non_exhaustive(),
        }
    }
}

fn lock(keys: &Mutex<MemoryKeys>) -> std::sync::MutexGuard<'_, MemoryKeys> {
    keys.lock().unwrap_or_else(PoisonError::into_inner)
}
