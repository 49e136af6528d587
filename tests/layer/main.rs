//! Layer behaviour that does not depend on the store (run on `MemoryStore`, paused time): the key
//! header through HTTP, which methods are covered, request limits, problem responses, the key in
//! extensions and the axum extractor, and the builder's settings. Its modules: the circuit
//! breaker, JSON bodies by meaning, a hyper server, the problems' renderers, the replay cache,
//! metrics, when answers come over a slow store, store wrappers passing `prepare` through, and
//! what waiting duplicates cost.

mod breaker;
mod canonical_json;
mod hyper_server;
mod metrics;
mod quota_and_breaker;
mod render;
mod replay_cache;
mod timing;
mod wait_cost;
mod wrappers;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::ScopeQuota;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MemoryStore, Outcome, Rejection, RequestBody,
};
use tower_idempotency_test::{
    Counting, Faulty, Handler, Reply, assert_a_quota_keeps_a_flood_off_the_others, created,
    gated_handler, keyed, pattern, post as post_request, respond, send, service, spawn_send,
    status_handler, status_request, streamed,
};

type Store = Counting<MemoryStore>;

fn store() -> Store {
    Counting::new(MemoryStore::new())
}

fn echo() -> Handler {
    Handler::ok(|call| created(format!("call {}", call.n)))
}

/// A POST with the raw key header value `key`.
fn post_raw(key: HeaderValue) -> Request<Body> {
    Request::post("/")
        .header("idempotency-key", key)
        .body(Body::from("x"))
        .expect("a request")
}

#[track_caller]
fn assert_rejected(reply: &Reply, kind: ProblemKind, status: StatusCode) {
    reply.assert_problem(kind, status);
    assert_eq!(reply.outcome, Some(Outcome::Rejected), "{reply:?}");
}

// ---------------------------------------------------------------------------------------------
// The key
// ---------------------------------------------------------------------------------------------

/// Every invalid key form gets a 400 problem, never reaches the handler, and claims nothing.
/// PROTOCOL.md §2.3.
#[tokio::test(start_paused = true)]
async fn invalid_keys_get_400_and_never_reach_the_handler() {
    let store = store();
    let handler = echo();
    let svc = service(IdempotencyLayer::new(store.clone()), handler.clone());

    let too_long = "k".repeat(256);
    let too_long_quoted = format!("\"{}\"", "k".repeat(256));
    let values: Vec<(&str, HeaderValue)> = vec![
        ("empty", HeaderValue::from_static("")),
        ("empty quoted", HeaderValue::from_static("\"\"")),
        (
            "256 characters",
            HeaderValue::from_str(&too_long).expect("ascii"),
        ),
        (
            "256 characters quoted",
            HeaderValue::from_str(&too_long_quoted).expect("ascii"),
        ),
        ("space inside", HeaderValue::from_static("a b")),
        ("space inside quotes", HeaderValue::from_static("\"a b\"")),
        ("control character", HeaderValue::from_static("a\tb")),
        (
            "non-ASCII byte",
            HeaderValue::from_bytes(b"key\xff").expect("obs-text"),
        ),
        (
            "UTF-8",
            HeaderValue::from_bytes("caf\u{e9}".as_bytes()).expect("obs-text"),
        ),
        ("unterminated quote", HeaderValue::from_static("\"abc")),
        ("bad escape", HeaderValue::from_static("\"a\\x\"")),
        ("list with space", HeaderValue::from_static("a, b")),
        ("list", HeaderValue::from_static("a,b")),
        ("list of strings", HeaderValue::from_static("\"a\", \"b\"")),
        ("parameter", HeaderValue::from_static("\"a\";p=1")),
        ("quote inside bare key", HeaderValue::from_static("ab\"c")),
    ];
    for (what, value) in values {
        let reply = send(&svc, post_raw(value)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {reply:?}");
        assert_rejected(&reply, ProblemKind::InvalidKey, StatusCode::BAD_REQUEST);
    }

    let two = Request::post("/")
        .header("idempotency-key", "a")
        .header("idempotency-key", "a")
        .body(Body::from("x"))
        .expect("a request");
    assert_rejected(
        &send(&svc, two).await,
        ProblemKind::InvalidKey,
        StatusCode::BAD_REQUEST,
    );

    assert_eq!(handler.calls(), 0, "no invalid key reached the handler");
    assert_eq!(store.calls().total(), 0, "no invalid key reached the store");
}

/// A 255-character key works (and is replayed); the handler sees it unchanged.
/// PROTOCOL.md §2.2, §2.4.
#[tokio::test(start_paused = true)]
async fn longest_key_is_accepted() {
    let handler = Handler::ok(|call| {
        created(
            call.key()
                .map(|k| k.as_str().to_owned())
                .unwrap_or_default(),
        )
    });
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), handler.clone());
    let key = format!("{}{}", "7".repeat(254), "~");
    for _ in 0..2 {
        let reply = send(&svc, post_request(&key, "x")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(reply.text(), key);
    }
    let quoted = send(&svc, post_request(&format!("\"{key}\""), "x")).await;
    assert_eq!(quoted.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 1);
}

