//! The client layer's bounds, against the server layer in process on paused time: the attempts,
//! the per-attempt timeout, the deadline, the retry budget, the backoff and the body limit, and
//! what the caller gets when they end the retries (PROTOCOL.md §14.4, §14.5).

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Full;
use support::{Fault, Link, always, attempts, charge, charges, layer, server, unavailable_once};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency_client::{Error, IdempotentRetryLayer};

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_the_answer_at_once() {
    let (server, runs) = server(Duration::ZERO, unavailable_once("60".into()));
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(layer().deadline(Duration::from_secs(30)))
        .service(link.clone());
    let started = tokio::time::Instant::now();

    let response = client.oneshot(charge("x")).await.unwrap();

    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&response).count(), 1);
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no wait that could not end in time"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn failures_to_the_end_are_an_error_with_the_attempt_count() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::Refuse; 5]);
    let client = ServiceBuilder::new()
        .layer(layer().max_attempts(3))
        .service(link.clone());

    let err = client.oneshot(charge("x")).await.unwrap_err();

    assert!(
        matches!(err, Error::Transport { attempts: 3, .. }),
        "{err:?}"
    );
    let source = std::error::Error::source(&err).unwrap();
    let io = source.downcast_ref::<std::io::Error>().unwrap();
    assert_eq!(
        io.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "the source is kept"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_ends_an_attempt_that_runs_past_it() {
    let (server, _runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::Stall; 5]);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(4))
                .deadline(Duration::from_secs(10)),
        )
        .service(link.clone());

    let err = client.oneshot(charge("x")).await.unwrap_err();

    // Attempts at 0 s and 4 s time out on their own; the one at 8 s meets the deadline at 10 s.
    let Error::TimedOut { attempts, elapsed } = err else {
        panic!("{err:?}")
    };
    assert_eq!((attempts, elapsed), (3, Duration::from_secs(10)));
}

#[tokio::test(start_paused = true)]
async fn a_last_attempt_that_times_out_is_a_timeout_error() {
    let (server, _runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::Stall; 2]);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(1))
                .max_attempts(2),
        )
        .service(link.clone());

    let err = client.oneshot(charge("x")).await.unwrap_err();

    let Error::TimedOut { attempts, elapsed } = err else {
        panic!("{err:?}")
    };
    assert_eq!((attempts, elapsed), (2, Duration::from_secs(2)));
}

/// A slow handler past the deadline: the 409s are waited on until the next wait would pass the
/// deadline, and that 409 is the answer; the handler still ran once.
#[tokio::test(start_paused = true)]
async fn a_409_whose_wait_would_pass_the_deadline_is_the_answer() {
    let (server, runs) = server(Duration::from_secs(3600), charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(4))
                .deadline(Duration::from_secs(10)),
        )
        .service(link.clone());

    let response = client.oneshot(charge("x")).await.unwrap();

    // Timeouts at 4 s and 8 s; at 8 s a 409 with `Retry-After: 1`; at 9 s another, and a second
    // more would reach the deadline.
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(attempts(&response).count(), 4);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_is_an_error_and_nothing_is_sent() {
    let (server, _runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(layer().body_limit(8))
        .service(link.clone());

    let err = client.oneshot(charge("amount=100")).await.unwrap_err();

    assert!(matches!(err, Error::BodyTooLarge { limit: 8 }), "{err:?}");
    assert_eq!(err.attempts(), 0);
    assert!(link.sent().is_empty());
}

/// With tower's budget: the first operation deposits, and a budget with no reserve and no share
/// of retries refuses its retry.
#[tokio::test(start_paused = true)]
async fn a_spent_retry_budget_stops_the_retries() {
    let (server, _runs) = server(Duration::ZERO, always(503, HeaderMap::new()));
    let link = Link::new(server, []);
    let budget = Arc::new(tower::retry::budget::TpsBudget::new(
        Duration::from_secs(1),
        0,
        0.0,
    ));
    let client = ServiceBuilder::new()
        .layer(layer().budget(budget))
        .service(link.clone());

    let response = client.oneshot(charge("x")).await.unwrap();

    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&response).count(), 1);
}

