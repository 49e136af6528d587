//! The store contract suite on `PgStore`, each case on a PostgreSQL server of its own.
//!
//! PostgreSQL keeps its own clock, so these cases run on real time with a short lease and window
//! (the memory suite runs the same cases on paused time).

use std::future::Future;
use std::time::Duration;

use test_servers::postgres_server::PostgresServer;
use tower_idempotency_postgres::PgStore;
use tower_idempotency_test::Harness;

#[derive(Debug)]
struct PgHarness {
    store: PgStore,
    /// Kept for the case, and dropped after the store.
    _server: PostgresServer,
}

impl PgHarness {
    async fn start() -> Self {
        Self::start_with(|store| store).await
    }

    /// With `NOTIFY` in every completion and release, and a listener for waiting requests.
    async fn notifying() -> Self {
        Self::start_with(|store| store.with_notifications(true)).await
    }

    async fn start_with(configure: impl FnOnce(PgStore) -> PgStore) -> Self {
        let server = PostgresServer::start();
        let store = configure(PgStore::connect(&server.url()).expect("a store"));
        store.migrate().await.expect("the table is created");
        Self {
            store,
            _server: server,
        }
    }
}

impl Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(3)
    }

    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(d)
    }
}

tower_idempotency_test::store_contract!(PgHarness::start().await, flavor = "multi_thread");
tower_idempotency_test::layer_contract!(PgHarness::start().await, flavor = "multi_thread");

/// The whole contract again with change notifications: the statements that notify must keep every
/// rule of the ones that do not.
mod notifying {
    use super::*;

    tower_idempotency_test::store_contract!(PgHarness::notifying().await, flavor = "multi_thread");
    tower_idempotency_test::layer_contract!(PgHarness::notifying().await, flavor = "multi_thread");
}
