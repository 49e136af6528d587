//! [`RedisStore`]: the records of [`tower-idempotency`](tower_idempotency) in Redis (7.0 or
//! newer), on one server or a Redis Cluster, shared by every instance behind a load balancer.
//!
//! ```toml
//! [dependencies]
//! tower-idempotency = "0.1"
//! tower-idempotency-redis = "0.1"
//! ```
//!
//! Rust 1.95 or newer. The store goes under the layer; check it once at start-up:
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_idempotency::IdempotencyLayer;
//! use tower_idempotency_redis::RedisStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
//! let store = RedisStore::from_url("redis://127.0.0.1:6379")?;
//! store.check().await?; // unreachable, older than 7.0, or evicting keys: fail at start-up
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(|| async { "charged" }))
//!     .route_layer(IdempotencyLayer::new(store));
//! # Ok(())
//! # }
//! ```
//!
//! - **Round trips**: a new key 2 (the claim script, then the completion script), a replay, a 409
//!   or a 422 1, on one server or a cluster ([`RedisStore`]).
//! - **Redis must not evict keys**: an evicted record lets a retry run its request again, so
//!   [`check`](RedisStore::check) refuses a `maxmemory-policy` other than `noeviction`
//!   ([`allow_eviction`](RedisStore::allow_eviction) accepts the hazard knowingly).
//! - **Redis Cluster** ([`RedisStore::cluster`]): a failover can lose a claim that the replica
//!   had not received, and run a retry a second time;
//!   [`with_replication_wait`](RedisStore::with_replication_wait) closes that window as far as
//!   Redis allows.
//! - **Large records**: [`with_compression`](RedisStore::with_compression) stores completed
//!   records LZ4-compressed, since Redis keeps every record in memory for the whole dedup window.
//!
//! What a store must do, and why, is the [protocol](tower_idempotency::protocol)'s §10. The
//! crate's README has the measured latency and throughput of each set-up: one server, a replica,
//! the replication wait, a cluster.

#![forbid(unsafe_code)]

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
use tower_idempotency::record::{ClaimToken, Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};

use compression::Compression;

mod batch;
mod calls;
mod compression;
mod connection;
mod inspect;
mod replication;
mod scripts;

// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "idempotency:";
/// The default bound on one Redis call, including taking a connection from the pool.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// The default bound on the length a compressed record may declare
/// ([`RedisStore::with_max_decompressed`]): 2 MiB, the layer's default response limit (1 MiB of
/// body and trailers) and as much again for the headers and the encoding.
pub const DEFAULT_MAX_DECOMPRESSED: usize = 2 * 1024 * 1024;

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
/// recovers by itself when Redis comes back. A kept connection quiet for 100 ms is checked before
/// the next command (a `PING` in the same write, no round trip), so one that died while the
/// store was idle, in a Redis restart, fails no request (§10.6). A command goes out at once when
/// nothing else is on
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
    max_decompressed: usize,
    allow_eviction: bool,
    full: FullWarning,
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
            max_decompressed: DEFAULT_MAX_DECOMPRESSED,
            allow_eviction: false,
            full: FullWarning::default(),
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
    /// Redis may evict keys to make room (its `maxmemory-policy` is not `noeviction`), so a live
    /// record may vanish and its request run twice: refused by [`RedisStore::check`] unless
    /// [`RedisStore::allow_eviction`] is set.
    #[error(
        "Redis at {node} evicts keys (maxmemory-policy {policy}): a record it evicts lets its \
         request run twice; run CONFIG SET maxmemory-policy noeviction (and set it in \
         redis.conf), or call RedisStore::allow_eviction to accept the risk"
    )]
    Evicting {
        /// The policy the server reported.
        policy: String,
        /// The node that reported it (`host:port` on a cluster).
        node: String,
    },
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
    /// ([`StoreError::Unreadable`]: the layer answers `500 record-unreadable`). So is one that
    /// declares more than [`with_max_decompressed`](RedisStore::with_max_decompressed) bytes,
    /// refused before anything is allocated; a record longer than that is stored as it is.
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

    /// Sets the longest record a compressed value may declare: reading a compressed value
    /// allocates its declared length, so a longer one (forged, or damaged) is refused before
    /// anything is allocated ([`StoreError::Unreadable`]: neither replayed nor run again), and
    /// with [`with_compression`](RedisStore::with_compression) a longer record is stored as it
    /// is. Default: [`DEFAULT_MAX_DECOMPRESSED`], 2 MiB.
    ///
    /// Set it above the longest record the layer stores: its `response_body_limit` (1 MiB by
    /// default, body and trailers) plus the headers. Every instance sharing the records should
    /// have the same bound: one with a larger bound may compress records that the others refuse.
    ///
    /// ```no_run
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # fn main() -> Result<(), tower_idempotency_redis::RedisStoreError> {
    /// // A layer with `response_body_limit(8 << 20)`: records up to 8 MiB and 1 MiB of headers.
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379")?
    ///     .with_compression(1024)
    ///     .with_max_decompressed(9 << 20);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_max_decompressed(self, bytes: usize) -> Self {
        self.with_inner(|inner| inner.max_decompressed = bytes)
    }

    /// Lets [`check`](RedisStore::check) accept a Redis that evicts keys (a `maxmemory-policy`
    /// other than `noeviction`). Default: refused.
    ///
    /// The hazard accepted: when Redis reaches `maxmemory` it evicts keys, records included,
    /// whatever their TTL. An evicted completed record shortens its dedup window (a retry runs
    /// the request again); an evicted in-flight record frees its key while its request runs (a
    /// retry runs it a second time, at once). Only for a Redis whose memory is known never to
    /// fill, or records whose loss is acceptable.
    ///
    /// ```no_run
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # async fn start() -> Result<(), tower_idempotency_redis::RedisStoreError> {
    /// // A cache-sized Redis shared with other data, under allkeys-lru, chosen knowingly.
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379")?.allow_eviction();
    /// store.check().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn allow_eviction(self) -> Self {
        self.with_inner(|inner| inner.allow_eviction = true)
    }

    fn with_inner(self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Inner {
            prefix: shared.prefix.clone(),
            timeout: shared.timeout,
            replication: shared.replication,
            compression: shared.compression,
            max_decompressed: shared.max_decompressed,
            allow_eviction: shared.allow_eviction,
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

    /// Connects and checks that the server (on a cluster: every master) is Redis 7.0 or newer
    /// and does not evict keys: call it at start-up to fail fast with a clear message.
    ///
    /// A `maxmemory-policy` other than `noeviction` (`allkeys-*`, or `volatile-*`: every record
    /// has a TTL) lets Redis evict live records when it reaches `maxmemory`: a completed record,
    /// and a retry runs its request again; a claim, and a second request runs while the first
    /// still does. `check` refuses it ([`RedisStoreError::Evicting`]), whatever `maxmemory` is
    /// now, unless [`allow_eviction`](RedisStore::allow_eviction) says the application accepts
    /// that. Under `noeviction` a full Redis refuses writes instead, and the store answers
    /// [`StoreError::Full`] (the layer's 503 with `Retry-After`).
    ///
    /// ```no_run
    /// use tower_idempotency_redis::{RedisStore, RedisStoreError};
    ///
    /// # async fn start() -> Result<(), RedisStoreError> {
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379")?;
    /// match store.check().await {
    ///     Err(RedisStoreError::Evicting { policy, .. }) => {
    ///         panic!("Redis evicts records under {policy}: CONFIG SET maxmemory-policy noeviction")
    ///     }
    ///     other => other?,
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// A [`RedisStoreError`] when Redis is unreachable, slow, too old or evicting.
    pub async fn check(&self) -> Result<(), RedisStoreError> {
        let timeout = self.inner.timeout;
        let check = async {
            let mut connection = self.connection().await.map_err(RedisStoreError::Redis)?;
            // One command for both sections; on a cluster, redis-rs sends `INFO` to every master.
            let info: Value = redis::cmd("INFO")
                .arg("server")
                .arg("memory")
                .query_async(&mut connection)
                .await
                .map_err(RedisStoreError::Redis)?;
            // One server answers with its text; a cluster with one text per node.
            let mut texts = Vec::new();
            collect_text(None, &info, &mut texts);
            for (node, text) in texts {
                let field = |name: &str| {
                    text.lines()
                        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                        .map(|value| value.trim().to_owned())
                };
                let version = field("redis_version").unwrap_or_else(|| "unknown".to_owned());
                let major: u32 = version
                    .split('.')
                    .next()
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(0);
                if major < 7 {
                    return Err(RedisStoreError::ServerTooOld(version));
                }
                // A server that does not say is taken at its default, `noeviction`.
                let policy = field("maxmemory_policy").unwrap_or_else(|| "noeviction".to_owned());
                if policy != "noeviction" && !self.inner.allow_eviction {
                    return Err(RedisStoreError::Evicting {
                        policy,
                        node: node.unwrap_or_else(|| "the server".to_owned()),
                    });
                }
            }
            Ok(())
        };
        tokio::time::timeout(timeout, check)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }
}

/// How often the store warns that Redis is full.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(10);

/// The warning that Redis refused a write at `maxmemory`, at most once per
/// [`FULL_WARNING_EVERY`]: the layer logs a `Full` error as "the store is full", and this says
/// which Redis limit it is, with Redis's own words.
#[derive(Default)]
struct FullWarning {
    last: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl FullWarning {
    fn warn(&self, err: &RedisError) {
        let now = tokio::time::Instant::now();
        {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|at| now.duration_since(at) < FULL_WARNING_EVERY) {
                return;
            }
            *last = Some(now);
        }
        tracing::warn!(
            target: "tower_idempotency",
            error = %err,
            "Redis refused a write: it reached maxmemory (OOM); claims are refused with 503 \
             until memory frees (raise maxmemory, or let records expire)"
        );
    }
}

/// Every text in a reply, nested ones included, with the node that answered it where the reply
/// names it (a cluster's answer from every master is a map of node to text).
fn collect_text(node: Option<&str>, value: &Value, out: &mut Vec<(Option<String>, String)>) {
    let node_owned = || node.map(str::to_owned);
    match value {
        Value::BulkString(bytes) => {
            out.push((node_owned(), String::from_utf8_lossy(bytes).into_owned()));
        }
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => {
            out.push((node_owned(), text.clone()));
        }
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|item| collect_text(node, item, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(name, item)| {
            let name = match name {
                Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
                Value::SimpleString(text) => Some(text.clone()),
                _ => None,
            };
            collect_text(name.as_deref().or(node), item, out);
        }),
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

impl OperatorStore for RedisStore {
    fn inspect(
        &self,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<Inspected>, StoreError>> + Send {
        Box::pin(self.inspect_call(id))
    }

    fn forget(
        &self,
        id: &RecordId,
        force: bool,
    ) -> impl Future<Output = Result<ForgetOutcome, StoreError>> + Send {
        Box::pin(self.forget_call(id, force))
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RedisStore");
        debug
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("replication", &self.inner.replication)
            .field("compression", &self.inner.compression)
            .field("max_decompressed", &self.inner.max_decompressed)
            .field("allow_eviction", &self.inner.allow_eviction);
        match &*self.inner.backend {
            Backend::Single(single) => debug.field("pool", &single.pool.status()),
            Backend::Cluster(_) => debug.field("cluster", &true),
        };
        debug.finish_non_exhaustive()
    }
}
