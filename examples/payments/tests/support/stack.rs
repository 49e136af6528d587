//! The example's components on one backend, built as `config.rs` builds them, each behind the
//! test's instruments (`instruments.rs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency_postgres::PgStore;

use example_payments::AppState;
use example_payments::balance::{MemoryBalances, PgBalances};
use example_payments::consumer::{self, Counts, MemoryOutbox, Outbox};
use example_payments::ledger::{MemoryLedger, PgLedger};
use example_payments::outbox::PgOutbox;
use example_payments::provider::{Provider, ProviderClient};
use example_payments::reconciler::Reconciler;

use super::instruments::{FaultyBalances, GatedLedger, ProviderProbe};

/// How often a test's consumer looks at an empty outbox.
pub(crate) const POLL: Duration = Duration::from_millis(10);

/// One instance's components.
pub(crate) struct Parts {
    pub ledger: Arc<GatedLedger>,
    pub balances: Arc<FaultyBalances>,
    pub outbox: Arc<dyn Outbox>,
    /// In memory: the outbox, to count what waits.
    pub memory_outbox: Option<Arc<MemoryOutbox>>,
    pub probe: Arc<ProviderProbe>,
    pub provider: Provider,
    /// On PostgreSQL: the store of the records and the example's tables.
    pub store: Option<PgStore>,
}

impl Parts {
    /// Everything in memory; the provider's keys and the charges' operations held for `window`.
    pub(crate) fn memory(window: Duration) -> Self {
        let balances = FaultyBalances::new(Arc::new(MemoryBalances::default()));
        let outbox = Arc::new(MemoryOutbox::new(balances.clone()));
        Self {
            ledger: GatedLedger::new(Arc::new(MemoryLedger::new(outbox.clone(), window))),
            balances,
            outbox: outbox.clone(),
            memory_outbox: Some(outbox),
            probe: Arc::default(),
            provider: Provider::new(Duration::ZERO, window),
            store: None,
        }
    }

    /// The money in `store`'s PostgreSQL, as `DATABASE_URL` puts it, with a provider of its own.
    pub(crate) fn postgres(store: &PgStore, window: Duration) -> Self {
        Self::postgres_with(store, Provider::new(Duration::ZERO, window), window)
    }

    /// The money in `store`'s PostgreSQL, calling `provider` (which other instances share).
    pub(crate) fn postgres_with(store: &PgStore, provider: Provider, window: Duration) -> Self {
        let pool = store.pool().clone();
        let balances = PgBalances::new(store.clone());
        Self {
            ledger: GatedLedger::new(Arc::new(PgLedger::new(pool.clone(), window))),
            balances: FaultyBalances::new(Arc::new(balances.clone())),
            outbox: Arc::new(PgOutbox::new(pool, balances)),
            memory_outbox: None,
            probe: Arc::default(),
            provider,
            store: Some(store.clone()),
        }
    }

    /// The provider taking `latency` to answer each call.
    pub(crate) fn latency(mut self, latency: Duration, window: Duration) -> Self {
        self.provider = Provider::new(latency, window);
        self
    }

    /// The provider's API, as the handlers call it (through the probe).
    pub(crate) fn client(&self) -> ProviderClient {
        ProviderClient::new(self.probe.router(&self.provider))
    }

    /// The handlers' state.
    pub(crate) fn state(&self) -> AppState {
        AppState {
            ledger: self.ledger.clone(),
            balances: self.balances.clone(),
            provider: self.client(),
            metrics: None,
        }
    }

    /// A reconciler of charges unchanged for `after`.
    pub(crate) fn reconciler(&self, after: Duration) -> Reconciler {
        Reconciler::new(self.ledger.clone(), self.client(), after)
    }

    /// The ledger consumer of the outbox, running until `stop`.
    pub(crate) fn consume(&self, stop: &CancellationToken) -> JoinHandle<Counts> {
        tokio::spawn(consumer::run(self.outbox.clone(), POLL, stop.clone()))
    }

    /// Adds `event` to the outbox as a write of the ledger does: the same event added again is
    /// an event handed out again.
    pub(crate) async fn publish(&self, event: &example_payments::events::PaymentEvent) {
        match (&self.memory_outbox, &self.store) {
            (Some(outbox), _) => outbox.push(event.clone()),
            (None, Some(store)) => {
                let mut conn = store.pool().acquire().await.expect("a connection");
                let inserted = example_payments::outbox::insert(&mut conn, event).await;
                inserted.expect("the outbox");
            }
            (None, None) => panic!("no outbox"),
        }
    }

    /// How many events wait in the outbox.
    pub(crate) async fn backlog(&self) -> usize {
        match (&self.memory_outbox, &self.store) {
            (Some(outbox), _) => outbox.len(),
            (None, Some(store)) => {
                let count: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
                    .fetch_one(store.pool())
                    .await
                    .expect("the outbox");
                usize::try_from(count).unwrap_or(usize::MAX)
            }
            (None, None) => 0,
        }
    }
}
