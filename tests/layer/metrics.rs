//! Metrics through the `metrics` facade (feature `metrics`), recorded by a test recorder: one
//! count per covered request and outcome, one latency sample per store call by operation and
//! result, and labels from fixed sets only (never a key or a scope). PROTOCOL.md §12.5.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::body::Body;
use http::{Method, Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use tokio::sync::Notify;
use tower::BoxError;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome, Scope};
use tower_idempotency_test::{Faulty, Handler, created, keyed, post, respond, send, spawn_send};

/// Counters by outcome, histogram sample counts by `(operation, result)`, and the circuit
/// breaker's changes by the state entered.
#[derive(Debug, Default)]
struct Recorded {
    outcomes: BTreeMap<String, u64>,
    store_calls: BTreeMap<(String, String), usize>,
    breaker: BTreeMap<String, u64>,
}

fn labels(key: &CompositeKey) -> BTreeMap<String, String> {
    key.key()
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect()
}

fn recorded(snapshotter: &Snapshotter) -> Recorded {
    let mut recorded = Recorded::default();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels = labels(&key);
        match (key.kind(), key.key().name(), value) {
            (MetricKind::Counter, "idempotency_requests_total", DebugValue::Counter(n)) => {
                let names: Vec<_> = labels.keys().map(String::as_str).collect();
                assert_eq!(names, ["outcome"], "{key:?}");
                *recorded
                    .outcomes
                    .entry(labels["outcome"].clone())
                    .or_default() += n;
            }
            (
                MetricKind::Histogram,
                "idempotency_store_call_duration_seconds",
                DebugValue::Histogram(samples),
            ) => {
                let names: Vec<_> = labels.keys().map(String::as_str).collect();
                assert_eq!(names, ["operation", "result"], "{key:?}");
                for seconds in &samples {
                    assert!((0.0..5.0).contains(&seconds.0), "{key:?}: {seconds}");
                }
                let entry = (labels["operation"].clone(), labels["result"].clone());
                *recorded.store_calls.entry(entry).or_default() += samples.len();
            }
            (
                MetricKind::Counter,
                "idempotency_circuit_breaker_transitions_total",
                DebugValue::Counter(n),
            ) => {
                let names: Vec<_> = labels.keys().map(String::as_str).collect();
                assert_eq!(names, ["state"], "{key:?}");
                *recorded.breaker.entry(labels["state"].clone()).or_default() += n;
            }
            other => panic!("an unexpected metric: {other:?}"),
        }
    }
    recorded
}

/// The test handler: `x-fail` errors, `x-big` answers more than the response limit, `x-status`
/// picks the status, `x-gate` waits for the test on its first call.
fn handler(started: Arc<Notify>, gate: Arc<Notify>) -> Handler {
    Handler::new(move |call| {
        let (started, gate) = (started.clone(), gate.clone());
        async move {
            if call.header("x-fail").is_some() {
                return Err(BoxError::from("the backend is down"));
            }
            if call.header("x-gate").is_some() {
                started.notify_one();
                gate.notified().await;
            }
            if call.header("x-big").is_some() {
                return Ok(created(vec![b'x'; 100]));
            }
            let status = call.header("x-status").map_or(Ok(201), str::parse);
            Ok(respond(
                status.expect("a status"),
                format!("call {}", call.n),
            ))
        }
    })
}

fn with(key: &str, header: &str) -> Request<Body> {
    keyed(Method::POST, "/", key)
        .header(header, "1")
        .header(
            "x-status",
            if header == "x-unavailable" {
                "503"
            } else {
                "201"
            },
        )
        .body(Body::from("x"))
        .expect("a request")
}