/// The quoted sf-string `"k1"` and the bare `k1` are one key, in either order; escapes are
/// unescaped.
/// PROTOCOL.md §2.1.
#[tokio::test(start_paused = true)]
async fn quoted_and_bare_keys_are_one_key() {
    let handler = echo();
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), handler.clone());

    let first = send(&svc, post_request("\"k1\"", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let second = send(&svc, post_request("k1", "x")).await;
    assert_eq!(second.outcome, Some(Outcome::Replayed));
    assert_eq!(second.body, first.body);

    let bare = send(
        &svc,
        post_request("8e03978e-40d5-43e8-bc93-6894a57f9324", "x"),
    )
    .await;
    assert_eq!(bare.outcome, Some(Outcome::Executed));
    let quoted = send(
        &svc,
        post_request("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"", "x"),
    )
    .await;
    assert_eq!(quoted.outcome, Some(Outcome::Replayed));

    // `"a\\b"` unquotes to `a\b`, which is also a valid bare key.
    let escaped = send(&svc, post_request(r#""a\\b""#, "x")).await;
    assert_eq!(escaped.outcome, Some(Outcome::Executed));
    let bare = send(&svc, post_request(r"a\b", "x")).await;
    assert_eq!(bare.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 3);
}

/// A covered request without a key gets 400 by default.
/// PROTOCOL.md §1.4.
#[tokio::test(start_paused = true)]
async fn missing_key_gets_400() {
    let store = store();
    let handler = echo();
    let svc = service(IdempotencyLayer::new(store.clone()), handler.clone());
    for method in [Method::POST, Method::PATCH] {
        let request = Request::builder()
            .method(method)
            .uri("/")
            .body(Body::from("x"))
            .expect("a request");
        let reply = send(&svc, request).await;
        assert_rejected(&reply, ProblemKind::MissingKey, StatusCode::BAD_REQUEST);
    }
    assert_eq!(handler.calls(), 0);
    assert_eq!(store.calls().total(), 0);
}

/// With `key_required(false)`, a request without a key passes through, runs every time and makes
/// no store call; a request with a key is still protected.
/// PROTOCOL.md §1.4.
#[tokio::test(start_paused = true)]
async fn optional_key_passes_through_every_time_without_store_calls() {
    let store = store();
    let handler = echo();
    let svc = service(
        IdempotencyLayer::new(store.clone()).key_required(false),
        handler.clone(),
    );
    for n in 1..=3 {
        let reply = send(
            &svc,
            Request::post("/").body(Body::from("x")).expect("a request"),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(reply.outcome, Some(Outcome::Unprotected));
        assert_eq!(reply.text(), format!("call {n}"));
    }
    assert_eq!(handler.calls(), 3);
    assert_eq!(store.calls().total(), 0, "no key, no store call");

    let first = send(&svc, post_request("k", "x")).await;
    let replay = send(&svc, post_request("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 4);
    let invalid = send(&svc, post_raw(HeaderValue::from_static("a b"))).await;
    assert_rejected(&invalid, ProblemKind::InvalidKey, StatusCode::BAD_REQUEST);
}

// ---------------------------------------------------------------------------------------------
// Methods
// ---------------------------------------------------------------------------------------------

/// A body fed through a channel: the stream ends only when the sender is dropped.
fn channel_body() -> (tokio::sync::mpsc::UnboundedSender<Bytes>, Body) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, Infallible>(chunk), rx))
    });
    (tx, Body::from_stream(stream))
}

/// An inner service that answers with the first chunk of the request body, without waiting for
/// the rest, and whether the request carried a key extension.
fn first_chunk_service(
    calls: Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<RequestBody<Body>>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send {
    tower::service_fn(move |request: Request<RequestBody<Body>>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let has_key = request.extensions().get::<IdempotencyKey>().is_some();
            let mut body = request.into_body();
            let first = match body.frame().await {
                Some(Ok(frame)) => frame.into_data().unwrap_or_default(),
                _ => Bytes::new(),
            };
            let text = format!("{} key:{has_key}", String::from_utf8_lossy(&first));
            Ok::<_, Infallible>(Response::new(Body::from(text)))
        }
    })
}

/// GET, HEAD, OPTIONS, DELETE and PUT pass through untouched by default, even with an invalid key
/// header: the handler runs every time, no store call, and the body is not buffered (the handler
/// answers from the first chunk while the client has not finished sending).
/// PROTOCOL.md §1.1, §1.2.
#[tokio::test(start_paused = true)]
async fn unprotected_methods_pass_through_untouched() {
    let store = store();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = service(
        IdempotencyLayer::new(store.clone()),
        first_chunk_service(calls.clone()),
    );
    let methods = [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::DELETE,
        Method::PUT,
    ];
    for method in methods.clone() {
        for key in ["k", "not a valid key"] {
            let (tx, body) = channel_body();
            tx.send(Bytes::from("first chunk")).expect("send");
            let request = keyed(method.clone(), "/", key)
                .body(body)
                .expect("a request");
            let reply = tokio::time::timeout(Duration::from_secs(60), send(&svc, request))
                .await
                .unwrap_or_else(|_| {
                    panic!("{method}: the layer waited for the whole body (it buffered it)")
                });
            assert_eq!(reply.status, StatusCode::OK, "{method}");
            assert_eq!(reply.text(), "first chunk key:false", "{method}");
            assert_eq!(reply.outcome, None, "{method}: no outcome on a passthrough");
            drop(tx);
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2 * methods.len());
    assert_eq!(store.calls().total(), 0, "no store call");
}

/// `methods` replaces the covered set: PUT is protected, POST passes through.
/// PROTOCOL.md §1.1.
#[tokio::test(start_paused = true)]
async fn configured_methods_are_the_only_ones_protected() {
    let store = store();
    let handler = echo();
    let svc = service(
        IdempotencyLayer::new(store.clone()).methods([Method::PUT]),
        handler.clone(),
    );
    for n in 1..=2 {
        let reply = send(&svc, post_request("k", "x")).await;
        assert_eq!((reply.outcome, reply.text()), (None, format!("call {n}")));
    }
    assert_eq!(store.calls().total(), 0);
    let put = || {
        keyed(Method::PUT, "/", "k")
            .body(Body::from("x"))
            .expect("a request")
    };
    assert_eq!(send(&svc, put()).await.outcome, Some(Outcome::Executed));
    assert_eq!(send(&svc, put()).await.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 3);
}

// ---------------------------------------------------------------------------------------------
// The request body
// ---------------------------------------------------------------------------------------------

/// A body over the limit (with a Content-Length, or streamed without one) gets 413; nothing is
/// claimed and the handler does not run; the key is not blocked: a small body with it works.
/// PROTOCOL.md §1.5.
#[tokio::test(start_paused = true)]
async fn oversized_request_gets_413_and_claims_nothing() {
    let store = store();
    let handler = echo();
    let svc = service(
        IdempotencyLayer::new(store.clone()).request_body_limit(16),
        handler.clone(),
    );

    let sized = keyed(Method::POST, "/", "k")
        .header(CONTENT_LENGTH, "17")
        .body(Body::from(vec![b'x'; 17]))
        .expect("a request");
    let reply = send(&svc, sized).await;
    assert_rejected(
        &reply,
        ProblemKind::BodyTooLarge,
        StatusCode::PAYLOAD_TOO_LARGE,
    );
    assert!(
        reply.json()["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("larger than 16 bytes")),
        "the detail names the limit: {}",
        reply.text()
    );

    // 4 chunks of 8 bytes, no length: the layer finds out while reading.
    let reply = send(&svc, post_request("k", streamed(4, 8))).await;
    assert_rejected(
        &reply,
        ProblemKind::BodyTooLarge,
        StatusCode::PAYLOAD_TOO_LARGE,
    );

    assert_eq!(store.calls().claim, 0, "nothing was claimed");
    assert_eq!(handler.calls(), 0);

    // At the limit exactly, streamed or not, the same key works.
    let first = send(&svc, post_request("k", streamed(2, 8))).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let replay = send(
        &svc,
        post_request(
            "k",
            vec![0u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        ),
    )
    .await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "the same 16 bytes");
    assert_eq!(handler.calls(), 1);
}

/// A request body that fails while it is read gets a 400 problem; nothing is claimed.
/// PROTOCOL.md §1.5.
#[tokio::test(start_paused = true)]
async fn unreadable_request_body_gets_400() {
    let store = store();
    let handler = echo();
    let svc = service(IdempotencyLayer::new(store.clone()), handler.clone());
    let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from("partial")),
        Err(std::io::Error::other("connection reset")),
    ];
    let body = Body::from_stream(futures_util::stream::iter(chunks));
    let reply = send(&svc, post_request("k", body)).await;
    assert_rejected(&reply, ProblemKind::BodyUnreadable, StatusCode::BAD_REQUEST);
    assert_eq!(store.calls().claim, 0);
    assert_eq!(handler.calls(), 0);
}

/// `bytes` in 8 KiB chunks, with no length: as a client or a handler streams a large body.
fn chunked(bytes: Vec<u8>) -> Body {
    const CHUNK: usize = 8 * 1024;
    let bytes = Bytes::from(bytes);
    let chunks: Vec<Result<Bytes, Infallible>> = (0..bytes.len())
        .step_by(CHUNK)
        .map(|at| Ok(bytes.slice(at..bytes.len().min(at + CHUNK))))
        .collect();
    Body::from_stream(futures_util::stream::iter(chunks))
}

/// The default limits at full size (1 MiB each way): a request body of exactly the limit reaches
/// the handler whole, and its answer of exactly the limit is stored and replayed byte for byte.
/// One byte more of request is 413 with nothing claimed; one byte more of answer reaches the
/// client whole but leaves a tombstone. PROTOCOL.md §1.5, §8.4, §6.4.
#[tokio::test(start_paused = true)]
async fn the_largest_exchange_the_default_limits_allow_replays_byte_for_byte() {
    const LIMIT: usize = 1024 * 1024;
    let store = store();
    // Echoes the request body and `x-more` bytes after it, in chunks; `x-call` names the run.
    let handler = Handler::ok(|call| {
        let more: usize = call
            .header("x-more")
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut body = call.body.to_vec();
        body.extend(pattern(more));
        Response::builder()
            .status(StatusCode::CREATED)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header("x-call", call.n.to_string())
            .body(chunked(body))
            .expect("a response")
    });
    let svc = service(IdempotencyLayer::new(store.clone()), handler.clone());
    let request = |key: &str, size: usize, more: usize| {
        keyed(Method::POST, "/", key)
            .header("x-more", more.to_string())
            .body(chunked(pattern(size)))
            .expect("a request")
    };

    let first = send(&svc, request("largest", LIMIT, 0)).await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed)),
        "{first:?}"
    );
    assert!(
        first.body == pattern(LIMIT),
        "the handler got the whole request and the client its whole answer: {} bytes",
        first.body.len()
    );
    let replay = send(&svc, request("largest", LIMIT, 0)).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert!(replay.is_replay());
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.header_list(), first.header_list(), "x-call: 1 kept");
    assert!(replay.body == first.body, "the same body, byte for byte");
    assert_eq!(handler.calls(), 1);

    let claims = store.calls().claim;
    let over = send(&svc, request("request-over", LIMIT + 1, 0)).await;
    assert_rejected(
        &over,
        ProblemKind::BodyTooLarge,
        StatusCode::PAYLOAD_TOO_LARGE,
    );
    assert_eq!(store.calls().claim, claims, "nothing was claimed");
    assert_eq!(handler.calls(), 1, "the handler did not run");

    let over = send(&svc, request("response-over", LIMIT, 1)).await;
    assert_eq!(over.outcome, Some(Outcome::Executed), "{over:?}");
    let mut whole = pattern(LIMIT);
    whole.extend(pattern(1));
    assert!(
        over.body == whole,
        "delivered whole: {} bytes",
        over.body.len()
    );
    let retry = send(&svc, request("response-over", LIMIT, 1)).await;
    retry.assert_problem(ProblemKind::NotReplayable, StatusCode::CONFLICT);
    assert_eq!(
        handler.calls(),
        2,
        "the tombstone kept it from running again"
    );
}

