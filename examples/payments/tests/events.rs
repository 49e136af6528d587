//! Events and the idempotent consumer, in-process: every scenario runs on the in-memory queue
//! (on paused time) and on a Redis Stream (a private `redis-server` per test, real time with
//! short timeouts); the outbox's consumer on PostgreSQL.
//!
//! The consumer's records are kept by the crate's `Deduplicator` on a `MemoryStore` or a
//! `RedisStore`; the events go through the example's queue; the balances are the example's.

mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_server::RedisServer;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, RecordId, Store};
use tower_idempotency_redis::RedisStore;

use example_payments::app;
use example_payments::balance::{Applied, Available, BALANCES_PREFIX, BalanceError, Balances};
use example_payments::config::STREAM;
use example_payments::consumer::{self, Counts, Handled, LedgerConsumer, SCOPE, deduplicator};
use example_payments::events::{EventType, PaymentEvent};
use example_payments::outbox::{self, OutboxConsumer};
use example_payments::provider::WINDOW;
use example_payments::queue::{ConsumerConfig, QueueConsumer};
use example_payments::{balance::PgBalances, pg};
use support::api::{ALICE, BOB, Call, account, create_charge, visa};
use support::instruments::{CountingQueue, Fault};
use support::stack::Parts;

/// How long a message stays pending before another consumer takes it over, in these tests.
const MIN_IDLE: Duration = Duration::from_millis(300);
/// How long a receive waits for new messages, in these tests.
const BLOCK: Duration = Duration::from_millis(50);
/// How long a test waits for the consumers to get somewhere.
const PATIENCE: Duration = Duration::from_secs(60);

/// The example's components on one backend, and the consumers' store.
struct Env<St> {
    parts: Parts,
    /// The Deduplicator's store.
    store: St,
    /// A fresh idempotency store for the HTTP layer, in a namespace named by the argument.
    http_store: Box<dyn Fn(&str) -> St>,
    redis: Option<RedisServer>,
}

impl Env<MemoryStore> {
    fn memory() -> Self {
        Env {
            parts: Parts::memory(WINDOW),
            store: MemoryStore::new(),
            http_store: Box::new(|_| MemoryStore::new()),
            redis: None,
        }
    }
}

impl Env<RedisStore> {
    async fn redis() -> Self {
        let server = RedisServer::start();
        let url = server.url();
        let store = RedisStore::from_url(&url)
            .expect("a valid URL")
            .with_prefix(consumer::RECORDS_PREFIX);
        store.check().await.expect("the fixture's Redis answers");
        let conn = RedisStore::from_url(&url)
            .expect("a valid URL")
            .shared_connection();
        let http_url = url.clone();
        Env {
            parts: Parts::redis_events(&conn, WINDOW).await,
            store,
            http_store: Box::new(move |namespace| {
                RedisStore::from_url(&http_url)
                    .expect("a valid URL")
                    .with_prefix(format!("idempotency:{namespace}:"))
            }),
            redis: Some(server),
        }
    }
}

/// A consumer running in a task of its own.
struct Running {
    stop: CancellationToken,
    task: JoinHandle<Counts>,
}

impl Running {
    /// Stops the consumer the way SIGTERM does, and returns what it did.
    async fn stop(self) -> Counts {
        self.stop.cancel();
        self.task.await.expect("the consumer does not panic")
    }
}

