//! The events' way to the balances. The outbox hands each event out at least once: in memory,
//! filled under the ledger's lock, to the process's one consumer; in PostgreSQL, rows written in
//! the charge's transaction, taken with `FOR UPDATE SKIP LOCKED`. The balances record each event
//! id with its change, so that it changes a balance once. Memory runs on paused time.

mod support;

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::http::StatusCode;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tower_idempotency::MemoryStore;
use tracing::instrument::WithSubscriber;

use example_payments::balance::{Available, Balances};
use example_payments::consumer::{self, Counts};
use example_payments::events::{EventType, PaymentEvent};
use example_payments::{outbox, provider::WINDOW};
use support::api::{ALICE, BOB, account, create_charge, visa};
use support::harness::{Harness, Records, new_database};
use support::instruments::Fault;
use support::stack::{POLL, Parts};

/// `charge.succeeded` of a charge of `amount` euro cents, captured.
fn succeeded(id: &str, account: &str, amount: i64) -> PaymentEvent {
    PaymentEvent {
        id: id.to_owned(),
        kind: EventType::Succeeded,
        account: account.to_owned(),
        amount,
        currency: "eur".to_owned(),
        charge: format!("ch_{id}"),
        captured: true,
    }
}

fn eur(amount: i64) -> Vec<Available> {
    let currency = "eur".to_owned();
    vec![Available { amount, currency }]
}

async fn balance(parts: &Parts, account: &str) -> Vec<Available> {
    parts.balances.get(account).await.expect("the balance")
}

/// What a consumer did: `[applied, already applied, failed, rejected]`, and nothing else.
fn did(c: Counts) -> [usize; 4] {
    assert_eq!(c.in_progress + c.unreadable, 0, "{c:?}");
    [c.applied, c.already_applied, c.failed, c.rejected]
}

