//! Start-up: the environment chooses the backend once, here, and every component is built on it.
//!
//! | variable | what it sets |
//! |---|---|
//! | `ADDR` | where to listen (`127.0.0.1:3000`) |
//! | `REDIS_URL` | the idempotency records, and everything below, in that Redis (7 or newer); unset: memory |
//! | `REDIS_CLUSTER_URLS` | instead of `REDIS_URL`: a Redis Cluster, comma-separated seed URLs |
//! | `LEDGER_REDIS_URL` | the charges, events, balances, provider keys and consumer records in another Redis (durable data: persistence, no eviction); default: the records' Redis |
//! | `DATABASE_URL` | everything in that PostgreSQL, its schema created at start-up (the Redis variables unused) |
//! | `RECONCILE_AFTER_MS` | how long a charge stays in an `-ing` state before the reconciler settles it (120000) |
//! | `PSP_LATENCY_MS` | the provider's delay per call (0; from 3000 every call outlasts the client's attempt timeout) |
//! | `IDEMPOTENCY_WAIT_MS` | how long a duplicate of a running charge waits for its replay (unset: `409` at once) |
//! | `IDEMPOTENCY_QUOTA_BYTES` | each account's quota of record bytes per instance and day (64 MiB): past it, `429` with `Retry-After` |
//! | `IDEMPOTENCY_SEAL_KEYS` | `id:base64key,...`, the first sealing the records, every one opening (rotation); unset: a public development key, with a warning |
//! | `SHUTDOWN_TIMEOUT_MS` | how long a shutdown may take (20000: keep it below your orchestrator's kill, 30 s on Kubernetes) |
//! | `RUST_LOG` | the log filter (`info`) |
//!
//! Every Redis command goes through the store's connection ([`SharedConnection`], one per Redis),
//! with its 1 s bound per call and its healing: on a Cluster a master that stops answering with
//! its connections open is left for its promoted replica within seconds. A Redis that times out
//! is a `503` for the caller (a `504` when a provider's write may have happened).

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, ScopeQuota, Store};
use tower_idempotency_redis::{RedisStore, SharedConnection};

use super::balance::{Balances, MemoryBalances, PgBalances, RedisBalances};
use super::consumer::{self, LedgerConsumer};
use super::events::Publisher;
use super::ledger::{Ledger, MemoryLedger, PgLedger, RedisLedger};
use super::outbox::OutboxConsumer;
use super::provider::{self, KeyTable, MemoryKeys, PgKeys, Provider, ProviderClient, RedisKeys};
use super::queue::{ConsumerConfig, MemoryQueue, Queue, RedisQueue};
use super::reconciler::Reconciler;
use super::{AppState, app, http_server, pg, prometheus};

/// The default of `SHUTDOWN_TIMEOUT_MS`.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// The default of `IDEMPOTENCY_QUOTA_BYTES`: 32 MiB at once, then about 400 bytes a second, tens
/// of thousands of charges in a burst; one account writing records as fast as it can is answered
/// `429` past it, and the others keep their room (PROTOCOL.md §3.4).
const QUOTA_BYTES: u64 = 64 << 20;

/// The default of `RECONCILE_AFTER_MS`: four lease lengths of the idempotency layer (30 s each),
/// far above any provider call.
const RECONCILE_AFTER: Duration = Duration::from_secs(120);

/// How often the outbox's consumer looks at an empty outbox.
const OUTBOX_POLL: Duration = Duration::from_millis(200);

/// The stream the events go to in Redis; its `{events}` hash tag keeps the stream and its group
/// in one slot of a cluster.
pub const STREAM: &str = "payments:{events}";

/// The development key that seals records when `IDEMPOTENCY_SEAL_KEYS` is unset: fixed, so that
/// a second instance and a restarted one still open the records. Public: never for production.
const DEV_SEAL_KEY: (&str, [u8; 32]) = ("dev-insecure", *b"tower-idempotency development!!!");

/// A task started with the stop token.
type Worker = Box<dyn FnOnce(CancellationToken) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Every component on the backend the environment chose.
struct Backend {
    /// What the banner says: `memory`, `redis`, `redis cluster` or `postgres`.
    name: &'static str,
    /// The idempotency records.
    records: BoxStore,
    ledger: Arc<dyn Ledger>,
    balances: Arc<dyn Balances>,
    keys: Arc<dyn KeyTable>,
    /// The in-memory outbox in front of the queue, whose relay runs until the last request has
    /// published (none on PostgreSQL: the outbox is a table).
    events: Option<Publisher>,
    /// The ledger consumer.
    consumer: Worker,
}