impl<St: Store + Clone + 'static> Env<St> {
    fn config(&self) -> ConsumerConfig {
        ConsumerConfig::default().min_idle(MIN_IDLE).block(BLOCK)
    }

    fn queue(&self) -> &CountingQueue {
        self.parts.queue.as_deref().expect("a queue")
    }

    /// A consumer, and its end of the queue to receive and ack by hand.
    async fn consumer_with(
        &self,
        name: &str,
        config: ConsumerConfig,
    ) -> (LedgerConsumer<St>, Box<dyn QueueConsumer>) {
        let reads = self.queue().consumer_of(name, config).await;
        let dedup = deduplicator(self.store.clone(), config.min_idle);
        (
            LedgerConsumer::new(self.parts.balances.clone(), dedup),
            reads,
        )
    }

    async fn start(&self, name: &str) -> Running {
        let stop = CancellationToken::new();
        let task = (self.parts)
            .consume(name, self.store.clone(), self.config(), &stop)
            .await;
        Running { stop, task }
    }

    async fn publish(&self, event: &PaymentEvent) -> String {
        use example_payments::queue::Queue;
        self.queue()
            .publish(&event.to_json())
            .await
            .expect("the queue takes the event")
    }

    async fn balance(&self, account: &str) -> Vec<(i64, String)> {
        let available = (self.parts.balances.get(account))
            .await
            .expect("the balance is readable");
        available
            .into_iter()
            .map(|Available { amount, currency }| (amount, currency))
            .collect()
    }

    /// How many events the ledger records as applied to `account` (in Redis, its set's size).
    async fn applied_count(&self, account: &str) -> usize {
        match &self.redis {
            Some(redis) => {
                let key = format!("{BALANCES_PREFIX}{{{account}}}:applied");
                let count = redis.command(&["ZCARD", &key]).as_integer();
                usize::try_from(count.expect("a count")).expect("a size")
            }
            None => self.parts.balances.applied(account),
        }
    }

    async fn backlog(&self) -> usize {
        self.queue().backlog()
    }

    /// Waits until every message published so far is acknowledged.
    async fn drained(&self) {
        wait_for("the queue to drain", || async { self.backlog().await == 0 }).await;
    }
}

/// Polls `condition` every 10 ms for up to [`PATIENCE`].
async fn wait_for<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A `charge.succeeded` event of a captured charge.
fn captured(id: &str, account: &str, amount: i64, currency: &str) -> PaymentEvent {
    PaymentEvent {
        id: id.to_owned(),
        kind: EventType::Succeeded,
        account: account.to_owned(),
        amount,
        currency: currency.to_owned(),
        charge: format!("ch_{id}"),
        captured: true,
    }
}

fn eur(amount: i64) -> Vec<(i64, String)> {
    vec![(amount, "eur".to_owned())]
}

async fn redeliveries_change_the_balance_once<St: Store + Clone + 'static>(env: Env<St>) {
    for n in [2_u64, 10, 100] {
        let account = format!("acct_{n}");
        let event = captured(&format!("evt_{n}"), &account, 2500, "eur");
        let message = env.publish(&event).await;
        // Every receive takes the unacknowledged message over again at once.
        let config = env.config().min_idle(Duration::ZERO);
        let (consumer, mut reads) = env.consumer_with(&format!("consumer-{n}"), config).await;
        let mut handled = Vec::new();
        for delivery in 1..=n {
            let batch = reads.receive().await.expect("a receive");
            assert_eq!(batch.len(), 1, "delivery {delivery} of {n}: {batch:?}");
            assert_eq!(batch[0].id, message, "the same message");
            assert_eq!(
                env.queue().delivery_count(&message),
                Some(delivery),
                "delivered {delivery} times"
            );
            // Only the last delivery is acked, as if every ack before it were lost.
            handled.push(if delivery < n {
                consumer.handle(&batch[0]).await
            } else {
                consumer.finish(&mut *reads, &batch[0]).await
            });
        }
        assert_eq!(handled[0], Handled::Applied, "{n} deliveries");
        assert!(
            handled[1..].iter().all(|h| *h == Handled::Duplicate),
            "{handled:?}"
        );
        assert_eq!(env.queue().delivery_count(&message), None);
        assert_eq!(env.balance(&account).await, eur(2500), "{n} deliveries");

        // The same event published again (a handler that ran again): other messages, one event.
        for _ in 0..3 {
            env.publish(&event).await;
        }
        let mut copies = Vec::new();
        while copies.len() < 3 {
            for delivery in reads.receive().await.expect("a receive") {
                copies.push(consumer.finish(&mut *reads, &delivery).await);
            }
        }
        assert_eq!(copies, vec![Handled::Duplicate; 3]);
        assert_eq!(env.balance(&account).await, eur(2500), "{n} deliveries");
        assert_eq!(env.applied_count(&account).await, 1);
        assert_eq!(env.backlog().await, 0);
    }
}

