//! `RedisStore`: records in Redis (7.0 or newer), shared by every instance.

use std::fmt::{self, Write as _};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_redis::redis::AsyncConnectionConfig;
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::{self, Cmd, FromRedisValue, RedisError, RedisResult, Value};
use deadpool_redis::{Manager, Pool, Runtime};

use super::{Claim, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::hex::Hex;
use crate::record::{ClaimToken, Completed, Record, RecordId, encode_in_flight, unix_millis};
use batch::{Batch, ClaimRef};
use scripts::{COMPLETE, Lua, RELEASE, RENEW};

mod batch;
mod scripts;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idempotency:";
/// The default bound on one Redis call, including taking a connection from the pool.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// A store in Redis, through a deadpool-redis pool: many server instances share one truth.
///
/// Requires Redis 7.0 or newer (for `SET ... NX GET`); an older server fails every claim with a
/// clear error. Each record is one Redis key, `<prefix>{<record id>}`, hash-tagged so that Redis
/// Cluster keeps it in one slot; values use the compact binary encoding of [`crate::record`].
///
/// Round trips per request: a new key 2 (`SET NX PX GET`, then `EVALSHA` to complete), a replay, a
/// 409 or a 422 1 (the `SET` returns the existing record), plus one `EVALSHA` per lease renewal of
/// a long handler. The store keeps one multiplexed connection from the pool and shares it between
/// requests, so it does not pay the pool's `UNWATCH` + `PING` recycle check per request; it goes
/// back to the pool for a fresh, checked connection after a connection error or timeout, so it
/// recovers by itself when Redis comes back. The commands of requests that arrive together are
/// sent as one pipeline (one write, one read on each side) rather than one write each; each
/// still gets its own answer and its own error.
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, RedisStore};
///
/// # fn main() -> Result<(), tower_idempotency::store::RedisStoreError> {
/// let store = RedisStore::from_url("redis://127.0.0.1:6379")?.with_prefix("payments:idem:");
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    prefix: String,
    timeout: Duration,
    connection: Mutex<Option<MultiplexedConnection>>,
    batch: Batch,
    complete: Lua,
    renew: Lua,
    release: Lua,
}

impl Inner {
    fn new(pool: Pool, prefix: String, timeout: Duration) -> Self {
        Self {
            pool,
            prefix,
            timeout,
            connection: Mutex::new(None),
            batch: Batch::default(),
            complete: Lua::new(COMPLETE),
            renew: Lua::new(RENEW),
            release: Lua::new(RELEASE),
        }
    }
}