impl Backend {
    /// Charges, events, balances and provider keys in memory, the queue's consumer beside them.
    async fn memory(records: BoxStore, name: &'static str) -> Result<Self, String> {
        let queue = Arc::new(MemoryQueue::new());
        let events = Publisher::new(queue.clone());
        let balances: Arc<dyn Balances> = Arc::new(MemoryBalances::default());
        Ok(Self {
            name,
            records,
            ledger: Arc::new(MemoryLedger::new(events.clone(), provider::WINDOW)),
            keys: Arc::new(MemoryKeys::new(provider::WINDOW)),
            consumer: queue_consumer(&*queue, balances.clone(), MemoryStore::new()).await?,
            balances,
            events: Some(events),
        })
    }

    /// Charges, events, balances and provider keys in the Redis of `ledger`, one ledger for every
    /// instance on it; the consumer's records there too, under a prefix of their own.
    async fn redis(
        records: BoxStore,
        name: &'static str,
        (ledger, var): (RedisStore, &str),
    ) -> Result<Self, String> {
        let conn: SharedConnection = ledger.shared_connection();
        let queue = RedisQueue::connect(conn.clone(), STREAM, consumer::SCOPE)
            .await
            .map_err(|err| format!("cannot use Redis at {var}: {}", report(&err)))?;
        tracing::info!("events and balances: Redis stream {STREAM:?}");
        let events = Publisher::new(Arc::new(queue.clone()));
        let balances: Arc<dyn Balances> = Arc::new(RedisBalances::new(conn.clone()));
        let dedup = ledger.with_prefix(consumer::RECORDS_PREFIX);
        Ok(Self {
            name,
            records,
            ledger: Arc::new(RedisLedger::new(
                conn.clone(),
                events.clone(),
                provider::WINDOW,
            )),
            keys: Arc::new(RedisKeys::new(conn, provider::WINDOW)),
            consumer: queue_consumer(&queue, balances.clone(), dedup).await?,
            balances,
            events: Some(events),
        })
    }

    /// Everything in the PostgreSQL at `url`: the events in an outbox table written with the
    /// charges, which its own consumer applies.
    async fn postgres(url: &str) -> Result<Self, String> {
        if ["REDIS_URL", "REDIS_CLUSTER_URLS", "LEDGER_REDIS_URL"]
            .into_iter()
            .any(|var| env_nonempty(var).is_some())
        {
            tracing::warn!("DATABASE_URL is set: the Redis variables are not used");
        }
        let store = pg::connect(url).await?;
        tracing::info!("charges, events, balances and records: PostgreSQL");
        let pool = store.pool().clone();
        let balances = PgBalances::new(store.clone());
        let outbox = OutboxConsumer::new(pool.clone(), balances.clone(), OUTBOX_POLL);
        Ok(Self {
            name: "postgres",
            records: BoxStore::new(store),
            ledger: Arc::new(PgLedger::new(pool.clone(), provider::WINDOW)),
            balances: Arc::new(balances),
            keys: Arc::new(PgKeys::new(pool, provider::WINDOW)),
            events: None,
            consumer: Box::new(|stop| {
                Box::pin(async move {
                    outbox.run(stop).await;
                })
            }),
        })
    }
}

/// The ledger consumer of `queue`, its Deduplicator's records on `dedup`.
async fn queue_consumer(
    queue: &dyn Queue,
    balances: Arc<dyn Balances>,
    dedup: impl Store + 'static,
) -> Result<Worker, String> {
    let config = ConsumerConfig::default();
    let reads = (queue.consumer(&consumer_name(), config).await)
        .map_err(|err| format!("cannot read the event stream: {}", report(&err)))?;
    let consumer = LedgerConsumer::new(balances, consumer::deduplicator(dedup, config.min_idle));
    Ok(Box::new(|stop| {
        Box::pin(async move {
            consumer.run(reads, stop).await;
        })
    }))
}