async fn a_consumer_that_dies_before_acking_is_taken_over<St: Store + Clone + 'static>(
    env: Env<St>,
) {
    let event = captured("evt_1", &account(ALICE), 2500, "eur");
    let message = env.publish(&event).await;
    let (dying, mut reads) = env.consumer_with("dying", env.config()).await;
    let batch = reads.receive().await.expect("a receive");
    assert_eq!(batch.len(), 1);
    assert_eq!(dying.handle(&batch[0]).await, Handled::Applied);
    assert_eq!(env.balance(&account(ALICE)).await, eur(2500));
    // The process dies here: applied, recorded as done, never acked.
    drop((dying, reads));
    assert_eq!(env.queue().delivery_count(&message), Some(1));

    let survivor = env.start("survivor").await;
    env.drained().await;
    let counts = survivor.stop().await;
    assert_eq!(
        (counts.applied, counts.duplicates),
        (0, 1),
        "taken over and skipped: {counts:?}"
    );
    assert_eq!(env.balance(&account(ALICE)).await, eur(2500));
    assert_eq!(env.applied_count(&account(ALICE)).await, 1);
}

async fn a_consumer_that_dies_between_applying_and_recording_is_caught_by_the_ledger<
    St: Store + Clone + 'static,
>(
    env: Env<St>,
) {
    let event = captured("evt_1", &account(ALICE), 2500, "eur");
    env.parts
        .balances
        .inject(&event.id, Fault::HangAfterApplying);
    env.publish(&event).await;
    let dying = env.start("dying").await;
    wait_for("the ledger to apply the event", || async {
        env.balance(&account(ALICE)).await == eur(2500)
    })
    .await;
    // The process dies with the effect made, before the Deduplicator recorded it: only its claim
    // is left, and it expires with its lease.
    dying.task.abort();
    assert!(dying.task.await.is_err_and(|err| err.is_cancelled()));
    assert_eq!(env.backlog().await, 1, "the message is still pending");

    let survivor = env.start("survivor").await;
    env.drained().await;
    let counts = survivor.stop().await;
    assert_eq!(
        (counts.applied, counts.already_applied),
        (0, 1),
        "run again, and the ledger skipped it: {counts:?}"
    );
    assert_eq!(env.parts.balances.attempts(&event.id), 2);
    assert_eq!(env.balance(&account(ALICE)).await, eur(2500));
    assert_eq!(env.applied_count(&account(ALICE)).await, 1);
}

