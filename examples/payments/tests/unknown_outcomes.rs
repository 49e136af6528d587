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

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{Extensions, StatusCode};
use serde_json::Value;
use sqlx::Row;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{
    BoxStore, ClaimToken, IdempotencyLayer, MemoryStore, Outcome, RecordId, Store, StoreError,
};
use tower_idempotency_redis::RedisStore;

use example_payments::app;
use example_payments::auth::Account;
use example_payments::balance::Balances;
use example_payments::consumer;
use example_payments::ledger::{Ledger, NewCharge, Opened};
use example_payments::pg;
use example_payments::provider::{Source, WINDOW};
use example_payments::queue::ConsumerConfig;
use example_payments::reconciler::Reference;
use example_payments::state_machine::Status;
use support::api::{ALICE, Call, Reply, account, authorize, create_charge, visa};
use support::instance::{
    AUTHORIZING, Instance, LEASE as PG_LEASE, NEVER, admin, charge_through_a_locked_provider,
    count, crash_during_the_provider_call, lock_provider_keys, provider_payments, release,
    wait_for_count,
};
use support::instruments::Hang;
use support::stack::Parts;
use support::wait_until;

/// The idempotency layer's lease here: short, so that each repetition takes about a second.
const SHORT_LEASE: Duration = Duration::from_millis(300);
/// How often a client sends its request again after a `409` or a `503`.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Repetitions per store.
const REPETITIONS: usize = 20;
/// How long a test waits for something to happen.
const PATIENCE: Duration = Duration::from_secs(30);

/// A store whose lease renewals fail while `stalled` is set: the claim's lease runs out in the
/// store while its handler is still running, as behind a stalled network or a locked table.
#[derive(Clone)]
struct Stalling<St> {
    inner: St,
    stalled: Arc<AtomicBool>,
}

impl<St: Store> Store for Stalling<St> {
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

    tower_idempotency::forward_store!(inner => claim, complete, prepare, release, changed);
}

/// One instance: its API over its own layer, and its components.
struct Side {
    router: Router,
    parts: Arc<Parts>,
}

/// Two instances over the same stores, and what the test reads them by.
struct Pair {
    a: Side,
    b: Side,
    stalled: Arc<AtomicBool>,
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
    .lease(SHORT_LEASE)
}

/// Starts the ledger consumer of `parts`, its Deduplicator on `dedup`.
async fn consume(parts: &Parts, dedup: impl Store + 'static, stop: &CancellationToken) {
    let config = ConsumerConfig::default()
        .min_idle(Duration::from_millis(300))
        .block(Duration::from_millis(50));
    drop(parts.consume("ledger-test", dedup, config, stop).await);
}

impl Pair {
    /// Both instances share one process's state and one `MemoryStore`.
    async fn memory() -> Self {
        let stalled = Arc::new(AtomicBool::new(false));
        let parts = Parts::memory(WINDOW);
        let stop = CancellationToken::new();
        consume(&parts, MemoryStore::new(), &stop).await;
        Self::shared(parts, MemoryStore::new(), stalled, stop, Servers::None)
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
        let parts = Parts::redis(&store.shared_connection(), WINDOW).await;
        let dedup = store.clone().with_prefix(consumer::RECORDS_PREFIX);
        let stalled = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        consume(&parts, dedup, &stop).await;
        Self::shared(parts, store, stalled, stop, servers)
    }

