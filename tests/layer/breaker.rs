//! The circuit breaker in front of the store (PROTOCOL.md §9.11), over a `Faulty` memory store on
//! paused time: no store call while open, the probe, recovery, and fail-open layers.

use std::time::Duration;

use http::StatusCode;
use http::header::RETRY_AFTER;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::CircuitBreaker;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{
    Counting, Faulty, Handler, Reply, StoreCall, created, post, send, spawn_send,
};

type Store = Counting<Faulty<MemoryStore>>;

/// A store that counts the calls that reach it, and can be made to fail.
fn store() -> Store {
    Counting::new(Faulty::new(MemoryStore::new()))
}

/// `store` behind a breaker: 3 failures within 10 s open it for 5 s.
fn breaker(store: &Store) -> CircuitBreaker<Store> {
    CircuitBreaker::new(store.clone())
        .with_failure_threshold(3)
        .with_window(Duration::from_secs(10))
        .with_cool_down(Duration::from_secs(5))
}

fn handler() -> Handler {
    Handler::ok(|call| created(format!("call {}", call.n)))
}

/// Asserts the open breaker's 503: `store-unavailable`, `Retry-After` of `seconds`, outcome
/// `CircuitOpen`.
#[track_caller]
fn assert_circuit_open(reply: &Reply, seconds: u64) {
    reply.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert_eq!(reply.outcome, Some(Outcome::CircuitOpen), "{reply:?}");
    let expected = seconds.to_string();
    assert_eq!(
        reply.header(RETRY_AFTER),
        Some(expected.as_str()),
        "{reply:?}"
    );
    assert!(reply.text().contains("not sent to it"), "{}", reply.text());
}