async fn two_consumers_apply_1000_events_once_each<St: Store + Clone + 'static>(env: Env<St>) {
    let accounts = ["acct_a", "acct_b", "acct_c"];
    let currencies = ["eur", "usd"];
    let mut expected: BTreeMap<&str, BTreeMap<&str, i64>> = BTreeMap::new();
    let mut events = Vec::new();
    let (mut failing, mut lost_replies) = (0, 0);
    for i in 0..1000_i64 {
        let account = accounts[(i % 3) as usize];
        let currency = currencies[((i / 3) % 2) as usize];
        let amount = 100 + i % 17;
        let mut event = captured(&format!("evt_{i}"), account, amount, currency);
        match i % 10 {
            5 => event.captured = false, // authorized only: no change
            9 => event.kind = EventType::Refunded,
            _ => {}
        }
        if let Some((_, change)) = event.balance_change() {
            *expected
                .entry(account)
                .or_default()
                .entry(currency)
                .or_default() += change;
        }
        match i % 50 {
            7 => {
                env.parts
                    .balances
                    .inject(&event.id, Fault::Fail { times: 1 });
                failing += 1;
            }
            23 => {
                env.parts
                    .balances
                    .inject(&event.id, Fault::FailAfterApplying { times: 1 });
                lost_replies += 1;
            }
            _ => {}
        }
        events.push(event);
    }

    let first = env.start("first").await;
    let second = env.start("second").await;
    for (i, event) in events.iter().enumerate() {
        env.publish(event).await;
        // Every 7th event is published again a little later, as a handler that ran twice would.
        if i % 7 == 6 {
            env.publish(&events[i - 3]).await;
        }
        if i % 10 == 9 {
            // Let the consumers in while publishing goes on (the in-memory queue never waits).
            tokio::task::yield_now().await;
        }
    }
    let published = env.queue().published();
    assert_eq!(published, 1000 + 142);
    env.drained().await;
    let (first, second) = (first.stop().await, second.stop().await);
    assert!(
        first.applied > 0 && second.applied > 0,
        "both consumers took part: {first:?} {second:?}"
    );
    let counts = first + second;

    for account in accounts {
        let want: Vec<(i64, String)> = expected[account]
            .iter()
            .map(|(currency, amount)| (*amount, (*currency).to_owned()))
            .collect();
        assert_eq!(env.balance(account).await, want, "{account}");
    }
    let mut applied = 0;
    for account in accounts {
        applied += env.applied_count(account).await;
    }
    assert_eq!(applied, 1000, "every event applied once in the ledger");
    // One apply per event made the change; those whose reply was lost were found applied by the
    // ledger on their next run. (At most: a Redis reply that timed out counts the same way.)
    assert!(counts.applied <= 1000 - lost_replies, "{counts:?}");
    assert!(
        counts.applied + counts.already_applied >= 1000,
        "{counts:?}"
    );
    assert!(counts.already_applied >= lost_replies, "{counts:?}");
    assert!(counts.failed >= failing + lost_replies, "{counts:?}");
    assert!(counts.duplicates >= 142, "{counts:?}");
    assert_eq!(counts.unreadable, 0, "{counts:?}");
}

async fn a_failing_apply_is_retried_on_redelivery_then_applied_once<St: Store + Clone + 'static>(
    env: Env<St>,
) {
    let failing = captured("evt_failing", &account(ALICE), 2500, "eur");
    let fine = captured("evt_fine", &account(ALICE), 700, "eur");
    env.parts
        .balances
        .inject(&failing.id, Fault::Fail { times: 2 });
    env.publish(&failing).await;
    env.publish(&fine).await;

    let consumer = env.start("consumer").await;
    env.drained().await;
    let counts = consumer.stop().await;
    // Not acked after a failure: delivered again, twice, and then applied.
    assert_eq!(env.parts.balances.attempts(&failing.id), 3);
    assert_eq!((counts.failed, counts.applied), (2, 2), "{counts:?}");
    assert_eq!(env.balance(&account(ALICE)).await, eur(3200));
    assert_eq!(env.applied_count(&account(ALICE)).await, 2);
}

async fn a_stop_finishes_the_message_at_hand<St: Store + Clone + 'static>(env: Env<St>) {
    let (reached, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let events = [
        captured("evt_1", &account(ALICE), 100, "eur"),
        captured("evt_2", &account(ALICE), 20, "eur"),
        captured("evt_3", &account(ALICE), 3, "eur"),
    ];
    env.parts.balances.inject(
        &events[0].id,
        Fault::Hold {
            reached: reached.clone(),
            release: release.clone(),
        },
    );
    for event in &events {
        env.publish(event).await;
    }
    let consumer = env.start("stopping").await;
    reached.notified().await;
    // SIGTERM while the first event is being applied.
    consumer.stop.cancel();
    release.notify_one();
    let counts = consumer.task.await.expect("the consumer stops cleanly");
    assert_eq!(counts.applied, 1, "only the message at hand: {counts:?}");
    assert_eq!(env.balance(&account(ALICE)).await, eur(100));
    assert_eq!(env.backlog().await, 2, "the rest waits in the queue");

    // The next consumer (the service restarted) takes over what was left.
    let next = env.start("next").await;
    env.drained().await;
    let counts = next.stop().await;
    assert_eq!(counts.applied, 2, "{counts:?}");
    assert_eq!(env.balance(&account(ALICE)).await, eur(123));
}

/// A `charge.refunded` event.
fn refunded(id: &str, account: &str, amount: i64, currency: &str) -> PaymentEvent {
    PaymentEvent {
        kind: EventType::Refunded,
        ..captured(id, account, amount, currency)
    }
}