// ---------------------------------------------------------------------------------------------
// Problem responses
// ---------------------------------------------------------------------------------------------

/// Every error the layer makes is `application/problem+json` with `Cache-Control: no-store` and a
/// JSON `type`, `title`, `status` (matching the HTTP status) and `detail`; each kind has its own
/// stable type URI.
/// PROTOCOL.md §7.1, §7.2.
#[tokio::test(start_paused = true)]
async fn every_layer_error_is_a_problem_json() {
    let mut seen = Vec::new();
    let mut check = |kind: ProblemKind, status: StatusCode, anchor: &str, reply: Reply| {
        reply.assert_problem(kind, status);
        assert!(
            kind.type_uri().ends_with(&format!("#{anchor}")),
            "{kind:?}: {}",
            kind.type_uri()
        );
        assert!(kind.type_uri().starts_with("https://"));
        assert_eq!(reply.json()["title"], kind.title());
        seen.push(kind.type_uri());
    };

    let svc = service(
        IdempotencyLayer::new(MemoryStore::new()).request_body_limit(4),
        echo(),
    );
    let missing = Request::post("/").body(Body::from("x")).expect("a request");
    check(
        ProblemKind::MissingKey,
        StatusCode::BAD_REQUEST,
        "missing-key",
        send(&svc, missing).await,
    );
    check(
        ProblemKind::InvalidKey,
        StatusCode::BAD_REQUEST,
        "invalid-key",
        send(&svc, post_request("a,b", "x")).await,
    );
    check(
        ProblemKind::BodyTooLarge,
        StatusCode::PAYLOAD_TOO_LARGE,
        "body-too-large",
        send(&svc, post_request("big", "12345")).await,
    );
    let failing: Vec<Result<Bytes, std::io::Error>> = vec![Err(std::io::Error::other("reset"))];
    check(
        ProblemKind::BodyUnreadable,
        StatusCode::BAD_REQUEST,
        "body-unreadable",
        send(
            &svc,
            post_request(
                "unreadable",
                Body::from_stream(futures_util::stream::iter(failing)),
            ),
        )
        .await,
    );

    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let svc = service(
        IdempotencyLayer::new(MemoryStore::new()).response_body_limit(4),
        gated_handler(started.clone(), gate.clone(), "response"),
    );
    let held = spawn_send(&svc, post_request("held", "x"));
    started.notified().await;
    check(
        ProblemKind::InFlight,
        StatusCode::CONFLICT,
        "in-flight",
        send(&svc, post_request("held", "x")).await,
    );
    check(
        ProblemKind::Mismatch,
        StatusCode::UNPROCESSABLE_ENTITY,
        "mismatch",
        send(&svc, post_request("held", "y")).await,
    );
    gate.notify_one();
    assert_eq!(held.await.expect("task").text(), "response 1");
    check(
        ProblemKind::NotReplayable,
        StatusCode::CONFLICT,
        "not-replayable",
        send(&svc, post_request("held", "x")).await,
    );

    let faulty = Faulty::new(MemoryStore::new());
    faulty.fail(true);
    let svc = service(IdempotencyLayer::new(faulty), echo());
    check(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        send(&svc, post_request("k", "x")).await,
    );

    let failing = Handler::new(|_| async { Err(tower::BoxError::from("boom")) });
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), failing);
    check(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-failed",
        send(&svc, post_request("k", "x")).await,
    );

    let faulty = Faulty::new(MemoryStore::new());
    faulty.reject_completions(true);
    let svc = service(IdempotencyLayer::new(faulty), echo());
    check(
        ProblemKind::CommitRejected,
        StatusCode::UNPROCESSABLE_ENTITY,
        "commit-rejected",
        send(&svc, post_request("k", "x")).await,
    );

    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 10, "one distinct type per kind");
}