/// Real time on a current-thread runtime: every task records to this thread's recorder, and no
/// lease renewal comes due while the test runs.
#[tokio::test]
async fn every_outcome_and_store_call_is_counted_exactly() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);

    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let svc = tower_idempotency_test::service(
        IdempotencyLayer::new(MemoryStore::new())
            .response_body_limit(8)
            .key_required(false)
            .scope(|parts: &http::request::Parts| Ok(Scope::from(parts.uri.path()))),
        handler(started.clone(), gate.clone()),
    );
    let outcome = |reply: tower_idempotency_test::Reply| reply.outcome;

    assert_eq!(
        outcome(send(&svc, post("k1", "x")).await),
        Some(Outcome::Executed)
    );
    for _ in 0..2 {
        assert_eq!(
            outcome(send(&svc, post("k1", "x")).await),
            Some(Outcome::Replayed)
        );
    }
    assert_eq!(
        outcome(send(&svc, post("k1", "y")).await),
        Some(Outcome::Mismatch)
    );
    let unavailable = send(&svc, with("k2", "x-unavailable")).await;
    assert_eq!(unavailable.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(unavailable.outcome, Some(Outcome::NotStored));
    assert_eq!(
        outcome(send(&svc, with("k3", "x-big")).await),
        Some(Outcome::Executed)
    );
    assert_eq!(
        outcome(send(&svc, with("k3", "x-big")).await),
        Some(Outcome::NotReplayable)
    );
    assert_eq!(
        outcome(send(&svc, with("k4", "x-fail")).await),
        Some(Outcome::HandlerFailed)
    );
    let no_key = Request::post("/").body(Body::from("x")).expect("a request");
    assert_eq!(
        outcome(send(&svc, no_key).await),
        Some(Outcome::Unprotected)
    );
    assert_eq!(
        outcome(send(&svc, post("a,b", "x")).await),
        Some(Outcome::Rejected)
    );
    let get = Request::get("/").body(Body::empty()).expect("a request");
    assert_eq!(
        outcome(send(&svc, get).await),
        None,
        "a passthrough is not counted"
    );
    let held = spawn_send(&svc, with("k5", "x-gate"));
    started.notified().await;
    assert_eq!(
        outcome(send(&svc, with("k5", "x-gate")).await),
        Some(Outcome::InFlight)
    );
    gate.notify_one();
    assert_eq!(
        held.await.expect("the held request").outcome,
        Some(Outcome::Executed)
    );

    let down = Faulty::new(MemoryStore::new());
    down.fail(true);
    let closed = tower_idempotency_test::service(
        IdempotencyLayer::new(down.clone()),
        handler(started.clone(), gate.clone()),
    );
    assert_eq!(
        outcome(send(&closed, post("k6", "x")).await),
        Some(Outcome::StoreUnavailable)
    );
    let no_key = Request::post("/").body(Body::from("x")).expect("a request");
    assert_eq!(
        outcome(send(&closed, no_key).await),
        Some(Outcome::Rejected)
    );
    let open = tower_idempotency_test::service(
        IdempotencyLayer::new(down).fail_open(true),
        handler(started, gate),
    );
    assert_eq!(
        outcome(send(&open, post("k7", "x")).await),
        Some(Outcome::FailedOpen)
    );

    let rejecting = Faulty::new(MemoryStore::new());
    rejecting.reject_completions(true);
    let rejected = tower_idempotency_test::service(
        IdempotencyLayer::new(rejecting),
        Handler::ok(|_| tower_idempotency_test::created("ok")),
    );
    assert_eq!(
        outcome(send(&rejected, post("k8", "x")).await),
        Some(Outcome::CommitRejected)
    );
    // A completion that did not commit: the handler ran, but the request is counted once, by
    // its answer.
    let aborting = Faulty::new(MemoryStore::new());
    aborting.abort_completions(true);
    let aborted = tower_idempotency_test::service(
        IdempotencyLayer::new(aborting),
        Handler::ok(|_| tower_idempotency_test::created("ok")),
    );
    assert_eq!(
        outcome(send(&aborted, post("k9", "x")).await),
        Some(Outcome::StoreUnavailable)
    );

    let recorded = recorded(&snapshotter);
    let expected_outcomes: BTreeMap<String, u64> = [
        ("executed", 3),
        ("replayed", 2),
        ("mismatch", 1),
        ("not_stored", 1),
        ("not_replayable", 1),
        ("handler_failed", 1),
        ("unprotected", 1),
        ("rejected", 2),
        ("in_flight", 1),
        ("store_unavailable", 2),
        ("failed_open", 1),
        ("commit_rejected", 1),
    ]
    .into_iter()
    .map(|(name, n)| (name.to_owned(), n))
    .collect();
    assert_eq!(recorded.outcomes, expected_outcomes);

    // Claims: k1 four times, k2, k3 twice, k4, k5 twice, k8, k9 (ok); k6 and k7 (the store was
    // down). Completions: k1, k3 (a tombstone), k5; k8 rejected, k9 aborted. Releases: k2 (not
    // stored), k4 (failed).
    let expected_calls: BTreeMap<(String, String), usize> = [
        (("claim", "ok"), 12),
        (("claim", "unavailable"), 2),
        (("complete", "ok"), 3),
        (("complete", "rejected"), 1),
        (("complete", "aborted"), 1),
        (("release", "ok"), 2),
    ]
    .into_iter()
    .map(|((op, result), n)| ((op.to_owned(), result.to_owned()), n))
    .collect();
    assert_eq!(recorded.store_calls, expected_calls);
}