/// Waits until `check` holds, for up to [`support::PATIENCE`].
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + support::PATIENCE;
    while !check().await {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().expect("the logs").write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One consumer until the outbox is empty: what it did, and what it logged.
async fn drain(parts: &Parts) -> ([usize; 4], String) {
    let (logs, stop) = (Logs::default(), CancellationToken::new());
    let writer = logs.clone();
    let logger = tracing_subscriber::fmt().with_writer(move || writer.clone());
    let run = consumer::run(parts.outbox.clone(), POLL, stop.clone());
    let consumer = tokio::spawn(run.with_subscriber(logger.with_ansi(false).finish()));
    eventually("the outbox to empty", async || parts.backlog().await == 0).await;
    stop.cancel();
    let counts = consumer.await.expect("the consumer stops");
    let logs = logs.0.lock().expect("the logs").clone();
    (did(counts), String::from_utf8(logs).expect("text"))
}

/// An event handed out 2, 10 and 100 times (published again, say) changes its balance once.
async fn an_event_handed_out_again_changes_the_balance_once(parts: Parts) {
    for n in [2, 10, 100] {
        let account = format!("acct_{n}");
        let event = succeeded(&format!("evt_{n}"), &account, 2500);
        for _ in 0..n {
            parts.publish(&event).await;
        }
        assert_eq!(drain(&parts).await.0, [1, n - 1, 0, 0], "{n} times");
        assert_eq!(balance(&parts, &account).await, eur(2500), "{n} times");
    }
}

/// Makes the next two applies of `event` fail before its balance changes; in PostgreSQL, at the
/// balance's upsert, after its id was marked processed (a trigger; a sequence counts them).
async fn fail_twice(parts: &Parts, event: &PaymentEvent) {
    let Some(store) = &parts.store else {
        return parts.balances.inject(&event.id, Fault::Fail { times: 2 });
    };
    let account = &event.account;
    let sql = format!(
        "CREATE SEQUENCE attempts;
         CREATE FUNCTION flaky() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             IF NEW.account = '{account}' AND nextval('attempts') <= 2 THEN RAISE 'no'; END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER flaky BEFORE INSERT ON balances FOR EACH ROW EXECUTE FUNCTION flaky();"
    );
    let trigger = sqlx::raw_sql(&sql);
    trigger.execute(store.pool()).await.expect("a trigger");
}

/// A failing apply leaves its event in the outbox (in PostgreSQL its processed mark rolls back
/// too): retried, it applies once. An event that would overflow the balance is refused for good:
/// logged, taken off, never retried nor marked (once there is room, it applies).
async fn a_failing_apply_is_retried_an_overflowing_one_is_not(parts: Parts) {
    let (alice, bob) = (account(ALICE), account(BOB));
    let failing = succeeded("evt_failing", &bob, 700);
    fail_twice(&parts, &failing).await;
    let (max, overflow) = (i64::MAX, succeeded("evt_over", &alice, 1));
    let top = succeeded("evt_max", &alice, max);
    let mut refund = succeeded("evt_refund", &alice, 3);
    refund.kind = EventType::Refunded;
    for event in [&failing, &top, &overflow, &refund] {
        parts.publish(event).await;
    }
    let (done, logs) = drain(&parts).await;
    assert_eq!(done, [3, 0, 2, 1]);
    assert_eq!(balance(&parts, &bob).await, eur(700));
    assert_eq!(balance(&parts, &alice).await, eur(max - 3));
    let logged = |line: &&str| line.contains(" ERROR ") && line.contains("event=evt_over");
    assert_eq!(logs.lines().filter(logged).count(), 1, "{logs}");
    parts.publish(&overflow).await;
    assert_eq!(drain(&parts).await.0, [1, 0, 0, 0]);
    assert_eq!(balance(&parts, &alice).await, eur(max - 2));
}

/// In memory: a consumer whose reply is lost after applying, and one that dies there (its task
/// aborted), leave the event at the front; taken again, it is found applied.
async fn a_consumer_that_dies_after_applying_leaves_the_balance_right(parts: Parts) {
    let alice = account(ALICE);
    let lost = succeeded("evt_lost_reply", &alice, 2500);
    let dead = succeeded("evt_dead", &alice, 700);
    let lose = Fault::FailAfterApplying { times: 1 };
    parts.balances.inject(&lost.id, lose);
    parts.balances.inject(&dead.id, Fault::HangAfterApplying);
    parts.publish(&lost).await;
    parts.publish(&dead).await;
    let dying = parts.consume(&CancellationToken::new());
    eventually("both applied", async || parts.balances.applied(&alice) == 2).await;
    dying.abort();
    assert!(dying.await.is_err_and(|err| err.is_cancelled()));
    assert_eq!(drain(&parts).await.0, [0, 1, 0, 0], "taken again");
    let attempts = [&lost, &dead].map(|event| parts.balances.attempts(&event.id));
    assert_eq!(attempts, [2, 2], "each taken again");
    assert_eq!(balance(&parts, &alice).await, eur(3200));
}

/// A stop while an event is being applied finishes that event, and leaves the rest.
async fn a_stop_finishes_the_event_at_hand(parts: Parts) {
    let alice = account(ALICE);
    let (at, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (reached, release) = (at.clone(), go.clone());
    let hold = Fault::Hold { reached, release };
    parts.balances.inject("evt_1", hold);
    for (id, amount) in [("evt_1", 100), ("evt_2", 20), ("evt_3", 3)] {
        parts.publish(&succeeded(id, &alice, amount)).await;
    }
    let stop = CancellationToken::new();
    let consumer = parts.consume(&stop);
    at.notified().await;
    stop.cancel();
    tokio::time::sleep(POLL).await; // the consumer sees the stop mid-apply
    go.notify_one();
    let stopped = did(consumer.await.expect("the consumer stops"));
    assert_eq!(stopped, [1, 0, 0, 0], "only the event at hand");
    assert_eq!(balance(&parts, &alice).await, eur(100));
    assert_eq!(drain(&parts).await.0, [2, 0, 0, 0]);
    assert_eq!(balance(&parts, &alice).await, eur(123));
}

/// A consumer whose connection dies mid-event (its id marked, its balance change waiting on a
/// lock) leaves nothing: another takes the next event past the held row, then that one, as new.
async fn a_consumer_whose_connection_dies_mid_event_leaves_it_to_another(parts: Parts) {
    let pool = parts.store.as_ref().expect("PostgreSQL").pool().clone();
    let (alice, bob) = (account(ALICE), account(BOB));
    parts.publish(&succeeded("evt_alice", &alice, 2500)).await;
    parts.publish(&succeeded("evt_bob", &bob, 700)).await;
    // Another transaction writes Alice's balance row: the first consumer waits for it.
    let mut writer = pool.begin().await.expect("a transaction");
    let hold = sqlx::query("INSERT INTO balances VALUES ($1, 'eur', 0)").bind(&alice);
    hold.execute(&mut *writer).await.expect("a row");
    let stop = CancellationToken::new();
    let dying = parts.consume(&stop);
    let mut pid: Option<i32> = None;
    eventually("the first consumer to wait at the balance", async || {
        let waiting = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()
             AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO balances%'",
        );
        pid = waiting.fetch_optional(&pool).await.expect("pids");
        pid.is_some()
    })
    .await;
    let other = parts.consume(&stop);
    let bob_applied = async || balance(&parts, &bob).await == eur(700);
    eventually("Bob's event, past the held one", bob_applied).await;
    dying.abort();
    let kill = sqlx::query("SELECT pg_terminate_backend($1)").bind(pid);
    kill.execute(&pool).await.expect("the connection dies");
    writer.rollback().await.expect("the row lock goes");
    eventually("the outbox to empty", async || parts.backlog().await == 0).await;
    stop.cancel();
    let done = did(other.await.expect("the other consumer stops"));
    assert_eq!(done, [2, 0, 0, 0], "Alice's as new");
    assert_eq!(balance(&parts, &alice).await, eur(2500));
}

/// Two consumers apply 1,000 events, 142 of them published twice, each once. They are published
/// while the consumers run, 100 a transaction: a copy is often in the transaction of its first.
async fn two_consumers_apply_1000_events_once_each(parts: Parts) {
    let pool = parts.store.as_ref().expect("PostgreSQL").pool().clone();
    let events: Vec<PaymentEvent> = (0..1000_usize)
        .map(|i| succeeded(&format!("evt_{i}"), ["a", "b"][i % 2], 1 + i as i64))
        .collect();
    let stop = CancellationToken::new();
    let (a, b) = (parts.consume(&stop), parts.consume(&stop));
    for (n, chunk) in events.chunks(100).enumerate() {
        let mut tx = pool.begin().await.expect("a transaction");
        for (i, event) in (n * 100..).zip(chunk) {
            let again = (i % 7 == 6).then(|| &events[i - 3]);
            for event in [Some(event), again].into_iter().flatten() {
                outbox::insert(&mut tx, event).await.expect("published");
            }
        }
        tx.commit().await.expect("committed");
    }
    eventually("the outbox to empty", async || parts.backlog().await == 0).await;
    stop.cancel();
    let (a, b) = (did(a.await.expect("one")), did(b.await.expect("two")));
    assert!(a[0] > 0 && b[0] > 0, "both took part: {a:?} {b:?}");
    let sum: Vec<usize> = a.iter().zip(b).map(|(a, b)| a + b).collect();
    assert_eq!(sum, [1000, 142, 0, 0], "{a:?} {b:?}");
    assert_eq!(balance(&parts, "a").await, eur(500 * 500), "1 + 3 + ...");
    assert_eq!(balance(&parts, "b").await, eur(500 * 501), "2 + 4 + ...");
    let marks = sqlx::query_scalar("SELECT count(*) FROM idempotency_records");
    let marks: i64 = marks.fetch_one(&pool).await.expect("the processed ids");
    assert_eq!(marks, 1000, "one processed id per event");
}

fn harness(parts: Parts) -> Harness {
    let records = (parts.store.clone())
        .map_or_else(|| Records::Memory(MemoryStore::new()), Records::Postgres);
    Harness::on(parts, records, WINDOW)
}

/// The `available` of what `GET /v1/balance` shows the caller.
async fn shown(h: &Harness, api_key: &str) -> Value {
    let reply = h.get("/v1/balance").auth(api_key).send().await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json["object"], "balance");
    reply.json["available"].clone()
}

