//! The idempotent consumer on every store: the memory store on paused time, Redis on a
//! `redis-server` of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tower_idempotency::MemoryStore;
use tower_idempotency::consumer::{DedupError, Deduplicator, Processed};
use tower_idempotency::record::{Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency_redis::RedisStore;

/// Applies an event's amount to a balance and counts the applications.
#[derive(Clone, Default)]
struct Ledger {
    balance: Arc<AtomicUsize>,
    applied: Arc<AtomicUsize>,
}

impl Ledger {
    async fn apply(&self, amount: usize) -> Result<(), std::convert::Infallible> {
        self.balance.fetch_add(amount, Ordering::SeqCst);
        self.applied.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn balance(&self) -> usize {
        self.balance.load(Ordering::SeqCst)
    }
}

async fn redeliveries_change_the_balance_once<St: Store + Clone>(store: St) {
    for deliveries in [2, 10, 100] {
        let dedup = Deduplicator::new(store.clone(), format!("ledger-{deliveries}"));
        let ledger = Ledger::default();
        let mut outcomes = Vec::new();
        for _ in 0..deliveries {
            outcomes.push(dedup.process("evt_1", || ledger.apply(250)).await.unwrap());
        }
        assert_eq!(ledger.balance(), 250, "{deliveries} deliveries");
        assert_eq!(outcomes[0], Processed::Done(()));
        assert!(outcomes[1..].iter().all(|o| *o == Processed::Duplicate));
    }
}

async fn a_failed_attempt_is_retried_then_applied_once<St: Store + Clone>(store: St) {
    let dedup = Deduplicator::new(store, "ledger");
    let ledger = Ledger::default();
    let failed = dedup
        .process("evt_1", || async { Err::<(), _>("database down") })
        .await;
    assert!(matches!(failed, Err(DedupError::Failed("database down"))));
    let panicked = dedup
        .process("evt_1", || async {
            panic!("bug in the consumer");
            #[allow(unreachable_code)]
            Ok::<(), std::convert::Infallible>(())
        })
        .await;
    assert!(matches!(&panicked, Err(DedupError::Panicked(m)) if m.contains("bug in the consumer")));
    assert_eq!(
        dedup.process("evt_1", || ledger.apply(100)).await.unwrap(),
        Processed::Done(())
    );
    assert_eq!(
        dedup.process("evt_1", || ledger.apply(100)).await.unwrap(),
        Processed::Duplicate
    );
    assert_eq!(ledger.balance(), 100);
}

async fn a_concurrent_delivery_waits_for_the_first_and_never_runs_beside_it<St: Store + Clone>(
    store: St,
) {
    let first = Deduplicator::new(store.clone(), "ledger");
    let second = Deduplicator::new(store.clone(), "ledger");
    let ledger = Ledger::default();
    let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let running = tokio::spawn({
        let (ledger, started, finish) = (ledger.clone(), started.clone(), finish.clone());
        async move {
            first
                .process("evt_1", || async {
                    started.notify_one();
                    finish.notified().await;
                    ledger.apply(100).await
                })
                .await
        }
    });
    started.notified().await;
    // Another consumer of the group gets the same message meanwhile: it must not run it.
    let impatient = Deduplicator::new(store, "ledger").max_wait(Duration::ZERO);
    assert_eq!(
        impatient
            .process("evt_1", || ledger.apply(100))
            .await
            .unwrap(),
        Processed::InProgress
    );
    let waiting = tokio::spawn({
        let ledger = ledger.clone();
        async move { second.process("evt_1", || ledger.apply(100)).await }
    });
    tokio::task::yield_now().await;
    finish.notify_one();
    assert_eq!(running.await.unwrap().unwrap(), Processed::Done(()));
    assert_eq!(waiting.await.unwrap().unwrap(), Processed::Duplicate);
    assert_eq!(ledger.balance(), 100);
}

async fn long_work_keeps_its_claim<St: Store + Clone>(store: St, lease: Duration) {
    let ledger = Ledger::default();
    let first = Deduplicator::new(store.clone(), "ledger").lease(lease);
    let running = tokio::spawn({
        let ledger = ledger.clone();
        async move {
            first
                .process("evt_1", || async {
                    // Three leases long: without renewal the claim would expire twice over.
                    tokio::time::sleep(lease * 3).await;
                    ledger.apply(100).await
                })
                .await
        }
    });
    tokio::time::sleep(lease * 2).await;
    let other = Deduplicator::new(store, "ledger")
        .lease(lease)
        .max_wait(Duration::ZERO);
    assert_eq!(
        other.process("evt_1", || ledger.apply(100)).await.unwrap(),
        Processed::InProgress
    );
    assert_eq!(running.await.unwrap().unwrap(), Processed::Done(()));
    assert_eq!(ledger.balance(), 100);
}

/// A consumer that died holding a message's claim (it never completes nor releases it) holds it
/// only for its lease: the next consumer takes the message over, and its effect happens once.
async fn a_dead_consumers_message_is_taken_over<St: Store + Clone>(store: St, lease: Duration) {
    // What a consumer that crashed after claiming leaves behind: the claim, and nothing else.
    let id = RecordId::for_message(b"ledger", "evt_1");
    let fingerprint = Fingerprint::from_bytes([0; 32]);
    let claim = store.claim(&id, &fingerprint, lease).await.unwrap();
    assert!(matches!(claim, Claim::Claimed(_)), "{claim:?}");

    let ledger = Ledger::default();
    let impatient = Deduplicator::new(store.clone(), "ledger").max_wait(Duration::ZERO);
    assert_eq!(
        impatient
            .process("evt_1", || ledger.apply(100))
            .await
            .unwrap(),
        Processed::InProgress,
        "while the dead consumer's lease lasts, the message is in progress"
    );
    let next = Deduplicator::new(store, "ledger")
        .lease(lease)
        .max_wait(lease * 4);
    assert_eq!(
        next.process("evt_1", || ledger.apply(100)).await.unwrap(),
        Processed::Done(()),
        "taken over once the lease ran out"
    );
    assert_eq!(
        next.process("evt_1", || ledger.apply(100)).await.unwrap(),
        Processed::Duplicate
    );
    assert_eq!(ledger.balance(), 100);
}

async fn many_events_with_redeliveries_across_two_consumers<St: Store + Clone>(store: St) {
    let ledger = Ledger::default();
    let consumers = [
        Deduplicator::new(store.clone(), "ledger"),
        Deduplicator::new(store, "ledger"),
    ];
    // 1,000 events; every third is delivered again, every seventh a third time, to either consumer.
    let mut deliveries: Vec<usize> = (0..1000).collect();
    deliveries.extend((0..1000).step_by(3));
    deliveries.extend((0..1000).step_by(7));
    let tasks: Vec<_> = deliveries
        .into_iter()
        .enumerate()
        .map(|(n, event)| {
            let dedup = consumers[n % 2].clone();
            let ledger = ledger.clone();
            tokio::spawn(async move {
                dedup
                    .process(&format!("evt_{event}"), || ledger.apply(event))
                    .await
            })
        })
        .collect();
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        assert!(
            matches!(outcome, Processed::Done(()) | Processed::Duplicate),
            "{outcome:?}"
        );
    }
    assert_eq!(
        ledger.applied.load(Ordering::SeqCst),
        1000,
        "every event applied exactly once"
    );
    assert_eq!(ledger.balance(), (0..1000).sum::<usize>());
}

mod memory {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn redeliveries_change_the_balance_once() {
        super::redeliveries_change_the_balance_once(MemoryStore::new()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_attempt_is_retried_then_applied_once() {
        super::a_failed_attempt_is_retried_then_applied_once(MemoryStore::new()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_concurrent_delivery_waits_for_the_first_and_never_runs_beside_it() {
        super::a_concurrent_delivery_waits_for_the_first_and_never_runs_beside_it(
            MemoryStore::new(),
        )
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn long_work_keeps_its_claim() {
        super::long_work_keeps_its_claim(MemoryStore::new(), Duration::from_secs(30)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_consumers_message_is_taken_over() {
        let lease = Duration::from_secs(5);
        super::a_dead_consumers_message_is_taken_over(MemoryStore::new(), lease).await;
    }

    #[tokio::test(start_paused = true)]
    async fn many_events_with_redeliveries_across_two_consumers() {
        super::many_events_with_redeliveries_across_two_consumers(MemoryStore::new()).await;
    }

    /// A consumer sharing a store with the HTTP layer never mistakes an HTTP key for a message id,
    /// even when an account is named like the consumer's scope.
    #[tokio::test(start_paused = true)]
    async fn message_ids_and_http_keys_never_collide() {
        use axum::{Router, body::Body, routing::post};
        use tower::ServiceExt;
        use tower_idempotency::{IdempotencyLayer, Scope};

        let store = MemoryStore::new();
        let app = Router::new().route("/", post(|| async { "ok" })).layer(
            IdempotencyLayer::new(store.clone())
                .scope(|_: &http::request::Parts| Ok(Scope::from("ledger"))),
        );
        let request = http::Request::post("/")
            .header("idempotency-key", "evt_1")
            .body(Body::empty())
            .unwrap();
        assert_eq!(
            app.oneshot(request).await.unwrap().status(),
            http::StatusCode::OK
        );

        let ledger = Ledger::default();
        let dedup = Deduplicator::new(store, "ledger");
        assert_eq!(
            dedup.process("evt_1", || ledger.apply(5)).await.unwrap(),
            Processed::Done(())
        );
        assert_eq!(ledger.balance(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_processed_id_is_new_again_after_the_window() {
        let dedup =
            Deduplicator::new(MemoryStore::new(), "ledger").dedup_window(Duration::from_secs(60));
        let ledger = Ledger::default();
        dedup.process("evt_1", || ledger.apply(1)).await.unwrap();
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(
            dedup.process("evt_1", || ledger.apply(1)).await.unwrap(),
            Processed::Duplicate
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            dedup.process("evt_1", || ledger.apply(1)).await.unwrap(),
            Processed::Done(())
        );
        assert_eq!(ledger.balance(), 2);
    }
}

mod redis {
    use super::*;
    use test_servers::redis_server::RedisServer;

    fn store(server: &RedisServer) -> RedisStore {
        RedisStore::from_url(&server.url()).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_change_the_balance_once() {
        let server = RedisServer::start();
        super::redeliveries_change_the_balance_once(store(&server)).await;
        assert!(server.keys_without_ttl().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_attempt_is_retried_then_applied_once() {
        let server = RedisServer::start();
        super::a_failed_attempt_is_retried_then_applied_once(store(&server)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrent_delivery_waits_for_the_first_and_never_runs_beside_it() {
        let server = RedisServer::start();
        super::a_concurrent_delivery_waits_for_the_first_and_never_runs_beside_it(store(&server))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_work_keeps_its_claim() {
        let server = RedisServer::start();
        super::long_work_keeps_its_claim(store(&server), Duration::from_millis(300)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_consumers_message_is_taken_over() {
        let server = RedisServer::start();
        super::a_dead_consumers_message_is_taken_over(store(&server), Duration::from_millis(300))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_events_with_redeliveries_across_two_consumers() {
        let server = RedisServer::start();
        super::many_events_with_redeliveries_across_two_consumers(store(&server)).await;
        assert!(server.keys_without_ttl().is_empty());
    }
}

/// The consumer on a Redis Cluster of three masters and three replicas: the message ids of one
/// consumer spread over every master.
mod cluster {
    use super::*;
    use test_servers::redis_cluster::RedisCluster;

    fn store(prefix: &str) -> RedisStore {
        RedisStore::cluster(RedisCluster::shared().urls())
            .unwrap()
            .with_prefix(prefix)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_change_the_balance_once() {
        super::redeliveries_change_the_balance_once(store("redeliveries:")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_events_with_redeliveries_across_two_consumers() {
        super::many_events_with_redeliveries_across_two_consumers(store("many:")).await;
        assert!(RedisCluster::shared().keys_without_ttl().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_consumers_message_is_taken_over() {
        let lease = Duration::from_millis(300);
        super::a_dead_consumers_message_is_taken_over(store("dead:"), lease).await;
    }
}

/// A message whose work is done is recorded at once: the first write of its record waits for
/// nothing (only a write that failed before waits before it is tried again). PROTOCOL.md §9.5,
/// §11.2.
#[tokio::test(start_paused = true)]
async fn a_processed_message_is_recorded_without_a_pause() {
    let dedup = Deduplicator::new(MemoryStore::new(), "ledger");
    let started = tokio::time::Instant::now();
    let processed = dedup
        .process("evt_1", || async { Ok::<_, std::convert::Infallible>(()) })
        .await;
    assert!(processed.is_ok(), "{processed:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "recorded after {:?}",
        started.elapsed()
    );
}
