//! The payments example on PostgreSQL (`DATABASE_URL`): each test on a PostgreSQL server of its
//! own (`test-servers`).
//!
//! An instance of the example runs in-process on a tokio runtime of its own, over a pool of its
//! own: two instances on one database are two runtimes, and a crash is its runtime shut down at
//! once, which stops everything the instance runs (handlers, lease renewals, the consumer, the
//! reconciler) and closes its connections, so the database rolls back what they held open. The
//! server binary itself is run for the start-up paths.

#![cfg(unix)]

use example_payments as server;

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};
use sqlx::{self, Connection, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{BoxStore, IdempotencyLayer, Outcome, RecordId};

use server::balance::Fault;
use server::consumer::{Counts, SCOPE};
use server::events::{EventType, PaymentEvent};
use server::pg::{Database, OutboxConsumer, outbox};
use server::provider::{Hang, Provider};
use server::reconciler::Reconciler;
use server::{AppState, app};
use support::api::{ALICE, Call, Reply, account, authorize, create_charge, visa};

/// The idempotency layer's lease in these tests: a crashed instance's claim runs out this soon.
const LEASE: Duration = Duration::from_secs(1);
/// A reconciler that stays out of the way.
const NEVER: Duration = Duration::from_secs(3600);
/// How long a test waits for something to happen.
const PATIENCE: Duration = Duration::from_secs(30);

/// One instance of the example, on a runtime of its own.
struct Instance {
    runtime: Option<Runtime>,
    router: Router,
    provider: Provider,
    stop: CancellationToken,
}

impl Instance {
    /// An instance on the database at `url` (its schema created if missing), whose reconciler
    /// settles charges `authorizing` longer than `reconcile_after`.
    async fn start(url: &str, reconcile_after: Duration) -> Self {
        let stop = CancellationToken::new();
        let url = url.to_owned();
        let workers = stop.clone();
        // Set up with `block_on`, on a thread that may block: `PgStore::migrate`'s future is not
        // `Send`, so it cannot be spawned.
        let (runtime, router, provider) = tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime");
            let (router, provider) = runtime.block_on(async move {
                let db = Database::connect(&url)
                    .await
                    .expect("the database is usable");
                let state = db.state(AppState::new(Duration::ZERO));
                drop(db.spawn_workers(&state, reconcile_after, workers));
                let layer = IdempotencyLayer::new(BoxStore::new(db.store().clone())).lease(LEASE);
                (app(state.clone(), layer), state.provider)
            });
            (runtime, router, provider)
        })
        .await
        .expect("the instance starts");
        Self {
            runtime: Some(runtime),
            router,
            provider,
            stop,
        }
    }

    /// Sends `call`, made on this instance's router, in a task of the instance.
    fn spawn(&self, call: Call) -> JoinHandle<Reply> {
        self.runtime
            .as_ref()
            .expect("a running instance")
            .spawn(call.send())
    }

    async fn send(&self, call: Call) -> Reply {
        self.spawn(call).await.expect("the instance answers")
    }

    /// A charge as Alice under `key`.
    fn charge_call(&self, key: &str, body: &Value) -> Call {
        create_charge(&self.router, ALICE, key, body)
    }

    async fn charge(&self, key: &str, body: &Value) -> Reply {
        self.send(self.charge_call(key, body)).await
    }

    /// Sends the charge again while the key is in flight (409), as a client honouring
    /// `Retry-After` would, until it gets another answer.
    async fn retry_charge(&self, key: &str, body: &Value) -> Reply {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let reply = self.charge(key, body).await;
            if reply.status != StatusCode::CONFLICT {
                return reply;
            }
            assert!(
                Instant::now() < deadline,
                "still in flight: {}",
                reply.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn post_empty(&self, path: &str, key: &str) -> Reply {
        self.send(Call::post(&self.router, path).auth(ALICE).key(key))
            .await
    }

    async fn get(&self, path: &str) -> Reply {
        self.send(Call::get(&self.router, path).auth(ALICE)).await
    }

    /// The ids and statuses of Alice's charges, newest first.
    async fn charges(&self) -> Vec<(String, String)> {
        let list = self.get("/v1/charges").await;
        assert_eq!(list.status, StatusCode::OK, "{}", list.text());
        list.json["data"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|charge| {
                (
                    charge["id"].as_str().unwrap_or_default().to_owned(),
                    charge["status"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    /// Waits until Alice's balance is `amount` euro cents.
    async fn wait_for_balance(&self, amount: i64) {
        let expected = json!([{ "amount": amount, "currency": "eur" }]);
        let deadline = Instant::now() + PATIENCE;
        loop {
            let balance = self.get("/v1/balance").await;
            if balance.json["available"] == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the balance is not {amount}: {}",
                balance.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops everything the instance runs, at once, as a crash of its process would.
    fn crash(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn admin(server: &PostgresServer) -> PgConnection {
    PgConnection::connect(&server.url())
        .await
        .expect("an admin connection")
}

/// One number from `sql`.
async fn count(server: &PostgresServer, sql: &str) -> i64 {
    sqlx::query(sql)
        .fetch_one(&mut admin(server).await)
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"))
        .get(0)
}

/// How many payments the provider made: its keys used for a new payment, across instances.
async fn provider_payments(server: &PostgresServer) -> i64 {
    count(
        server,
        "SELECT count(*) FROM provider_keys WHERE request LIKE 'create_payment %'",
    )
    .await
}

/// Waits until `sql` counts `expected`.
async fn wait_for_count(server: &PostgresServer, sql: &str, expected: i64) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let now = count(server, sql).await;
        if now == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{sql}: {now}, not {expected}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const AUTHORIZING: &str = "SELECT count(*) FROM charges WHERE status = 'authorizing'";

/// Starts an instance whose provider hangs `at` a point of every call, sends a charge to it, waits
/// until the charge is `authorizing` in the database (and, hanging after the effect, the provider
/// has charged), and crashes it.
async fn crash_during_the_provider_call(
    server: &PostgresServer,
    at: Hang,
    key: &str,
    body: &Value,
) {
    let first = Instance::start(&server.url(), NEVER).await;
    first.provider.hang(Some(at));
    let lost = first.spawn(first.charge_call(key, body));
    wait_for_count(server, AUTHORIZING, 1).await;
    let charged = i64::from(at == Hang::AfterEffect);
    wait_for_count(
        server,
        "SELECT count(*) FROM provider_keys WHERE request LIKE 'create_payment %'",
        charged,
    )
    .await;
    first.crash();
    let answer = lost.await;
    assert!(
        answer.as_ref().is_err_and(|err| err.is_cancelled()),
        "the client never gets an answer: {answer:?}"
    );
}

/// A restarted server finds its charges: the retry replays the first answer, the list and the
/// balance are still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_replays_and_lists_its_charges() {
    let server = PostgresServer::start();
    let first = Instance::start(&server.url(), NEVER).await;
    let created = first.charge("order-1", &visa(2500)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.json["status"], "captured");
    first.wait_for_balance(2500).await;
    drop(first);

    let second = Instance::start(&server.url(), NEVER).await;
    let retry = second.charge("order-1", &visa(2500)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.text(), created.text(), "byte for byte");
    let id = created.json["id"].as_str().expect("an id").to_owned();
    assert_eq!(second.charges().await, [(id.clone(), "captured".into())]);
    let one = second.get(&format!("/v1/charges/{id}")).await;
    assert_eq!(one.json["amount"], 2500, "{}", one.text());
    second.wait_for_balance(2500).await;
    assert_eq!(
        second.provider.calls(),
        0,
        "the retry never reached the provider"
    );
    assert_eq!(provider_payments(&server).await, 1);
}

/// Two instances on one database: a charge made on one replays on the other; 50 concurrent
/// requests with one key, spread over both, make one charge; a capture on one and its retry on the
/// other capture once; a declined card is recorded and replayed on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_truth() {
    let server = PostgresServer::start();
    let a = Instance::start(&server.url(), NEVER).await;
    let b = Instance::start(&server.url(), NEVER).await;

    let created = a.charge("first", &visa(1000)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let replay = b.charge("first", &visa(1000)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.text(), created.text());

    let body = visa(700);
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let instance = if i % 2 == 0 { &a } else { &b };
            instance.spawn(instance.charge_call("burst", &body))
        })
        .collect();
    let mut executed = Vec::new();
    for task in tasks {
        let reply = task.await.expect("an answer");
        match reply.outcome {
            Some(Outcome::Executed) => executed.push(reply),
            // Never ran the handler (a 503 when a pool stayed busy past the store's timeout).
            Some(Outcome::InFlight | Outcome::Replayed | Outcome::StoreUnavailable) => {}
            other => panic!("{other:?}: {}", reply.text()),
        }
    }
    assert_eq!(executed.len(), 1, "one request ran the handler");
    assert_eq!(
        executed[0].status,
        StatusCode::CREATED,
        "{}",
        executed[0].text()
    );
    let burst = b.charge("burst", &body).await;
    assert!(burst.replayed());
    assert_eq!(burst.json["id"], executed[0].json["id"]);
    assert_eq!(a.charges().await.len(), 2);
    assert_eq!(provider_payments(&server).await, 2);

    // Authorize on one, capture on the other, retry the capture on the first.
    let authorized = a.charge("authorize", &authorize(300)).await;
    assert_eq!(
        authorized.json["status"],
        "authorized",
        "{}",
        authorized.text()
    );
    let id = authorized.json["id"].as_str().expect("an id");
    let capture = format!("/v1/charges/{id}/capture");
    let captured = b.post_empty(&capture, "capture-1").await;
    assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
    assert_eq!(captured.json["status"], "captured");
    let again = a.post_empty(&capture, "capture-1").await;
    assert!(again.replayed(), "{again:?}");
    a.wait_for_balance(1000 + 700 + 300).await;

    let declined = json!({ "amount": 50, "currency": "eur", "source": "tok_chargeDeclined" });
    let refused = b.charge("declined", &declined).await;
    assert_eq!(
        refused.status,
        StatusCode::PAYMENT_REQUIRED,
        "{}",
        refused.text()
    );
    let refused_again = a.charge("declined", &declined).await;
    assert!(refused_again.replayed());
    assert_eq!(refused_again.text(), refused.text());
    let charges = b.charges().await;
    assert_eq!(charges.len(), 4, "{charges:?}");
    assert_eq!(charges[0].1, "failed");
    assert_eq!(
        a.provider.effects() + b.provider.effects(),
        5,
        "four payments and one capture"
    );
    assert_eq!(count(&server, AUTHORIZING).await, 0);
}

/// Captures, refunds and cancellations on PostgreSQL: each step's state commits with its record
/// and its event, a provider outage rolls a capture back, and the balance follows. A retry whose
/// record was deleted finds its charge by its key, without calling the provider again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captures_refunds_and_cancellations_on_postgres() {
    let server = PostgresServer::start();
    let h = Instance::start(&server.url(), NEVER).await;
    let id_of = |reply: &Reply| reply.json["id"].as_str().expect("an id").to_owned();

    let first = h.charge("auth-1", &authorize(1000)).await;
    assert_eq!(first.json["status"], "authorized", "{}", first.text());
    let first_id = id_of(&first);
    h.provider.set_outage(true);
    let down = h
        .post_empty(&format!("/v1/charges/{first_id}/capture"), "capture-1")
        .await;
    assert_eq!(
        down.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        down.text()
    );
    let after = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(after.json["status"], "authorized", "rolled back");
    h.provider.set_outage(false);
    let captured = h
        .post_empty(&format!("/v1/charges/{first_id}/capture"), "capture-1")
        .await;
    assert_eq!(captured.json["status"], "captured", "{}", captured.text());

    let refunds = format!("/v1/charges/{first_id}/refunds");
    let part = h
        .send(
            Call::post(&h.router, &refunds)
                .auth(ALICE)
                .key("refund-1")
                .raw(r#"{"amount": 300}"#),
        )
        .await;
    assert_eq!(part.status, StatusCode::CREATED, "{}", part.text());
    let charge = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(
        (&charge.json["status"], &charge.json["amount_refunded"]),
        (&json!("captured"), &json!(300))
    );
    let rest = h.post_empty(&refunds, "refund-2").await;
    assert_eq!(rest.json["amount"], 700, "{}", rest.text());
    let again = h.post_empty(&refunds, "refund-2").await;
    assert!(again.replayed());
    let charge = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(charge.json["status"], "refunded");

    let second = h.charge("auth-2", &authorize(500)).await;
    let canceled = h
        .post_empty(
            &format!("/v1/charges/{}/cancel", id_of(&second)),
            "cancel-1",
        )
        .await;
    assert_eq!(canceled.json["status"], "canceled", "{}", canceled.text());

    let third = h.charge("visa-3", &visa(2000)).await;
    assert_eq!(third.json["status"], "captured");
    h.wait_for_balance(2000).await;

    // The layer's records gone, the retry finds its charge, and the provider is not called.
    let calls = h.provider.calls();
    let forget =
        "WITH gone AS (DELETE FROM idempotency_records RETURNING 1) SELECT count(*) FROM gone";
    assert!(count(&server, forget).await > 0);
    let retry = h.charge("visa-3", &visa(2000)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.json["id"], third.json["id"]);
    // Another request under that key, the layer's record gone again: the charge's own refusal,
    // in Stripe's form (400 `idempotency_error`, which its SDKs raise as IdempotencyError).
    assert!(count(&server, forget).await > 0);
    let reused = h.charge("visa-3", &visa(2100)).await;
    assert_eq!(reused.status, StatusCode::BAD_REQUEST, "{}", reused.text());
    assert_eq!(reused.json["error"]["code"], "idempotency_key_reused");
    assert_eq!(h.provider.calls(), calls);
    assert_eq!(h.charges().await.len(), 3);
    h.wait_for_balance(2000).await;
    assert_eq!(
        count(&server, "SELECT count(*) FROM payment_events").await,
        0
    );
}

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
    assert_eq!(second.provider.effects(), 0, "the provider charged no more");
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

    let second = Instance::start(&server.url(), 2 * LEASE).await;
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
    assert_eq!(second.provider.effects(), 0);
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

    let second = Instance::start(&server.url(), 2 * LEASE).await;
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

    let db = Database::connect(&server.url())
        .await
        .expect("the database");
    let state = db.state(AppState::new(Duration::ZERO));
    let reconcilers = [Duration::ZERO, Duration::ZERO].map(|after| Reconciler::new(&state, after));
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

/// The outbox consumer applies every event once: a consumer that dies in the middle of an event
/// (applied, not committed) leaves it to the next one, two consumers share the rest, and events
/// published twice change the balance once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outbox_event_is_applied_once_across_consumer_restarts() {
    let server = PostgresServer::start();
    let db = Database::connect(&server.url())
        .await
        .expect("the database");
    let state = db.state(AppState::new(Duration::ZERO));
    let alice = account(ALICE);
    let events: Vec<PaymentEvent> = (1..=40)
        .map(|n| PaymentEvent {
            id: format!("evt_succeeded_ch_{n}"),
            kind: EventType::Succeeded,
            account: alice.clone(),
            amount: n,
            currency: "eur".into(),
            charge: format!("ch_{n}"),
            captured: true,
        })
        .collect();
    let mut conn = db.pool().acquire().await.expect("a connection");
    for event in events.iter().chain(&events[5..10]) {
        outbox::insert(&mut conn, event).await.expect("published");
    }
    drop(conn);
    let total: i64 = (1..=40).sum();

    // The first consumer applies the first event, then dies before it commits.
    state
        .balances
        .inject(&events[0].id, Fault::HangAfterApplying);
    let poll = Duration::from_millis(20);
    let stop = CancellationToken::new();
    let dying = tokio::spawn(
        OutboxConsumer::new(db.pool().clone(), state.balances.clone(), poll).run(stop.clone()),
    );
    let deadline = Instant::now() + PATIENCE;
    while state.balances.attempts(&events[0].id) == 0 {
        assert!(Instant::now() < deadline, "the first event was never taken");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dying.abort();
    assert!(dying.await.is_err_and(|err| err.is_cancelled()));

    let consumers: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(
                OutboxConsumer::new(db.pool().clone(), state.balances.clone(), poll)
                    .run(stop.clone()),
            )
        })
        .collect();
    wait_for_count(&server, "SELECT count(*) FROM payment_events", 0).await;
    stop.cancel();
    let mut counts = Counts::default();
    for consumer in consumers {
        counts = counts + consumer.await.expect("a consumer");
    }
    assert_eq!((counts.applied, counts.duplicates), (40, 5), "{counts:?}");
    assert_eq!(state.balances.attempts(&events[0].id), 2);
    let balance = state.balances.get(&alice).await.expect("a balance");
    assert_eq!(balance.len(), 1);
    assert_eq!(balance[0].amount, total, "each event applied once");

    // Each id is recorded as processed, in the store's table.
    let mut admin = admin(&server).await;
    for event in &events {
        let id = RecordId::for_message(SCOPE.as_bytes(), &event.id);
        let found: i64 = sqlx::query("SELECT count(*) FROM idempotency_records WHERE id = $1")
            .bind(id.as_bytes().as_slice())
            .fetch_one(&mut admin)
            .await
            .expect("a count")
            .get(0);
        assert_eq!(found, 1, "{}", event.id);
    }
}

// The server binary, on PostgreSQL.

fn spawn_server(env: &[(&str, &str)]) -> Child {
    let mut command = Command::new(support::binary("server"));
    command
        .env("ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .env_remove("REDIS_URL")
        .env_remove("LEDGER_REDIS_URL")
        .env_remove("REDIS_CLUSTER_URLS")
        .env_remove("DATABASE_URL")
        .env_remove("RECONCILE_AFTER_MS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    command.spawn().expect("the example starts")
}

/// A running server process, killed when dropped.
struct Process {
    child: Child,
    addr: SocketAddr,
    banner: String,
    stderr: Option<std::thread::JoinHandle<String>>,
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

impl Process {
    fn start(env: &[(&str, &str)]) -> Self {
        let mut child = spawn_server(env);
        let stderr = drain(child.stderr.take().expect("piped stderr"));
        let (lines, banner) = std::sync::mpsc::channel();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let banner = loop {
            match banner.recv_timeout(PATIENCE) {
                Ok(line) if line.starts_with("listening on ") => break line,
                Ok(_) => continue,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let stderr = stderr.join().unwrap_or_default();
                    panic!("the example did not print its address; stderr:\n{stderr}")
                }
            }
        };
        let addr = banner
            .strip_prefix("listening on http://")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no address in {banner:?}"));
        Self {
            child,
            addr,
            banner,
            stderr: Some(stderr),
        }
    }

    /// One HTTP/1.1 request as Alice, on a fresh connection: the status, whether it is a
    /// replay, and the body.
    fn request(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> (u16, bool, String) {
        let mut stream = TcpStream::connect(self.addr).expect("the example accepts connections");
        stream
            .set_read_timeout(Some(PATIENCE))
            .expect("a socket timeout");
        let mut message = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Authorization: Bearer {ALICE}\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if let Some(key) = key {
            message.push_str(&format!("Idempotency-Key: {key}\r\n"));
        }
        message.push_str("\r\n");
        message.push_str(body);
        stream.write_all(message.as_bytes()).expect("sent");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read");
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("a status");
        let replayed = head
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true");
        (status, replayed, body.to_owned())
    }

    /// SIGTERM; the exit status and everything the process logged.
    fn terminate(mut self) -> (ExitStatus, String) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let status = support::wait_within(&mut self.child, PATIENCE);
        let stderr = self.stderr.take().map(|t| t.join().unwrap_or_default());
        (status, stderr.unwrap_or_default())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `DATABASE_URL=... cargo run -p example-payments`: the schema is created at
/// start-up, and a restarted server replays and lists what the first one did.
#[test]
fn the_server_keeps_its_charges_in_postgres_across_a_restart() {
    let database = PostgresServer::start();
    let url = database.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("SHUTDOWN_TIMEOUT_MS", "2000"),
    ];
    let charge = r#"{"amount": 1500, "currency": "eur", "source": "tok_visa"}"#;

    let first = Process::start(&env);
    assert!(
        first.banner.ends_with("(store: postgres)"),
        "{}",
        first.banner
    );
    let (status, replayed, created) = first.request("POST", "/v1/charges", Some("order-9"), charge);
    assert_eq!((status, replayed), (201, false), "{created}");
    let (status, stderr) = first.terminate();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let second = Process::start(&env);
    let (status, replayed, retry) = second.request("POST", "/v1/charges", Some("order-9"), charge);
    assert_eq!((status, replayed), (201, true), "{retry}");
    assert_eq!(retry, created, "byte for byte");
    let (status, _, list) = second.request("GET", "/v1/charges", None, "");
    assert_eq!(status, 200);
    let list: Value = serde_json::from_str(&list).expect("JSON");
    let created: Value = serde_json::from_str(&created).expect("JSON");
    assert_eq!(list["data"][0]["id"], created["id"], "{list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1));
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, _, balance) = second.request("GET", "/v1/balance", None, "");
        if balance.contains(r#"{"amount":1500,"currency":"eur"}"#) {
            break;
        }
        assert!(Instant::now() < deadline, "no balance: {balance}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, stderr) = second.terminate();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// An unreachable `DATABASE_URL`: one line that names it, a non-zero exit, before listening.
#[test]
fn an_unreachable_database_url_exits_naming_it() {
    let mut child = spawn_server(&[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/payments")]);
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut stdout)
        .expect("stdout");
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = support::wait_within(&mut child, PATIENCE);
    assert!(!status.success(), "exit {status:?}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {stderr}");
    assert!(
        lines[0].contains("cannot use PostgreSQL at DATABASE_URL"),
        "{}",
        lines[0]
    );
}

/// The reconciler settles every intermediate state a crash can leave, from what the provider did
/// under the key of the call in flight: a capture, a cancellation and a refund the provider made
/// are completed, with the events the requests would have published (the balance counts the
/// capture and the refund once); a capture and a refund it never saw go back to where the charge
/// was. A second round finds nothing to do.
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
    ] {
        let reply = h.charge(key, &body).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        ids.push(reply.json["id"].as_str().expect("an id").to_owned());
    }
    h.wait_for_balance(3500).await;

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
    h.provider
        .capture("capture-call", 1, &payments[0])
        .await
        .expect("captured");
    h.provider
        .cancel("cancel-call", 1, &payments[1])
        .await
        .expect("canceled");
    h.provider
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

    let db = Database::connect(&server.url())
        .await
        .expect("the database");
    let state = db.state(AppState::new(Duration::ZERO));
    let reconciler = Reconciler::new(&state, Duration::ZERO);
    let done = reconciler.round().await.expect("a round");
    assert_eq!(
        (done.settled, done.removed, done.left),
        (3, 2, 0),
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
        ("authorized", 0),
        ("captured", 0),
    ]
    .map(|(status, refunded)| (status.to_owned(), refunded));
    assert_eq!(found, expected);
    h.wait_for_balance(3500 + 1000 - 1200).await;

    let again = reconciler.round().await.expect("a round");
    assert_eq!(
        (again.settled, again.removed, again.left),
        (0, 0, 0),
        "{again:?}"
    );
    wait_for_count(&server, "SELECT count(*) FROM payment_events", 0).await;
    h.wait_for_balance(3500 + 1000 - 1200).await;
}

/// A database made before charges held their operation gets the column and the unique index at
/// start-up, each charge holding its own; one that already holds two charges for one operation
/// (as a stalled run taken over could leave) stops start-up with an error that says so, rather
/// than run without the constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_database_gets_the_unique_operation_or_a_clear_error() {
    let server = PostgresServer::start();
    drop(
        Database::connect(&server.url())
            .await
            .expect("the database"),
    );
    let mut admin = admin(&server).await;
    let insert = |id: &str, key: &str| {
        format!(
            "INSERT INTO charges (id, account, provider_key, amount, currency, source, capture,
                                  status, created)
             VALUES ('{id}', 'acct_1', '{key}', 100, 'eur', 'tok_visa', true, 'captured', 0)"
        )
    };
    for sql in [
        "ALTER TABLE charges DROP COLUMN operation".to_owned(),
        insert("ch_1", "op-1"),
        insert("ch_2", "op-2"),
    ] {
        sqlx::raw_sql(&sql).execute(&mut admin).await.expect(&sql);
    }
    drop(Database::connect(&server.url()).await.expect("migrated"));
    let held = count(
        &server,
        "SELECT count(*) FROM charges WHERE operation = provider_key",
    )
    .await;
    assert_eq!(held, 2, "each charge holds its operation");

    for sql in [
        "ALTER TABLE charges DROP COLUMN operation".to_owned(),
        insert("ch_3", "op-1"),
    ] {
        sqlx::raw_sql(&sql).execute(&mut admin).await.expect(&sql);
    }
    let err = Database::connect(&server.url())
        .await
        .expect_err("two charges for one operation");
    assert!(err.contains("two charges for one operation"), "{err}");
}

/// Locks the provider's key table, as the outage did: every provider call that writes a key waits
/// until the transaction ends (reads go on). Returns the connection holding the lock.
async fn lock_provider_keys(server: &PostgresServer) -> PgConnection {
    let mut lock = admin(server).await;
    for sql in ["BEGIN", "LOCK TABLE provider_keys IN EXCLUSIVE MODE"] {
        sqlx::query(sql)
            .execute(&mut lock)
            .await
            .unwrap_or_else(|err| panic!("{sql}: {err}"));
    }
    lock
}

/// Releases the lock of [`lock_provider_keys`]: the calls held behind it commit now.
async fn release(mut lock: PgConnection) {
    sqlx::query("COMMIT")
        .execute(&mut lock)
        .await
        .expect("the lock's transaction ends");
}

/// Sends a charge while the provider's key table is locked past the provider client's deadline
/// (8 s): the answer says the outcome is not known yet (never "nothing was charged"), and the
/// charge is kept `authorizing`. Then the lock goes, and the provider's write commits.
async fn charge_through_a_locked_provider(server: &PostgresServer, instance: &Instance, key: &str) {
    let lock = lock_provider_keys(server).await;
    let first = instance.charge(key, &visa(3100)).await;
    first.assert_outcome_unknown();
    release(lock).await;
    wait_for_count(server, "SELECT count(*) FROM provider_payments", 1).await;
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
async fn a_payment_no_charge_names_is_found_by_the_reconciler() {
    let server = PostgresServer::start();
    let instance = Instance::start(&server.url(), 2 * LEASE).await;
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