/// Charges, a capture and a refund through the API reach the balance the API shows: each
/// write's event is in the outbox when it is answered, and a replay publishes none.
async fn charges_captures_and_refunds_reach_the_balance_shown(parts: Parts) {
    let h = harness(parts);
    let c1 = h.charge(ALICE, visa(2500)).await;
    let c1 = c1["id"].as_str().expect("an id");
    assert_eq!(h.parts.backlog().await, 1, "written with the charge");
    let c2 = h.authorized(ALICE, 1000).await;
    h.charge(BOB, visa(300)).await;
    for _ in 0..2 {
        let capture = h.post(&format!("/v1/charges/{c2}/capture")).auth(ALICE);
        let capture = capture.key("capture").json(json!({})).send().await;
        assert_eq!(capture.status, StatusCode::OK, "{}", capture.text());
        let refund = h.post(&format!("/v1/charges/{c1}/refunds")).auth(ALICE);
        let refund = refund.key("refund").json(json!({ "amount": 500 }));
        let refund = refund.send().await;
        assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());
        assert_eq!(h.parts.backlog().await, 5, "no event for a replay");
    }
    assert_eq!(drain(&h.parts).await.0, [5, 0, 0, 0]);
    assert_eq!(shown(&h, ALICE).await, json!(eur(2500 - 500 + 1000)));
    assert_eq!(shown(&h, BOB).await, json!(eur(300)));
    assert_eq!(shown(&h, "sk_test_carol").await, json!([]));
}

