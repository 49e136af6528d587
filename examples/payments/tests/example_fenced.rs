//! Two instances of the payments example over the same stores, whose claims' leases run out while
//! their handlers are stalled: on memory, Redis, a Redis Cluster and PostgreSQL.
//!
//! Each repetition stalls every charge handler right after its claim (the ledger's opens held, as
//! a locked `charges` table holds them) while the lease renewals fail, so the first attempt's
//! lease runs out; the client's retry, on the other instance, takes the key over and stalls too.
//! Then both are let go at once, and each client retries until it gets an answer that is not a
//! `409` or a `503`. Whatever the interleaving, an operation must end with exactly one charge, one
//! provider payment and one credit to the balance, and every client with that charge or a clear
//! error.
//!
//! In memory the two instances share one process's state; on Redis they share the store under
//! test, where everything is (records, charges, provider keys, events, balances). On PostgreSQL
//! every instance has its own pool, ledger and provider client over one database.

#![cfg(unix)]

use example_payments as server;

mod support;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::Value;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{
    BoxStore, Claim, ClaimToken, Completed, Fingerprint, IdempotencyLayer, MemoryStore, RecordId,
    Store, StoreError,
};
use tower_idempotency_redis::{RedisStore, SharedConnection};

use server::consumer::deduplicator;
use server::pg::{Database, outbox};
use server::provider::KeyTable;
use server::queue::{ConsumerConfig, Queue, RedisQueue};
use server::reconciler::Reconciler;
use server::{AppState, Balances, Ledger, LedgerConsumer, Provider, app};
use support::api::{ALICE, Call, Reply, account, create_charge, visa};

/// The idempotency layer's lease here: short, so that each repetition takes about a second.
const LEASE: Duration = Duration::from_millis(300);
/// How often a client sends its request again after a `409` or a `503`.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Repetitions per store.
const REPETITIONS: usize = 20;
/// How long a test waits for something to happen.
const PATIENCE: Duration = Duration::from_secs(30);
/// A reconciler that stays out of the way until the test runs a round itself.
const NEVER: Duration = Duration::from_secs(3600);

/// A store whose lease renewals fail while `stalled` is set: the claim's lease runs out in the
/// store while its handler is still running, as behind a stalled network or a locked table.
#[derive(Clone)]
struct Stalling<St> {
    inner: St,
    stalled: Arc<AtomicBool>,
}

impl<St: Store> Store for Stalling<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if self.stalled.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout(lease));
        }
        self.inner.renew(id, token, lease).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut axum::http::Extensions) {
        self.inner.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.inner.release(id, token).await
    }

    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.inner.changed(id)
    }
}

/// One instance: its API over its own layer.
struct Instance {
    router: Router,
    state: AppState,
}

/// Two instances over the same stores, and what the test reads them by.
struct Pair {
    a: Instance,
    b: Instance,
    stalled: Arc<AtomicBool>,
    /// Set on PostgreSQL: the database, to run the reconciler and read the outbox.
    db: Option<Database>,
    stop: CancellationToken,
    /// The servers, kept running for the test.
    _servers: Servers,
}

#[allow(dead_code)] // kept for their Drop
enum Servers {
    None,
    Redis(RedisServer),
    Cluster(RedisCluster),
    Postgres(PostgresServer),
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn layer<St: Store>(store: St, stalled: &Arc<AtomicBool>) -> IdempotencyLayer<BoxStore> {
    IdempotencyLayer::new(BoxStore::new(Stalling {
        inner: store,
        stalled: stalled.clone(),
    }))
    .lease(LEASE)
}

/// Starts the ledger consumer of `state`'s queue, its Deduplicator on `dedup`.
async fn consume<St: Store + Clone>(state: &AppState, dedup: St, stop: &CancellationToken) {
    let config = ConsumerConfig::default()
        .min_idle(Duration::from_millis(300))
        .block(Duration::from_millis(50));
    let queue = state
        .events
        .queue()
        .consumer("ledger-test", config)
        .await
        .expect("a consumer of the queue");
    let consumer = LedgerConsumer::new(
        queue,
        state.balances.clone(),
        deduplicator(dedup, config.min_idle),
    );
    tokio::spawn(consumer.run(stop.clone()));
}

impl Pair {
    /// Both instances share one process's state and one `MemoryStore`.
    async fn memory() -> Self {
        let stalled = Arc::new(AtomicBool::new(false));
        let state = AppState::new(Duration::ZERO);
        let store = MemoryStore::new();
        let stop = CancellationToken::new();
        consume(&state, MemoryStore::new(), &stop).await;
        Self::shared((state.clone(), state), store, stalled, stop, Servers::None)
    }

