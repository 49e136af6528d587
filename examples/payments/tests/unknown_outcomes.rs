//! Unknown outcomes (a lease taken over under a stalled handler, a run that never came back from
//! the provider, a provider slow or down) end as one charge, one payment and one credit, whoever
//! settles them, and no answer says that nothing happened once the provider may have acted. A run
//! that never comes back hangs in its provider call ([`Hang`]) as a stuck process would; the
//! reconciler calls the provider past the probe ([`reconciler_past_the_probe`]).

mod support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_test::Faulty;

use example_payments::app;
use example_payments::balance::Balances;
use example_payments::now_ms;
use example_payments::provider::{ProviderClient, WINDOW};
use example_payments::reconciler::Reconciler;
use support::api::{ALICE, Call, Reply, account, authorize, create_charge, visa};
use support::harness::{Harness, on_both_ledgers};
use support::instruments::Hang;
use support::stack::Parts;
use support::{PATIENCE, wait_until};

/// The provider client's `DEADLINE` for one call, all attempts (`provider/client.rs`).
const CLIENT_DEADLINE: Duration = Duration::from_secs(8);

// ---------------------------------------------------------------------------------------------
// The means the scenarios share.

/// A charge of `amount` euro cents as Alice under `key`.
fn charge(router: &Router, key: &str, amount: i64) -> Call {
    create_charge(router, ALICE, key, &visa(amount))
}

/// Sends `call` from a task of its own: a client the test can leave.
fn spawn(call: Call) -> JoinHandle<Reply> {
    tokio::spawn(call.send())
}

/// A reconciler of `parts`' ledger that calls the provider directly, past the probe (which holds
/// or hangs the handlers' calls), taking every unsettled charge however recent.
fn reconciler_past_the_probe(parts: &Parts) -> Reconciler {
    let client = ProviderClient::new(parts.provider.router());
    Reconciler::new(parts.ledger.clone(), client, Duration::ZERO)
}

/// What a round did: `[settled, removed, left]`.
async fn round(reconciler: &Reconciler) -> [usize; 3] {
    let done = reconciler.round().await.expect("a round");
    [done.settled, done.removed, done.left]
}

/// Alice's charges of `amount` (each scenario's amounts are its own).
async fn charges_of(router: &Router, amount: i64) -> Vec<Value> {
    let list = Call::get(router, "/v1/charges").auth(ALICE).send().await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text());
    let all = list.json["data"].as_array().expect("a list").iter();
    all.filter(|c| c["amount"] == amount).cloned().collect()
}

/// The one charge of `amount`, which must be `status`.
async fn the_charge(router: &Router, amount: i64, status: &str) -> Value {
    let charges = charges_of(router, amount).await;
    assert_eq!(charges.len(), 1, "one charge: {charges:?}");
    assert_eq!(charges[0]["status"], status, "{charges:?}");
    charges.into_iter().next().expect("one charge")
}

/// How many payments of `amount` the provider made.
async fn payments_of(parts: &Parts, amount: i64) -> usize {
    let payments = parts.provider.payments_since(0, 1000).await;
    payments.iter().filter(|p| p.amount == amount).count()
}

/// Alice's balance in euro cents, once every event in the outbox is applied.
async fn balance(parts: &Parts) -> i64 {
    while (parts.outbox.next().await.expect("the outbox")).is_some() {}
    let available = parts
        .balances
        .get(&account(ALICE))
        .await
        .expect("a balance");
    available
        .iter()
        .filter(|a| a.currency == "eur")
        .map(|a| a.amount)
        .sum()
}

/// Asserts the answer is `charge`, created.
#[track_caller]
fn assert_is(reply: &Reply, charge: &Value) {
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    assert_eq!(reply.json["id"], charge["id"], "{}", reply.text());
}

// ---------------------------------------------------------------------------------------------
// (1) A lease taken over under a stalled handler.

/// The layer's lease here: short, so that a held run loses its claim within a repetition.
const SHORT_LEASE: Duration = Duration::from_millis(200);
/// How often a client sends its request again after a `409`.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// The instances a client's first attempt and its retries reach (`routers`), over one ledger:
/// the first one, and on PostgreSQL a second one.
struct Takeover {
    routers: [Router; 2],
    instances: Vec<Harness>,
    /// The instances' store, whose lease renewals fail while a run is held: its lease runs out
    /// in the store while its handler is still alive, as behind a stalled network.
    store: Faulty<BoxStore>,
}