/// A completion the store rejects for good (the handler's transaction broke a rule of the
/// database) is not reported as done, and not as a store outage: 422 `commit-rejected` without
/// `Retry-After`, the write is not retried, and the key is free: the same request runs again, and
/// once the store accepts, it is stored and replayed. A status set with `problem_status` is the
/// one sent. PROTOCOL.md §9.9, §7.2, §7.3.
#[tokio::test(start_paused = true)]
async fn a_rejected_completion_is_an_answer_and_frees_the_key() {
    let faulty = Faulty::new(MemoryStore::new());
    let store = Counting::new(faulty.clone());
    let handler = echo();
    let layer = IdempotencyLayer::new(store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.reject_completions(true);
    for run in 1..=2 {
        let rejected = send(&svc, post_request("k", "x")).await;
        rejected.assert_problem(
            ProblemKind::CommitRejected,
            StatusCode::UNPROCESSABLE_ENTITY,
        );
        assert_eq!(rejected.outcome, Some(Outcome::CommitRejected));
        assert_eq!(
            rejected.header(RETRY_AFTER),
            None,
            "retrying as it is cannot help"
        );
        assert_ne!(
            rejected.text(),
            format!("call {run}"),
            "the rolled-back response is not delivered"
        );
    }
    shutdown.clone().wait().await;
    let calls = store.calls();
    assert_eq!(
        (calls.complete, handler.calls()),
        (2, 2),
        "no write is retried; each request ran, as the key was free again"
    );

    faulty.reject_completions(false);
    let accepted = send(&svc, post_request("k", "x")).await;
    assert_eq!(accepted.outcome, Some(Outcome::Executed));
    assert_eq!(accepted.text(), "call 3");
    let replay = send(&svc, post_request("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 3);

    faulty.reject_completions(true);
    let remapped = service(
        IdempotencyLayer::new(faulty.clone())
            .problem_status(ProblemKind::CommitRejected, StatusCode::CONFLICT),
        echo(),
    );
    send(&remapped, post_request("other", "x"))
        .await
        .assert_problem(ProblemKind::CommitRejected, StatusCode::CONFLICT);
}

/// `problem_status(ProblemKind::Mismatch, 409)` answers a mismatch with 409 instead of 422.
/// PROTOCOL.md §7.3.
#[tokio::test(start_paused = true)]
async fn mismatch_status_is_configurable() {
    let handler = echo();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .problem_status(ProblemKind::Mismatch, StatusCode::CONFLICT);
    let svc = service(layer, handler.clone());
    send(&svc, post_request("k", "a")).await;
    let reply = send(&svc, post_request("k", "b")).await;
    reply.assert_problem(ProblemKind::Mismatch, StatusCode::CONFLICT);
    assert_eq!(reply.outcome, Some(Outcome::Mismatch));
    assert_eq!(handler.calls(), 1);
}

/// `retry_after` sets the `Retry-After` of a 409 in flight and of a 503, rounded up to whole
/// seconds.
/// PROTOCOL.md §6.3.
#[tokio::test(start_paused = true)]
async fn retry_after_is_configurable_in_whole_seconds() {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = IdempotencyLayer::new(MemoryStore::new()).retry_after(Duration::from_millis(2_500));
    let svc = service(layer, gated_handler(started.clone(), gate.clone(), "done"));
    let held = spawn_send(&svc, post_request("k", "x"));
    started.notified().await;
    assert_eq!(
        send(&svc, post_request("k", "x")).await.assert_in_flight(),
        3
    );
    gate.notify_one();
    held.await.expect("task");

    let faulty = Faulty::new(MemoryStore::new());
    faulty.fail(true);
    let layer = IdempotencyLayer::new(faulty).retry_after(Duration::from_millis(2_500));
    let reply = send(&service(layer, echo()), post_request("k", "x")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.header(RETRY_AFTER), Some("3"));
}

// ---------------------------------------------------------------------------------------------
// The key in handlers
// ---------------------------------------------------------------------------------------------

/// Through an `axum::Router`: a handler taking `IdempotencyKey` gets the unquoted key;
/// `Option<IdempotencyKey>` is `None` on an unprotected GET; a required key on an unprotected route
/// is a 500 problem (a wiring error).
/// PROTOCOL.md §2.4, §7.4.
#[tokio::test(start_paused = true)]
async fn extractor_gets_the_key() {
    async fn optional(key: Option<IdempotencyKey>) -> String {
        match key {
            Some(key) => format!("some {key}"),
            None => String::from("none"),
        }
    }
    let app =
        Router::new()
            .route(
                "/charges",
                post(|key: IdempotencyKey| async move {
                    format!("{} {}", key.as_str(), key.derive("psp"))
                }),
            )
            .route("/optional", get(optional).post(optional))
            .route(
                "/required",
                get(|key: IdempotencyKey| async move { key.to_string() }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()));

    let request = keyed(Method::POST, "/charges", "\"order-42\"")
        .body(Body::empty())
        .expect("a request");
    let reply = send(&app, request).await;
    let expected = IdempotencyKey::parse(&HeaderValue::from_static("order-42"))
        .expect("a key")
        .derive("psp");
    assert_eq!(reply.text(), format!("order-42 {expected}"));

    let request = Request::get("/optional")
        .header("idempotency-key", "k")
        .body(Body::empty())
        .expect("a request");
    assert_eq!(send(&app, request).await.text(), "none");
    let request = keyed(Method::POST, "/optional", "k")
        .body(Body::empty())
        .expect("a request");
    assert_eq!(send(&app, request).await.text(), "some k");

    let request = Request::get("/required")
        .body(Body::empty())
        .expect("a request");
    let reply = send(&app, request).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.header(CONTENT_TYPE), Some("application/problem+json"));
}

/// Through `tower::ServiceBuilder`: the key is in the request's extensions.
/// PROTOCOL.md §2.4.
#[tokio::test(start_paused = true)]
async fn handler_gets_the_key_in_its_extensions() {
    let handler = Handler::ok(|call| {
        let key = call.key().expect("a key extension");
        created(format!("{} {}", key.as_str(), key.derive("acct_1")))
    });
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), handler);
    let reply = send(&svc, post_request("\"a\\\"b\"", "x")).await;
    let key = IdempotencyKey::parse(&HeaderValue::from_static("\"a\\\"b\"")).expect("a key");
    assert_eq!(reply.text(), format!("a\"b {}", key.derive("acct_1")));
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------

/// `header_name` moves the key to another header; the default header is then ignored.
/// PROTOCOL.md §1.3.
#[tokio::test(start_paused = true)]
async fn header_name_is_configurable() {
    let handler = echo();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .header_name(HeaderName::from_static("x-request-key"));
    let svc = service(layer, handler.clone());
    let request = || {
        Request::post("/")
            .header("x-request-key", "k")
            .body(Body::from("x"))
            .expect("a request")
    };
    assert_eq!(send(&svc, request()).await.outcome, Some(Outcome::Executed));
    assert_eq!(send(&svc, request()).await.outcome, Some(Outcome::Replayed));
    let reply = send(&svc, post_request("k", "x")).await;
    assert_rejected(&reply, ProblemKind::MissingKey, StatusCode::BAD_REQUEST);
    assert_eq!(handler.calls(), 1);
}

/// Request headers are not part of the fingerprint by default; `fingerprint_headers` adds them.
/// PROTOCOL.md §4.1.
#[tokio::test(start_paused = true)]
async fn fingerprint_headers_are_opt_in() {
    let request = |content_type: &str| {
        keyed(Method::POST, "/", "k")
            .header(CONTENT_TYPE, content_type)
            .body(Body::from("{}"))
            .expect("a request")
    };

    let svc = service(IdempotencyLayer::new(MemoryStore::new()), echo());
    send(&svc, request("application/json")).await;
    let reply = send(&svc, request("text/plain")).await;
    assert_eq!(reply.outcome, Some(Outcome::Replayed), "by default");

    let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint_headers([CONTENT_TYPE]);
    let svc = service(layer, echo());
    send(&svc, request("application/json")).await;
    assert_eq!(
        send(&svc, request("application/json")).await.outcome,
        Some(Outcome::Replayed)
    );
    let reply = send(&svc, request("text/plain")).await;
    reply.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
}

/// `store_policy` decides what is stored; `Cache-Control: no-store` wins over any policy.
/// PROTOCOL.md §8.1, §8.2.
#[tokio::test(start_paused = true)]
async fn store_policy_is_configurable_and_no_store_wins() {
    let handler = status_handler();
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).store_policy(|head: &http::response::Parts| {
            head.status == StatusCode::CREATED || head.status.is_server_error()
        });
    let svc = service(layer, handler.clone());

    for _ in 0..2 {
        let reply = send(&svc, status_request("ok", 200, None)).await;
        assert_eq!(reply.outcome, Some(Outcome::NotStored));
    }
    assert_eq!(handler.calls(), 2);
    for (key, status) in [("created", 201), ("error", 503)] {
        send(&svc, status_request(key, status, None)).await;
        let replay = send(&svc, status_request(key, status, None)).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{status}");
        assert_eq!(replay.status.as_u16(), status);
    }
    assert_eq!(handler.calls(), 4);
    for _ in 0..2 {
        let reply = send(&svc, status_request("no-store", 201, Some("no-store"))).await;
        assert_eq!(reply.outcome, Some(Outcome::NotStored));
    }
    assert_eq!(handler.calls(), 6);
}