    /// Two instances over one set of components, each with its own layer.
    fn shared<St: Store + Clone>(
        parts: Parts,
        store: St,
        stalled: Arc<AtomicBool>,
        stop: CancellationToken,
        servers: Servers,
    ) -> Self {
        let parts = Arc::new(parts);
        let a = Side {
            router: app(parts.state(), layer(store.clone(), &stalled)),
            parts: parts.clone(),
        };
        let b = Side {
            router: app(parts.state(), layer(store, &stalled)),
            parts,
        };
        Self {
            a,
            b,
            stalled,
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
        for i in 0..2 {
            let store = pg::connect(&server.url())
                .await
                .expect("the database is usable");
            let parts = Arc::new(Parts::postgres(&store, WINDOW));
            if i == 0 {
                consume(&parts, MemoryStore::new(), &stop).await;
            }
            let router = app(parts.state(), layer(store.clone(), &stalled));
            instances.push(Side { router, parts });
        }
        let b = instances.pop().expect("two instances");
        let a = instances.pop().expect("two instances");
        Self {
            a,
            b,
            stalled,
            stop,
            _servers: Servers::Postgres(server),
        }
    }

    /// The components of the two instances (one set, when they share it).
    fn parts(&self) -> Vec<&Arc<Parts>> {
        let (a, b) = (&self.a.parts, &self.b.parts);
        if Arc::ptr_eq(a, b) {
            vec![a]
        } else {
            vec![a, b]
        }
    }

    /// How many payments and other effects the provider made, across instances.
    fn payments(&self) -> usize {
        self.parts().iter().map(|parts| parts.keys.effects()).sum()
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
        (self.parts().iter())
            .map(|parts| parts.ledger.opens.waiting())
            .sum()
    }

    /// Runs what a crash or a stale run left behind to its end: a reconciler round over every
    /// charge still in an intermediate state; then waits until every event published
    /// so far is applied.
    async fn settle(&self) {
        self.a.parts.reconcile().await;
        let deadline = Instant::now() + PATIENCE;
        loop {
            let backlog = self.a.parts.backlog().await;
            if backlog == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{backlog} events never applied");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Alice's balance in euro cents.
    async fn balance(&self) -> i64 {
        let available = (self.a.parts.balances.get(&account(ALICE)))
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
    for parts in pair.parts() {
        holds.push(parts.ledger.opens.shut().await);
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
    let stall = pair.a.parts.keys.stall().await;
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
        let round = pair.a.parts.reconcile().await;
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

// ---------------------------------------------------------------------------------------------
// On PostgreSQL: an instance that crashes during the provider call, or a provider whose key table
// is locked past its client's deadline, and the retry or the reconciler that settles the charge.

/// The instance dies after committing `authorizing` and after the provider charged, before it
/// answered. The client's retry, once the claim's lease ran out, resumes the charge on another
/// instance: the provider answers with the same payment, nothing is charged twice, and the
/// balance counts the charge once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_provider_call_is_settled_by_the_retry() {
    let server = PostgresServer::start();
    let body = visa(4200);
    crash_during_the_provider_call(&server, Hang::AfterEffect, "crash-1", &body).await;

    let second = Instance::start(&server.url(), NEVER).await;
    let retry = second.retry_charge("crash-1", &body).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(
        retry.outcome,
        Some(Outcome::Executed),
        "resumed, not replayed"
    );
    assert_eq!(retry.json["status"], "captured");
    let id = retry.json["id"].as_str().expect("an id").to_owned();
    assert_eq!(second.charges().await, [(id, "captured".into())]);
    assert_eq!(
        second.parts.keys.effects(),
        0,
        "the provider charged no more"
    );
    assert_eq!(provider_payments(&server).await, 1);
    second.wait_for_balance(4200).await;

    let replay = second.charge("crash-1", &body).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.text(), retry.text());
    assert_eq!(
        count(&server, "SELECT count(*) FROM payment_events").await,
        0
    );
    second.wait_for_balance(4200).await;
}

/// The instance dies after the provider charged, and no retry comes: the reconciler of another
/// instance asks the provider by the charge's key, and settles the charge with its event, once.
/// The client's late retry then gets that charge: still one payment, one charge, one balance
/// change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_provider_call_is_settled_by_the_reconciler() {
    let server = PostgresServer::start();
    let body = visa(1300);
    crash_during_the_provider_call(&server, Hang::AfterEffect, "crash-2", &body).await;

    let second = Instance::start(&server.url(), 2 * PG_LEASE).await;
    wait_for_count(&server, AUTHORIZING, 0).await;
    let charges = second.charges().await;
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(charges[0].1, "captured");
    second.wait_for_balance(1300).await;

    let late = second.retry_charge("crash-2", &body).await;
    assert_eq!(late.status, StatusCode::CREATED, "{}", late.text());
    assert_eq!(late.json["id"].as_str(), Some(charges[0].0.as_str()));
    assert_eq!(second.charges().await, charges, "no second charge");
    assert_eq!(provider_payments(&server).await, 1);
    assert_eq!(second.parts.keys.effects(), 0);
    assert_eq!(
        count(&server, "SELECT count(*) FROM payment_events").await,
        0
    );
    second.wait_for_balance(1300).await;
}

/// The instance dies after committing `authorizing`, before the provider did anything: the
/// reconciler finds no payment under the key and removes the charge; the client's retry makes it,
/// charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_the_provider_never_saw_is_removed_then_made_by_the_retry() {
    let server = PostgresServer::start();
    let body = visa(900);
    crash_during_the_provider_call(&server, Hang::BeforeEffect, "crash-3", &body).await;

    let second = Instance::start(&server.url(), 2 * PG_LEASE).await;
    wait_for_count(&server, "SELECT count(*) FROM charges", 0).await;
    assert_eq!(provider_payments(&server).await, 0);

    let retry = second.retry_charge("crash-3", &body).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(second.charges().await.len(), 1);
    assert_eq!(provider_payments(&server).await, 1);
    second.wait_for_balance(900).await;
}

/// Two reconcilers on one stuck charge, and a retry: one of them settles it, and one event is
/// written; the retry answers with the settled charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reconcilers_settle_a_charge_once() {
    let server = PostgresServer::start();
    let body = authorize(800);
    crash_during_the_provider_call(&server, Hang::AfterEffect, "crash-4", &body).await;

    let store = pg::connect(&server.url()).await.expect("the database");
    let parts = Parts::postgres(&store, WINDOW);
    let reconcilers = [Duration::ZERO, Duration::ZERO].map(|after| parts.reconciler(after));
    let (one, two) = tokio::join!(reconcilers[0].round(), reconcilers[1].round());
    let (one, two) = (one.expect("a round"), two.expect("a round"));
    assert_eq!(one.settled + two.settled, 1, "{one:?} {two:?}");
    assert_eq!(one.removed + two.removed, 0);
    assert_eq!(count(&server, AUTHORIZING).await, 0);
    assert_eq!(
        count(&server, "SELECT count(*) FROM payment_events").await,
        1
    );

    let second = Instance::start(&server.url(), NEVER).await;
    let retry = second.retry_charge("crash-4", &body).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(retry.json["status"], "authorized");
    assert_eq!(second.charges().await.len(), 1);
    assert_eq!(provider_payments(&server).await, 1);
}

/// The reconciler settles every intermediate state a crash can leave, from what the provider did
/// under the key of the call in flight: a capture, a cancellation and a refund the provider made
/// are completed, with the events the requests would have published (the balance counts the
/// capture and the refund once); a capture and a refund it never saw are made now, under their
/// keys, once (rolled back, a call held up at the provider could land after); a refund the
/// provider refuses (more than is left) goes back to where the charge was; a call that began
/// longer ago than the provider keeps its keys is left for an operator. A second round finds
/// nothing else to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_settles_every_intermediate_state() {
    let server = PostgresServer::start();
    let h = Instance::start(&server.url(), NEVER).await;
    let mut ids = Vec::new();
    for (key, body) in [
        ("capture-made", authorize(1000)),
        ("cancel-made", authorize(200)),
        ("refund-made", visa(3000)),
        ("capture-lost", authorize(400)),
        ("refund-lost", visa(500)),
        ("refund-refused", visa(600)),
        ("capture-forgotten", authorize(300)),
    ] {
        let reply = h.charge(key, &body).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        ids.push(reply.json["id"].as_str().expect("an id").to_owned());
    }
    h.wait_for_balance(4100).await;

