//! Redis stalls (SIGSTOP) that span a completion, with a client retrying against a second
//! instance meanwhile: the handler runs once, and the retry gets the first response. And claims
//! that time out in a stall: none leaves its key claimed once Redis answers again.
//!
//! Each test runs its own `redis-server` (`test_servers::RedisServer`) on real time: Redis keeps
//! its own clock, and the point is what a real stall does to real leases.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use test_servers::redis_server::RedisServer;
use tower::ServiceExt;
use tower_idempotency::record::{Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store, StoreError};
use tower_idempotency::{IdempotencyLayer, Outcome, Shutdown};
use tower_idempotency_redis::RedisStore;

/// How long the handler takes: the stall starts while it runs and spans its completion.
const HANDLER: Duration = Duration::from_secs(2);
/// When the stall starts, from the first request.
const STALL_START: Duration = Duration::from_millis(500);
/// How often the client retries.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// One server instance: its own store, pool and layer on the shared Redis, and a handler whose
/// runs are counted across instances.
#[derive(Clone)]
struct Instance {
    app: Router,
    pending: Shutdown,
}

impl Instance {
    fn new(server: &RedisServer, lease: Duration, runs: &Arc<AtomicUsize>) -> Self {
        let store = RedisStore::from_url(&server.url()).expect("a valid url");
        let layer = IdempotencyLayer::new(store).lease(lease);
        let pending = layer.shutdown_handle();
        let runs = runs.clone();
        let app = Router::new()
            .route(
                "/charges",
                post(move |body: String| {
                    let runs = runs.clone();
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        tokio::time::sleep(HANDLER).await;
                        (StatusCode::CREATED, format!("charge ch_{n} for {body}"))
                    }
                }),
            )
            .layer(layer);
        Self { app, pending }
    }

    async fn send(&self, key: &str) -> (StatusCode, Option<Outcome>, String) {
        let request = Request::post("/charges")
            .header("idempotency-key", key)
            .body(Body::from("100 EUR"))
            .expect("a request");
        let response = self.app.clone().oneshot(request).await.expect("infallible");
        let status = response.status();
        let outcome = response.extensions().get::<Outcome>().copied();
        let body = response.into_body().collect().await.expect("a body");
        let body = String::from_utf8_lossy(&body.to_bytes()).into_owned();
        (status, outcome, body)
    }
}

/// Two instances on `server`, both connected before anything stalls (as running servers would
/// be), and the count of the handler's runs across them, from zero.
async fn two_instances(
    server: &RedisServer,
    lease: Duration,
) -> (Instance, Instance, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let (a, b) = (
        Instance::new(server, lease, &runs),
        Instance::new(server, lease, &runs),
    );
    for (instance, key) in [(&a, "warm-a"), (&b, "warm-b")] {
        assert_eq!(instance.send(key).await.0, StatusCode::CREATED);
    }
    runs.store(0, Ordering::SeqCst);
    (a, b, runs)
}