/// `Every4xxStorePolicy`, the default up to 0.1, stores a request refused as it was sent (a
/// validation or authentication failure): the retry gets it replayed, and a corrected request
/// under the same key is a mismatch. The default stores none of them (the contract suite's
/// `responses_that_are_not_stored_run_again`).
/// PROTOCOL.md §8.1.
#[tokio::test(start_paused = true)]
async fn every_4xx_store_policy_stores_validation_failures() {
    let handler = status_handler();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .store_policy(tower_idempotency::Every4xxStorePolicy);
    let svc = service(layer, handler.clone());
    for (i, status) in [400, 401, 403, 404, 413, 415, 422].into_iter().enumerate() {
        let key = format!("refused-{status}");
        let first = send(&svc, status_request(&key, status, None)).await;
        assert_eq!(first.status.as_u16(), status);
        assert_eq!(
            first.outcome,
            Some(Outcome::Executed),
            "{status}: {first:?}"
        );
        let replay = send(&svc, status_request(&key, status, None)).await;
        assert_eq!(
            replay.outcome,
            Some(Outcome::Replayed),
            "{status}: {replay:?}"
        );
        assert_eq!(replay.body, first.body, "{status}");
        assert_eq!(
            handler.calls(),
            i + 1,
            "§8.1: stored, so run once: {status}"
        );
    }
    let corrected = send(
        &svc,
        keyed(Method::POST, "/", "refused-422")
            .body(Body::from("corrected"))
            .expect("a request"),
    )
    .await;
    corrected.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    for (key, status) in [("in-flight", 409), ("busy", 429)] {
        send(&svc, status_request(key, status, None)).await;
        let again = send(&svc, status_request(key, status, None)).await;
        assert_eq!(again.outcome, Some(Outcome::NotStored), "{status}");
    }
}