/// The consumer's store calls are timed too; its labels are the same fixed sets.
#[tokio::test]
async fn the_consumers_store_calls_are_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);

    let dedup = tower_idempotency::consumer::Deduplicator::new(MemoryStore::new(), "ledger");
    let done = dedup
        .process("evt_1", || async { Ok::<_, BoxError>(()) })
        .await;
    assert!(done.expect("processed").should_ack());
    let again = dedup
        .process("evt_1", || async { Ok::<_, BoxError>(()) })
        .await;
    assert!(again.expect("a duplicate").should_ack());

    let recorded = recorded(&snapshotter);
    assert!(recorded.outcomes.is_empty(), "{recorded:?}");
    let calls: BTreeSet<_> = recorded.store_calls.iter().collect();
    let claim_ok = ("claim".to_owned(), "ok".to_owned());
    let complete_ok = ("complete".to_owned(), "ok".to_owned());
    assert_eq!(
        calls,
        BTreeSet::from([(&claim_ok, &2), (&complete_ok, &1)]),
        "{recorded:?}"
    );
}

/// The circuit breaker's changes of state are counted by the state entered, and the requests it
/// answers without the store by their own outcome (PROTOCOL.md §9.11, §12.5).
#[tokio::test(start_paused = true)]
async fn the_breakers_changes_and_answers_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);

    let store = Faulty::new(MemoryStore::new());
    let breaker = tower_idempotency::store::CircuitBreaker::new(store.clone())
        .with_failure_threshold(3)
        .with_cool_down(std::time::Duration::from_secs(5));
    let svc = tower_idempotency_test::service(
        IdempotencyLayer::new(breaker),
        Handler::ok(|_| created("ok")),
    );
    store.time_out(true);
    for n in 0..5 {
        send(&svc, post(&format!("k{n}"), "x")).await;
    }
    store.time_out(false);
    tokio::time::advance(std::time::Duration::from_secs(5)).await;
    assert_eq!(
        send(&svc, post("k9", "x")).await.outcome,
        Some(Outcome::Executed)
    );

    let recorded = recorded(&snapshotter);
    let counts = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
        pairs.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
    };
    assert_eq!(
        recorded.breaker,
        counts(&[("open", 1), ("half_open", 1), ("closed", 1)])
    );
    assert_eq!(
        recorded.outcomes,
        counts(&[
            ("store_unavailable", 3),
            ("circuit_open", 2),
            ("executed", 1)
        ])
    );
    let claims = |result: &str| recorded.store_calls[&("claim".to_owned(), result.to_owned())];
    assert_eq!((claims("timeout"), claims("ok")), (3, 1), "{recorded:?}");
}