/// Instance A runs a charge; Redis stalls from 0.5 s for `stall`, spanning A's completion, while
/// the client retries every 0.5 s through a load balancer that alternates between A and B. Until
/// a replay, every answer must be a refusal (503 while Redis is stalled, 409 while the claim is
/// still in flight), and the replay must come within `replay_within` of Redis coming back.
///
/// The first retry reaches A while its handler still runs: its claim times out, and A replaces
/// its connection, so A's completion goes out on a fresh connection that cannot be set up until
/// Redis is back. Nothing A sent before then can land later by itself.
async fn stall_spanning_the_completion(stall: Duration, replay_within: Duration) {
    let server = RedisServer::start();
    let (a, b, runs) = two_instances(&server, Duration::from_secs(30)).await;

    let started = Instant::now();
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.send("order-1").await }
    });
    tokio::time::sleep(STALL_START).await;
    server.pause();
    let balanced = [&a, &b];
    let mut answers = Vec::new();
    while started.elapsed() < STALL_START + stall {
        let (status, outcome, _) = balanced[answers.len() % 2].send("order-1").await;
        answers.push((status, outcome));
        tokio::time::sleep(RETRY_EVERY).await;
    }
    server.resume();
    let resumed = Instant::now();

    let (status, outcome, first_body) = first.await.expect("the first request");
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    let replay = loop {
        let (status, outcome, body) = balanced[answers.len() % 2].send("order-1").await;
        if outcome == Some(Outcome::Replayed) {
            break (status, body);
        }
        answers.push((status, outcome));
        assert!(
            resumed.elapsed() < replay_within,
            "no replay within {replay_within:?} of Redis coming back; answers: {answers:?}"
        );
        tokio::time::sleep(RETRY_EVERY).await;
    };
    assert_eq!(replay, (StatusCode::CREATED, first_body));
    for (status, outcome) in &answers {
        assert!(
            matches!(
                (status, outcome),
                (
                    &StatusCode::SERVICE_UNAVAILABLE,
                    Some(Outcome::StoreUnavailable)
                ) | (&StatusCode::CONFLICT, Some(Outcome::InFlight))
            ),
            "a retry during the stall got {status} {outcome:?}; all: {answers:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the charge ran once");
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_8_s_stall_spanning_the_completion_runs_the_handler_once() {
    stall_spanning_the_completion(Duration::from_secs(8), Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20_s_stall_spanning_the_completion_runs_the_handler_once() {
    stall_spanning_the_completion(Duration::from_secs(20), Duration::from_secs(5)).await;
}

/// A stall longer than the lease: the claim runs out while Redis is away. As the protocol says,
/// the owner's completion still lands once Redis answers (the key has no record, and the handler
/// did run), so a retry that comes after it gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_longer_than_the_lease_still_stores_the_result() {
    let server = RedisServer::start();
    let lease = Duration::from_secs(3);
    let (a, b, runs) = two_instances(&server, lease).await;

    let first = tokio::spawn({
        let a = a.clone();
        async move { a.send("order-1").await }
    });
    tokio::time::sleep(STALL_START).await;
    server.pause();
    tokio::time::sleep(lease * 2).await;
    server.resume();

    let (status, _, first_body) = first.await.expect("the first request");
    assert_eq!(status, StatusCode::CREATED);
    tokio::time::timeout(Duration::from_secs(5), a.pending.clone().wait())
        .await
        .expect("the pending completion lands once Redis is back");
    let (status, outcome, body) = b.send("order-1").await;
    assert_eq!(
        (status, outcome, body),
        (StatusCode::CREATED, Some(Outcome::Replayed), first_body)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the charge ran once");
    assert_eq!(server.keys_without_ttl(), Vec::<String>::new());
}

/// Claims that time out while Redis is stalled answer 503, and leave no key claimed once it
/// answers again (PROTOCOL.md §10.6): the first went out on its own, the others in a pipeline
/// behind it, and Redis runs them all when it resumes; each is released behind its claim, or its
/// key stays claimed by nobody for a whole lease, and every retry gets a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_timed_out_in_a_stall_leave_no_key_claimed() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url())
        .expect("a valid url")
        .with_timeout(Duration::from_millis(300));
    let fingerprint = Fingerprint::from_bytes([4; 32]);
    let lease = Duration::from_secs(30);
    let claim = |n: usize| {
        let store = store.clone();
        async move {
            let id = RecordId::new(b"", &format!("stalled-{n}"));
            store.claim(&id, &fingerprint, lease).await
        }
    };
    // Connected, and the claim script loaded, before the stall.
    assert!(matches!(claim(0).await, Ok(Claim::Claimed(_))));

    server.pause();
    let mut alone = std::pin::pin!(claim(1));
    assert!(
        std::future::poll_fn(|cx| Poll::Ready(alone.as_mut().poll(cx)))
            .await
            .is_pending(),
        "the first claim is on its way"
    );
    let batched: Vec<_> = (2..5).map(|n| tokio::spawn(claim(n))).collect();
    let mut answers = vec![alone.await];
    for claim in batched {
        answers.push(claim.await.expect("a claim"));
    }
    server.resume();
    for answer in &answers {
        assert!(
            matches!(answer, Err(StoreError::Timeout(_))),
            "a claim in the stall: {answer:?}"
        );
    }

    // A retry may reach Redis before the release behind its claim (on a connection of its own):
    // it is told the key is in flight until the release lands, moments later.
    let deadline = Instant::now() + Duration::from_secs(2);
    for n in 1..5 {
        loop {
            match claim(n).await {
                Ok(Claim::Claimed(_)) => break,
                Ok(Claim::Existing(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                other => panic!("§10.6: the key of timed-out claim {n} is free again: {other:?}"),
            }
        }
    }
}