/// The policy sees the response's extensions: a handler marks one response "do not store" by
/// type, with nothing the client sees, and only that response runs again on a retry.
/// PROTOCOL.md §8.1.
#[tokio::test(start_paused = true)]
async fn store_policy_reads_a_marker_in_the_response_extensions() {
    #[derive(Debug, Clone)]
    struct DoNotStore;
    let handler = Handler::ok(|call| {
        let mut response = created(format!("call {}", call.n));
        if call.header("x-volatile").is_some() {
            response.extensions_mut().insert(DoNotStore);
        }
        response
    });
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).store_policy(|head: &http::response::Parts| {
            tower_idempotency::DefaultStorePolicy::stores(head.status)
                && head.extensions.get::<DoNotStore>().is_none()
        });
    let svc = service(layer, handler.clone());
    let request = |key: &str, volatile: bool| {
        let builder = keyed(Method::POST, "/", key);
        let builder = if volatile {
            builder.header("x-volatile", "1")
        } else {
            builder
        };
        builder.body(Body::from("x")).expect("a request")
    };

    for n in 1..=2 {
        let reply = send(&svc, request("volatile", true)).await;
        assert_eq!(reply.outcome, Some(Outcome::NotStored));
        assert_eq!(reply.text(), format!("call {n}"));
        assert_eq!(
            reply.headers.len(),
            0,
            "no marker reaches the client: {reply:?}"
        );
    }
    let first = send(&svc, request("kept", false)).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let replay = send(&svc, request("kept", false)).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.text(), "call 3");
    assert_eq!(handler.calls(), 3);
}

/// A handler's refusal made before any effect, answered `Cache-Control: no-store` (a 400, which
/// `Every4xxStorePolicy` would store; the default stores none), leaves no record, fingerprint
/// included: the same key with a corrected body runs, where a stored 400 would have made it a
/// different request (422). The key then holds the corrected request: its retry replays, and the
/// refused body gets the 422.
/// PROTOCOL.md §8.2, §8.1, §4.3.
#[tokio::test(start_paused = true)]
async fn a_no_store_refusal_leaves_the_key_to_the_corrected_request() {
    let store = store();
    let handler = Handler::ok(|call| {
        if call.body == "amount=ten" {
            let mut refusal = respond(400, format!("amount is not a number (call {})", call.n));
            refusal
                .headers_mut()
                .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
            refusal
        } else {
            created(format!("charged (call {})", call.n))
        }
    });
    let layer =
        IdempotencyLayer::new(store.clone()).store_policy(tower_idempotency::Every4xxStorePolicy);
    let svc = service(layer, handler.clone());

    let refused = send(&svc, post_request("fix-and-retry", "amount=ten")).await;
    assert_eq!(
        (refused.status, refused.outcome),
        (StatusCode::BAD_REQUEST, Some(Outcome::NotStored)),
        "{refused:?}"
    );
    assert_eq!(refused.header(CACHE_CONTROL), Some("no-store"));
    assert_eq!(refused.text(), "amount is not a number (call 1)");

    let fixed = send(&svc, post_request("fix-and-retry", "amount=100")).await;
    assert_eq!(
        (fixed.status, fixed.outcome, fixed.text()),
        (
            StatusCode::CREATED,
            Some(Outcome::Executed),
            "charged (call 2)".to_owned()
        ),
        "the corrected request runs under the same key: {fixed:?}"
    );
    assert!(!fixed.is_replay());

    let retry = send(&svc, post_request("fix-and-retry", "amount=100")).await;
    assert_eq!(
        (retry.status, retry.outcome, retry.text()),
        (
            StatusCode::CREATED,
            Some(Outcome::Replayed),
            "charged (call 2)".to_owned()
        ),
        "{retry:?}"
    );
    let stale = send(&svc, post_request("fix-and-retry", "amount=ten")).await;
    stale.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(stale.outcome, Some(Outcome::Mismatch));

    assert_eq!(handler.calls(), 2);
    let calls = store.calls();
    assert_eq!(
        (calls.release, calls.complete),
        (1, 1),
        "the refusal released its claim, the charge completed: {calls:?}"
    );
}

/// A scope function's `Rejection` built from a whole response reaches the client as it is.
/// PROTOCOL.md §3.2.
#[tokio::test(start_paused = true)]
async fn scope_rejection_is_the_applications_response() {
    let store = store();
    let handler = echo();
    let layer = IdempotencyLayer::new(store.clone()).scope(|_: &http::request::Parts| {
        let response = Response::builder()
            .status(StatusCode::FORBIDDEN)
            .header("x-reason", "suspended")
            .body(Bytes::from("account suspended"))
            .expect("a response");
        Err(Rejection::from(response))
    });
    let svc = service(layer, handler.clone());
    let reply = send(&svc, post_request("k", "x")).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.header("x-reason"), Some("suspended"));
    assert_eq!(reply.text(), "account suspended");
    assert_eq!(reply.outcome, Some(Outcome::Rejected));
    assert_eq!(store.calls().total(), 0);
    assert_eq!(handler.calls(), 0);
    // Unprotected requests never meet the scope function.
    let get = Request::get("/").body(Body::empty()).expect("a request");
    assert_eq!(send(&svc, get).await.status, StatusCode::CREATED);
}

/// A scope function may reject with anything axum turns into a response: its own error type,
/// `(StatusCode, Json)`, a response with a streamed body. The client gets it as it is, and nothing
/// is claimed. PROTOCOL.md §3.2.
#[tokio::test(start_paused = true)]
async fn scope_rejection_from_into_response_and_streamed_bodies() {
    /// An API's own error type, as axum handlers return it.
    struct Unauthorized;
    impl axum::response::IntoResponse for Unauthorized {
        fn into_response(self) -> axum::response::Response {
            let body = serde_json::json!({"error": {"code": "missing_api_key"}});
            (
                StatusCode::UNAUTHORIZED,
                [("www-authenticate", "Bearer")],
                axum::Json(body),
            )
                .into_response()
        }
    }
    let store = store();
    let handler = echo();
    let layer = IdempotencyLayer::new(store.clone()).scope(|parts: &http::request::Parts| {
        match parts.headers.get("x-case").map(|v| v.as_bytes()) {
            Some(b"into-response") => Err(Rejection::new(Unauthorized)),
            Some(b"tuple") => Err(Rejection::new((StatusCode::FORBIDDEN, "suspended"))),
            Some(b"streamed") => {
                let chunks: Vec<Result<Bytes, Infallible>> =
                    vec![Ok(Bytes::from("too ")), Ok(Bytes::from("many"))];
                let body = Body::from_stream(futures_util::stream::iter(chunks));
                let response = Response::builder().status(429).body(body);
                Err(Rejection::new(response.expect("a response")))
            }
            _ => Ok(tower_idempotency::Scope::from("acct")),
        }
    });
    let svc = service(layer, handler.clone());
    let request = |case: &str| {
        keyed(Method::POST, "/", "k")
            .header("x-case", case)
            .body(Body::from("x"))
            .expect("a request")
    };

    let reply = send(&svc, request("into-response")).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
    assert_eq!(reply.header(CONTENT_TYPE), Some("application/json"));
    assert_eq!(reply.json()["error"]["code"], "missing_api_key");
    assert_eq!(reply.outcome, Some(Outcome::Rejected));
    assert_eq!(
        reply.problem, None,
        "the application's response, not the layer's"
    );

    let reply = send(&svc, request("tuple")).await;
    assert_eq!(
        (reply.status, reply.text()),
        (StatusCode::FORBIDDEN, "suspended".into())
    );
    assert_eq!(reply.outcome, Some(Outcome::Rejected));

    let reply = send(&svc, request("streamed")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.text(), "too many");
    assert_eq!(reply.outcome, Some(Outcome::Rejected));

    assert_eq!(store.calls().total(), 0, "nothing claimed");
    assert_eq!(handler.calls(), 0);
    let accepted = send(&svc, request("none")).await;
    assert_eq!(accepted.outcome, Some(Outcome::Executed));
}