    /// The records, provider keys, events and balances in one Redis, as `REDIS_URL` puts them.
    async fn redis() -> Self {
        let server = RedisServer::start();
        let url = server.url();
        let store = RedisStore::from_url(&url).expect("a valid URL");
        Self::on_redis(store, Servers::Redis(server)).await
    }

    /// The same on a Redis Cluster, as `REDIS_CLUSTER_URLS` puts them.
    async fn cluster() -> Self {
        let cluster = RedisCluster::start();
        let urls = cluster.urls();
        let store = RedisStore::cluster(&urls).expect("valid URLs");
        Self::on_redis(store, Servers::Cluster(cluster)).await
    }

    /// Everything on `store`'s Redis and its connection, as `main` puts it: the consumer's
    /// records under their own prefix.
    async fn on_redis(store: RedisStore, servers: Servers) -> Self {
        store.check().await.expect("the fixture's Redis answers");
        let conn = store.shared_connection();
        let dedup = store.clone().with_prefix(server::CONSUMER_PREFIX);
        let queue = RedisQueue::connect(conn.clone(), server::STREAM, server::consumer::SCOPE)
            .await
            .expect("the stream's group");
        let keys = KeyTable::redis(
            conn.clone(),
            server::PROVIDER_PREFIX,
            server::provider::WINDOW,
        );
        let state = AppState::new(Duration::ZERO)
            .with_events(
                Queue::Redis(queue),
                Balances::redis(conn.clone(), server::BALANCES_PREFIX),
            )
            .with_provider(Provider::with_keys(Duration::ZERO, keys));
        // Each instance has its own handle on the ledger: they share the charges through Redis.
        let b = redis_ledger(state.clone(), &conn);
        let a = redis_ledger(state, &conn);
        let stalled = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        consume(&a, dedup, &stop).await;
        Self::shared((a, b), store, stalled, stop, servers)
    }

    fn shared<St: Store + Clone>(
        (a, b): (AppState, AppState),
        store: St,
        stalled: Arc<AtomicBool>,
        stop: CancellationToken,
        servers: Servers,
    ) -> Self {
        let a = Instance {
            router: app(a.clone(), layer(store.clone(), &stalled)),
            state: a,
        };
        let b = Instance {
            router: app(b.clone(), layer(store, &stalled)),
            state: b,
        };
        Self {
            a,
            b,
            stalled,
            db: None,
            stop,
            _servers: servers,
        }
    }

    /// Two instances on one PostgreSQL, each with its own pool, ledger and provider client, as two
    /// processes with `DATABASE_URL` set have; one of them runs the outbox consumer.
    async fn postgres() -> Self {
        let server = PostgresServer::start();
        let stalled = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let mut instances = Vec::new();
        let mut first_db = None;
        for i in 0..2 {
            let db = Database::connect(&server.url())
                .await
                .expect("the database is usable");
            let state = db.state(AppState::new(Duration::ZERO));
            if i == 0 {
                drop(db.spawn_workers(&state, NEVER, stop.clone()));
            }
            let router = app(state.clone(), layer(db.store().clone(), &stalled));
            instances.push(Instance { router, state });
            first_db.get_or_insert(db);
        }
        let b = instances.pop().expect("two instances");
        let a = instances.pop().expect("two instances");
        Self {
            a,
            b,
            stalled,
            db: first_db,
            stop,
            _servers: Servers::Postgres(server),
        }
    }

