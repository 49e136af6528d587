//! `RedisStore`: records in Redis (7.0 or newer), on one server or a Redis Cluster, shared by
//! every instance.

#![forbid(unsafe_code)]
#![deny(missing_docs, missing_debug_implementations, rust_2018_idioms)]

use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::AsyncConnectionConfig;
use deadpool_redis::redis::cluster::{ClusterClient, ClusterClientBuilder};
use deadpool_redis::redis::{self, RedisError, Value};
use deadpool_redis::{Manager, Pool, Runtime};

use connection::{Backend, Cluster, Single};
use replication::Replication;
use scripts::{CLAIM, COMPLETE, Lua, RELEASE, RENEW};
use tower_idempotency::Fingerprint;
use tower_idempotency::record::{ClaimToken, Completed, RecordId};
use tower_idempotency::store::{Claim, Store, StoreError};

use compression::Compression;

mod batch;
mod calls;
mod compression;
mod connection;
mod replication;
mod scripts;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idempotency:";
/// The default bound on one Redis call, including taking a connection from the pool.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// A store in Redis: many server instances share one truth. One server (through a
/// deadpool-redis pool) or a Redis Cluster ([`RedisStore::cluster`]).
///
/// Requires Redis 7.0 or newer: [`RedisStore::check`] refuses an older server with a clear error. Each record is one Redis key, `<prefix>{<record id>}`, hash-tagged so that a
/// cluster keeps it in one slot; values use the compact binary encoding of [`tower_idempotency::record`].
///
/// Round trips per request, on one server or a cluster: a new key 2 (the claim script, which
/// numbers the claim with the server's clock (§5.3), then the completion script), a replay, a 409
/// or a 422 1 (the claim returns the existing record),
/// plus one `EVALSHA` per lease renewal of a long handler. With
/// [`with_replication_wait`](RedisStore::with_replication_wait), the claim and the completion
/// each carry a `WAIT` in the same round trip.
///
/// On one server the store keeps one multiplexed connection from the pool and shares it between
/// requests, so it does not pay the pool's `UNWATCH` + `PING` recycle check per request; it goes
/// back to the pool for a fresh, checked connection after a connection error or timeout, so it
/// recovers by itself when Redis comes back. A command goes out at once when nothing else is on
/// its way; the commands of requests that arrive while one is are sent as one pipeline (one
/// write, one read on each side) rather than one write each, each still with its own answer and
/// its own error. On a cluster, redis-rs's cluster connection
/// routes each command to its slot's master and follows redirections and failovers.
///
/// ```no_run
/// use tower_idempotency::IdempotencyLayer;
/// use tower_idempotency_redis::RedisStore;
///
/// # fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
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
    backend: Arc<Backend>,
    prefix: String,
    timeout: Duration,
    replication: Option<Replication>,
    compression: Option<Compression>,
    claim: Lua,
    complete: Lua,
    renew: Lua,
    release: Lua,
}

impl Inner {
    fn new(backend: Arc<Backend>) -> Self {
        Self {
            backend,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            replication: None,
            compression: None,
            claim: Lua::new(CLAIM),
            complete: Lua::new(COMPLETE),
            renew: Lua::new(RENEW),
            release: Lua::new(RELEASE),
        }
    }
}

/// Setting up a [`RedisStore`] failed, or Redis did not do what a call needs.
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
    #[error("Redis {0} is too old: tower-idempotency needs Redis 7.0 or newer")]
    ServerTooOld(String),
    /// Fewer replicas than [`RedisStore::with_replication_wait`] asks for acknowledged a write in
    /// time. A claim is released (its handler does not run); a completion is kept and retried.
    #[error("{acked} of {wanted} replicas acknowledged the write in time")]
    NotReplicated {
        /// How many replicas acknowledged.
        acked: u32,
        /// How many were asked for.
        wanted: u32,
    },
}

impl RedisStore {
    /// A store on `pool` (one Redis server), with the default prefix (`idempotency:`) and
    /// timeout (1 second).
    pub fn new(pool: Pool) -> Self {
        Self::on(Backend::Single(Box::new(Single::new(pool))))
    }

    fn on(backend: Backend) -> Self {
        Self {
            inner: Arc::new(Inner::new(Arc::new(backend))),
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

    /// A store on a Redis Cluster, found through any of its nodes (`redis://host:port` each; one
    /// reachable node is enough, the client learns the rest). Commands go to their slot's master;
    /// redirections (`MOVED`, `ASK`) and failovers are followed. Nothing is connected until the
    /// first call; use [`RedisStore::check`] to fail fast at start-up.
    ///
    /// A master's writes reach its replicas asynchronously: a claim acknowledged by a master that
    /// fails before replicating it is lost, and a retry on the promoted replica runs again. See
    /// [`with_replication_wait`](RedisStore::with_replication_wait) for what narrows that window.
    ///
    /// ```no_run
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
    /// let store = RedisStore::cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`RedisStoreError::Url`] when a URL is invalid or none is given.
    pub fn cluster<I, U>(urls: I) -> Result<Self, RedisStoreError>
    where
        I: IntoIterator<Item = U>,
        U: AsRef<str>,
    {
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_owned()).collect();
        let client = ClusterClientBuilder::new(urls)
            // Each call is bounded by the store's own timeout; these keep a dead node from
            // holding the client's own retries past it.
            .connection_timeout(DEFAULT_TIMEOUT)
            .response_timeout(DEFAULT_TIMEOUT)
            .build()
            .map_err(RedisStoreError::Url)?;
        Ok(Self::from_cluster_client(client))
    }

    /// A store on a Redis Cluster through a client you built (TLS, credentials, retries, read
    /// routing: see redis-rs's `ClusterClientBuilder`).
    pub fn from_cluster_client(client: ClusterClient) -> Self {
        Self::on(Backend::Cluster(Box::new(Cluster::new(client))))
    }

    /// Sets the prefix of every key the store writes. Default: `idempotency:`.
    pub fn with_prefix(self, prefix: impl Into<String>) -> Self {
        self.with_inner(|inner| inner.prefix = prefix.into())
    }

    /// Sets the bound on each Redis call, taking a connection included. Default: 1 second.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        self.with_inner(|inner| inner.timeout = timeout)
    }