/// Setting up a [`RedisStore`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisStoreError {
    /// The Redis URL is invalid.
    #[error("invalid Redis URL")]
    Url(#[source] RedisError),
    /// The pool could not be built.
    #[error("could not build the Redis pool")]
    Build(#[source] deadpool_redis::BuildError),
    /// Redis could not be reached, or failed.
    #[error("Redis is unreachable or failed")]
    Redis(#[source] RedisError),
    /// Taking a connection from the pool failed.
    #[error("could not take a Redis connection from the pool")]
    Pool(#[source] deadpool_redis::PoolError),
    /// The call did not finish in time.
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    /// The server is older than Redis 7.0.
    #[error(
        "Redis {0} is too old: tower-idempotency needs Redis 7.0 or newer (SET with NX and GET)"
    )]
    ServerTooOld(String),
}

impl RedisStore {
    /// A store on `pool`, with the default prefix (`idempotency:`) and timeout (1 second).
    pub fn new(pool: Pool) -> Self {
        Self {
            inner: Arc::new(Inner::new(pool, DEFAULT_PREFIX.to_owned(), DEFAULT_TIMEOUT)),
        }
    }

    /// A store on a new pool for `url` (`redis://host:port/db`). Nothing is connected until the
    /// first call; use [`RedisStore::check`] to fail fast at start-up.
    ///
    /// # Errors
    /// [`RedisStoreError::Url`] when the URL is invalid.
    pub fn from_url(url: &str) -> Result<Self, RedisStoreError> {
        // The store bounds every call itself (`with_timeout`), so the connections need no response
        // timer of their own: one timer per call instead of two.
        let config = AsyncConnectionConfig::new().set_response_timeout(None);
        let manager = Manager::new_with_config(url, config).map_err(RedisStoreError::Url)?;
        let pool = Pool::builder(manager)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(RedisStoreError::Build)?;
        Ok(Self::new(pool))
    }

    /// Sets the prefix of every key the store writes. Default: `idempotency:`.
    pub fn with_prefix(self, prefix: impl Into<String>) -> Self {
        self.with_inner(|inner| inner.prefix = prefix.into())
    }

    /// Sets the bound on each Redis call, taking a connection included. Default: 1 second.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        self.with_inner(|inner| inner.timeout = timeout)
    }

    fn with_inner(self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| {
            Inner::new(shared.pool.clone(), shared.prefix.clone(), shared.timeout)
        });
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The pool the store takes its connection from.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The Redis key of a record.
    pub fn redis_key(&self, id: &RecordId) -> String {
        let prefix = &self.inner.prefix;
        let mut key = String::with_capacity(prefix.len() + 34);
        // Writing to a String cannot fail.
        let _ = write!(key, "{prefix}{{{}}}", Hex(id.as_bytes()));
        key
    }

    /// Connects and checks that the server is Redis 7.0 or newer: call it at start-up to fail fast
    /// with a clear message.
    ///
    /// # Errors
    /// A [`RedisStoreError`] when Redis is unreachable, slow or too old.
    pub async fn check(&self) -> Result<(), RedisStoreError> {
        let timeout = self.inner.timeout;
        let check = async {
            let mut connection = self.inner.pool.get().await.map_err(RedisStoreError::Pool)?;
            let info: String = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut *connection)
                .await
                .map_err(RedisStoreError::Redis)?;
            let version = info
                .lines()
                .find_map(|line| line.strip_prefix("redis_version:"))
                .unwrap_or("unknown")
                .trim()
                .to_owned();
            let major: u32 = version
                .split('.')
                .next()
                .and_then(|m| m.parse().ok())
                .unwrap_or(0);
            if major < 7 {
                return Err(RedisStoreError::ServerTooOld(version));
            }
            Ok(())
        };
        tokio::time::timeout(timeout, check)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }

    /// The shared multiplexed connection, taken from the pool the first time and after a failure.
    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(connection) = self.cached().clone() {
            return Ok(connection);
        }
        // Boxed: the pool's future is large (about 7 KiB, as it may connect), and every request
        // future that awaits a store call would otherwise carry it, and copy it, for this rare path.
        Box::pin(self.connect()).await
    }

    /// Takes a connection from the pool and shares it.
    async fn connect(&self) -> Result<MultiplexedConnection, StoreError> {
        let pooled = self
            .inner
            .pool
            .get()
            .await
            .map_err(|err| StoreError::Unavailable(Box::new(RedisStoreError::Pool(err))))?;
        let connection = MultiplexedConnection::clone(&pooled);
        *self.cached() = Some(connection.clone());
        Ok(connection)
    }

    fn cached(&self) -> std::sync::MutexGuard<'_, Option<MultiplexedConnection>> {
        self.inner
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs one call; its pipeline bounds it by the timeout (see [`RedisStore::queue`]).
    async fn run<T>(&self, call: impl Future<Output = RedisResult<T>>) -> Result<T, StoreError> {
        call.await.map_err(|err| {
            if err.is_timeout() {
                StoreError::Timeout(self.inner.timeout)
            } else {
                self.redis_error(err)
            }
        })
    }

    fn redis_error(&self, err: RedisError) -> StoreError {
        if err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || err.is_timeout()
            || err.is_unrecoverable_error()
        {
            self.cached().take();
        }
        StoreError::Unavailable(Box::new(RedisStoreError::Redis(err)))
    }

    /// Sends `cmd` with the commands of the other requests queued now, as one pipeline (see
    /// `batch`), and returns its own answer.
    async fn send<T: FromRedisValue>(&self, cmd: Cmd) -> RedisResult<T> {
        let answer = self
            .queue(cmd, None)
            .await
            .unwrap_or_else(|_| Err(dropped()))?;
        T::from_redis_value(answer).map_err(RedisError::from)
    }

    /// Queues `cmd` for the next pipeline; `claim` names the claim a `SET ... NX` makes, for the
    /// pipeline to release if its caller stops waiting. The first command of a batch starts the
    /// task that sends it, once the requests that are ready now have queued theirs.
    fn queue(
        &self,
        cmd: Cmd,
        claim: Option<ClaimRef>,
    ) -> tokio::sync::oneshot::Receiver<RedisResult<Value>> {
        let (answer, first) = self.inner.batch.push(cmd, claim);
        if first {
            let store = self.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let pipeline = store.inner.batch.take();
                // One bound for taking a connection and the round trip: every caller gets its
                // answer, or an error, within the store's timeout.
                let deadline = tokio::time::Instant::now() + store.inner.timeout;
                let failure = match tokio::time::timeout_at(deadline, store.connection()).await {
                    Ok(Ok(connection)) => pipeline.send(connection, deadline, RELEASE).await,
                    Ok(Err(err)) => Some(pipeline.fail(&err)),
                    Err(_) => Some(pipeline.fail(&io_timeout())),
                };
                if let Some(err) = failure {
                    // Drops the shared connection when the error says it is broken.
                    store.redis_error(err);
                }
            });
        }
        answer
    }
}

