//! The store contract suite on `PgStore`, each case in a table of its own on the binary's one
//! PostgreSQL server (no case stops or pauses it).
//!
//! PostgreSQL keeps its own clock, so these cases run on real time with a short lease and window
//! (the memory suite runs the same cases on paused time).

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use test_servers::postgres_server::PostgresServer;
use tower_idempotency_postgres::PgStore;
use tower_idempotency_test::Harness;

#[derive(Debug)]
struct PgHarness {
    store: PgStore,
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
        static TABLES: AtomicU32 = AtomicU32::new(0);
        let table = format!("records_{}", TABLES.fetch_add(1, Ordering::Relaxed));
        let store = PgStore::connect(&PostgresServer::shared().url()).expect("a store");
        let store = configure(store.with_table(&table));
        store.migrate().await.expect("the table is created");
        Self { store }
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