/// Failures open it; while open, requests get the 503 at once and no claim reaches the store;
/// after the cool-down, one probe's success closes it, and claims reach the store again.
#[tokio::test(start_paused = true)]
async fn failures_open_it_and_while_open_no_claim_reaches_the_store() {
    let store = store();
    let handler = handler();
    let svc =
        tower_idempotency_test::service(IdempotencyLayer::new(breaker(&store)), handler.clone());
    store.inner().time_out(true);
    for n in 0..3 {
        let reply = send(&svc, post(&format!("k{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable), "{reply:?}");
    }
    assert_eq!(store.calls().claim, 3);

    // Open: answered at once, with the cool-down left, and the store is not asked.
    assert_circuit_open(&send(&svc, post("k3", "x")).await, 5);
    tokio::time::advance(Duration::from_millis(3_200)).await;
    assert_circuit_open(&send(&svc, post("k4", "x")).await, 2);
    assert_eq!(store.calls().claim, 3, "no claim while open");
    assert_eq!(handler.calls(), 0);

    // The store is back; after the cool-down the next request probes, runs, and closes it.
    store.inner().time_out(false);
    tokio::time::advance(Duration::from_millis(1_800)).await;
    let probe = send(&svc, post("k4", "x")).await;
    assert_eq!(probe.outcome, Some(Outcome::Executed), "{probe:?}");
    assert_eq!(store.calls().claim, 4);
    for n in 5..10 {
        let reply = send(&svc, post(&format!("k{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::Executed), "{reply:?}");
    }
    assert_eq!(
        store.calls().claim,
        9,
        "closed: every claim reaches the store"
    );
}

/// A store that answers, even with a refusal (`Full`) or an unreadable record, ends the run of
/// failures: only an unreachable or timed-out store opens the breaker.
#[tokio::test(start_paused = true)]
async fn answers_of_the_store_are_not_failures() {
    let store = store();
    let svc = tower_idempotency_test::service(IdempotencyLayer::new(breaker(&store)), handler());
    for round in 0..5 {
        store.inner().fail(true);
        for n in 0..2 {
            send(&svc, post(&format!("r{round}-{n}"), "x")).await;
        }
        store.inner().fail(false);
        store.inner().undecodable(true);
        let reply = send(&svc, post(&format!("r{round}-codec"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable), "{reply:?}");
        store.inner().undecodable(false);
    }
    assert_eq!(
        store.calls().claim,
        15,
        "never opened: every claim reached the store"
    );
}

/// While the probe's claim runs, the others get the fast 503 with `Retry-After: 1`; the probe's
/// failure opens the breaker for another whole cool-down.
#[tokio::test(start_paused = true)]
async fn while_the_probe_runs_the_others_wait_and_its_failure_reopens_it() {
    let store = store();
    let handler = handler();
    let svc =
        tower_idempotency_test::service(IdempotencyLayer::new(breaker(&store)), handler.clone());
    store.inner().fail(true);
    for n in 0..3 {
        send(&svc, post(&format!("k{n}"), "x")).await;
    }
    tokio::time::advance(Duration::from_secs(5)).await;

    // The probe's claim takes 800 ms and times out.
    store.inner().fail(false);
    store.inner().time_out(true);
    store.inner().delay(Some(Duration::from_millis(800)));
    let probe = spawn_send(&svc, post("probe", "x"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.calls().claim, 4, "the probe reached the store");
    assert_circuit_open(&send(&svc, post("other", "x")).await, 1);
    assert_eq!(store.calls().claim, 4, "one probe at a time");
    let probe = probe.await.expect("the probe");
    assert_eq!(probe.outcome, Some(Outcome::StoreUnavailable), "{probe:?}");

    // Open again, for a whole cool-down from the probe's failure.
    assert_circuit_open(&send(&svc, post("other", "x")).await, 5);
    store.inner().time_out(false);
    store.inner().delay(None);
    tokio::time::advance(Duration::from_millis(4_900)).await;
    assert_circuit_open(&send(&svc, post("other", "x")).await, 1);
    tokio::time::advance(Duration::from_millis(100)).await;
    let reply = send(&svc, post("other", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed), "{reply:?}");
    assert_eq!(store.calls().claim, 5);
    assert_eq!(handler.calls(), 1);
}

/// A fail-open layer keeps failing open: while the breaker is open its requests run unprotected,
/// without a store call, and the probe still closes it once the store is back.
#[tokio::test(start_paused = true)]
async fn a_fail_open_layer_runs_requests_unprotected_while_open() {
    let store = store();
    let handler = handler();
    let svc = tower_idempotency_test::service(
        IdempotencyLayer::new(breaker(&store)).fail_open(true),
        handler.clone(),
    );
    store.inner().fail(true);
    for n in 0..6 {
        let reply = send(&svc, post(&format!("k{n}"), "x")).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_eq!(reply.outcome, Some(Outcome::FailedOpen), "{reply:?}");
        assert_eq!(reply.header(RETRY_AFTER), None);
    }
    assert_eq!(handler.calls(), 6, "every request ran");
    assert_eq!(store.calls().claim, 3, "no claim once the breaker opened");

    store.inner().fail(false);
    tokio::time::advance(Duration::from_secs(5)).await;
    let probe = send(&svc, post("k9", "x")).await;
    assert_eq!(probe.outcome, Some(Outcome::Executed), "{probe:?}");
    let replay = send(&svc, post("k9", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert_eq!(store.calls().claim, 5);
}

/// Every clone of the layer, and every service built from them, shares one breaker (the clones
/// of the store share it); a layer without one asks the store every time.
#[tokio::test(start_paused = true)]
async fn one_breaker_per_layer_shared_by_its_services() {
    let store = store();
    let layer = IdempotencyLayer::new(breaker(&store));
    let services: Vec<_> = (0..3)
        .map(|_| tower_idempotency_test::service(layer.clone(), handler()))
        .collect();
    store.inner().fail(true);
    for (n, svc) in services.iter().enumerate() {
        send(svc, post(&format!("k{n}"), "x")).await;
    }
    for svc in &services {
        assert_circuit_open(&send(svc, post("k", "x")).await, 5);
    }
    assert_eq!(store.calls().claim, 3);

    let plain = tower_idempotency_test::service(IdempotencyLayer::new(store.clone()), handler());
    for n in 0..10 {
        let reply = send(&plain, post(&format!("p{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable), "{reply:?}");
    }
    assert_eq!(
        store.calls().claim,
        13,
        "without a breaker, every claim is made"
    );
}

/// An open breaker refuses claims, never a running handler's renewals: they are the store's to
/// answer. A handler that runs through three leases of an open breaker (claims failing all along)
/// keeps its claim, and once the breaker closes, a retry gets 409, not a second run.
#[tokio::test(start_paused = true)]
async fn renewals_pass_an_open_breaker() {
    let store = store();
    let (started, gate) = (
        std::sync::Arc::new(tokio::sync::Notify::new()),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let handler = tower_idempotency_test::gated_handler(started.clone(), gate.clone(), "slow");
    let layer = IdempotencyLayer::new(breaker(&store)).lease(Duration::from_secs(3));
    let svc = tower_idempotency_test::service(layer, handler.clone());
    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;

    store.inner().fail_call(StoreCall::Claim, true);
    for n in 0..9 {
        let reply = send(&svc, post(&format!("other-{n}"), "x")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let open = send(&svc, post("k", "x")).await;
    assert_eq!(
        open.outcome,
        Some(Outcome::CircuitOpen),
        "the breaker is open: {open:?}"
    );

    store.inner().fail_call(StoreCall::Claim, false);
    tokio::time::sleep(Duration::from_secs(6)).await;
    send(&svc, post("k", "x")).await.assert_in_flight();
    assert_eq!(
        handler.calls(),
        1,
        "§9.2, §9.11: the running handler kept its claim"
    );
    gate.notify_one();
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
}