    let mut admin = admin(&server).await;
    let mut payment_of = async |id: &str| -> String {
        sqlx::query("SELECT payment FROM charges WHERE id = $1")
            .bind(id)
            .fetch_one(&mut admin)
            .await
            .expect("the charge")
            .get(0)
    };
    let payments = [
        payment_of(&ids[0]).await,
        payment_of(&ids[1]).await,
        payment_of(&ids[2]).await,
    ];
    // The provider did these; the process that asked died before recording them.
    h.parts
        .provider
        .capture("capture-call", 1, &payments[0])
        .await
        .expect("captured");
    h.parts
        .provider
        .cancel("cancel-call", 1, &payments[1])
        .await
        .expect("canceled");
    h.parts
        .provider
        .refund("refund-call", 1, &payments[2], 1200)
        .await
        .expect("refunded");
    let mut admin = self::admin(&server).await;
    for (id, status, call_key, amount) in [
        (&ids[0], "capturing", "capture-call", 0),
        (&ids[1], "canceling", "cancel-call", 0),
        (&ids[2], "refunding", "refund-call", 1200),
        (&ids[3], "capturing", "never-sent", 0),
        (&ids[4], "refunding", "never-sent-either", 100),
        (&ids[5], "refunding", "more-than-is-left", 700),
        (&ids[6], "capturing", "past-the-window", 0),
    ] {
        sqlx::query(
            "UPDATE charges SET status = $2, call_key = $3, call_amount = $4 WHERE id = $1",
        )
        .bind(id)
        .bind(status)
        .bind(call_key)
        .bind(amount)
        .execute(&mut admin)
        .await
        .expect("the charge is left mid-call");
    }