async fn balances_never_wrap<St: Store + Clone + 'static>(env: Env<St>) {
    let max = captured("evt_max", &account(ALICE), i64::MAX, "eur");
    let one_more = captured("evt_one_more", &account(ALICE), 1, "eur");
    assert!(matches!(
        env.parts.balances.apply(&max).await,
        Ok(Applied::New)
    ));
    for _ in 0..2 {
        let overflow = env.parts.balances.apply(&one_more).await;
        assert!(
            matches!(&overflow, Err(BalanceError::Overflow { currency }) if currency == "eur"),
            "{overflow:?}"
        );
        assert_eq!(
            env.balance(&account(ALICE)).await,
            eur(i64::MAX),
            "unchanged"
        );
        assert_eq!(
            env.applied_count(&account(ALICE)).await,
            1,
            "not recorded as applied"
        );
    }
    // Once there is room, the same event applies.
    let refund = refunded("evt_refund", &account(ALICE), 1, "eur");
    assert!(matches!(
        env.parts.balances.apply(&refund).await,
        Ok(Applied::New)
    ));
    assert!(matches!(
        env.parts.balances.apply(&one_more).await,
        Ok(Applied::New)
    ));
    assert_eq!(env.balance(&account(ALICE)).await, eur(i64::MAX));

    // Below zero, too.
    let big_refund = refunded("evt_big_refund", &account(BOB), i64::MAX, "eur");
    let two_more = refunded("evt_two_more", &account(BOB), 2, "eur");
    assert!(matches!(
        env.parts.balances.apply(&big_refund).await,
        Ok(Applied::New)
    ));
    let underflow = env.parts.balances.apply(&two_more).await;
    assert!(
        matches!(&underflow, Err(BalanceError::Overflow { currency }) if currency == "eur"),
        "{underflow:?}"
    );
    assert_eq!(env.balance(&account(BOB)).await, eur(-i64::MAX));

    // An amount that is not positive is refused, even the one whose negation overflows.
    for amount in [0, -5, i64::MIN] {
        let refund = refunded("evt_not_positive", &account(BOB), amount, "eur");
        let refused = env.parts.balances.apply(&refund).await;
        assert!(
            matches!(refused, Err(BalanceError::InvalidAmount(a)) if a == amount),
            "{refused:?}"
        );
    }
    assert_eq!(env.balance(&account(BOB)).await, eur(-i64::MAX));
    assert_eq!(env.applied_count(&account(BOB)).await, 1);
}

async fn an_overflowing_event_is_dropped_not_retried<St: Store + Clone + 'static>(env: Env<St>) {
    env.publish(&captured("evt_max", &account(ALICE), i64::MAX, "eur"))
        .await;
    env.publish(&captured("evt_overflow", &account(ALICE), 1, "eur"))
        .await;
    env.publish(&refunded("evt_refund", &account(ALICE), 3, "eur"))
        .await;

    let consumer = env.start("consumer").await;
    env.drained().await;
    let counts = consumer.stop().await;
    assert_eq!(
        (counts.applied, counts.rejected, counts.failed),
        (2, 1, 0),
        "{counts:?}"
    );
    assert_eq!(env.balance(&account(ALICE)).await, eur(i64::MAX - 3));
    assert_eq!(env.applied_count(&account(ALICE)).await, 2);
}

async fn balance_json(router: &Router, api_key: &str) -> Value {
    let reply = Call::get(router, "/v1/balance").auth(api_key).send().await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    reply.json
}

