//! The quota and the circuit breaker as store wrappers, together and with waiting
//! (PROTOCOL.md §3.4, §6.6, §9.11): each refusal of one is seen by the other and by the layer
//! for what it is, never as the store answering or failing.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tower_idempotency::store::{CircuitBreaker, ScopeQuota};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{
    Faulty, Handler, StoreCall, account_post, account_scope, created, send, service, spawn_send,
};

/// One claim's worth of budget (a bound of 512 bytes: a burst of 256).
const ONE_CLAIM: u64 = 512;

/// A quota over an open breaker: a scope past its quota is refused `429` at once, without
/// waiting on the failing store for its read.
#[tokio::test(start_paused = true)]
async fn past_its_quota_a_scope_is_refused_at_once_while_the_breaker_is_open() {
    let store = Faulty::new(MemoryStore::new());
    let breaker = CircuitBreaker::new(store.clone())
        .with_failure_threshold(3)
        .with_cool_down(Duration::from_secs(60));
    let layer = IdempotencyLayer::new(ScopeQuota::new(breaker, ONE_CLAIM)).scope(account_scope);
    let svc = service(layer, Handler::ok(|_| created("ok")));
    let spent = send(&svc, account_post("acct_a", "a-1")).await;
    assert_eq!(spent.outcome, Some(Outcome::Executed), "{spent:?}");

    // Every call now waits 5 s and fails: three claims open the breaker.
    store.delay(Some(Duration::from_secs(5)));
    store.fail(true);
    for n in 0..3 {
        send(&svc, account_post(&format!("acct_{n}"), "k")).await;
    }
    let started = Instant::now();
    let refused = send(&svc, account_post("acct_a", "a-2")).await;
    assert_eq!(refused.outcome, Some(Outcome::QuotaExceeded), "{refused:?}");
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "§3.4, §9.11: the quota's read is refused by the open breaker, not sent to the store"
    );
}

/// A breaker over a quota: a probe the quota refuses says nothing of the store, so it neither
/// closes the breaker nor counts; the next request probes the store instead.
#[tokio::test(start_paused = true)]
async fn a_probe_the_quota_refuses_does_not_close_the_breaker() {
    let store = Faulty::new(MemoryStore::new());
    let quota = ScopeQuota::new(store.clone(), ONE_CLAIM);
    let breaker = CircuitBreaker::new(quota)
        .with_failure_threshold(3)
        .with_cool_down(Duration::from_secs(5));
    let layer = IdempotencyLayer::new(breaker).scope(account_scope);
    let svc = service(layer, Handler::ok(|_| created("ok")));
    let spent = send(&svc, account_post("acct_a", "a-1")).await;
    assert_eq!(spent.outcome, Some(Outcome::Executed), "{spent:?}");

    store.fail(true);
    for n in 0..3 {
        send(&svc, account_post(&format!("acct_{n}"), "k")).await;
    }
    tokio::time::advance(Duration::from_secs(5)).await;
    // The probe: the scope is past its quota, and the store cannot be read.
    let probe = send(&svc, account_post("acct_a", "a-2")).await;
    assert_eq!(probe.outcome, Some(Outcome::QuotaExceeded), "{probe:?}");
    // The next request probes the store, which still fails: open again.
    let second_probe = send(&svc, account_post("acct_b", "b-1")).await;
    assert_eq!(
        second_probe.outcome,
        Some(Outcome::StoreUnavailable),
        "{second_probe:?}"
    );
    let after = send(&svc, account_post("acct_c", "c-1")).await;
    assert_eq!(
        after.outcome,
        Some(Outcome::CircuitOpen),
        "§9.11: a quota's refusal is not the store's answer, so the breaker did not close: {after:?}"
    );
}

/// A duplicate waiting for a request in flight, in a scope past its quota: when the first run
/// fails and frees the key, the wait ends at once with the duplicate's own `429`, rather than a
/// `409` at the end of its bound.
#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_of_a_scope_past_its_quota_is_refused_once_the_key_is_free() {
    const BOUND: Duration = Duration::from_secs(10);
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let failing = Handler::new({
        let (started, gate) = (started.clone(), gate.clone());
        move |_| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                Err("the run failed".into())
            }
        }
    });
    let layer = IdempotencyLayer::new(ScopeQuota::new(MemoryStore::new(), ONE_CLAIM))
        .scope(account_scope)
        .wait_for_in_flight(BOUND);
    let svc = service(layer, failing);
    let first = spawn_send(&svc, account_post("acct_a", "k"));
    started.notified().await;
    let waiting = spawn_send(&svc, account_post("acct_a", "k"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let freed = Instant::now();
    gate.notify_one();
    let first = first.await.expect("the first run");
    assert_eq!(first.outcome, Some(Outcome::HandlerFailed), "{first:?}");
    let waited = waiting.await.expect("the duplicate");
    assert_eq!(
        waited.outcome,
        Some(Outcome::QuotaExceeded),
        "§3.4, §6.6: the free key's claim is the duplicate's, and its scope is past its quota: \
         {waited:?}"
    );
    assert!(
        freed.elapsed() < BOUND,
        "answered when the key was freed, not at the wait's bound: {:?}",
        freed.elapsed()
    );
}

/// A completion is charged to its scope once, when the store took it: the attempts that failed
/// before it cost nothing, and the scope's next request fits in what is left (§3.4).
#[tokio::test(start_paused = true)]
async fn a_completion_retried_after_failures_is_charged_once() {
    let store = Faulty::new(MemoryStore::new());
    // A burst of 2,012 bytes: a claim (256) and a 1,000-byte response leave 756, room for
    // another claim; the response charged twice would leave none.
    let layer = IdempotencyLayer::new(ScopeQuota::new(store.clone(), 4_024)).scope(account_scope);
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, Handler::ok(|_| created("x".repeat(1_000))));

    store.fail_call(StoreCall::Complete, true);
    let first = send(&svc, account_post("acct_a", "a-1")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{first:?}");
    // Attempts at about 0, 0.1, 0.3, 0.7 and 1.5 s fail; the next lands.
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.fail_call(StoreCall::Complete, false);
    shutdown.wait().await;

    let second = send(&svc, account_post("acct_a", "a-2")).await;
    assert_eq!(
        second.outcome,
        Some(Outcome::Executed),
        "§3.4: the first response was charged once, when it was stored: {second:?}"
    );
}
