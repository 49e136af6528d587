//! Every check against the payments example (`examples/payments`), built as its `config.rs`
//! builds it (sealed records, a quota per account, the API's own limits, scope and problem
//! format) and served over HTTP, on memory, Redis and PostgreSQL, with the sample config
//! `examples/payments.toml`: each check passes or says why it does not apply.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use example_payments::balance::{Balances, MemoryBalances, PgBalances, RedisBalances};
use example_payments::config::STREAM;
use example_payments::events::Publisher;
use example_payments::ledger::{Ledger, MemoryLedger, PgLedger, RedisLedger};
use example_payments::provider::{
    self, KeyTable, MemoryKeys, PgKeys, Provider, ProviderClient, RedisKeys,
};
use example_payments::queue::{MemoryQueue, RedisQueue};
use example_payments::{AppState, app, consumer, pg};
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_server::RedisServer;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, ScopeQuota};
use tower_idempotency_conformance::{Config, Report, Verdict, run};
use tower_idempotency_redis::RedisStore;

/// What the example runs on: its idempotency records and every component, on one backend.
struct Backend {
    records: BoxStore,
    ledger: Arc<dyn Ledger>,
    balances: Arc<dyn Balances>,
    keys: Arc<dyn KeyTable>,
}

impl Backend {
    fn memory() -> Self {
        let events = Publisher::new(Arc::new(MemoryQueue::new()));
        Self {
            records: BoxStore::new(MemoryStore::new()),
            ledger: Arc::new(MemoryLedger::new(events, provider::WINDOW)),
            balances: Arc::new(MemoryBalances::default()),
            keys: Arc::new(MemoryKeys::new(provider::WINDOW)),
        }
    }

    async fn redis(server: &RedisServer) -> Self {
        let store = RedisStore::from_url(&server.url()).expect("a valid URL");
        store.check().await.expect("the fixture's Redis answers");
        let conn = store.shared_connection();
        let queue = RedisQueue::connect(conn.clone(), STREAM, consumer::SCOPE)
            .await
            .expect("the stream's group");
        let events = Publisher::new(Arc::new(queue));
        Self {
            records: BoxStore::new(store),
            ledger: Arc::new(RedisLedger::new(conn.clone(), events, provider::WINDOW)),
            balances: Arc::new(RedisBalances::new(conn.clone())),
            keys: Arc::new(RedisKeys::new(conn, provider::WINDOW)),
        }
    }

    async fn postgres(server: &PostgresServer) -> Self {
        let store = pg::connect(&server.url())
            .await
            .expect("the database is usable");
        let pool = store.pool().clone();
        Self {
            records: BoxStore::new(store.clone()),
            ledger: Arc::new(PgLedger::new(pool.clone(), provider::WINDOW)),
            balances: Arc::new(PgBalances::new(store)),
            keys: Arc::new(PgKeys::new(pool, provider::WINDOW)),
        }
    }

    /// Serves the example on a free port, as `config.rs` builds it; its base URL.
    async fn serve(self) -> String {
        let provider = Provider::new(self.keys, Duration::ZERO);
        let state = AppState {
            ledger: self.ledger,
            balances: self.balances,
            provider: ProviderClient::new(provider.router()),
            metrics: None,
        };
        let seal =
            SealKeys::new([SealKey::new("conformance", [7; 32]).expect("a key")]).expect("one key");
        let layer = IdempotencyLayer::new(BoxStore::new(SealedStore::new(self.records, seal)))
            .scope_quota(ScopeQuota::new(64 << 20));
        let router = app(state, layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the example serves");
        });
        format!("http://{addr}")
    }
}

/// The sample config, pointed at `base_url`.
fn config(base_url: String) -> Config {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/payments.toml");
    let mut config = Config::load(path).expect("examples/payments.toml is valid");
    config.base_url = base_url;
    config
}

/// Runs every check against the example at `base_url`: none fails, and only the retention check
/// (the example sends no retention header) does not apply.
async fn conforms(store: &str, base_url: String) {
    let report: Report = run(&config(base_url)).await.expect("the example answers");
    println!("payments example on {store}:\n{}", report.table());
    assert_eq!(report.summary.fail, 0, "{}", report.table());
    let not_applicable: Vec<_> = (report.checks.iter())
        .filter_map(|check| match &check.verdict {
            Verdict::NotApplicable { reason } => Some((check.name, reason.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        not_applicable,
        [("retention", "no retention_header configured")]
    );
    assert_eq!(report.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_conforms_on_memory() {
    conforms("memory", Backend::memory().serve().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_conforms_on_redis() {
    let server = RedisServer::start();
    conforms("redis", Backend::redis(&server).await.serve().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_conforms_on_postgres() {
    let server = PostgresServer::start();
    conforms("postgres", Backend::postgres(&server).await.serve().await).await;
}