impl Takeover {
    fn router(h: &Harness, store: &Faulty<BoxStore>) -> Router {
        let layer = IdempotencyLayer::new(BoxStore::new(store.clone()));
        app(h.state.clone(), layer.lease(SHORT_LEASE))
    }

    /// One instance in memory: the retries reach the same one.
    fn memory() -> Self {
        let (h, store) = (
            Harness::memory(),
            Faulty::new(BoxStore::new(MemoryStore::new())),
        );
        let router = Self::router(&h, &store);
        let routers = [router.clone(), router];
        Self {
            routers,
            instances: vec![h],
            store,
        }
    }

    /// Two instances on one database, sharing one provider, each with its own layer, ledger and
    /// provider client: the retries reach the second.
    async fn postgres() -> Self {
        let h = Harness::postgres().await;
        let store = Faulty::new(BoxStore::new(h.parts.store.clone().expect("PostgreSQL")));
        let second = h.second_instance();
        let instances = vec![h, second];
        let routers = [0, 1].map(|i| Self::router(&instances[i], &store));
        Self {
            routers,
            instances,
            store,
        }
    }

    /// The first instance's parts: its provider and outbox are every instance's.
    fn parts(&self) -> &Parts {
        &self.instances[0].parts
    }

    fn held(&self) -> usize {
        let opens = self
            .instances
            .iter()
            .map(|i| i.parts.ledger.opens.waiting());
        opens.sum()
    }

    /// One operation whose first run is held right after its claim until the retry has taken
    /// the key over and is held too; then both go on. What went wrong, if anything.
    async fn repetition(&self, rep: i64) -> Option<String> {
        let (key, amount) = (format!("takeover-{rep}"), 1000 + rep);
        let balance_before = balance(self.parts()).await;
        let mut holds = Vec::new();
        for instance in &self.instances {
            holds.push(instance.parts.ledger.opens.shut().await);
        }
        self.store.fail_renewals(usize::MAX);
        let first = spawn(charge(&self.routers[0], &key, amount));
        wait_until("the first run, held", || self.held() == 1).await;
        // `409` while the first run's lease lasts; then a retry takes the key over, and is held.
        let started = Instant::now();
        let retry = 'retry: loop {
            let mut attempt = spawn(charge(&self.routers[1], &key, amount));
            loop {
                match tokio::time::timeout(RETRY_EVERY, &mut attempt).await {
                    Ok(reply) => {
                        let reply = reply.expect("an answer");
                        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text());
                        break;
                    }
                    Err(_) if self.held() == 2 => break 'retry attempt,
                    Err(_) => assert!(started.elapsed() < PATIENCE, "no answer, no takeover"),
                }
            }
            assert!(started.elapsed() < PATIENCE, "never taken over");
            tokio::time::sleep(RETRY_EVERY).await;
        };
        // Both runs alive; both go on at once.
        self.store.fail_renewals(0);
        drop(holds);
        let runs = [first, retry].into_iter().zip(self.routers.clone());
        let clients =
            runs.map(|(run, router)| tokio::spawn(client(router, key.clone(), amount, run)));
        let mut replies = Vec::new();
        for client in clients.collect::<Vec<_>>() {
            replies.push(client.await.expect("a client"));
        }
        let charges = charges_of(&self.routers[0], amount).await;
        let payments = payments_of(self.parts(), amount).await;
        let credited = balance(self.parts()).await - balance_before;
        let captured = charges.len() == 1 && charges[0]["status"] == "captured";
        let answered = |(status, id): &(StatusCode, Value)| {
            *status == StatusCode::CREATED && charges.first().is_some_and(|c| c["id"] == *id)
        };
        let fine = captured && payments == 1 && credited == amount && replies.iter().all(answered);
        let charges: Vec<_> = charges.iter().map(|c| (&c["id"], &c["status"])).collect();
        (!fine).then(|| format!("{charges:?}, {payments} paid, {credited} credited, {replies:?}"))
    }

    async fn every_operation_charges_once(self, repetitions: i64) {
        let mut failed = Vec::new();
        for rep in 0..repetitions {
            if let Some(fault) = self.repetition(rep).await {
                failed.push(format!("repetition {rep}: {fault}"));
            }
        }
        assert!(failed.is_empty(), "{}", failed.join("\n"));
    }
}