// Each call is boxed: inline, a call's future (about 200 bytes for a claim, 800 for a fenced
// script) would push the request futures that await it past 1 KiB, out of the allocator's fast
// per-thread cache, and be copied with them.
impl Store for RedisStore {
    fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        Box::pin(self.claim_call(id, fingerprint, lease))
    }

    fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.complete_call(id, token, completed, ttl))
    }

    fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.renew_call(id, token, lease))
    }

    fn release(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.release_call(id, token))
    }
}

impl RedisStore {
    async fn claim_call(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let token = ClaimToken::generate();
        let value = encode_in_flight(&token, fingerprint, SystemTime::now() + lease);
        let key = self.redis_key(id);
        // Sized up front: grown argument by argument, the command would be reallocated each time.
        let mut set = Cmd::with_capacity(7, 3 + key.len() + value.len() + 2 + 2 + 20 + 3);
        set.arg("SET")
            .arg(&key)
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease))
            .arg("GET");
        let timeout = self.inner.timeout;
        // If this caller stops waiting (a timeout, or this future is dropped because its client
        // went away), the SET may still claim the key for a request that will never run: the
        // pipeline then releases that claim behind the SET.
        let answer = self.queue(set, Some((key, token)));
        // The pipeline answers within the timeout, or fails.
        let existing = match answer.await {
            Ok(Ok(existing)) => Option::<Vec<u8>>::from_redis_value(existing)
                .map_err(|err| self.redis_error(RedisError::from(err)))?,
            Ok(Err(err)) if !err.is_timeout() => return Err(too_old(self.redis_error(err))),
            Ok(Err(_)) | Err(_) => return Err(StoreError::Timeout(timeout)),
        };
        match existing {
            None => Ok(Claim::Claimed(token)),
            Some(bytes) => Record::decode(Bytes::from(bytes))
                .map(Claim::Existing)
                .map_err(|err| StoreError::Codec(Box::new(err))),
        }
    }

    async fn complete_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let value = completed
            .encode()
            .map_err(|err| StoreError::Codec(Box::new(err)))?;
        let ttl = millis(ttl).to_string();
        self.fenced(&self.inner.complete, id, token, &[&value, ttl.as_bytes()])
            .await
    }

    async fn renew_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease_end = unix_millis(SystemTime::now() + lease).to_le_bytes();
        let lease = millis(lease).to_string();
        self.fenced(
            &self.inner.renew,
            id,
            token,
            &[&lease_end, lease.as_bytes()],
        )
        .await
    }

    async fn release_call(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.fenced(&self.inner.release, id, token, &[]).await
    }
}

/// The error of a pipeline that did not get a connection or an answer in time.
fn io_timeout() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "Redis did not answer within the store's timeout",
    )
}

/// The error of a command whose pipeline went away without answering it.
fn dropped() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Io,
        "Redis did not answer the pipeline carrying this command",
    ))
}

/// Milliseconds for `PX`: at least 1 (Redis refuses 0).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A server older than 7.0 rejects `SET` with both `NX` and `GET` as a syntax error.
fn too_old(err: StoreError) -> StoreError {
    if let StoreError::Unavailable(source) = &err
        && let Some(RedisStoreError::Redis(redis)) = source.downcast_ref::<RedisStoreError>()
        && redis
            .to_string()
            .to_ascii_lowercase()
            .contains("syntax error")
    {
        return StoreError::Unavailable(Box::new(RedisStoreError::ServerTooOld(String::from(
            "< 7.0",
        ))));
    }
    err
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("pool", &self.inner.pool.status())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_older_than_7_gets_a_clear_error() {
        // Redis 6.2 answers `SET key value NX PX 1000 GET` with "ERR syntax error".
        let reply = redis::make_extension_error("ERR".into(), Some("syntax error".into()));
        let err = too_old(StoreError::Unavailable(Box::new(RedisStoreError::Redis(
            reply,
        ))));
        let StoreError::Unavailable(source) = err else {
            panic!("still a store failure")
        };
        let message = source.to_string();
        assert!(message.contains("7.0 or newer"), "{message}");
    }

    #[test]
    fn other_errors_are_left_alone() {
        let reply = redis::make_extension_error("OOM".into(), Some("out of memory".into()));
        let err = too_old(StoreError::Unavailable(Box::new(RedisStoreError::Redis(
            reply,
        ))));
        let StoreError::Unavailable(source) = err else {
            panic!("still a store failure")
        };
        assert!(!source.to_string().contains("7.0"), "{source}");
    }
}