/// Runs the server, configured from the environment, until SIGTERM or Ctrl-C.
pub async fn run() -> Result<(), Box<dyn Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = env_millis("PSP_LATENCY_MS")?.unwrap_or_default();
    let shutdown_timeout = env_millis("SHUTDOWN_TIMEOUT_MS")?.unwrap_or(SHUTDOWN_TIMEOUT);
    let reconcile_after = env_millis("RECONCILE_AFTER_MS")?.unwrap_or(RECONCILE_AFTER);
    let metrics = prometheus::install()?;
    let backend = match env_nonempty("DATABASE_URL") {
        Some(url) => Backend::postgres(&url).await?,
        None => redis_or_memory().await?,
    };

    // Every stored response is sealed: readers of the store see no charge, writers cannot forge
    // or move one.
    let store = BoxStore::new(SealedStore::new(backend.records, seal_keys()?));
    let mut idempotency = IdempotencyLayer::new(store);
    // One account cannot fill the store for the others: each has its quota of record bytes.
    let quota = env_bytes("IDEMPOTENCY_QUOTA_BYTES", QUOTA_BYTES)?;
    idempotency = idempotency.scope_quota(ScopeQuota::new(quota));
    // A duplicate of a charge still running waits for it and gets its replay, not a 409.
    if let Some(bound) = env_millis("IDEMPOTENCY_WAIT_MS")? {
        idempotency = idempotency.wait_for_in_flight(bound);
    }
    let drained = idempotency.shutdown_handle();
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let signal = shutdown_signal()?;
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            signal.await;
            stop.cancel();
        }
    });

    let provider = Provider::new(backend.keys, latency);
    let client = ProviderClient::new(provider.router());
    let reconciler = Reconciler::new(backend.ledger.clone(), client.clone(), reconcile_after);
    let workers = tokio::spawn({
        let (consumer, stop) = ((backend.consumer)(stop.clone()), stop.clone());
        async move {
            tokio::join!(consumer, reconciler.run(stop));
        }
    });
    tokio::spawn(provider.sweep_keys_every(provider::SWEEP_EVERY, stop.clone()));
    // The outbox's relay runs until the last request has published its events.
    let relay_stop = CancellationToken::new();
    let relay = backend
        .events
        .map(|events| tokio::spawn(events.relay(relay_stop.clone())));
    let state = AppState {
        ledger: backend.ledger,
        balances: backend.balances,
        provider: client,
        metrics: Some(metrics),
    };

    println!(
        "listening on http://{} (store: {})",
        listener.local_addr()?,
        backend.name
    );
    let shutdown_deadline = async {
        stop.cancelled().await;
        tokio::time::Instant::now() + shutdown_timeout
    };
    let app = app(state, idempotency);
    let ((), shutdown_deadline) = tokio::join!(
        http_server::serve(listener, app, stop.clone(), shutdown_timeout),
        shutdown_deadline,
    );
    // Handlers whose client went away run on, detached; let them finish and store their result.
    if tokio::time::timeout_at(shutdown_deadline, drained.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            ?shutdown_timeout,
            "gave up waiting for detached requests; their claims' leases will run out"
        );
    }
    relay_stop.cancel();
    if let Some(relay) = relay {
        let _ = relay.await;
    }
    if let Err(err) = workers.await {
        tracing::error!(%err, "the ledger consumer failed");
    }
    tracing::info!("stopped");
    Ok(())
}

/// The backend of `REDIS_URL`, `REDIS_CLUSTER_URLS` and `LEDGER_REDIS_URL`, or memory.
async fn redis_or_memory() -> Result<Backend, String> {
    let records = match (env_nonempty("REDIS_URL"), env_urls("REDIS_CLUSTER_URLS")) {
        (Some(_), Some(_)) => return Err("set REDIS_URL or REDIS_CLUSTER_URLS, not both".into()),
        (Some(url), None) => Some(connect_redis("REDIS_URL", RedisStore::from_url(&url)).await?),
        (None, Some(urls)) => {
            Some(connect_redis("REDIS_CLUSTER_URLS", RedisStore::cluster(urls)).await?)
        }
        (None, None) => None,
    };
    // The ledger's Redis is the records' (one connection for both) unless `LEDGER_REDIS_URL`
    // names another; its errors name the variable its URL came from.
    let ledger = match env_nonempty("LEDGER_REDIS_URL") {
        Some(url) => {
            let store = RedisStore::from_url(&url);
            Some(connect_redis("LEDGER_REDIS_URL", store).await?)
        }
        None => records.clone(),
    };
    let (store, name) = match records {
        None => (BoxStore::new(MemoryStore::new()), "memory"),
        Some((store, _)) if store.is_cluster() => (BoxStore::new(store), "redis cluster"),
        Some((store, _)) => (BoxStore::new(store), "redis"),
    };
    match ledger {
        Some(ledger) => Backend::redis(store, name, ledger).await,
        None => Backend::memory(store, name).await,
    }
}

