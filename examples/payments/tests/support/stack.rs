//! The example's components on one backend, built as `config.rs` builds them, each behind the
//! test's instruments (`instruments.rs`).

use std::sync::Arc;
use std::time::Duration;

use tower_idempotency::Store;
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::SharedConnection;

use example_payments::AppState;
use example_payments::balance::{MemoryBalances, PgBalances, RedisBalances};
use example_payments::config::STREAM;
use example_payments::consumer::{self, Counts, LedgerConsumer};
use example_payments::events::Publisher;
use example_payments::ledger::{MemoryLedger, PgLedger, RedisLedger};
use example_payments::outbox::OutboxConsumer;
use example_payments::provider::{
    KeyTable, MemoryKeys, PgKeys, Provider, ProviderClient, RedisKeys,
};
use example_payments::queue::{ConsumerConfig, MemoryQueue, RedisQueue};
use example_payments::reconciler::{Reconciled, Reconciler};
use tokio_util::sync::CancellationToken;

use super::instruments::{CountingQueue, FaultyBalances, GatedLedger, Outage, ProbedKeys};

/// One instance's components.
pub struct Parts {
    /// The events' queue (none on PostgreSQL: the outbox table).
    pub queue: Option<Arc<CountingQueue>>,
    pub events: Option<Publisher>,
    pub ledger: Arc<GatedLedger>,
    pub balances: Arc<FaultyBalances>,
    pub keys: Arc<ProbedKeys>,
    pub outage: Arc<Outage>,
    pub provider: Provider,
    /// On PostgreSQL: the store, for the outbox's consumer.
    pub store: Option<PgStore>,
}

impl Parts {
    /// Everything in memory; keys and operations held for `window`.
    pub fn memory(window: Duration) -> Self {
        let queue = CountingQueue::new(Arc::new(MemoryQueue::new()));
        let events = Publisher::new(queue.clone());
        let ledger = Arc::new(MemoryLedger::new(events.clone(), window));
        let balances = Arc::new(MemoryBalances::default());
        Self::new(
            Some(queue),
            Some(events),
            ledger,
            balances,
            Arc::new(MemoryKeys::new(window)),
        )
    }

    /// Everything in the Redis of `conn`, as `REDIS_URL` puts it.
    pub async fn redis(conn: &SharedConnection, window: Duration) -> Self {
        let stream = RedisQueue::connect(conn.clone(), STREAM, consumer::SCOPE)
            .await
            .expect("the stream's group");
        let queue = CountingQueue::new(Arc::new(stream));
        let events = Publisher::new(queue.clone());
        let ledger = Arc::new(RedisLedger::new(conn.clone(), events.clone(), window));
        let balances = Arc::new(RedisBalances::new(conn.clone()));
        let keys = Arc::new(RedisKeys::new(conn.clone(), window));
        Self::new(Some(queue), Some(events), ledger, balances, keys)
    }

    /// The events and the balances in the Redis of `conn`, the charges and the provider's keys
    /// in memory: where a test of the events alone wants Redis.
    pub async fn redis_events(conn: &SharedConnection, window: Duration) -> Self {
        let stream = RedisQueue::connect(conn.clone(), STREAM, consumer::SCOPE)
            .await
            .expect("the stream's group");
        let queue = CountingQueue::new(Arc::new(stream));
        let events = Publisher::new(queue.clone());
        let ledger = Arc::new(MemoryLedger::new(events.clone(), window));
        let balances = Arc::new(RedisBalances::new(conn.clone()));
        let keys = Arc::new(MemoryKeys::new(window));
        Self::new(Some(queue), Some(events), ledger, balances, keys)
    }

    /// Everything in `store`'s PostgreSQL, as `DATABASE_URL` puts it.
    pub fn postgres(store: &PgStore, window: Duration) -> Self {
        let pool = store.pool().clone();
        let ledger = Arc::new(PgLedger::new(pool.clone(), window));
        let balances = Arc::new(PgBalances::new(store.clone()));
        let keys = Arc::new(PgKeys::new(pool, window));
        let mut parts = Self::new(None, None, ledger, balances, keys);
        parts.store = Some(store.clone());
        parts
    }

    fn new(
        queue: Option<Arc<CountingQueue>>,
        events: Option<Publisher>,
        ledger: Arc<dyn example_payments::ledger::Ledger>,
        balances: Arc<dyn example_payments::balance::Balances>,
        keys: Arc<dyn KeyTable>,
    ) -> Self {
        let keys = ProbedKeys::new(keys);
        Self {
            queue,
            events,
            ledger: GatedLedger::new(ledger),
            balances: FaultyBalances::new(balances),
            provider: Provider::new(keys.clone(), Duration::ZERO),
            keys,
            outage: Arc::default(),
            store: None,
        }
    }

    /// The provider taking `latency` to answer each call.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.provider = Provider::new(self.keys.clone(), latency);
        self
    }

    /// The provider's API, as the handlers call it (through the outage probe).
    pub fn client(&self) -> ProviderClient {
        ProviderClient::new(self.outage.router(&self.provider))
    }

    /// The handlers' state.
    pub fn state(&self) -> AppState {
        AppState {
            ledger: self.ledger.clone(),
            balances: self.balances.clone(),
            provider: self.client(),
            metrics: None,
        }
    }

    /// A reconciler of charges unchanged for `after`.
    pub fn reconciler(&self, after: Duration) -> Reconciler {
        Reconciler::new(self.ledger.clone(), self.client(), after)
    }

    /// One reconciler round over every charge still in an intermediate state.
    pub async fn reconcile(&self) -> Reconciled {
        self.reconciler(Duration::ZERO)
            .round()
            .await
            .expect("a reconciler round")
    }

    /// A ledger consumer named `name` of the queue, its Deduplicator on `dedup`, running until
    /// `stop`; on PostgreSQL, the outbox's consumer.
    pub async fn consume(
        &self,
        name: &str,
        dedup: impl Store + 'static,
        config: ConsumerConfig,
        stop: &CancellationToken,
    ) -> tokio::task::JoinHandle<Counts> {
        match (&self.queue, &self.store) {
            (Some(queue), _) => {
                let reads = queue.consumer_of(name, config).await;
                let dedup = consumer::deduplicator(dedup, config.min_idle);
                let consumer = LedgerConsumer::new(self.balances.clone(), dedup);
                tokio::spawn(consumer.run(reads, stop.clone()))
            }
            (None, Some(store)) => {
                let balances = PgBalances::new(store.clone());
                let outbox = OutboxConsumer::new(store.pool().clone(), balances, config.block);
                tokio::spawn(outbox.run(stop.clone()))
            }
            (None, None) => unreachable!("a queue or a database"),
        }
    }

    /// How many events wait to be applied: in the queue, or in the outbox table.
    pub async fn backlog(&self) -> usize {
        match (&self.queue, &self.store) {
            (Some(queue), _) => queue.backlog(),
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

impl CountingQueue {
    /// A consumer of the group, which must be had.
    pub async fn consumer_of(
        &self,
        name: &str,
        config: ConsumerConfig,
    ) -> Box<dyn example_payments::queue::QueueConsumer> {
        use example_payments::queue::Queue;
        self.consumer(name, config)
            .await
            .expect("a consumer of the queue")
    }
}
