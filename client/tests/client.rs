//! The client layer against the server layer in process, through a link that loses answers or
//! refuses connections, on paused time: what is retried, when, with which key and bytes, and
//! what the caller is told (PROTOCOL.md §14).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{Full, StreamBody};
use support::{
    Fault, Link, always, attempts, charge, charges, layer, server, server_with, text,
    unavailable_once,
};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_client::{Error, IdempotentRetryLayer};

#[tokio::test(start_paused = true)]
async fn a_response_lost_after_the_handler_ran_is_replayed_on_retry() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::LoseResponse]);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());

    let response = client.oneshot(charge("amount=100")).await.unwrap();

    assert_eq!(response.status(), StatusCode::CREATED);
    let attempts = attempts(&response);
    assert_eq!((attempts.count(), attempts.replayed()), (2, true));
    assert_eq!(text(response).await, "ch_1", "the first run's answer");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one execution");
}

#[tokio::test(start_paused = true)]
async fn a_refused_connection_is_retried_and_runs_once() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::Refuse]);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());

    let response = client.oneshot(charge("amount=100")).await.unwrap();

    assert_eq!(response.status(), StatusCode::CREATED);
    let attempts = attempts(&response);
    assert_eq!((attempts.count(), attempts.replayed()), (2, false));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(link.sent().len(), 2);
}

/// The first attempt times out while the handler runs on (detached on the server); the next ones
/// get 409 with `Retry-After: 1` and wait that second, until the replay.
#[tokio::test(start_paused = true)]
async fn a_slow_handler_is_waited_for_as_the_server_asks_then_replayed() {
    let (server, runs) = server(Duration::from_millis(2500), charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(
            layer()
                .attempt_timeout(Duration::from_secs(1))
                .max_attempts(6),
        )
        .service(link.clone());

    let response = client.oneshot(charge("amount=100")).await.unwrap();

    assert_eq!(response.status(), StatusCode::CREATED);
    let attempts = attempts(&response);
    assert_eq!((attempts.count(), attempts.replayed()), (4, true));
    assert_eq!(text(response).await, "ch_1");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one execution");
    // The timeout (1 s, no backoff), then the 409's `Retry-After` (1 s) twice.
    assert_eq!(link.gaps(), [Duration::from_secs(1); 3]);
}

#[tokio::test(start_paused = true)]
async fn answers_that_are_the_requests_fault_are_not_retried() {
    for status in [
        400, 401, 402, 403, 404, 405, 408, 410, 413, 415, 422, 425, 501, 505,
    ] {
        let (server, runs) = server(Duration::ZERO, always(status, HeaderMap::new()));
        let link = Link::new(server, []);
        let client = ServiceBuilder::new().layer(layer()).service(link.clone());
        let response = client.oneshot(charge("x")).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(attempts(&response).count(), 1, "{status}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn transient_answers_are_retried_up_to_the_maximum() {
    for status in [409, 429, 500, 502, 503, 504, 507] {
        let (server, runs) = server(Duration::ZERO, always(status, HeaderMap::new()));
        let link = Link::new(server, []);
        let client = ServiceBuilder::new()
            .layer(layer().max_attempts(3))
            .service(link.clone());
        let response = client.oneshot(charge("x")).await.unwrap();
        assert_eq!(
            response.status().as_u16(),
            status,
            "the last answer, as it is"
        );
        assert_eq!(attempts(&response).count(), 3, "{status}");
        // None of these is stored by the server: each retry runs the handler again.
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{status}");
    }
}

/// The server's own 422: the same key with another body. Never retried, and nothing runs.
#[tokio::test(start_paused = true)]
async fn a_key_reused_for_another_request_is_not_retried() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());
    let keyed = |body: &'static str| {
        let mut request = charge(body);
        request
            .headers_mut()
            .insert("idempotency-key", HeaderValue::from_static("order-1"));
        request
    };

    let first = client.clone().oneshot(keyed("amount=100")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let reused = client.oneshot(keyed("amount=999")).await.unwrap();

    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(attempts(&reused).count(), 1);
    assert_eq!(link.sent().len(), 2, "one attempt each");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A charge under the caller's own `key`, as a job sends it each time it runs.
fn keyed(key: &'static str) -> Request<Full<Bytes>> {
    let mut request = charge("amount=100");
    (request.headers_mut()).insert("idempotency-key", HeaderValue::from_static(key));
    request
}

/// The key's operation ran once and left a tombstone (its answer was over the server's response
/// limit): the server's `409 not-replayable` ends the next call at its first attempt, with an
/// error that says so, instead of retries that cannot change it. PROTOCOL.md §14.3.
#[tokio::test(start_paused = true)]
async fn a_not_replayable_answer_ends_the_call_after_one_attempt() {
    let big = Arc::new(|n, _: &Bytes| {
        let body = format!("ch_{n} {}", "x".repeat(64));
        http::Response::builder()
            .status(StatusCode::CREATED)
            .body(axum::body::Body::from(body))
            .unwrap()
    });
    let limited = IdempotencyLayer::new(MemoryStore::new()).response_body_limit(16);
    let (server, runs) = server_with(limited, Duration::ZERO, big);
    let link = Link::new(server, []);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());
    let first = client.clone().oneshot(keyed("order-7")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED, "delivered, not stored");

    let err = client.oneshot(keyed("order-7")).await.unwrap_err();

    assert!(
        matches!(&err, Error::NotReplayable { key, attempts: 1 } if key == "order-7"),
        "{err:?}"
    );
    assert_eq!(err.attempts(), 1);
    assert_eq!(link.sent().len(), 2, "one attempt each");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
    let message = err.to_string();
    assert!(
        message.contains("ran once") && message.contains("not kept"),
        "{message}"
    );
}

/// A server may answer `not-replayable` with another status than `409` (`problem_status`): the
/// header names it, and the call still ends at once with the error, not as a `410` returned as
/// an answer or a `500` retried to the end, which a caller would take for a failure and send again
/// under a new key. PROTOCOL.md §14.3.
#[tokio::test(start_paused = true)]
async fn a_not_replayable_answer_under_another_status_still_ends_the_call() {
    use tower_idempotency::problem::ProblemKind;
    for status in [StatusCode::GONE, StatusCode::INTERNAL_SERVER_ERROR] {
        let limited = IdempotencyLayer::new(MemoryStore::new())
            .response_body_limit(1)
            .problem_status(ProblemKind::NotReplayable, status);
        let (server, runs) = server_with(limited, Duration::ZERO, charges());
        let link = Link::new(server, []);
        let client = ServiceBuilder::new().layer(layer()).service(link.clone());
        let first = client.clone().oneshot(keyed("order-9")).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED, "delivered, not stored");

        let result = client.oneshot(keyed("order-9")).await;

        assert!(
            matches!(&result, Err(Error::NotReplayable { key, attempts: 1 }) if key == "order-9"),
            "{status}: {result:?}"
        );
        assert_eq!(link.sent().len(), 2, "{status}: one attempt each");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{status}");
    }
}