async fn end_to_end_through_the_http_api<St: Store + Clone + 'static>(env: Env<St>) {
    let state = env.parts.state();
    let router = app(
        state.clone(),
        IdempotencyLayer::new(BoxStore::new((env.http_store)("http"))),
    );
    let consumer = env.start("ledger").await;

    let charge = |amount: i64, currency: &str, capture: bool| json!({ "amount": amount, "currency": currency, "source": "tok_visa", "capture": capture });
    let first = create_charge(&router, ALICE, "k1", &charge(2500, "eur", true))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let c1 = first.json["id"].as_str().unwrap().to_owned();
    let authorized = create_charge(&router, ALICE, "k2", &charge(1000, "eur", false))
        .send()
        .await;
    assert_eq!(authorized.json["status"], "authorized");
    let c2 = authorized.json["id"].as_str().unwrap().to_owned();
    create_charge(&router, BOB, "k1", &charge(300, "eur", true))
        .send()
        .await;
    create_charge(&router, ALICE, "k3", &charge(700, "usd", true))
        .send()
        .await;
    // Replays: the layer answers, no handler runs, nothing is published.
    let replay = create_charge(&router, ALICE, "k1", &charge(2500, "eur", true))
        .send()
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.json, first.json);
    env.drained().await;

    // The authorized charge does not count until it is captured.
    assert_eq!(
        balance_json(&router, ALICE).await,
        json!({
            "object": "balance",
            "available": [{ "amount": 2500, "currency": "eur" }, { "amount": 700, "currency": "usd" }],
        })
    );
    assert_eq!(
        balance_json(&router, BOB).await,
        json!({ "object": "balance", "available": [{ "amount": 300, "currency": "eur" }] })
    );

    for _ in 0..2 {
        let captured = Call::post(&router, &format!("/v1/charges/{c2}/capture"))
            .auth(ALICE)
            .key("k4")
            .json(json!({}))
            .send()
            .await;
        assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
        let refund = Call::post(&router, &format!("/v1/charges/{c1}/refunds"))
            .auth(ALICE)
            .key("k5")
            .json(json!({ "amount": 500 }))
            .send()
            .await;
        assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());
    }
    assert_eq!(env.queue().published(), 6);

    // The idempotency records are lost: the create runs again, the provider answers with the same
    // payment, and the same event is published again.
    let forgetful = app(
        state,
        IdempotencyLayer::new(BoxStore::new((env.http_store)("lost"))),
    );
    let again = create_charge(&forgetful, ALICE, "k1", &charge(2500, "eur", true))
        .send()
        .await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text());
    assert!(!again.replayed(), "the handler ran again");
    assert_eq!(again.json["id"], c1.as_str());
    assert_eq!(env.queue().published(), 7);
    env.drained().await;

    assert_eq!(
        balance_json(&router, ALICE).await,
        json!({
            "object": "balance",
            "available": [{ "amount": 3000, "currency": "eur" }, { "amount": 700, "currency": "usd" }],
        })
    );
    assert_eq!(
        balance_json(&router, BOB).await,
        json!({ "object": "balance", "available": [{ "amount": 300, "currency": "eur" }] })
    );
    assert_eq!(
        balance_json(&router, "sk_test_carol").await,
        json!({ "object": "balance", "available": [] })
    );
    let anonymous = Call::get(&router, "/v1/balance").send().await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    let counts = consumer.stop().await;
    assert_eq!(counts.applied, 6, "{counts:?}");
    assert_eq!(counts.duplicates, 1, "the republished event: {counts:?}");
    assert_eq!(env.applied_count(&account(ALICE)).await, 5);

    if let Some(redis) = &env.redis {
        // The stream and the balances are kept; idempotency records and applied-event sets expire.
        let mut durable = vec![
            format!("{BALANCES_PREFIX}{{{}}}:available", account(ALICE)),
            format!("{BALANCES_PREFIX}{{{}}}:available", account(BOB)),
            STREAM.to_owned(),
        ];
        durable.sort();
        assert_eq!(redis.keys_without_ttl(), durable);
        // The accounts' ids name their keys, never their API keys.
        for key in redis.keys() {
            assert!(!key.contains(ALICE) && !key.contains(BOB), "{key}");
        }
    }
}

macro_rules! on_both_queues {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(start_paused = true)]
                async fn $scenario() {
                    super::$scenario(super::Env::memory()).await;
                }
            )*
        }

        mod redis {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(super::Env::redis().await).await;
                }
            )*
        }
    };
}