/// A Redis store (7.0 or newer), checked now so that a wrong URL fails at start-up, not at the
/// first request, and the environment variable it came from, which its errors name.
async fn connect_redis(
    var: &'static str,
    store: Result<RedisStore, tower_idempotency_redis::RedisStoreError>,
) -> Result<(RedisStore, &'static str), String> {
    let store = store.map_err(|err| format!("bad {var}: {}", report(&err)))?;
    (store.check().await).map_err(|err| format!("cannot use Redis at {var}: {}", report(&err)))?;
    Ok((store, var))
}

/// A consumer name unique to this process: a restarted process is a new consumer of the group,
/// and takes over what the old one left pending.
fn consumer_name() -> String {
    use std::hash::{BuildHasher, RandomState};
    let nonce = RandomState::new().hash_one(std::process::id()) as u32;
    format!("ledger-{}-{nonce:08x}", std::process::id())
}

/// The keys that seal the idempotency records: `IDEMPOTENCY_SEAL_KEYS`, or the development key,
/// with a warning. To rotate, put a new key first and drop the old one a dedup window later.
fn seal_keys() -> Result<SealKeys, Box<dyn Error>> {
    let Some(list) = env_nonempty("IDEMPOTENCY_SEAL_KEYS") else {
        let (id, key) = DEV_SEAL_KEY;
        tracing::warn!(
            "IDEMPOTENCY_SEAL_KEYS is unset: idempotency records are sealed under the public \
             development key {id:?}; set IDEMPOTENCY_SEAL_KEYS=id:base64key (32 bytes, e.g. \
             `openssl rand -base64 32`) in production"
        );
        return Ok(SealKeys::new([SealKey::new(id, key)?])?);
    };
    let keys = SealKeys::parse(&list).map_err(|err| format!("IDEMPOTENCY_SEAL_KEYS: {err}"))?;
    let ids: Vec<_> = keys.ids().collect();
    tracing::info!(?ids, "idempotency records sealed under {:?}", ids[0]);
    Ok(keys)
}

/// The environment variable `name`, a number of bytes, or `default` when it is unset.
fn env_bytes(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(bytes) => {
            (bytes.parse()).map_err(|_| format!("{name} must be a number of bytes, not {bytes:?}"))
        }
        Err(_) => Ok(default),
    }
}

/// The environment variable `name`, a number of milliseconds, unless it is unset.
fn env_millis(name: &str) -> Result<Option<Duration>, String> {
    match std::env::var(name) {
        Ok(ms) => (ms.parse().map(|ms| Some(Duration::from_millis(ms))))
            .map_err(|_| format!("{name} must be a number of milliseconds, not {ms:?}")),
        Err(_) => Ok(None),
    }
}

/// The environment variable `name`, unless it is unset or empty.
fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

/// The comma-separated URLs of the environment variable `name`, unless it names none.
fn env_urls(name: &str) -> Option<Vec<String>> {
    let urls: Vec<String> = env_nonempty(name)?
        .split(',')
        .map(str::trim)
        .filter(|value| !value.is_empty())
        .map(str::to_owned)
        .collect();
    (!urls.is_empty()).then_some(urls)
}

/// Resolves at the first SIGTERM or Ctrl-C. The handlers are installed now, before the server
/// listens, so that an early signal is not lost.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutting down: finishing the requests in flight");
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down: finishing the requests in flight");
    })
}

/// An error and its sources, on one line.
pub fn report(err: &dyn Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some errors repeat their source in their own message.
        if !line.contains(&cause_text) {
            line.push_str(": ");
            line.push_str(&cause_text);
        }
        source = cause.source();
    }
    line
}