/// The other `409`, with the same key while its first request still runs, is retried as the
/// server asks until the replay: only `not-replayable` ends a call.
#[tokio::test(start_paused = true)]
async fn a_409_in_flight_is_still_retried_then_replayed() {
    let (server, runs) = server(Duration::from_millis(2500), charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new()
        .layer(layer().max_attempts(5))
        .service(link.clone());
    let first = tokio::spawn(client.clone().oneshot(keyed("order-8")));
    tokio::task::yield_now().await;

    let second = client.oneshot(keyed("order-8")).await.unwrap();

    assert_eq!(second.status(), StatusCode::CREATED);
    let attempts = attempts(&second);
    assert_eq!((attempts.count(), attempts.replayed()), (4, true));
    assert_eq!(text(second).await, "ch_1");
    let first = first.await.unwrap().unwrap();
    assert_eq!(text(first).await, "ch_1");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one execution");
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds_is_waited_exactly() {
    let (server, _runs) = server(Duration::ZERO, unavailable_once("7".into()));
    let link = Link::new(server, []);
    // A backoff that would wait far less: the server's figure wins.
    let client = ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .backoff(Duration::from_millis(10), Duration::from_millis(10)),
        )
        .service(link.clone());

    let response = client.oneshot(charge("x")).await.unwrap();

    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(link.gaps(), [Duration::from_secs(7)]);
}

/// An HTTP date is read against the wall clock (the only clock it can be), and waited on tokio's.
#[tokio::test(start_paused = true)]
async fn retry_after_as_a_date_is_waited_until_that_date() {
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(5));
    let (server, _runs) = server(Duration::ZERO, unavailable_once(date));
    let link = Link::new(server, []);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());

    let response = client.oneshot(charge("x")).await.unwrap();

    assert_eq!(response.status(), StatusCode::OK);
    let gap = link.gaps()[0];
    // The date has whole seconds: it names a moment between 4 and 5 s from now.
    assert!(
        gap > Duration::from_secs(3) && gap <= Duration::from_secs(5),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn every_attempt_carries_the_same_key_and_bytes() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::Refuse, Fault::LoseResponse]);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());
    // A body that arrives in pieces, once: the layer reads it and sends the same bytes each time.
    let chunks = ["amount=2500", "&currency=eur", "&source=tok_visa"]
        .map(|chunk| Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(chunk))));
    let body = StreamBody::new(futures_util::stream::iter(chunks));
    let request = Request::post("/v1/charges").body(body).unwrap();

    let response = client.oneshot(request).await.unwrap();

    assert_eq!(attempts(&response).count(), 3);
    let sent = link.sent();
    assert_eq!(sent.len(), 3);
    let key = sent[0].key.clone().unwrap();
    for attempt in &sent {
        assert_eq!(attempt.key.as_ref(), Some(&key));
        assert_eq!(attempt.body, "amount=2500&currency=eur&source=tok_visa");
    }
    assert_eq!(attempts(&response).key(), Some(&key));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn two_operations_never_share_a_key() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, []);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());

    for _ in 0..2 {
        let response = client.clone().oneshot(charge("amount=100")).await.unwrap();
        assert_eq!(response.headers().get("idempotent-replayed"), None);
    }

    let keys: Vec<HeaderValue> = link.sent().into_iter().map(|s| s.key.unwrap()).collect();
    assert_ne!(keys[0], keys[1]);
    for key in &keys {
        let uuid = uuid::Uuid::parse_str(key.to_str().unwrap()).unwrap();
        assert_eq!(uuid.get_version_num(), 4);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the same body, two charges");
}

