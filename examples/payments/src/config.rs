//! Start-up: the environment chooses where the money and the records live, once, here.
//!
//! | variable | what it sets |
//! |---|---|
//! | `ADDR` | where to listen (`127.0.0.1:3000`) |
//! | `DATABASE_URL` | the charges, balances and outbox in that PostgreSQL, for any number of instances, its schema created at start-up; and the idempotency records, unless a Redis variable is set. Unset: in memory, for one process |
//! | `REDIS_URL` | the idempotency records in that Redis (7 or newer) |
//! | `REDIS_CLUSTER_URLS` | instead of `REDIS_URL`: a Redis Cluster, comma-separated seed URLs |
//! | `PROVIDER_URL` | the payment provider's program (`--bin provider`), which every instance calls; unset: one served in process |
//! | `PSP_LATENCY_MS` | the in-process provider's delay per call (0; from 3000 every call outlasts the client's attempt timeout) |
//! | `RECONCILE_AFTER_MS` | how long a charge stays in an `-ing` state before the reconciler settles it (120000) |
//! | `IDEMPOTENCY_WAIT_MS` | how long a duplicate of a running charge waits for its replay (unset: `409` at once) |
//! | `IDEMPOTENCY_QUOTA_BYTES` | each account's quota of record bytes per instance and day (64 MiB): past it, `429` with `Retry-After` |
//! | `IDEMPOTENCY_SEAL_KEYS` | `id:base64key,...`, the first sealing the records, every one opening (rotation); unset: a public development key, with a warning |
//! | `SHUTDOWN_TIMEOUT_MS` | how long a shutdown may take (20000: keep it below your orchestrator's kill, 30 s on Kubernetes) |
//! | `RUST_LOG` | the log filter (`info`) |
//!
//! Money in memory belongs to one process: with the records in a Redis that other instances
//! share, a second instance whose money is in memory refuses to start (`single_process.rs`).

use std::error::Error;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::ScopeQuota;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_redis::RedisStore;

use super::balance::{Balances, MemoryBalances, PgBalances};
use super::consumer::{self, MemoryOutbox, Outbox};
use super::ledger::{Ledger, MemoryLedger, PgLedger};
use super::outbox::PgOutbox;
use super::provider::{self, Provider, ProviderClient};
use super::reconciler::Reconciler;
use super::{AppState, app, http_server, pg, prometheus, single_process};

/// `IDEMPOTENCY_QUOTA_BYTES`' default: a 32 MiB burst (tens of thousands of charges), then about
/// 400 bytes a second; past it, `429` for that account alone (PROTOCOL.md §3.4).
const QUOTA_BYTES: u64 = 64 << 20;

/// Seals the records when `IDEMPOTENCY_SEAL_KEYS` is unset: fixed, so a second instance and a
/// restarted one still open them. Public: never for production.
const DEV_SEAL_KEY: (&str, [u8; 32]) = ("dev-insecure", *b"tower-idempotency development!!!");

/// Where the money lives, and the records unless Redis holds them.
struct Backend {
    name: &'static str,
    records: BoxStore,
    ledger: Arc<dyn Ledger>,
    balances: Arc<dyn Balances>,
    outbox: Arc<dyn Outbox>,
}

impl Backend {
    fn memory() -> Self {
        let balances: Arc<dyn Balances> = Arc::new(MemoryBalances::default());
        let outbox = Arc::new(MemoryOutbox::new(balances.clone()));
        Self {
            name: "memory",
            records: BoxStore::new(MemoryStore::new()),
            ledger: Arc::new(MemoryLedger::new(outbox.clone(), provider::WINDOW)),
            balances,
            outbox,
        }
    }

    async fn postgres(url: &str) -> Result<Self, String> {
        let store = pg::connect(url).await?;
        let pool = store.pool().clone();
        let balances = PgBalances::new(store.clone());
        Ok(Self {
            name: "postgres",
            records: BoxStore::new(store),
            ledger: Arc::new(PgLedger::new(pool.clone(), provider::WINDOW)),
            balances: Arc::new(balances.clone()),
            outbox: Arc::new(PgOutbox::new(pool, balances)),
        })
    }
}