    // This call began 25 h ago: the provider may have forgotten its key, and the reconciler leaves
    // it for an operator rather than make it a second time.
    sqlx::query("UPDATE charges SET call_started = call_started - 90000000 WHERE id = $1")
        .bind(&ids[6])
        .execute(&mut admin)
        .await
        .expect("an old call");
    let store = pg::connect(&server.url()).await.expect("the database");
    let reconciler = Parts::postgres(&store, WINDOW).reconciler(Duration::ZERO);
    // Made or not, each call is sent again under its key: the provider answers what it made
    // and makes the two it never saw, once.
    let done = reconciler.round().await.expect("a round");
    assert_eq!(
        (done.settled, done.removed, done.left),
        (5, 1, 1),
        "{done:?}"
    );

    let mut found = Vec::new();
    for id in &ids {
        let charge = h.get(&format!("/v1/charges/{id}")).await;
        found.push((
            charge.json["status"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            charge.json["amount_refunded"].as_i64().unwrap_or(-1),
        ));
    }
    let expected = [
        ("captured", 0),
        ("canceled", 0),
        ("captured", 1200),
        ("captured", 0),
        ("captured", 100),
        ("captured", 0),
        ("capturing", 0),
    ]
    .map(|(status, refunded)| (status.to_owned(), refunded));
    assert_eq!(found, expected);
    let balance = 4100 + 1000 + 400 - 1200 - 100;
    h.wait_for_balance(balance).await;

    let again = reconciler.round().await.expect("a round");
    assert_eq!(
        (again.settled, again.removed, again.left),
        (0, 0, 1),
        "{again:?}"
    );
    wait_for_count(&server, "SELECT count(*) FROM payment_events", 0).await;
    h.wait_for_balance(balance).await;
}

/// The provider's key table locked past its client's deadline, then released, and the client
/// retries with its key: the charge it kept is resumed and settled, one payment, one credit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_locked_past_its_deadline_is_settled_by_the_retry() {
    let server = PostgresServer::start();
    let instance = Instance::start(&server.url(), NEVER).await;
    charge_through_a_locked_provider(&server, &instance, "locked-1").await;
    assert_eq!(count(&server, AUTHORIZING).await, 1, "the charge is kept");

    let retry = instance.retry_charge("locked-1", &visa(3100)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(retry.json["status"], "captured");
    assert_eq!(instance.charges().await.len(), 1);
    assert_eq!(provider_payments(&server).await, 1);
    instance.wait_for_balance(3100).await;
}

/// The same without a retry: the reconciler settles the charge from what the provider did under
/// its key, and the client's late retry gets that charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_locked_past_its_deadline_is_settled_by_the_reconciler() {
    let server = PostgresServer::start();
    // Not before the provider client's deadline has passed (8 s), so that it finds the payment.
    let instance = Instance::start(&server.url(), Duration::from_secs(10)).await;
    charge_through_a_locked_provider(&server, &instance, "locked-2").await;
    instance.wait_for_balance(3100).await;
    let charges = instance.charges().await;
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(charges[0].1, "captured");
    let late = instance.retry_charge("locked-2", &visa(3100)).await;
    assert_eq!(late.json["id"].as_str(), Some(charges[0].0.as_str()));
    assert_eq!(provider_payments(&server).await, 1);
}

/// The reconciler comes while the provider still holds the call: it finds no payment under the key
/// and removes the charge; then the lock goes and the payment commits, which no charge names. The
/// reconciler's scan of the provider's payments finds it, and writes its charge: the money the
/// provider took is in the ledger and the balance, and the client's retry gets that charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_payment_no_charge_names_is_found_by_the_reconciler() {
    let server = PostgresServer::start();
    let instance = Instance::start(&server.url(), 2 * PG_LEASE).await;
    let lock = lock_provider_keys(&server).await;
    let first = instance.charge("locked-3", &visa(3100)).await;
    assert_eq!(
        first.status,
        StatusCode::GATEWAY_TIMEOUT,
        "{}",
        first.text()
    );
    wait_for_count(&server, "SELECT count(*) FROM charges", 0).await;
    release(lock).await;
    instance.wait_for_balance(3100).await;
    let charges = instance.charges().await;
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(charges[0].1, "captured");
    let retry = instance.retry_charge("locked-3", &visa(3100)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(retry.json["id"].as_str(), Some(charges[0].0.as_str()));
    assert_eq!(provider_payments(&server).await, 1);
}