    /// After each claim and each completion, waits until at least `replicas` replicas of the
    /// key's master acknowledged the write, for at most `timeout` (`WAIT`, sent in the same round
    /// trip as the write, to the same node). Default: off.
    ///
    /// Replication in Redis is asynchronous: a master acknowledges a write before any replica
    /// has it. If the master then fails and a replica that never received a claim is promoted,
    /// the claim is gone, and a retry of the same request claims the key again and runs its
    /// handler a second time. With the wait, a claim that fewer than `replicas` replicas
    /// acknowledged is released and the request answered 503 (retry later): the handler never
    /// runs on a claim that only the master holds. A completion that too few replicas
    /// acknowledged is answered to the client and its write retried in the background.
    ///
    /// What it cannot promise: `WAIT` does not make Redis strongly consistent. A replica that
    /// acknowledged may still lose the write (it restarts without persistence) or not be the one
    /// promoted, and a master cut off from its replicas keeps accepting writes until
    /// `cluster-node-timeout` passes. Server settings narrow this further: `min-replicas-to-write`
    /// (a master refuses writes when fewer replicas are connected) and `appendonly yes` with
    /// `appendfsync everysec` or `always` on the replicas.
    ///
    /// Off by default because it costs a replica round trip on every claim and completion
    /// (latency and throughput figures are in the README), and because a single server without
    /// replicas, the most common set-up, would refuse every request with it on. Each call may take
    /// up to the store's timeout plus `timeout`.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
    /// let store = RedisStore::cluster(["redis://10.0.0.1:6379"])?
    ///     .with_replication_wait(1, Duration::from_millis(100));
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_replication_wait(self, replicas: u32, timeout: Duration) -> Self {
        self.with_inner(|inner| inner.replication = Some(Replication { replicas, timeout }))
    }

    /// Stores completed records longer than `threshold` bytes compressed (LZ4), when that makes
    /// them smaller: Redis keeps every record in memory for the whole dedup window, and a JSON
    /// response takes about half the bytes. Default: off. Sealed records
    /// (`tower_idempotency::seal::SealedStore`) are ciphertext and stay as they are.
    ///
    /// Every store reads compressed records, compressing or not, so instances sharing the records
    /// can turn it on (or off) one at a time. A compressed record whose bytes were changed or cut
    /// is not replayed, and its request is not run again
    /// ([`StoreError::Unreadable`]: the layer answers `500 record-unreadable`).
    ///
    /// ```no_run
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
    /// // Records of more than 1 KiB are compressed.
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379")?.with_compression(1024);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_compression(self, threshold: usize) -> Self {
        self.with_inner(|inner| inner.compression = Some(Compression { threshold }))
    }

    fn with_inner(self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Inner {
            prefix: shared.prefix.clone(),
            timeout: shared.timeout,
            replication: shared.replication,
            compression: shared.compression,
            ..Inner::new(Arc::clone(&shared.backend))
        });
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The pool the store takes its connection from; `None` on a cluster.
    pub fn pool(&self) -> Option<&Pool> {
        match &*self.inner.backend {
            Backend::Single(single) => Some(&single.pool),
            Backend::Cluster(_) => None,
        }
    }

    /// Whether the store is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(&*self.inner.backend, Backend::Cluster(_))
    }

    /// The Redis key of a record.
    pub(crate) fn redis_key(&self, id: &RecordId) -> String {
        let prefix = &self.inner.prefix;
        let mut key = String::with_capacity(prefix.len() + 34);
        key.push_str(prefix);
        key.push('{');
        // Writing to a String cannot fail.
        let _ = write!(key, "{id}");
        key.push('}');
        key
    }

    /// Connects and checks that the server (on a cluster: every node) is Redis 7.0 or newer:
    /// call it at start-up to fail fast with a clear message.
    ///
    /// # Errors
    /// A [`RedisStoreError`] when Redis is unreachable, slow or too old.
    pub async fn check(&self) -> Result<(), RedisStoreError> {
        let timeout = self.inner.timeout;
        let check = async {
            let mut connection = self.connection().await.map_err(RedisStoreError::Redis)?;
            let info: Value = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut connection)
                .await
                .map_err(RedisStoreError::Redis)?;
            // One server answers with its text; a cluster with one text per node.
            let mut texts = Vec::new();
            collect_text(&info, &mut texts);
            for text in texts {
                let version = text
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
            }
            Ok(())
        };
        tokio::time::timeout(timeout, check)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }
}

/// Every text in a reply, nested ones included.
fn collect_text(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => out.push(text.clone()),
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|item| collect_text(item, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, item)| collect_text(item, out)),
        _ => {}
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

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RedisStore");
        debug
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("replication", &self.inner.replication)
            .field("compression", &self.inner.compression);
        match &*self.inner.backend {
            Backend::Single(single) => debug.field("pool", &single.pool.status()),
            Backend::Cluster(_) => debug.field("cluster", &true),
        };
        debug.finish_non_exhaustive()
    }
}