/// In PostgreSQL the event commits with the charge: a charge whose transaction rolled back (its
/// claim taken over while the provider answered) has no event, until the reconciler settles it.
async fn a_charge_whose_transaction_rolled_back_has_no_event(parts: Parts) {
    let h = harness(parts);
    let pool = h.parts.store.as_ref().expect("PostgreSQL").pool().clone();
    let stall = h.parts.probe.stall().await;
    let call = create_charge(&h.router, ALICE, "taken-over", &visa(2500));
    let call = tokio::spawn(call.send());
    let probe = &h.parts.probe;
    eventually("the call at the provider", async || probe.stalled() == 1).await;
    // The claim's lease ran out meanwhile, and another run claimed the key.
    let sql = "UPDATE idempotency_records SET token = decode(md5(''), 'hex')";
    sqlx::query(sql).execute(&pool).await.expect("taken over");
    drop(stall);
    let reply = call.await.expect("an answer");
    assert_eq!(reply.status.as_u16(), 503, "{}", reply.text());
    assert_eq!(probe.effects(), 1, "the provider charged");
    assert_eq!(h.parts.backlog().await, 0, "no event without the commit");
    let status = sqlx::query_scalar("SELECT status FROM charges");
    let status: String = status.fetch_one(&pool).await.expect("the charge");
    assert_eq!(status, "authorizing");
    h.reconcile_now().await;
    assert_eq!(drain(&h.parts).await.0, [1, 0, 0, 0]);
    assert_eq!(shown(&h, ALICE).await, json!(eur(2500)));
}

macro_rules! scenarios {
    ($module:ident, #[$test:meta], $parts:expr; $($scenario:ident),* $(,)?) => {
        mod $module {
            use super::*;
            $(#[$test] async fn $scenario() { super::$scenario($parts).await; })*
        }
    };
}

scenarios!(memory, #[tokio::test(start_paused = true)], Parts::memory(WINDOW);
    an_event_handed_out_again_changes_the_balance_once,
    a_failing_apply_is_retried_an_overflowing_one_is_not,
    a_consumer_that_dies_after_applying_leaves_the_balance_right,
    a_stop_finishes_the_event_at_hand,
    charges_captures_and_refunds_reach_the_balance_shown);

scenarios!(postgres, #[tokio::test(flavor = "multi_thread", worker_threads = 2)],
    Parts::postgres(&new_database().await.0, WINDOW);
    an_event_handed_out_again_changes_the_balance_once,
    a_failing_apply_is_retried_an_overflowing_one_is_not,
    a_consumer_whose_connection_dies_mid_event_leaves_it_to_another,
    two_consumers_apply_1000_events_once_each,
    charges_captures_and_refunds_reach_the_balance_shown,
    a_charge_whose_transaction_rolled_back_has_no_event);