    /// The ledgers of the two instances (one, when they share it).
    fn ledgers(&self) -> Vec<&Arc<Ledger>> {
        let (a, b) = (&self.a.state.ledger, &self.b.state.ledger);
        if Arc::ptr_eq(a, b) {
            vec![a]
        } else {
            vec![a, b]
        }
    }

    /// How many payments the providers made (one provider object when they share it).
    fn payments(&self) -> usize {
        let (a, b) = (&self.a.state.provider, &self.b.state.provider);
        let same = self.db.is_none();
        a.effects() + if same { 0 } else { b.effects() }
    }

    /// Forgets every idempotency record (a flushed Redis), keeping everything else.
    fn lose_records(&self) {
        let nodes: Vec<&RedisServer> = match &self._servers {
            Servers::Redis(server) => vec![server],
            Servers::Cluster(cluster) => cluster
                .masters()
                .into_iter()
                .map(|i| cluster.node(i))
                .collect(),
            _ => panic!("records in Redis only"),
        };
        for node in nodes {
            let keys = node.command(&["KEYS", "idempotency:*"]);
            let keys = match keys {
                test_servers::redis_server::RespValue::Array(keys) => keys,
                other => panic!("{other:?}"),
            };
            for key in keys.iter().filter_map(|key| key.as_string()) {
                assert!(node.command(&["DEL", &key]).as_integer().is_some());
            }
        }
    }

    fn held_opens(&self) -> usize {
        self.ledgers()
            .iter()
            .map(|ledger| ledger.held_opens())
            .sum()
    }