/// A rejection whose body fails while the layer reads it is sent with its status and headers
/// and an empty body (and no stale `Content-Length`).
#[tokio::test(start_paused = true)]
async fn scope_rejection_with_a_failing_body_is_sent_empty() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).scope(|_: &http::request::Parts| {
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            vec![Ok(Bytes::from("par")), Err(std::io::Error::other("cut"))];
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        let response = Response::builder()
            .status(StatusCode::FORBIDDEN)
            .header("x-reason", "suspended")
            .header(CONTENT_LENGTH, "9")
            .body(body);
        Err(Rejection::new(response.expect("a response")))
    });
    let svc = service(layer, echo());
    let reply = send(&svc, post_request("k", "x")).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.header("x-reason"), Some("suspended"));
    assert_eq!(reply.header(CONTENT_LENGTH), None);
    assert!(reply.body.is_empty());
    assert_eq!(reply.outcome, Some(Outcome::Rejected));
}

// ---------------------------------------------------------------------------------------------
// Failures around the handler
// ---------------------------------------------------------------------------------------------

/// PROTOCOL.md §9.7: a handler that errors or panics gets a 500 problem response, also when it
/// runs unprotected because the store is down and the layer is fail-open.
#[tokio::test(start_paused = true)]
async fn panicking_handler_under_fail_open_gets_500() {
    let faulty = Faulty::new(MemoryStore::new());
    faulty.fail(true);
    let handler = Handler::ok(|_| panic!("the handler panics (expected by the test)"));
    let svc = service(IdempotencyLayer::new(faulty).fail_open(true), handler);
    let reply = spawn_send(&svc, post_request("k", "x"))
        .await
        .expect("the client gets a response, not a panic");
    reply.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
}

/// A response body that fails while the layer reads it: the handler did run (its effects are
/// done), so the layer answers 500 and keeps a tombstone; a retry gets `not-replayable` and never
/// runs the handler a second time.
/// PROTOCOL.md §9.4, §8.4.
#[tokio::test(start_paused = true)]
async fn failed_response_body_gets_500_and_the_retry_is_not_run_again() {
    let handler = Handler::ok(|call| {
        if call.n == 1 {
            let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(Bytes::from("partial")),
                Err(std::io::Error::other("the upstream reset")),
            ];
            return Response::new(Body::from_stream(futures_util::stream::iter(chunks)));
        }
        created(format!("call {}", call.n))
    });
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), handler.clone());
    let failed = send(&svc, post_request("k", "x")).await;
    failed.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    let retry = send(&svc, post_request("k", "x")).await;
    retry.assert_problem(ProblemKind::NotReplayable, StatusCode::CONFLICT);
    assert_eq!(handler.calls(), 1);
}

/// `require_scope(true)` without a scope is refused at start-up: `check` names it, and applying
/// the layer (building the router) panics with the same message rather than serve one key space
/// to every tenant. With a scope, it serves.
#[test]
fn a_required_scope_that_is_missing_stops_the_start_up() {
    use tower_idempotency::ConfigError;
    let layer = IdempotencyLayer::new(store()).require_scope(true);
    assert_eq!(layer.check(), Err(ConfigError::ScopeRequired));
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Router::<()>::new()
            .route("/", post(|| async { "ok" }))
            .route_layer(layer.clone())
    }))
    .expect_err("a router with the layer is not built");
    let message = panic
        .downcast_ref::<String>()
        .expect("a message")
        .to_owned();
    assert!(message.contains("scope"), "{message}");
    let scoped = layer.scope(|_: &http::request::Parts| Ok(tower_idempotency::Scope::from("t")));
    assert_eq!(scoped.check(), Ok(()));
    let _router: Router = Router::new()
        .route("/", post(|| async { "ok" }))
        .route_layer(scoped);
}

/// The task that watches a key for its waiting duplicates is the layer's work like any other:
/// `Shutdown` counts it, and waits for it (PROTOCOL.md §6.6, §9.4).
#[tokio::test(start_paused = true)]
async fn shutdown_counts_the_task_that_watches_a_key_for_its_waiters() {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).wait_for_in_flight(Duration::from_secs(5));
    let shutdown = layer.shutdown_handle();
    let svc = service(
        layer.clone(),
        gated_handler(started.clone(), gate.clone(), "done"),
    );
    let first = spawn_send(&svc, post_request("k", "x"));
    started.notified().await;
    assert_eq!(shutdown.running(), 1, "the first request's work");
    let duplicate = spawn_send(&svc, post_request("k", "x"));
    while layer.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(shutdown.running(), 2, "and the watch of its key");
    gate.notify_one();
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(duplicate.body, first.body, "the waiter got the replay");
    tokio::time::timeout(Duration::from_secs(1), shutdown.clone().wait())
        .await
        .expect("nothing left running");
    assert_eq!(shutdown.running(), 0);
}

/// A duplicate waiting in the layer that runs the first request is told the moment the first
/// completes, not at its wait's next poll: the layer wakes the key's wait (PROTOCOL.md §6.6).
#[tokio::test(start_paused = true)]
async fn a_waiter_in_the_same_layer_is_answered_as_the_first_request_completes() {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).wait_for_in_flight(Duration::from_secs(5));
    let svc = service(layer, gated_handler(started.clone(), gate.clone(), "done"));
    let first = spawn_send(&svc, post_request("k", "x"));
    started.notified().await;
    let duplicate = spawn_send(&svc, post_request("k", "x"));
    // Long enough for the wait's polls to have backed off to their longest interval.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let released = tokio::time::Instant::now();
    gate.notify_one();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.outcome, Some(Outcome::Replayed));
    assert!(
        released.elapsed() < Duration::from_millis(10),
        "answered {:?} after the first completed",
        released.elapsed()
    );
    assert_eq!(first.await.unwrap().outcome, Some(Outcome::Executed));
}