on_both_queues!(
    redeliveries_change_the_balance_once,
    a_consumer_that_dies_before_acking_is_taken_over,
    a_consumer_that_dies_between_applying_and_recording_is_caught_by_the_ledger,
    two_consumers_apply_1000_events_once_each,
    a_failing_apply_is_retried_on_redelivery_then_applied_once,
    a_stop_finishes_the_message_at_hand,
    end_to_end_through_the_http_api,
    balances_never_wrap,
    an_overflowing_event_is_dropped_not_retried,
);

/// While the stream's Redis is stalled, every charge is answered after at most one publish
/// timeout: no charge waits for another's publish. The events wait in the outbox and reach the
/// ledger once Redis is back.
#[tokio::test]
async fn a_stalled_redis_does_not_serialise_charges() {
    const CHARGES: usize = 20;
    const STALL: Duration = Duration::from_secs(3);
    // The queue's 1 s bound on a publish, and a margin for a loaded machine.
    const ANSWER_BOUND: Duration = Duration::from_millis(2000);
    let env = Env::redis().await;
    let redis = env.redis.as_ref().expect("a Redis environment");
    let router = app(
        env.parts.state(),
        IdempotencyLayer::new(BoxStore::new(MemoryStore::new())),
    );
    let consumer = env.start("ledger").await;
    let relay_stop = CancellationToken::new();
    let events = env.parts.events.clone().expect("a publisher");
    let relay = tokio::spawn(events.relay(relay_stop.clone()));
    let warm_up = create_charge(&router, ALICE, "warm-up", &visa(1000))
        .send()
        .await;
    assert_eq!(warm_up.status, StatusCode::CREATED, "{}", warm_up.text());

    redis.pause();
    let stalled_at = tokio::time::Instant::now();
    let charges: Vec<_> = (0..CHARGES)
        .map(|n| {
            let router = router.clone();
            tokio::spawn(async move {
                let reply = create_charge(&router, ALICE, &format!("stall-{n}"), &visa(1000))
                    .send()
                    .await;
                (reply.status, stalled_at.elapsed())
            })
        })
        .collect();
    tokio::time::sleep_until(stalled_at + STALL).await;
    let finished_in_stall = charges.iter().filter(|charge| charge.is_finished()).count();
    redis.resume();

    let mut latencies = Vec::new();
    for charge in charges {
        let (status, elapsed) = charge.await.expect("the request task");
        assert_eq!(status, StatusCode::CREATED);
        latencies.push(elapsed);
    }
    latencies.sort();
    assert_eq!(
        finished_in_stall, CHARGES,
        "charges answered during the {STALL:?} stall: {finished_in_stall} of {CHARGES}; \
         answered after {latencies:?}"
    );
    let slowest = latencies.last().copied().unwrap_or_default();
    assert!(
        slowest <= ANSWER_BOUND,
        "the slowest charge took {slowest:?}: {latencies:?}"
    );

    // Nothing was lost: the outbox sent the events once Redis was back.
    wait_for("the stalled charges' events", || async {
        env.balance(&account(ALICE)).await == eur(1000 * (CHARGES as i64 + 1))
    })
    .await;
    relay_stop.cancel();
    relay.await.expect("the relay does not panic");
    let counts = consumer.stop().await;
    assert_eq!(counts.applied, CHARGES + 1, "{counts:?}");
}