#[tokio::test(start_paused = true)]
async fn backoff_waits_stay_within_their_doubling_bounds() {
    let (server, _runs) = server(Duration::ZERO, always(502, HeaderMap::new()));
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .backoff(Duration::from_millis(100), Duration::from_millis(300))
                .max_attempts(5),
        )
        .service(link.clone());

    let response = client.oneshot(charge("x")).await.unwrap();

    assert_eq!(attempts(&response).count(), 5);
    let bounds = [100, 200, 300, 300].map(Duration::from_millis);
    for (gap, bound) in link.gaps().into_iter().zip(bounds) {
        assert!(gap <= bound, "{gap:?} over {bound:?}");
    }
}

/// A server that stores its 503s (its upstream's "later"), states when it forgets a key, and keeps
/// keys for 30 s; its handler answers 503 with `Retry-After: {retry_after}` first, then 201.
fn forgetful_server(
    retry_after: u64,
    format: tower_idempotency::RetentionFormat,
) -> (axum::Router, Arc<std::sync::atomic::AtomicUsize>) {
    use tower_idempotency::{DefaultStorePolicy, IdempotencyLayer, MemoryStore, StorePolicy};
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .dedup_window(Duration::from_secs(30))
        .retention_header(tower_idempotency::IDEMPOTENCY_KEY_EXPIRES, format)
        .store_policy(|head: &http::response::Parts| {
            DefaultStorePolicy.store(head) || head.status == StatusCode::SERVICE_UNAVAILABLE
        });
    let script: support::Script = Arc::new(move |n, _| {
        let status = if n == 1 { 503 } else { 201 };
        http::Response::builder()
            .status(status)
            .header(http::header::RETRY_AFTER, retry_after.to_string())
            .body(axum::body::Body::from(format!("run {n}")))
            .unwrap()
    });
    support::server_with(layer, Duration::ZERO, script)
}

/// A retry that would reach the server after it forgot the key is not sent: the call ends with
/// an error naming the key, and the operation ran once. Without it, the retry 40 s later finds
/// the key new and runs the operation a second time. PROTOCOL.md §14.4.
#[tokio::test(start_paused = true)]
async fn no_retry_is_sent_after_the_server_forgets_the_key() {
    for format in [
        tower_idempotency::RetentionFormat::HttpDate,
        tower_idempotency::RetentionFormat::StructuredDate,
    ] {
        let (server, runs) = forgetful_server(40, format);
        let link = Link::new(server, []);
        let client = ServiceBuilder::new()
            .layer(layer().deadline(Duration::from_secs(120)))
            .service(link.clone());

        let err = client.oneshot(charge("x")).await.unwrap_err();

        let sent = link.sent();
        assert_eq!(sent.len(), 1, "no retry was sent");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
        let key = sent[0].key.clone().expect("a key");
        match &err {
            Error::RetentionPassed {
                key: named,
                attempts,
                ..
            } => assert_eq!((named, *attempts), (&key, 1)),
            other => panic!("{format:?}: {other:?}"),
        }
        let message = err.to_string();
        assert!(
            message.contains(key.to_str().unwrap())
                && message.contains("would run the operation again"),
            "{message}"
        );
    }
}