#[tokio::test(start_paused = true)]
async fn the_callers_own_key_is_kept() {
    let (server, _runs) = server(Duration::ZERO, charges());
    let link = Link::new(server, [Fault::LoseResponse]);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());
    let mut request = charge("amount=100");
    let key = HeaderValue::from_static("order-1001");
    request.headers_mut().insert("idempotency-key", key.clone());

    let response = client.oneshot(request).await.unwrap();

    assert!(attempts(&response).replayed());
    assert_eq!(attempts(&response).key(), Some(&key));
    assert!(link.sent().iter().all(|s| s.key.as_ref() == Some(&key)));
}

/// A POST without a key (none made: `key_methods` is empty) is sent once: its failure is not
/// known to be safe to repeat. A GET is idempotent: retried, and it gets no key.
#[tokio::test(start_paused = true)]
async fn only_requests_that_may_be_repeated_are_retried() {
    let (server, runs) = server(Duration::ZERO, charges());
    let link = Link::new(server.clone(), [Fault::LoseResponse]);
    let client = ServiceBuilder::new()
        .layer(layer().key_methods([]))
        .service(link.clone());
    let err = client.oneshot(charge("x")).await.unwrap_err();
    assert!(
        matches!(err, Error::Transport { attempts: 1, .. }),
        "{err:?}"
    );
    assert_eq!(link.sent()[0].key, None);

    let link = Link::new(server, [Fault::Refuse]);
    let client = ServiceBuilder::new().layer(layer()).service(link.clone());
    let get = Request::get("/v1/charges")
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = client.oneshot(get).await.unwrap();
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(attempts(&response).count(), 2);
    assert_eq!(attempts(&response).key(), None);
    assert!(link.sent().iter().all(|s| s.key.is_none()));
    // The server refused the keyless POST (400, lost on the way) and has no GET route.
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// PATCH is not idempotent (RFC 9110 §9.2.2): without a key (`key_methods` here is POST only) it
/// is sent once, after a lost answer as after a `500`, or the server applies the partial update
/// again.
#[tokio::test(start_paused = true)]
async fn a_patch_without_a_key_is_sent_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let api = axum::Router::new().route(
        "/v1/charges/ch_1",
        axum::routing::patch(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { StatusCode::INTERNAL_SERVER_ERROR }
        }),
    );
    let link = Link::new(api, [Fault::LoseResponse]);
    let client = ServiceBuilder::new()
        .layer(layer().key_methods([Method::POST]))
        .service(link.clone());
    let patch = || {
        Request::patch("/v1/charges/ch_1")
            .body(Full::<Bytes>::from("amount=200"))
            .unwrap()
    };

    let err = client.clone().oneshot(patch()).await.unwrap_err();
    assert!(
        matches!(err, Error::Transport { attempts: 1, .. }),
        "{err:?}"
    );
    let response = client.oneshot(patch()).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(attempts(&response).count(), 1);

    assert_eq!(runs.load(Ordering::SeqCst), 2, "once per call");
    assert!(link.sent().iter().all(|s| s.key.is_none()));
}