/// A client whose first attempt is `run`: it sends its request again after a `409` (the key in
/// flight, or the run superseded before it did anything) until another answer, its status and
/// charge. Never a `503` here, where each run is held before its provider call.
async fn client(
    router: Router,
    key: String,
    amount: i64,
    run: JoinHandle<Reply>,
) -> (StatusCode, Value) {
    let (started, mut reply) = (Instant::now(), run.await.expect("a run"));
    while reply.status == StatusCode::CONFLICT {
        assert!(started.elapsed() < PATIENCE, "still {}", reply.text());
        tokio::time::sleep(RETRY_EVERY).await;
        reply = charge(&router, &key, amount).send().await;
    }
    (reply.status, reply.json["id"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_instances_charge_once_when_a_lease_is_taken_over_under_a_stalled_handler() {
    let takeover = Takeover::postgres().await;
    takeover.every_operation_charges_once(20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_charges_once_when_a_lease_is_taken_over_under_a_stalled_handler() {
    Takeover::memory().every_operation_charges_once(20).await;
}

// ---------------------------------------------------------------------------------------------
// (2) A run that never comes back from the provider call, settled by the reconciler; (3) a
// provider down; (5) a run superseded after its call. On both ledgers.

on_both_ledgers!(
    a_run_lost_after_the_provider_acted_is_settled_by_the_reconciler,
    a_run_lost_before_the_provider_acted_is_made_once_by_the_reconciler,
    a_create_held_at_the_provider_is_made_once_by_the_reconciler,
    a_provider_down_answers_503_and_keeps_nothing,
    a_run_whose_answer_cannot_be_written_answers_the_outcome_unknown,
);

/// The provider charged, then the run hung before it answered, and its client left: the charge
/// stays `authorizing`, the reconciler sends the create again under its key, gets the payment
/// made and settles the charge with its event; the client's late retry gets that charge.
async fn a_run_lost_after_the_provider_acted_is_settled_by_the_reconciler(h: &mut Harness) {
    let probe = h.parts.probe.clone();
    probe.hang(Hang::AfterEffect);
    let lost = spawn(charge(&h.router, "lost-after", 1300));
    wait_until("the payment", || probe.effects() == 1).await;
    lost.abort();
    the_charge(&h.router, 1300, "authorizing").await;

    let reconciler = reconciler_past_the_probe(&h.parts);
    assert_eq!(round(&reconciler).await, [1, 0, 0]);
    let settled = the_charge(&h.router, 1300, "captured").await;
    assert_eq!(payments_of(&h.parts, 1300).await, 1);
    assert_eq!(balance(&h.parts).await, 1300);

    // The provider still hangs every call: an answer at all comes from the ledger.
    h.lose_idempotency_records().await;
    let again = charge(&h.router, "lost-after", 1300).send().await;
    assert_is(&again, &settled);
    assert_eq!((probe.effects(), balance(&h.parts).await), (1, 1300));
}

/// The run hung before the provider did anything, and its client left: the outcome is unknown
/// to everyone but the provider, so the reconciler drives the create through under its key, as a
/// completer does, and the provider makes it once; the client's late retry gets that charge.
async fn a_run_lost_before_the_provider_acted_is_made_once_by_the_reconciler(h: &mut Harness) {
    let probe = h.parts.probe.clone();
    probe.hang(Hang::BeforeEffect);
    let lost = spawn(charge(&h.router, "lost-before", 900));
    wait_until("the call", || probe.calls() == 1).await;
    lost.abort();
    the_charge(&h.router, 900, "authorizing").await;

    let reconciler = reconciler_past_the_probe(&h.parts);
    assert_eq!(round(&reconciler).await, [1, 0, 0]);
    let made = the_charge(&h.router, 900, "captured").await;
    assert_eq!(payments_of(&h.parts, 900).await, 1);
    assert_eq!(balance(&h.parts).await, 900);

    probe.stop_hanging();
    h.lose_idempotency_records().await;
    assert_is(&charge(&h.router, "lost-before", 900).send().await, &made);
    assert_eq!(payments_of(&h.parts, 900).await, 1);
    assert_eq!(round(&reconciler).await, [0, 0, 0]);
}

/// The reconciler came while the provider still held the run's call: it sends the create again
/// under the operation's key and the provider makes it. The held call then lands on the same
/// key: no second payment, and the run answers the charge the reconciler settled.
async fn a_create_held_at_the_provider_is_made_once_by_the_reconciler(h: &mut Harness) {
    let probe = h.parts.probe.clone();
    let stall = probe.stall().await;
    let held = spawn(charge(&h.router, "held", 3100));
    wait_until("the call, held", || probe.stalled() == 1).await;
    let reconciler = reconciler_past_the_probe(&h.parts);
    assert_eq!(round(&reconciler).await, [1, 0, 0]);
    let settled = the_charge(&h.router, 3100, "captured").await;

    drop(stall);
    assert_is(&held.await.expect("an answer"), &settled);
    assert_eq!(payments_of(&h.parts, 3100).await, 1);
    assert_eq!(balance(&h.parts).await, 3100);
    assert_eq!(round(&reconciler).await, [0, 0, 0]);
}

/// Every attempt refused before the provider did anything: `503`, nothing charged, no charge
/// kept, and the retry with the same key runs and charges once. A provider down for a moment
/// (two attempts) is retried within the request.
async fn a_provider_down_answers_503_and_keeps_nothing(h: &mut Harness) {
    let probe = h.parts.probe.clone();
    probe.set_down(true);
    let down = charge(&h.router, "down", 700).send().await;
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    down.assert_error(unavailable, "api_error", "provider_unavailable");
    assert!(down.text().contains("nothing was charged"), "{down:?}");
    assert_eq!(down.header("stripe-should-retry"), Some("true"));
    assert!(charges_of(&h.router, 700).await.is_empty());
    assert_eq!(probe.effects(), 0);

    probe.set_down(false);
    let retry = charge(&h.router, "down", 700).send().await;
    assert_is(&retry, &the_charge(&h.router, 700, "captured").await);

    probe.set_down_for(2);
    let blip = charge(&h.router, "blip", 800).send().await;
    assert_is(&blip, &the_charge(&h.router, 800, "captured").await);
    let payments = [
        payments_of(&h.parts, 700).await,
        payments_of(&h.parts, 800).await,
    ];
    assert_eq!(payments, [1, 1]);
    assert_eq!(balance(&h.parts).await, 1500);
}

/// Once the provider may have acted, no answer says that nothing happened: the provider charged
/// and the ledger could not write its answer, so the run answers the outcome unknown (`504`), not
/// "unavailable" (`503`); its retry resumes the charge, and the provider answers its key with the
/// same payment.
async fn a_run_whose_answer_cannot_be_written_answers_the_outcome_unknown(h: &mut Harness) {
    let probe = h.parts.probe.clone();
    h.parts.ledger.fail_records(true);
    charge(&h.router, "unwritten", 2200)
        .send()
        .await
        .assert_outcome_unknown();
    assert_eq!(probe.effects(), 1);
    h.parts.ledger.fail_records(false);

    let retry = charge(&h.router, "unwritten", 2200).send().await;
    let made = the_charge(&h.router, 2200, "captured").await;
    assert_is(&retry, &made);
    assert_eq!((probe.effects(), payments_of(&h.parts, 2200).await), (1, 1));
    assert_eq!(balance(&h.parts).await, 2200);
}

// ---------------------------------------------------------------------------------------------
// (3) A provider slower than the client's attempts, on paused time.

/// Every attempt held at the provider past its timeout: `504` at the client's deadline, not
/// before, never "nothing was charged"; the charge is kept, and the retry with the same key,
/// once the provider answers again, makes it once.
#[tokio::test(start_paused = true)]
async fn a_provider_slower_than_the_deadline_answers_504_and_the_retry_charges_once() {
    let h = Harness::memory();
    let stall = h.parts.probe.stall().await;
    let started = tokio::time::Instant::now();
    let slow = charge(&h.router, "slow", 1700).send().await;
    let took = started.elapsed();
    slow.assert_outcome_unknown();
    assert_eq!(slow.header("stripe-should-retry"), Some("true"));
    let bound = CLIENT_DEADLINE..CLIENT_DEADLINE + Duration::from_millis(100);
    assert!(bound.contains(&took), "answered after {took:?}");
    let kept = the_charge(&h.router, 1700, "authorizing").await;

    drop(stall);
    assert_is(&charge(&h.router, "slow", 1700).send().await, &kept);
    the_charge(&h.router, 1700, "captured").await;
    assert_eq!(payments_of(&h.parts, 1700).await, 1);
    assert_eq!(balance(&h.parts).await, 1700);
}

/// An attempt that went unanswered, then the provider down for the others: the last `503` says
/// nothing of the first attempt, which the provider may still be making, so the answer is `504`
/// and the charge is kept; its retry makes it once.
#[tokio::test(start_paused = true)]
async fn an_unanswered_attempt_then_a_provider_down_is_504_not_503() {
    let h = Harness::memory();
    let probe = h.parts.probe.clone();
    let stall = probe.stall().await;
    let first = spawn(charge(&h.router, "then-down", 1100));
    wait_until("the first attempt, held", || probe.stalled() == 1).await;
    probe.set_down(true);
    first.await.expect("an answer").assert_outcome_unknown();
    let kept = the_charge(&h.router, 1100, "authorizing").await;

    probe.set_down(false);
    drop(stall);
    assert_is(&charge(&h.router, "then-down", 1100).send().await, &kept);
    assert_eq!(payments_of(&h.parts, 1100).await, 1);
}

// ---------------------------------------------------------------------------------------------
// (4) The reconciler over every intermediate state, on PostgreSQL.

/// A charge whose text its row's JSON escapes (a NUL), its answer lost: the reconciler settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_charge_with_a_nul_is_reconciled() {
    let h = Harness::postgres().await;
    let body = json!({ "amount": 1700, "currency": "eur", "source": "tok_visa", "description": "a\u{0}b" });
    h.send_losing_the_answer(create_charge(&h.router, ALICE, "nul", &body))
        .await;
    assert_eq!(round(&h.parts.reconciler(Duration::ZERO)).await, [1, 0, 0]);
    the_charge(&h.router, 1700, "captured").await;
}

/// Each charge left mid-call as a crash leaves it: calls the provider made are settled with their
/// events, calls it never saw are made now, once, a refund it refuses is rolled back, and a call
/// older than the key window less an hour is left alone. A second round does nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_reconciler_settles_every_intermediate_state() {
    let h = Harness::postgres().await;
    let pool = h.parts.store.as_ref().expect("PostgreSQL").pool().clone();
    let margin = WINDOW - Duration::from_secs(3600) + Duration::from_secs(60);
    let margin = u64::try_from(margin.as_millis()).expect("a time");
    // The charge; the call it is left in (status, key, amount), made before or not; where the
    // reconciler leaves it (status, refunded).
    #[rustfmt::skip]
    let cases = [
        (authorize(1000), "capturing", "capture-made", 0, true, "captured", 0),
        (authorize(200), "canceling", "cancel-made", 0, true, "canceled", 0),
        (visa(3000), "refunding", "refund-made", 1200, true, "captured", 1200),
        (authorize(400), "capturing", "capture-lost", 0, false, "captured", 0),
        (visa(500), "refunding", "refund-lost", 100, false, "captured", 100),
        (visa(600), "refunding", "refund-refused", 700, false, "captured", 0),
        (authorize(300), "capturing", "capture-forgotten", 0, false, "capturing", 0),
    ];
    let provider = &h.parts.provider;
    let mut ids = Vec::new();
    for (body, status, key, amount, made, ..) in &cases {
        let id = h.charge(ALICE, body.clone()).await["id"].clone();
        let payment: String =
            sqlx::query_scalar("SELECT charge::jsonb ->> 'payment' FROM charges WHERE id = $1")
                .bind(id.as_str())
                .fetch_one(&pool)
                .await
                .expect("the charge");
        let done = match (*made, *status) {
            (false, _) => Ok(()),
            (_, "capturing") => provider.capture(key, &payment).await,
            (_, "canceling") => provider.cancel(key, &payment).await,
            _ => provider.refund(key, &payment, *amount).await.map(drop),
        };
        done.expect("made by the provider");
        let ago = if *key == "capture-forgotten" {
            margin
        } else {
            0
        };
        sqlx::query(
            "UPDATE charges SET status = $2, call_key = $3, charge = (charge::jsonb || jsonb_build_object(
                 'status', $2::text, 'call_key', $3::text, 'call_amount', $4::int8,
                 'call_started', $5::int8))::text
             WHERE id = $1",
        )
        .bind(id.as_str())
        .bind(status)
        .bind(key)
        .bind(amount)
        .bind(i64::try_from(now_ms() - ago).expect("a time"))
        .execute(&pool)
        .await
        .expect("the charge, left mid-call");
        ids.push(id.as_str().expect("an id").to_owned());
    }
    assert_eq!(balance(&h.parts).await, 3000 + 500 + 600);

    let reconciler = h.parts.reconciler(Duration::ZERO);
    assert_eq!(round(&reconciler).await, [5, 1, 1]);
    for (id, (.., status, refunded)) in ids.iter().zip(&cases) {
        h.assert_refunded(id, status, *refunded).await;
    }
    let refunded = h.provider_refunded().await.iter().sum::<i64>();
    assert_eq!(refunded, 1200 + 100, "nothing refunded twice");
    let now = 3000 + 500 + 600 + 1000 + 400 - 1200 - 100;
    assert_eq!(balance(&h.parts).await, now);

    assert_eq!(round(&reconciler).await, [0, 0, 1]);
    assert_eq!(balance(&h.parts).await, now);
}

// ---------------------------------------------------------------------------------------------
// (5) The layer's part of the rule, on PostgreSQL.

/// A run whose claim is taken after its provider call, before its `PgTx` commits: its transaction
/// rolls back (the charge `authorizing`, no event), and the layer answers `503` to retry with the
/// same key, saying the writes rolled back, never that nothing was done; the retry gets the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_commit_lost_to_a_newer_claim_is_the_layers_503() {
    let mut h = Harness::postgres().await;
    let (probe, ledger) = (h.parts.probe.clone(), h.parts.ledger.clone());
    let pool = h.parts.store.as_ref().expect("PostgreSQL").pool().clone();
    let stall = probe.stall().await;
    let held = spawn(charge(&h.router, "lost-commit", 2700));
    wait_until("the call, held", || probe.stalled() == 1).await;
    // The charge's row locked: the run's write of the answer waits for it.
    let mut lock = pool.begin().await.expect("a transaction");
    let locking = sqlx::query("SELECT id FROM charges FOR UPDATE");
    locking.fetch_all(&mut *lock).await.expect("locked");
    drop(stall);
    wait_until("the payment", || probe.effects() == 1).await;
    h.lose_idempotency_records().await;
    let door = ledger.opens.shut().await;
    let retry = spawn(charge(&h.router, "lost-commit", 2700));
    wait_until("the retry, claimed and held", || {
        ledger.opens.waiting() == 1
    })
    .await;
    lock.commit().await.expect("unlocked");

    let held = held.await.expect("an answer");
    assert_eq!(held.status, StatusCode::SERVICE_UNAVAILABLE, "{held:?}");
    assert_eq!(
        held.error_code(),
        "idempotency_store_unavailable",
        "the layer's"
    );
    assert_eq!(held.header("stripe-should-retry"), Some("true"));
    let message = held.error()["message"].as_str().expect("a message");
    assert!(!message.contains("nothing was done"), "{message}");
    assert!(message.contains("retry with the same key"), "{message}");
    the_charge(&h.router, 2700, "authorizing").await;
    assert_eq!(h.parts.backlog().await, 0, "its event rolled back with it");

    drop(door);
    let charge_made = the_charge_after(retry, &h.router, 2700).await;
    let again = charge(&h.router, "lost-commit", 2700).send().await;
    assert_is(&again, &charge_made);
    assert_eq!((probe.effects(), payments_of(&h.parts, 2700).await), (1, 1));
    assert_eq!(balance(&h.parts).await, 2700);
}

/// The charge of `amount` once `run` answered it: created, and `captured`.
async fn the_charge_after(run: JoinHandle<Reply>, router: &Router, amount: i64) -> Value {
    let reply = run.await.expect("an answer");
    let charge = the_charge(router, amount, "captured").await;
    assert_is(&reply, &charge);
    charge
}