/// One tenant writing 60 KB records as fast as it can into a store every tenant shares: without a
/// quota it fills the store and every other tenant gets `503`; with one, it is refused with `429`
/// long before, and the others are untouched. PROTOCOL.md §3.4.
#[tokio::test(start_paused = true)]
async fn a_quota_keeps_one_tenant_from_filling_the_store_for_the_others() {
    const CAPACITY: usize = 4 << 20;
    let quota = CAPACITY as u64 / 4;
    assert_a_quota_keeps_a_flood_off_the_others(|| MemoryStore::with_capacity(CAPACITY), quota)
        .await;
}

/// A tenant past its quota is refused only what would write a record: its replay (byte for byte),
/// its `409` for a key in flight and its `422` are answered as under the quota, from a read of
/// the key, with no claim and no budget spent; a new key is `429`. PROTOCOL.md §3.4.
#[tokio::test(start_paused = true)]
async fn past_its_quota_a_tenant_still_gets_its_replays_409s_and_422s() {
    let store = store();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    // A burst of 512 bytes: two claims, the second leaving nothing for its response.
    let layer = IdempotencyLayer::new(ScopeQuota::new(store.clone(), 1024))
        .scope(tower_idempotency_test::account_scope);
    let svc = service(layer, handler.clone());
    let request = |key: &str| tower_idempotency_test::account_post("acct_1", key);
    let other_body = |key: &str| {
        keyed(Method::POST, "/", key)
            .header("x-account", "acct_1")
            .body(Body::from("another charge"))
            .expect("a request")
    };

    let running = spawn_send(&svc, request("running"));
    started.notified().await;
    let done = send(&svc, request("done")).await;
    assert_eq!(done.outcome, Some(Outcome::Executed), "{done:?}");
    let refused = send(&svc, request("new")).await;
    refused.assert_problem(ProblemKind::QuotaExceeded, StatusCode::TOO_MANY_REQUESTS);
    let wait = refused
        .header(RETRY_AFTER)
        .expect("a Retry-After")
        .to_owned();
    let claims = store.calls().claim;

    // The replay of the completed record, byte for byte.
    let replay = send(&svc, request("done")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{replay:?}"
    );
    assert_eq!(
        (replay.status, replay.header_list(), &replay.body),
        (done.status, done.header_list(), &done.body)
    );
    // The key in flight: 409, with the time left on its lease at most.
    let in_flight = send(&svc, request("running")).await;
    assert!(in_flight.assert_in_flight() >= 1);
    // Either key with another request: 422.
    for key in ["done", "running"] {
        let mismatch = send(&svc, other_body(key)).await;
        mismatch.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    }
    // A new key still is refused, and its wait is what it was: nothing above spent the budget.
    let again = send(&svc, request("new")).await;
    again.assert_problem(ProblemKind::QuotaExceeded, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(again.header(RETRY_AFTER), Some(&*wait));
    assert_eq!(store.calls().claim, claims, "read, never claimed");
    assert_eq!(handler.calls(), 2);

    // The key that was in flight completes (its response spent, past the budget), and replays.
    gate.notify_one();
    let ran = running.await.unwrap();
    assert_eq!(ran.outcome, Some(Outcome::Executed), "{ran:?}");
    let replay = send(&svc, request("running")).await;
    assert_eq!(
        (replay.outcome, &replay.body),
        (Some(Outcome::Replayed), &ran.body)
    );
    // Once the wait has passed, the budget holds a claim again.
    let refused = send(&svc, request("new")).await;
    let wait: u64 = refused
        .header(RETRY_AFTER)
        .expect("a Retry-After")
        .parse()
        .unwrap();
    tokio::time::advance(Duration::from_secs(wait)).await;
    let later = send(&svc, request("new")).await;
    assert_eq!(later.outcome, Some(Outcome::Executed), "{later:?}");
}

/// A completion that failed while the request was answered is tried again on a task of its own:
/// first after 100 ms, never at once, then after pauses that double (200 ms, 400 ms, ...), until
/// it lands. PROTOCOL.md §9.5.
#[tokio::test(start_paused = true)]
async fn a_failed_completion_is_tried_again_after_doubling_pauses() {
    let faulty = Faulty::new(MemoryStore::new());
    let store = Counting::new(faulty.clone());
    let svc = service(IdempotencyLayer::new(store.clone()), echo());
    faulty.fail_writes(true);
    let first = send(&svc, post_request("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{first:?}");
    let started = tokio::time::Instant::now();
    // Attempts are due at 0 (in the request), 100, 300 and 700 ms.
    for (at, attempts) in [(50, 1), (150, 2), (250, 2), (350, 3), (650, 3), (750, 4)] {
        tokio::time::sleep_until(started + Duration::from_millis(at)).await;
        assert_eq!(
            store.calls().complete,
            attempts,
            "§9.5: {attempts} completion attempts by {at} ms"
        );
    }
    faulty.fail_writes(false);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        store.calls().complete,
        5,
        "§9.5: the attempt after the store came back lands"
    );
    let replay = send(&svc, post_request("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
}

/// A release that keeps failing is tried again for up to one lease, and not after: by then the
/// claim has run out by itself. PROTOCOL.md §9.5.
#[tokio::test(start_paused = true)]
async fn a_failing_release_is_given_up_within_a_lease() {
    let faulty = Faulty::new(MemoryStore::new());
    let store = Counting::new(faulty.clone());
    let failing = Handler::new(|_| async { Err::<Response<Body>, _>("boom".into()) });
    let svc = service(
        IdempotencyLayer::new(store.clone()).lease(Duration::from_secs(30)),
        failing,
    );
    faulty.fail_writes(true);
    let reply = send(&svc, post_request("k", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::HandlerFailed), "{reply:?}");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let by_the_lease = store.calls().release;
    assert!(
        by_the_lease > 3,
        "§9.5: the release is tried again: {by_the_lease}"
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        store.calls().release,
        by_the_lease,
        "§9.5: no release attempt after the lease"
    );
}

/// The layer calls the inner service it readied and leaves a clone behind, as tower's contract
/// asks: an inner service whose readiness is its own (a concurrency limit's permit) is never
/// called without it, and its permit goes with the request.
#[tokio::test(start_paused = true)]
async fn the_inner_service_called_is_the_one_readied() {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .concurrency_limit(1)
        .service(handler.clone());
    for key in ["k1", "k2", "k3"] {
        let reply =
            tokio::time::timeout(Duration::from_secs(5), send(&svc, post_request(key, "x")))
                .await
                .expect("the permit of each request is given back");
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    assert_eq!(handler.calls(), 3);
}