    /// Runs what a crash or a stale run left behind to its end: a reconciler round over every
    /// charge still in an intermediate state; then waits until every event published
    /// so far is applied.
    async fn settle(&self) {
        let reconciler = Reconciler::new(&self.a.state, Duration::ZERO);
        reconciler.round().await.expect("a reconciler round");
        let deadline = Instant::now() + PATIENCE;
        loop {
            let backlog = match &self.db {
                Some(db) => outbox::backlog(db.pool()).await.expect("the outbox") as usize,
                None => self
                    .a
                    .state
                    .events
                    .queue()
                    .backlog()
                    .await
                    .expect("the queue"),
            };
            if backlog == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{backlog} events never applied");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Alice's balance in euro cents.
    async fn balance(&self) -> i64 {
        let available = self
            .a
            .state
            .balances
            .get(&account(ALICE))
            .await
            .expect("the balance");
        available
            .iter()
            .filter(|a| a.currency == "eur")
            .map(|a| a.amount)
            .sum()
    }
}

/// Whether a client sends its request again after `reply`: a `409` (the key in flight, or the run
/// superseded) or a `503` (nothing done).
fn retries_after(reply: &Reply) -> bool {
    matches!(
        reply.status,
        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
    )
}

/// A client: sends its request again after every `409` or `503`, until another answer.
async fn client(router: Router, key: String, body: Value, first: Option<Reply>) -> Reply {
    let deadline = Instant::now() + PATIENCE;
    let mut reply = match first {
        Some(reply) => reply,
        None => create_charge(&router, ALICE, &key, &body).send().await,
    };
    while retries_after(&reply) {
        assert!(
            Instant::now() < deadline,
            "the client never got an answer: {}",
            reply.text()
        );
        tokio::time::sleep(RETRY_EVERY).await;
        reply = create_charge(&router, ALICE, &key, &body).send().await;
    }
    reply
}

/// What one repetition came to.
#[derive(Debug)]
struct Ending {
    /// The charges made for the operation.
    charges: Vec<Value>,
    /// The provider payments made for it.
    payments: usize,
    /// How much the balance went up, and by how much it should have.
    credited: i64,
    amount: i64,
    /// The clients' last answers.
    replies: Vec<Reply>,
}

impl Ending {
    /// What is wrong with it, if anything.
    fn faults(&self) -> Vec<String> {
        let mut faults = Vec::new();
        if self.charges.len() != 1 {
            faults.push(format!("{} charges", self.charges.len()));
        }
        if self.payments != 1 {
            faults.push(format!("{} provider payments", self.payments));
        }
        if self.credited != self.amount {
            faults.push(format!("credited {} for {}", self.credited, self.amount));
        }
        let id = self.charges.first().map(|charge| &charge["id"]);
        for reply in &self.replies {
            let that_charge = reply.status == StatusCode::CREATED && Some(&reply.json["id"]) == id;
            let clear_error =
                reply.status.is_client_error() && reply.json["error"]["type"].is_string();
            if !that_charge && !clear_error {
                faults.push(format!(
                    "a client ended with {} {}",
                    reply.status,
                    reply.text()
                ));
            }
        }
        faults
    }
}

/// One repetition: a charge of `amount` under `key`, whose first run is displaced by the retry's.
async fn repetition(pair: &Pair, key: &str, amount: i64) -> Ending {
    let body = visa(amount);
    let payments_before = pair.payments();
    let balance_before = pair.balance().await;

    let mut holds = Vec::new();
    for ledger in pair.ledgers() {
        holds.push(ledger.hold_opens().await);
    }
    pair.stalled.store(true, Ordering::SeqCst);

    // The first attempt, on instance A: claimed, and stalled right after its claim.
    let first = tokio::spawn(create_charge(&pair.a.router, ALICE, key, &body).send());
    wait_until("the first run to stall", || pair.held_opens() == 1).await;

    // The client's retries, on instance B: 409 while the first claim's lease lasts, then one of
    // them takes the key over and stalls too.
    let deadline = Instant::now() + PATIENCE;
    let second = 'retry: loop {
        let mut attempt = tokio::spawn(create_charge(&pair.b.router, ALICE, key, &body).send());
        // A slow answer is a 409 on its way, or a takeover not yet at the held gate: the first is
        // awaited, the second is the run sought (awaiting it would wait behind the gate).
        loop {
            match tokio::time::timeout(RETRY_EVERY, &mut attempt).await {
                Ok(reply) => {
                    let reply = reply.expect("an answer");
                    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
                    break;
                }
                Err(_) if pair.held_opens() == 2 => break 'retry attempt,
                Err(_) => assert!(
                    Instant::now() < deadline,
                    "an attempt neither answered nor took the key over"
                ),
            }
        }
        assert!(
            Instant::now() < deadline,
            "the retry never took the key over"
        );
        tokio::time::sleep(RETRY_EVERY).await;
    };

    // Both runs go on at once.
    pair.stalled.store(false, Ordering::SeqCst);
    drop(holds);
    let first = first.await.expect("an answer");
    let second = second.await.expect("an answer");
    let clients = [
        tokio::spawn(client(
            pair.a.router.clone(),
            key.to_owned(),
            body.clone(),
            Some(first),
        )),
        tokio::spawn(client(
            pair.b.router.clone(),
            key.to_owned(),
            body.clone(),
            Some(second),
        )),
    ];
    let mut replies = Vec::new();
    for client in clients {
        replies.push(client.await.expect("a client"));
    }

    pair.settle().await;
    let charges = charges_of(&pair.a.router, amount).await;
    Ending {
        charges,
        payments: pair.payments() - payments_before,
        credited: pair.balance().await - balance_before,
        amount,
        replies,
    }
}

/// Alice's charges of `amount`.
async fn charges_of(router: &Router, amount: i64) -> Vec<Value> {
    let list = Call::get(router, "/v1/charges").auth(ALICE).send().await;
    assert_eq!(list.status, StatusCode::OK);
    list.json["data"]
        .as_array()
        .expect("a list")
        .iter()
        .filter(|charge| charge["amount"] == amount)
        .cloned()
        .collect()
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs [`REPETITIONS`] repetitions on `pair`, and fails naming every one that went wrong.
async fn every_operation_charges_once(pair: Pair) {
    let started = Instant::now();
    let mut failed = Vec::new();
    for rep in 0..REPETITIONS {
        let amount = 1000 + i64::try_from(rep).expect("a small number");
        let ending = repetition(&pair, &format!("stalled-{rep}"), amount).await;
        let faults = ending.faults();
        if !faults.is_empty() {
            failed.push(format!("repetition {rep}: {}", faults.join(", ")));
        }
    }
    eprintln!(
        "{REPETITIONS} repetitions in {:?}, {} went wrong",
        started.elapsed(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {REPETITIONS} repetitions went wrong:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_charges_once_when_a_lease_runs_out_under_a_stalled_handler() {
    every_operation_charges_once(Pair::memory().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_charges_once_when_a_lease_runs_out_under_a_stalled_handler() {
    every_operation_charges_once(Pair::redis().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_charges_once_when_a_lease_runs_out_under_a_stalled_handler() {
    every_operation_charges_once(Pair::cluster().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_charges_once_when_a_lease_runs_out_under_a_stalled_handler() {
    every_operation_charges_once(Pair::postgres().await).await;
}

/// The ledger on Redis: as `main` sets it up when `REDIS_URL` is set.
fn redis_ledger(state: AppState, conn: &SharedConnection) -> AppState {
    state.with_ledger(Ledger::redis(conn.clone()))
}

/// The provider refuses a call whose fence is smaller than one its key has seen, and takes an
/// equal or larger one as the same request sent again, on the key table under test.
async fn the_provider_refuses_a_smaller_fence(provider: Provider) {
    use server::provider::{ProviderError, Source};
    let payment = provider
        .create_payment("fenced", 20, Source::Visa, 700, true, "")
        .await
        .expect("a payment");
    assert_eq!(
        provider
            .create_payment("fenced", 19, Source::Visa, 700, true, "")
            .await,
        Err(ProviderError::Superseded)
    );
    for fence in [20, 21] {
        assert_eq!(
            provider
                .create_payment("fenced", fence, Source::Visa, 700, true, "")
                .await,
            Ok(payment.clone())
        );
    }
    assert_eq!(
        provider
            .create_payment("fenced", 20, Source::Visa, 700, true, "")
            .await,
        Err(ProviderError::Superseded),
        "the key keeps its largest fence"
    );
    assert_eq!(
        provider
            .create_payment("fenced", 99, Source::Visa, 701, true, "")
            .await,
        Err(ProviderError::KeyReused)
    );
    let refund = provider
        .refund("fenced-refund", u64::MAX, &payment.id, 100)
        .await
        .expect("a refund");
    assert_eq!(
        provider
            .refund("fenced-refund", u64::MAX - 1, &payment.id, 100)
            .await,
        Err(ProviderError::Superseded),
        "fences compare exactly, up to the largest"
    );
    assert_eq!(
        provider
            .refund("fenced-refund", u64::MAX, &payment.id, 100)
            .await,
        Ok(refund)
    );
    assert_eq!(provider.effects(), 2, "one payment, one refund");
}

#[tokio::test]
async fn the_provider_refuses_a_smaller_fence_in_memory() {
    the_provider_refuses_a_smaller_fence(Provider::default()).await;
}

#[tokio::test]
async fn the_provider_refuses_a_smaller_fence_on_redis() {
    let server = RedisServer::start();
    let conn = RedisStore::from_url(&server.url())
        .expect("a valid URL")
        .shared_connection();
    let keys = KeyTable::redis(conn, server::PROVIDER_PREFIX, server::provider::WINDOW);
    the_provider_refuses_a_smaller_fence(Provider::with_keys(Duration::ZERO, keys)).await;
}

/// On PostgreSQL too; and the keys whose window ended are swept from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_refuses_a_smaller_fence_on_postgres_and_sweeps_expired_keys() {
    let server = PostgresServer::start();
    let db = Database::connect(&server.url())
        .await
        .expect("the database");
    let keys = KeyTable::postgres(db.pool().clone(), server::provider::WINDOW);
    the_provider_refuses_a_smaller_fence(Provider::with_keys(Duration::ZERO, keys)).await;

    let short = Provider::with_keys(
        Duration::ZERO,
        KeyTable::postgres(db.pool().clone(), Duration::from_millis(50)),
    );
    short
        .capture("short-lived", 1, "py_1")
        .await
        .expect("captured");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(short.sweep_keys().await.expect("a sweep"), 1);
    assert_eq!(short.sweep_keys().await.expect("a sweep"), 0);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM provider_keys WHERE key = 'short-lived'")
            .fetch_one(db.pool())
            .await
            .expect("a count");
    assert_eq!(left, 0);
}

/// A charge whose handler ran on both instances (its record lost between the two), then a full
/// refund sent to each instance under two keys: one ledger, so the second refund is refused with
/// a clear error, the provider refunds once, and the balance ends at 0, not at minus the amount.
async fn a_charge_is_refunded_once_across_two_instances(pair: Pair) {
    let body = visa(5000);
    let created = create_charge(&pair.a.router, ALICE, "refund-twice", &body)
        .send()
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    pair.lose_records();
    let again = create_charge(&pair.b.router, ALICE, "refund-twice", &body)
        .send()
        .await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text());
    assert_eq!(again.json["id"], created.json["id"], "one charge");
    let id = created.json["id"].as_str().expect("an id");

    let refund = |router: &Router, key: &str| {
        Call::post(router, &format!("/v1/charges/{id}/refunds"))
            .auth(ALICE)
            .key(key)
            .send()
    };
    let first = refund(&pair.a.router, "refund-on-a").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let second = refund(&pair.b.router, "refund-on-b").await;
    second.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );
    for router in [&pair.a.router, &pair.b.router] {
        let charges = charges_of(router, 5000).await;
        assert_eq!(charges.len(), 1, "{charges:?}");
        assert_eq!(charges[0]["status"], "refunded");
        assert_eq!(charges[0]["amount_refunded"], 5000);
    }
    pair.settle().await;
    assert_eq!(pair.balance().await, 0, "charged once, refunded once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refunds_a_charge_once_across_two_instances() {
    a_charge_is_refunded_once_across_two_instances(Pair::redis().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_refunds_a_charge_once_across_two_instances() {
    a_charge_is_refunded_once_across_two_instances(Pair::cluster().await).await;
}

/// The provider alone refuses a refund beyond what is left of its payment, whatever key it comes
/// under, atomically with its keys: the last line of defence, on the key table under test.
async fn the_provider_refuses_an_over_refund(provider: Provider) {
    use server::provider::{ProviderError, Source};
    let payment = provider
        .create_payment("over", 1, Source::Visa, 1000, true, "")
        .await
        .expect("a payment");
    let refunds = [("over-1", 700), ("over-2", 700), ("over-3", 300)];
    let mut answers = Vec::new();
    for (key, amount) in refunds {
        answers.push(provider.refund(key, 1, &payment.id, amount).await.map(drop));
    }
    assert_eq!(
        answers,
        [
            Ok(()),
            Err(ProviderError::AmountTooLarge {
                amount: 700,
                refundable: 300
            }),
            Ok(())
        ]
    );
    assert_eq!(
        provider.refund("over-4", 1, &payment.id, 1).await,
        Err(ProviderError::AmountTooLarge {
            amount: 1,
            refundable: 0
        })
    );
    let listed = provider.payments_since(0, 10).await.expect("a listing");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].refunded, 1000);
}

#[tokio::test]
async fn the_provider_refuses_an_over_refund_in_memory() {
    the_provider_refuses_an_over_refund(Provider::default()).await;
}

#[tokio::test]
async fn the_provider_refuses_an_over_refund_on_redis() {
    let server = RedisServer::start();
    let conn = RedisStore::from_url(&server.url())
        .expect("a valid URL")
        .shared_connection();
    let keys = KeyTable::redis(conn, server::PROVIDER_PREFIX, server::provider::WINDOW);
    the_provider_refuses_an_over_refund(Provider::with_keys(Duration::ZERO, keys)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_refuses_an_over_refund_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let conn = RedisStore::cluster(cluster.urls())
        .expect("valid URLs")
        .shared_connection();
    let keys = KeyTable::redis(conn, server::PROVIDER_PREFIX, server::provider::WINDOW);
    the_provider_refuses_an_over_refund(Provider::with_keys(Duration::ZERO, keys)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_refuses_an_over_refund_on_postgres() {
    let server = PostgresServer::start();
    let db = Database::connect(&server.url())
        .await
        .expect("the database");
    let keys = KeyTable::postgres(db.pool().clone(), server::provider::WINDOW);
    the_provider_refuses_an_over_refund(Provider::with_keys(Duration::ZERO, keys)).await;
}

/// What ends a charge whose provider call was stalled past the client's deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settler {
    /// The client's retry with the same key, once the provider is let go.
    Retry,
    /// The reconciler, once the provider is let go.
    Reconciler,
    /// The reconciler ran while the provider still held the call: it found no payment and removed
    /// the charge; the payment then landed, and a later round finds it on the provider's side.
    ReconcilerTooEarly,
}

/// The provider stalls a charge's call (its key table locked) past its client's deadline (8 s),
/// then lets it go: the call takes effect after the handler gave up. The handler answers that the
/// outcome is not known yet (`504`, never "nothing was charged"), keeps the charge
/// `authorizing`, and the retry or the reconciler settles it: one charge, captured, one payment,
/// one credit.
async fn a_provider_stalled_past_its_deadline_charges_once(pair: Pair, ending: Settler) {
    let body = visa(2500);
    let key = format!("stalled-{ending:?}");
    let provider = pair.a.state.provider.clone();
    let stall = provider.stall().await;
    let first = create_charge(&pair.a.router, ALICE, &key, &body)
        .send()
        .await;
    first.assert_outcome_unknown();
    assert_eq!(first.header("stripe-should-retry"), Some("true"));
    let kept = charges_of(&pair.a.router, 2500).await;
    assert_eq!(kept.len(), 1, "the charge is kept: {kept:?}");
    assert_eq!(kept[0]["status"], "authorizing");
    assert_eq!(pair.payments(), 0);

    if ending == Settler::ReconcilerTooEarly {
        let round = Reconciler::new(&pair.a.state, Duration::ZERO)
            .round()
            .await
            .expect("a round");
        assert_eq!(round.removed, 1, "{round:?}");
        assert!(charges_of(&pair.a.router, 2500).await.is_empty());
    }
    drop(stall);
    wait_until("the held call to take effect", || pair.payments() == 1).await;
    if ending == Settler::Retry {
        let again = client(pair.b.router.clone(), key.clone(), body.clone(), None).await;
        assert_eq!(again.status, StatusCode::CREATED, "{}", again.text());
        assert_eq!(again.json["id"], kept[0]["id"], "the charge kept");
        assert_eq!(again.json["status"], "captured");
    }
    pair.settle().await;
    let charges = charges_of(&pair.b.router, 2500).await;
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(charges[0]["status"], "captured");
    assert_eq!(pair.payments(), 1, "one payment");
    let deadline = Instant::now() + PATIENCE;
    while pair.balance().await != 2500 {
        assert!(
            Instant::now() < deadline,
            "the balance is {}",
            pair.balance().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The client's late retry gets that charge.
    let late = client(pair.a.router.clone(), key, body, None).await;
    assert_eq!(late.status, StatusCode::CREATED, "{}", late.text());
    assert_eq!(late.json["id"], charges[0]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_stalled_provider_call_is_settled_by_the_retry() {
    a_provider_stalled_past_its_deadline_charges_once(Pair::memory().await, Settler::Retry).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_stalled_provider_call_is_settled_by_the_reconciler() {
    let pair = Pair::memory().await;
    a_provider_stalled_past_its_deadline_charges_once(pair, Settler::Reconciler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_payment_no_charge_names_is_found_by_the_reconciler() {
    let pair = Pair::memory().await;
    a_provider_stalled_past_its_deadline_charges_once(pair, Settler::ReconcilerTooEarly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_stalled_provider_call_is_settled_by_the_retry() {
    a_provider_stalled_past_its_deadline_charges_once(Pair::redis().await, Settler::Retry).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_stalled_provider_call_is_settled_by_the_reconciler() {
    let pair = Pair::redis().await;
    a_provider_stalled_past_its_deadline_charges_once(pair, Settler::Reconciler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_payment_no_charge_names_is_found_by_the_reconciler() {
    let pair = Pair::redis().await;
    a_provider_stalled_past_its_deadline_charges_once(pair, Settler::ReconcilerTooEarly).await;
}