/// Runs the server, configured from the environment, until SIGTERM or Ctrl-C.
pub async fn run() -> Result<(), Box<dyn Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = env_millis("PSP_LATENCY_MS")?.unwrap_or_default();
    let shutdown_timeout = env_millis("SHUTDOWN_TIMEOUT_MS")?.unwrap_or(Duration::from_secs(20));
    // Four of the layer's 30 s leases, far above any provider call.
    let reconcile_after = env_millis("RECONCILE_AFTER_MS")?.unwrap_or(Duration::from_secs(120));
    let metrics = prometheus::install()?;
    let redis = redis_records().await?;
    let database = env_nonempty("DATABASE_URL");
    let memory_beside_redis = redis.is_some() && database.is_none();
    let backend = match database {
        Some(url) => Backend::postgres(&url).await?,
        None => Backend::memory(),
    };
    let (records, name) = match redis {
        Some((store, redis)) => (store, format!("{}, records in {redis}", backend.name)),
        None => (backend.records, backend.name.to_owned()),
    };
    let provider = match env_nonempty("PROVIDER_URL") {
        Some(url) => ProviderClient::http(&url)?,
        None => ProviderClient::new(Provider::new(latency, provider::WINDOW).router()),
    };
    let stop = CancellationToken::new();
    // Let go only once this process is done with its money, not when asked to stop.
    let exited = CancellationToken::new();
    let hold = if memory_beside_redis {
        Some(single_process::hold(records.clone(), exited.clone()).await?)
    } else {
        None
    };

    // Sealed: readers of the store see no charge, writers cannot forge or move one. Each
    // account has a quota of record bytes: one cannot fill the store for the others.
    let quota = env_parse("IDEMPOTENCY_QUOTA_BYTES", "a number of bytes")?.unwrap_or(QUOTA_BYTES);
    let sealed = SealedStore::new(records, seal_keys()?);
    let mut idempotency = IdempotencyLayer::new(BoxStore::new(ScopeQuota::new(sealed, quota)));
    // A duplicate of a running charge waits for its replay instead of a 409.
    if let Some(bound) = env_millis("IDEMPOTENCY_WAIT_MS")? {
        idempotency = idempotency.wait_for_in_flight(bound);
    }
    let drained = idempotency.shutdown_handle();
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let (signal, on_signal) = (shutdown_signal()?, stop.clone());
    tokio::spawn(async move {
        signal.await;
        on_signal.cancel();
    });

    let reconciler = Reconciler::new(backend.ledger.clone(), provider.clone(), reconcile_after);
    let consumer = consumer::run(backend.outbox, Duration::from_millis(200), stop.clone());
    let reconciler = reconciler.run(stop.clone());
    let workers = tokio::spawn(async move { tokio::join!(consumer, reconciler) });
    let state = AppState {
        ledger: backend.ledger,
        balances: backend.balances,
        provider,
        metrics: Some(metrics),
    };

    let local = listener.local_addr()?;
    println!("listening on http://{local} (store: {name})");
    let deadline = async {
        stop.cancelled().await;
        Instant::now() + shutdown_timeout
    };
    let app = app(state, idempotency);
    let serve = http_server::serve(listener, app, stop.clone(), shutdown_timeout);
    let ((), deadline) = tokio::join!(serve, deadline);
    // Handlers whose client went away run on, detached; let them finish and store their result.
    if timeout_at(deadline, drained.wait()).await.is_err() {
        tracing::warn!(
            ?shutdown_timeout,
            "gave up waiting for detached requests; their claims' leases will run out"
        );
    }
    if let Err(err) = workers.await {
        tracing::error!(%err, "the ledger consumer failed");
    }
    exited.cancel();
    if let Some(hold) = hold {
        let _ = hold.await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// The records' Redis of `REDIS_URL` or `REDIS_CLUSTER_URLS`, checked now so that a wrong URL
/// fails at start-up, not at the first request; `None` when neither is set.
async fn redis_records() -> Result<Option<(BoxStore, &'static str)>, String> {
    let (var, store, name) = match (env_nonempty("REDIS_URL"), env_urls("REDIS_CLUSTER_URLS")) {
        (Some(_), Some(_)) => return Err("set REDIS_URL or REDIS_CLUSTER_URLS, not both".into()),
        (Some(url), None) => ("REDIS_URL", RedisStore::from_url(&url), "redis"),
        (None, Some(urls)) => (
            "REDIS_CLUSTER_URLS",
            RedisStore::cluster(urls),
            "redis cluster",
        ),
        (None, None) => return Ok(None),
    };
    let store = store.map_err(|err| format!("bad {var}: {}", report(&err)))?;
    (store.check().await).map_err(|err| format!("cannot use Redis at {var}: {}", report(&err)))?;
    Ok(Some((BoxStore::new(store), name)))
}

/// The keys that seal the records: `IDEMPOTENCY_SEAL_KEYS`, or the development key, with a
/// warning. To rotate, put a new key first and drop the old one a dedup window later.
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

/// The environment variable `name`, parsed, or `None` when unset; an error says it must be `what`.
fn env_parse<T: FromStr>(name: &str, what: &str) -> Result<Option<T>, String> {
    let Ok(value) = std::env::var(name) else {
        return Ok(None);
    };
    (value.parse().map(Some)).map_err(|_| format!("{name} must be {what}, not {value:?}"))
}

/// The environment variable `name`, a number of milliseconds, unless it is unset.
pub fn env_millis(name: &str) -> Result<Option<Duration>, String> {
    Ok(env_parse(name, "a number of milliseconds")?.map(Duration::from_millis))
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
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    let (mut terminate, mut interrupt) = {
        use tokio::signal::unix::{SignalKind, signal};
        let terminate = signal(SignalKind::terminate())?;
        (terminate, signal(SignalKind::interrupt())?)
    };
    Ok(async move {
        #[cfg(unix)]
        tokio::select! { _ = terminate.recv() => {} _ = interrupt.recv() => {} }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down: finishing the requests in flight");
    })
}

/// An error and its sources, on one line.
pub fn report(err: &(dyn Error + 'static)) -> String {
    tower_idempotency::error_chain::ErrorChain(err).to_string()
}