/// A retry due well before the moment, less the margin, is sent and replayed; a wider margin
/// stops it.
#[tokio::test(start_paused = true)]
async fn retries_before_the_moment_less_the_margin_are_sent() {
    let (server, runs) = forgetful_server(15, tower_idempotency::RetentionFormat::HttpDate);
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(layer().max_attempts(2).deadline(Duration::from_secs(120)))
        .service(link.clone());
    // The moment is 30 s away (rounded down to the second); 15 s + the 10 s margin fit before it.
    let response = client.oneshot(charge("x")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&response).count(), 2);
    assert!(attempts(&response).replayed(), "the retry was recognised");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let (server, runs) = forgetful_server(15, tower_idempotency::RetentionFormat::HttpDate);
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .deadline(Duration::from_secs(120))
                .retention_margin(Duration::from_secs(16)),
        )
        .service(link.clone());
    let err = client.oneshot(charge("x")).await.unwrap_err();
    assert!(matches!(err, Error::RetentionPassed { .. }), "{err:?}");
    assert_eq!((link.sent().len(), runs.load(Ordering::SeqCst)), (1, 1));
}

/// A server that states its retention: its `409` while the key's first request runs says the key
/// is kept at least a dedup window (10 s here) from now. With the default margin of 10 s, the
/// retry the `409` asks for would come too late: the call ends there, after the timed-out attempt
/// and the `409`, and the operation ran once. PROTOCOL.md §8.7, §14.4.
#[tokio::test(start_paused = true)]
async fn a_409_in_flight_states_the_retention_that_bounds_the_retries() {
    use tower_idempotency::{IDEMPOTENCY_KEY_EXPIRES, IdempotencyLayer, MemoryStore};
    let stating = IdempotencyLayer::new(MemoryStore::new())
        .dedup_window(Duration::from_secs(10))
        .retention_header(
            IDEMPOTENCY_KEY_EXPIRES,
            tower_idempotency::RetentionFormat::HttpDate,
        );
    let (server, runs) = support::server_with(stating, Duration::from_secs(5), charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(layer().attempt_timeout(Duration::from_secs(1)))
        .service(link.clone());
    let before = std::time::SystemTime::now();

    let err = client.oneshot(charge("x")).await.unwrap_err();

    let Error::RetentionPassed {
        key,
        expires,
        attempts,
    } = err
    else {
        panic!("{err:?}")
    };
    assert_eq!(attempts, 2, "the timed-out attempt, then the 409");
    assert_eq!(Some(key), link.sent()[1].key.clone());
    let kept = expires.duration_since(before).unwrap();
    assert!(
        kept > Duration::from_secs(8) && kept <= Duration::from_secs(11),
        "{kept:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A server that states nothing, and a client told how long it keeps keys: the retries end
/// before the call plus that time, less the margin.
#[tokio::test(start_paused = true)]
async fn a_configured_retention_bounds_the_retries() {
    let (server, runs) = server(Duration::from_secs(3600), charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(1))
                .max_attempts(10)
                .retention(Duration::from_secs(4))
                .retention_margin(Duration::from_secs(1)),
        )
        .service(link.clone());

    let err = client.oneshot(charge("x")).await.unwrap_err();

    // A timeout at 1 s, then 409s at 1 s and 2 s; the one the 409 at 2 s asks for, at 3 s, is
    // at the call plus 4 s less the margin.
    assert!(
        matches!(err, Error::RetentionPassed { attempts: 3, .. }),
        "{err:?}"
    );
    assert_eq!(link.sent().len(), 3);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The two instances of [`rolling_window`] behind one service.
type Balancer = tower::util::BoxCloneService<Request<Full<Bytes>>, Response<Body>, Infallible>;

/// Two instances of one API over one store, behind a balancer, part-way through a change of its
/// dedup window: `A` keeps keys 20 s, `B` states 300 s (and asks for 25 s between its `409`s),
/// and both state the moment in their answers. The key's record is the completing instance's: the
/// handler (3 s) runs on `A`, so the key is forgotten 23 s after the call, whatever `B` says.
/// Attempts whose number (from 1) is in `to_b` go to `B`, the others to `A`. Returns the link and
/// the handler's runs on both.
fn rolling_window(to_b: &'static [usize]) -> (Link<Balancer>, impl Fn() -> usize) {
    use tower_idempotency::{IDEMPOTENCY_KEY_EXPIRES, IdempotencyLayer, MemoryStore};
    let store = MemoryStore::new();
    let instance = |window: u64, retry_after: u64| {
        let layer = IdempotencyLayer::new(store.clone())
            .dedup_window(Duration::from_secs(window))
            .retry_after(Duration::from_secs(retry_after))
            .retention_header(
                IDEMPOTENCY_KEY_EXPIRES,
                tower_idempotency::RetentionFormat::HttpDate,
            );
        support::server_with(layer, Duration::from_secs(3), charges())
    };
    let ((a, runs_a), (b, runs_b)) = (instance(20, 1), instance(300, 25));
    let sent = Arc::new(AtomicUsize::new(0));
    let balancer = tower::service_fn(move |request: Request<Full<Bytes>>| {
        let attempt = sent.fetch_add(1, Ordering::SeqCst) + 1;
        let instance = if to_b.contains(&attempt) { &b } else { &a };
        instance.clone().oneshot(request)
    });
    let runs = move || runs_a.load(Ordering::SeqCst) + runs_b.load(Ordering::SeqCst);
    (Link::new(Balancer::new(balancer), []), runs)
}

/// Asserts that the charge ran once and the call ended with `RetentionPassed` after `expected`
/// attempts, none sent after B's `409`; answers how long after `before` the key was said to be
/// kept.
#[track_caller]
fn assert_ended_before_a_second_run<T: std::fmt::Debug>(
    result: Result<T, Error>,
    runs: &impl Fn() -> usize,
    link: &Link<Balancer>,
    expected: u32,
    before: SystemTime,
) -> Duration {
    assert_eq!(runs(), 1, "the charge ran once");
    let Err(Error::RetentionPassed {
        expires,
        attempts: made,
        ..
    }) = result
    else {
        panic!("{result:?}")
    };
    assert_eq!(
        (made, link.sent().len()),
        (expected, expected as usize),
        "no retry after B's 409"
    );
    expires.duration_since(before).unwrap()
}

/// The earliest moment stated bounds the retries, not the latest: `A`'s `409` states 20 s, then
/// `B`'s states 300 s and asks for a retry in 25 s, after `A`'s record is gone. Kept to the
/// earliest, the call ends there; moved to the latest, the retry runs the charge a second time.
#[tokio::test(start_paused = true)]
async fn the_earliest_moment_stated_bounds_the_retries() {
    // A timeout at 1 s (the handler runs on, on `A`), `A`'s 409 at 1 s, `B`'s 409 at 2 s.
    let (link, runs) = rolling_window(&[3]);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(1))
                .deadline(Duration::from_secs(60)),
        )
        .service(link.clone());
    let before = SystemTime::now();

    let result = client.oneshot(charge("x")).await;

    let kept = assert_ended_before_a_second_run(result, &runs, &link, 3, before);
    assert!(
        kept > Duration::from_secs(18) && kept <= Duration::from_secs(20),
        "A's moment, not B's: {kept:?}"
    );
}

/// The configured retention (the server's documented window) still bounds the retries once an
/// answer states a later moment: `B`'s `409` states 300 s, but the key, completed on `A`, is kept
/// 20 s. The retry it asks for, at 26 s, is not sent; sent, it would run the charge again.
#[tokio::test(start_paused = true)]
async fn a_later_stated_moment_does_not_lift_the_configured_retention() {
    // A timeout at 1 s (the handler runs on, on `A`), then `B`'s 409 at 1 s.
    let (link, runs) = rolling_window(&[2]);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(1))
                .deadline(Duration::from_secs(60))
                .retention(Duration::from_secs(20)),
        )
        .service(link.clone());
    let before = SystemTime::now();

    let result = client.oneshot(charge("x")).await;

    // The call plus 20 s, on the wall clock at the decision (1 s of paused time in).
    let kept = assert_ended_before_a_second_run(result, &runs, &link, 2, before);
    assert!(
        kept > Duration::from_secs(18) && kept <= Duration::from_secs(20),
        "the configured bound: {kept:?}"
    );
}