/// Redis restarts empty: the stream, the consumer group and the balances are gone. The consumer
/// creates its group again and applies the events published since.
#[tokio::test]
async fn the_consumer_resumes_after_redis_restarts_empty() {
    // The consumer's longest pause between receives is 5 s; this is that and a margin.
    const RESUME_BOUND: Duration = Duration::from_secs(8);
    let mut env = Env::redis().await;
    let router = app(
        env.parts.state(),
        IdempotencyLayer::new(BoxStore::new(MemoryStore::new())),
    );
    let consumer = env.start("ledger").await;
    let relay_stop = CancellationToken::new();
    let events = env.parts.events.clone().expect("a publisher");
    let relay = tokio::spawn(events.relay(relay_stop.clone()));
    let before = create_charge(&router, ALICE, "before", &visa(1000))
        .send()
        .await;
    assert_eq!(before.status, StatusCode::CREATED, "{}", before.text());
    env.drained().await;
    assert_eq!(env.balance(&account(ALICE)).await, eur(1000));

    env.redis.as_mut().expect("a Redis environment").restart();
    let restarted_at = tokio::time::Instant::now();
    let after = create_charge(&router, ALICE, "after", &visa(1000))
        .send()
        .await;
    assert_eq!(after.status, StatusCode::CREATED, "{}", after.text());
    while env
        .parts
        .balances
        .get(&account(ALICE))
        .await
        .ok()
        .map(|available| available.len())
        != Some(1)
    {
        assert!(
            restarted_at.elapsed() < RESUME_BOUND,
            "no balance {RESUME_BOUND:?} after the restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.balance(&account(ALICE)).await,
        eur(1000),
        "the charge made after the restart"
    );

    relay_stop.cancel();
    relay.await.expect("the relay does not panic");
    let counts = consumer.stop().await;
    assert_eq!(counts.applied, 2, "{counts:?}");
}

/// The outbox's consumer on PostgreSQL applies every event once: a consumer that dies in the
/// middle of an event (its id recorded as processed, its balance change held up by a lock, nothing
/// committed) leaves it to the next one, two consumers share the rest, and events published twice
/// change the balance once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outbox_event_is_applied_once_across_consumer_restarts() {
    let server = PostgresServer::start();
    let store = pg::connect(&server.url()).await.expect("the database");
    let pool = store.pool().clone();
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
    let mut conn = pool.acquire().await.expect("a connection");
    for event in events.iter().chain(&events[5..10]) {
        outbox::insert(&mut conn, event).await.expect("published");
    }
    drop(conn);
    let total: i64 = (1..=40).sum();
    let mut admin = PgConnection::connect(&server.url())
        .await
        .expect("an admin connection");

    // The first consumer takes the first event and applies it, held up before it commits (the
    // balances locked), and dies there.
    let mut lock = PgConnection::connect(&server.url())
        .await
        .expect("a connection");
    for sql in ["BEGIN", "LOCK TABLE balances IN EXCLUSIVE MODE"] {
        sqlx::query(sql).execute(&mut lock).await.expect(sql);
    }
    let poll = Duration::from_millis(20);
    let consumer = || OutboxConsumer::new(pool.clone(), PgBalances::new(store.clone()), poll);
    let stop = CancellationToken::new();
    let dying = tokio::spawn(consumer().run(stop.clone()));
    // Taken: the first row is locked, and a look that skips locked rows finds the second.
    let deadline = StdInstant::now() + PATIENCE;
    loop {
        let free: i64 = sqlx::query_scalar(
            "SELECT seq FROM payment_events ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED",
        )
        .fetch_one(&mut admin)
        .await
        .expect("a row");
        let first: i64 = sqlx::query_scalar("SELECT min(seq) FROM payment_events")
            .fetch_one(&mut admin)
            .await
            .expect("a row");
        if free != first {
            break;
        }
        assert!(
            StdInstant::now() < deadline,
            "the first event was never taken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dying.abort();
    assert!(dying.await.is_err_and(|err| err.is_cancelled()));
    sqlx::query("COMMIT")
        .execute(&mut lock)
        .await
        .expect("the lock goes");

    let consumers: Vec<_> = (0..2)
        .map(|_| tokio::spawn(consumer().run(stop.clone())))
        .collect();
    let deadline = StdInstant::now() + PATIENCE;
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
            .fetch_one(&mut admin)
            .await
            .expect("a count");
        if left == 0 {
            break;
        }
        assert!(StdInstant::now() < deadline, "{left} events never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    let mut counts = Counts::default();
    for consumer in consumers {
        counts = counts + consumer.await.expect("a consumer");
    }
    assert_eq!(
        (counts.applied, counts.already_applied, counts.duplicates),
        (40, 5, 0),
        "{counts:?}"
    );
    let balance = PgBalances::new(store.clone())
        .get(&alice)
        .await
        .expect("a balance");
    assert_eq!(balance.len(), 1);
    assert_eq!(balance[0].amount, total, "each event applied once");

    // Each id is recorded as processed, in the store's table.
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