/// The scan of the provider's payments after a full page still lists a payment stamped earlier
/// than it committed (a write held up, another instance's clock), for as long as `after`: the
/// reconciler reads every page of a round, then reads again from `after` before it began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_payment_stamped_late_is_adopted_after_a_full_page() {
    let server = PostgresServer::start();
    let store = pg::connect(&server.url()).await.expect("the database");
    let parts = Parts::postgres(&store, WINDOW);
    let alice = Account::for_api_key(ALICE);
    let request = visa_request(100);
    let reference = Reference::of(&alice, &request);
    let pay = async |key: &str| {
        let made = (parts.provider)
            .create_payment(key, 1, Source::Visa, 100, true, &reference)
            .await;
        made.expect("a payment");
    };
    for n in 0..150 {
        pay(&format!("bulk-{n}")).await;
    }
    let reconciler = parts.reconciler(Duration::from_secs(10));
    let first = reconciler.round().await.expect("a round");
    assert_eq!(first.adopted, 150, "every page in one round: {first:?}");

    pay("stamped-late").await;
    let mut admin = admin(&server).await;
    sqlx::query(
        "UPDATE provider_payments SET created_at = created_at - interval '5 seconds'
         WHERE key = 'stamped-late'",
    )
    .execute(&mut admin)
    .await
    .expect("stamped earlier");
    let second = reconciler.round().await.expect("a round");
    assert_eq!(second.adopted, 1, "{second:?}");
    let charges = parts.ledger.list(&alice).await.expect("a list");
    assert_eq!(charges.len(), 151);
}

/// What `POST /v1/charges` asks for with [`visa`]`(amount)`, as the ledger takes it.
fn visa_request(amount: i64) -> NewCharge {
    NewCharge {
        amount,
        currency: "eur".into(),
        source: Source::Visa,
        capture: true,
        description: None,
        metadata: BTreeMap::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// A charge the reconciler removed, written back by the handler's late answer.

/// The handler's answer came after the reconciler removed its charge (the provider had not seen
/// the call when it asked): the charge is written back and holds its operation again, so neither
/// a retry nor the reconciler's payments scan makes a second charge of the same payment; and a
/// retry's charge, opened and removed meanwhile, is refused when its own answer comes.
async fn a_charge_written_back_holds_its_operation(ledger: Arc<dyn Ledger>) {
    let alice = Account::for_api_key(ALICE);
    let request = visa_request(500);
    let opened = ledger.open(&alice, "op-late", &request).await;
    let Ok(Opened::Authorizing(charge)) = opened else {
        panic!("a new charge: {opened:?}");
    };
    let removed = ledger.remove(&charge, Duration::ZERO).await;
    assert!(removed.expect("a removal"), "removed by the reconciler");
    let held = ledger.has_operation(&alice, "op-late").await;
    assert!(
        !held.expect("an answer"),
        "a removed charge holds no operation"
    );
    // A retry opens the operation again, and its charge is removed too.
    let reopened = ledger.open(&alice, "op-late", &request).await;
    let Ok(Opened::Authorizing(retried)) = reopened else {
        panic!("a second charge: {reopened:?}");
    };
    assert_ne!(retried.id, charge.id);
    let removed = ledger.remove(&retried, Duration::ZERO).await;
    assert!(removed.expect("a removal"), "removed by the reconciler");

    let mut answered = charge.clone();
    (answered.status, answered.payment) = (Status::Captured, "py_late".into());
    let recorded =
        (ledger.record(&Extensions::new(), answered, &|_| None).await).expect("written back");
    assert_eq!(
        (recorded.id.as_str(), recorded.status),
        (charge.id.as_str(), Status::Captured)
    );
    let held = ledger.has_operation(&alice, "op-late").await;
    assert!(
        held.expect("an answer"),
        "the charge written back holds its operation"
    );
    let mut late = retried.clone();
    (late.status, late.payment) = (Status::Captured, "py_late".into());
    let refused = ledger.record(&Extensions::new(), late, &|_| None).await;
    assert!(
        refused.is_err(),
        "the operation has its charge: {refused:?}"
    );
    match ledger.open(&alice, "op-late", &request).await {
        Ok(Opened::Settled(again)) => assert_eq!(again.id, charge.id),
        other => panic!("the written-back charge, settled: {other:?}"),
    }
    let list = ledger.list(&alice).await.expect("a list");
    assert_eq!(list.len(), 1, "{list:?}");
}

#[tokio::test]
async fn a_charge_written_back_holds_its_operation_in_memory() {
    a_charge_written_back_holds_its_operation(Parts::memory(WINDOW).ledger).await;
}

#[tokio::test]
async fn a_charge_written_back_holds_its_operation_on_redis() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a valid URL");
    let parts = Parts::redis(&store.shared_connection(), WINDOW).await;
    a_charge_written_back_holds_its_operation(parts.ledger).await;
}
