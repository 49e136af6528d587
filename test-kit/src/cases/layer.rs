//! Cases through the layer: the layer's behaviour over the store (PROTOCOL.md §6, §8, §9).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::AppendHeaders;
use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONTENT_TYPE, LOCATION, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::BoxError;
use tower_test::mock;

use crate::*;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::{
    IDEMPOTENT_REPLAYED, IdempotencyKey, Outcome, Rejection, RequestBody, Scope,
};

/// Asserts that `replay` repeats `first` byte for byte, marked as a replay.
#[track_caller]
pub(super) fn assert_replay_of(replay: &Reply, first: &Reply) {
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§6.2, §6.5: the first request runs the handler, outcome Executed: {first:?}"
    );
    assert!(
        !first.is_replay(),
        "§6.4: only replays carry Idempotent-Replayed, never a first response: {first:?}"
    );
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.2, §6.5: the same request again gets the replay, outcome Replayed: {replay:?}"
    );
    assert_eq!(
        replay.problem, None,
        "§6.5: a replay is the handler's response, and carries no ProblemKind: {replay:?}"
    );
    assert_eq!(
        replay.headers.get_all(IDEMPOTENT_REPLAYED).iter().count(),
        1,
        "§6.4: a replay carries exactly one Idempotent-Replayed header"
    );
    assert!(
        replay.is_replay(),
        "§6.4: a replay carries Idempotent-Replayed: true: {replay:?}"
    );
    assert_eq!(
        replay.status, first.status,
        "§6.4: a replay has the stored status"
    );
    assert_eq!(
        replay.header_list(),
        first.header_list(),
        "§6.4, §8.3: a replay has every stored header value, in order"
    );
    assert_eq!(
        replay.body, first.body,
        "§6.4: a replay has the stored body bytes"
    );
}

/// Through an `axum::Router`: the replay repeats the status, every header value in order and the
/// body, adds `Idempotent-Replayed: true`, and the handler runs once.
/// PROTOCOL.md §6.4.
pub async fn replay_is_byte_identical_through_a_router<H: Harness>(h: H) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new()
        .route(
            "/v1/charges",
            axum::routing::post(move |body: Bytes| {
                let counter = counter.clone();
                async move {
                    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut out =
                        format!("{{\"charge\":{n},\"bytes\":{}}}", body.len()).into_bytes();
                    out.extend_from_slice(b"\x00\xff");
                    (
                        StatusCode::CREATED,
                        [(CONTENT_TYPE, "application/json")],
                        AppendHeaders([("x-multi", "first"), ("x-multi", "second")]),
                        AppendHeaders([
                            (LOCATION, "/v1/charges/1"),
                            (HeaderName::from_static("x-multi"), "third"),
                        ]),
                        out,
                    )
                }
            }),
        )
        .layer(layer(&h, h.store()));
    let charge = || {
        keyed(
            Method::POST,
            "/v1/charges",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
        )
        .body(Body::from("amount=100&currency=eur"))
        .expect("a request")
    };

    let first = send(&app, charge()).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "§6.2: a new key gets the handler's response"
    );
    assert_eq!(
        first.all("x-multi"),
        [&b"first"[..], b"second", b"third"],
        "§8.3: the first client gets every header value the handler sent, in order"
    );
    let replay = send(&app, charge()).await;
    assert_replay_of(&replay, &first);
    assert_eq!(
        replay.all("x-multi"),
        [&b"first"[..], b"second", b"third"],
        "§6.4: a replay repeats a repeated header's values, in order"
    );
    let again = send(&app, charge()).await;
    assert_replay_of(&again, &first);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "§6.4: a replay never reaches the handler: it ran once"
    );
}

/// Through `tower::ServiceBuilder`, with repeated, empty and non-UTF-8 header values and a binary
/// body.
/// PROTOCOL.md §6.4, §10.1.
pub async fn replay_is_byte_identical_through_service_builder<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        let mut body = format!("run {} of ", call.n).into_bytes();
        body.extend_from_slice(&call.body);
        body.extend(pattern(300));
        Response::builder()
            .status(StatusCode::ACCEPTED)
            .header("x-multi", "a")
            .header(CONTENT_TYPE, "application/octet-stream")
            .header("x-multi", "b")
            .header("x-empty", "")
            .header(
                "x-bytes",
                HeaderValue::from_bytes(b"\xff\xfe").expect("obs-text"),
            )
            .header("x-multi", "c")
            .body(Body::from(body))
            .expect("a response")
    });
    let svc = service(layer(&h, h.store()), handler.clone());

    let first = send(&svc, post("k-1", "payload")).await;
    assert_eq!(
        first.status,
        StatusCode::ACCEPTED,
        "§6.2: a new key gets the handler's response"
    );
    assert!(
        first.body.starts_with(b"run 1 of payload"),
        "§1.5: the handler gets the buffered request body"
    );
    let replay = send(&svc, post("k-1", "payload")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(
        replay.all("x-multi"),
        [&b"a"[..], b"b", b"c"],
        "§6.4, §10.1: a replay repeats a repeated header's values, in order"
    );
    assert_eq!(
        replay.all("x-empty"),
        [&b""[..]],
        "§6.4, §10.1: a replay keeps an empty header value"
    );
    assert_eq!(
        replay.all("x-bytes"),
        [&b"\xff\xfe"[..]],
        "§6.4, §10.1: a replay keeps a non-UTF-8 header value byte for byte"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.4: a replay never reaches the handler: it ran once"
    );
}

/// While the first request is held in flight (a tower-test mock), the same request gets 409 with
/// `Retry-After: 1` and a different one 422, and the inner service sees one request; once the
/// first finishes, a retry gets its replay.
/// PROTOCOL.md §6.2, §6.3, §4.3.
pub async fn in_flight_request_gets_409_then_the_replay<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let (mock, mut handle) = mock::pair::<Request<RequestBody<Body>>, Response<Body>>();
    let svc = service(layer(&h, store.clone()), mock);

    let first = spawn_send(&svc, post("k", "pay 10"));
    let (request, respond) = handle
        .next_request()
        .await
        .expect("the first request reaches the inner service");
    assert_eq!(
        request
            .extensions()
            .get::<IdempotencyKey>()
            .map(IdempotencyKey::as_str),
        Some("k"),
        "§2.4, §9.1: a claimed request's key is in its extensions"
    );
    let body = request
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(
        body, "pay 10",
        "§1.5, §9.1: the handler gets the buffered body"
    );

    for _ in 0..3 {
        let conflict = send(&svc, post("k", "pay 10")).await;
        assert_eq!(
            conflict.assert_in_flight(),
            1,
            "§6.2, §6.3: the same request while the first runs gets 409 with Retry-After, 1 s by \
             default"
        );
    }
    let mismatch = send(&svc, post("k", "pay 20")).await;
    mismatch.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        handle.poll_request().is_pending(),
        "§6.2: a 409 or a 422 never reaches the inner service: only the first request did"
    );

    respond.send_response(
        Response::builder()
            .status(201)
            .header("x-charge", "ch_1")
            .body(Body::from("charged"))
            .expect("a response"),
    );
    let first = first.await.expect("the first request's task");
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "§6.2: the first request gets the handler's response"
    );
    assert_eq!(
        first.body, "charged",
        "§6.2: the first request gets the handler's body"
    );
    let replay = send(&svc, post("k", "pay 10")).await;
    assert_replay_of(&replay, &first);
    assert!(
        handle.poll_request().is_pending(),
        "§6.4: a replay never reaches the inner service"
    );
    let calls = store.calls();
    assert_eq!(
        (calls.complete, calls.release),
        (1, 0),
        "§9.5: one completion for the one run, no release: {calls:?}"
    );
}

/// A configured `Retry-After` longer than the lease is cut to the lease's end.
/// PROTOCOL.md §6.3.
pub async fn retry_after_never_goes_beyond_the_lease<H: Harness>(h: H) {
    let (mock, mut handle) = mock::pair::<Request<RequestBody<Body>>, Response<Body>>();
    let layer = layer(&h, h.store()).retry_after(h.lease() * 100);
    let svc = service(layer, mock);

    let first = spawn_send(&svc, post("k", "x"));
    let (_request, respond) = handle.next_request().await.expect("the first request");
    let seconds = send(&svc, post("k", "x")).await.assert_in_flight();
    assert!(
        (1..=whole_seconds(h.lease())).contains(&seconds),
        "§6.3: a 409's Retry-After never points past the running claim's lease: {seconds} s \
         with a {:?} lease",
        h.lease()
    );
    respond.send_response(created("done"));
    assert_eq!(
        first.await.expect("task").status,
        StatusCode::CREATED,
        "§6.2: the first request gets the handler's response"
    );
}

/// The same key with a different body, path, query or method gets 422 and the handler does not
/// run; the original record is undisturbed. Both POST-then-PATCH and PATCH-then-POST.
/// PROTOCOL.md §4.1, §4.3.
pub async fn different_request_with_the_same_key_gets_422<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        created(format!(
            "{} {} #{}",
            call.parts.method, call.parts.uri, call.n
        ))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());
    let request = |method: Method, uri: &str, key: &str, body: &'static str| {
        keyed(method, uri, key)
            .body(Body::from(body))
            .expect("a request")
    };

    let first = send(&svc, request(Method::POST, "/orders?page=1", "k", "a")).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "§6.2: a new key gets the handler's response"
    );
    for (method, uri, body) in [
        (Method::POST, "/orders?page=1", "b"),
        (Method::POST, "/orders?page=1", "a "),
        (Method::POST, "/orders?page=1", ""),
        (Method::POST, "/other?page=1", "a"),
        (Method::POST, "/orders?page=2", "a"),
        (Method::POST, "/orders", "a"),
        (Method::PATCH, "/orders?page=1", "a"),
    ] {
        let reply = send(&svc, request(method.clone(), uri, "k", body)).await;
        reply.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            reply.outcome,
            Some(Outcome::Mismatch),
            "§4.1, §4.3: another method, path, query or body with the key is a mismatch: \
             {method} {uri} {body:?}"
        );
    }
    assert_eq!(
        handler.calls(),
        1,
        "§6.2: a mismatch never reaches the handler"
    );
    let replay = send(&svc, request(Method::POST, "/orders?page=1", "k", "a")).await;
    assert_replay_of(&replay, &first);

    let first = send(&svc, request(Method::PATCH, "/orders/1", "k2", "a")).await;
    assert_eq!(
        first.body, "PATCH /orders/1 #2",
        "§1.1: a PATCH with a new key runs the handler"
    );
    let reply = send(&svc, request(Method::POST, "/orders/1", "k2", "a")).await;
    reply.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        handler.calls(),
        2,
        "§6.2: a mismatch never reaches the handler"
    );
    let calls = store.calls();
    assert_eq!(
        (calls.complete, calls.release),
        (2, 0),
        "§4.3, §6.2: a mismatch writes nothing; the two runs completed: {calls:?}"
    );
}

/// 5xx, the 4xx of a request refused before the handler acted (validation, authentication, ...),
/// 408, 409, 425 and 429 responses, and any with `Cache-Control: no-store`, are not stored: the
/// claim is released and a retry runs the handler again.
/// PROTOCOL.md §8.1, §8.2.
pub async fn responses_that_are_not_stored_run_again<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = status_handler();
    let svc = service(layer(&h, store.clone()), handler.clone());
    let cases = [
        (500, None),
        (502, None),
        (503, None),
        (400, None),
        (401, None),
        (403, None),
        (404, None),
        (405, None),
        (406, None),
        (407, None),
        (411, None),
        (412, None),
        (413, None),
        (414, None),
        (415, None),
        (417, None),
        (421, None),
        (422, None),
        (428, None),
        (431, None),
        (408, None),
        (409, None),
        (425, None),
        (429, None),
        (200, Some("no-store")),
        (201, Some("private, no-store")),
        (200, Some("No-Store")),
        (402, Some("max-age=0, no-store")),
        // no-store in the second of two Cache-Control lines.
        (200, Some("private|no-store")),
    ];
    for (i, (status, cache_control)) in cases.into_iter().enumerate() {
        let key = format!("not-stored-{i}");
        let before = handler.calls();
        for attempt in 1..=2 {
            let reply = send(&svc, status_request(&key, status, cache_control)).await;
            assert_eq!(
                reply.status.as_u16(),
                status,
                "§8.1: a response that is not stored reaches the client untouched: {status} \
                 {cache_control:?}"
            );
            assert_eq!(
                reply.outcome,
                Some(Outcome::NotStored),
                "§8.1, §8.2: 5xx, a request refused as it was sent, 408, 409, 425, 429 and \
                 Cache-Control: no-store are not stored: {status} {cache_control:?}"
            );
            assert!(
                !reply.is_replay(),
                "§8.1: a response that is not stored is never replayed"
            );
            assert_eq!(
                reply.text(),
                format!("status {status} call {}", before + attempt),
                "§8.1: each attempt gets its own run's response"
            );
        }
        assert_eq!(
            handler.calls(),
            before + 2,
            "§8.1: the claim was released, so the retry ran the handler again: {status} \
             {cache_control:?}"
        );
    }
    let calls = store.calls();
    assert_eq!(
        calls.complete, 0,
        "§8.1: a response that is not stored completes nothing: {calls:?}"
    );
    assert_eq!(
        calls.release,
        2 * cases.len(),
        "§8.1, §9.5: each run that is not stored releases its claim: {calls:?}"
    );
}

/// 2xx, 3xx and the 4xx a handler decides (402, 410, 451) are stored and replayed.
/// PROTOCOL.md §8.1.
pub async fn responses_that_are_stored_replay<H: Harness>(h: H) {
    let handler = status_handler();
    let svc = service(layer(&h, h.store()), handler.clone());
    let cases = [
        (200, Some("private, max-age=60")),
        (201, None),
        (204, None),
        (302, None),
        (402, None),
        (410, None),
        (451, None),
    ];
    for (i, (status, cache_control)) in cases.into_iter().enumerate() {
        let key = format!("stored-{i}");
        let first = send(&svc, status_request(&key, status, cache_control)).await;
        assert_eq!(
            first.status.as_u16(),
            status,
            "§6.2: a new key gets the handler's status"
        );
        let replay = send(&svc, status_request(&key, status, cache_control)).await;
        assert_replay_of(&replay, &first);
        assert_eq!(
            handler.calls(),
            i + 1,
            "§8.1: 2xx, 3xx and the 4xx a handler decides are stored, so the handler ran \
             once: {status}"
        );
        if status == 302 {
            assert_eq!(
                replay.header(LOCATION),
                Some("/elsewhere"),
                "§6.4: a replayed redirect keeps its Location"
            );
        }
    }
}

/// `Set-Cookie`, hop-by-hop headers and `Date` reach the first client but are not replayed;
/// repeated headers are. With `keep_set_cookie(true)`, `Set-Cookie` is replayed too.
/// PROTOCOL.md §8.3.
pub async fn replay_drops_cookies_hop_by_hop_headers_and_date<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        let mut response = created(format!("call {}", call.n));
        let headers = response.headers_mut();
        for (name, value) in [
            ("set-cookie", "session=abc; HttpOnly"),
            ("x-multi", "1"),
            ("connection", "keep-alive, x-conn"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("upgrade", "h2c"),
            ("proxy-authenticate", "Basic"),
            ("proxy-connection", "keep-alive"),
            ("date", "Wed, 02 Dec 2026 10:00:00 GMT"),
            ("set-cookie", "theme=dark"),
            ("x-multi", "2"),
            ("content-type", "text/plain"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        response
    });
    let dropped = [
        "set-cookie",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-connection",
        "date",
    ];
    let store = h.store();

    let svc = service(layer(&h, store.clone()), handler.clone());
    let first = send(&svc, post("default", "x")).await;
    for name in dropped {
        assert!(
            first.headers.contains_key(name),
            "§8.3: the first client gets every header the handler sent: {name}"
        );
    }
    let replay = send(&svc, post("default", "x")).await;
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.4: the same request again gets the replay"
    );
    assert_eq!(
        replay.body, first.body,
        "§6.4: a replay has the stored body"
    );
    for name in dropped {
        assert!(
            !replay.headers.contains_key(name),
            "§8.3: Set-Cookie (by default), hop-by-hop headers and Date are not replayed: {name} \
             in {replay:?}"
        );
    }
    assert_eq!(
        replay.all("x-multi"),
        [&b"1"[..], b"2"],
        "§8.3: other headers are replayed, every value in order"
    );
    assert_eq!(
        replay.header(CONTENT_TYPE),
        Some("text/plain"),
        "§8.3: Content-Type is replayed"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.4: a replay never reaches the handler"
    );

    let svc = service(layer(&h, store).keep_set_cookie(true), handler.clone());
    let first = send(&svc, post("cookies", "x")).await;
    let replay = send(&svc, post("cookies", "x")).await;
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.4: the same request again gets the replay"
    );
    assert_eq!(
        replay.body, first.body,
        "§6.4: a replay has the stored body"
    );
    assert_eq!(
        replay.all("set-cookie"),
        [&b"session=abc; HttpOnly"[..], b"theme=dark"],
        "§8.3: with keep_set_cookie(true), Set-Cookie is replayed, every value in order"
    );
    for name in dropped.iter().filter(|name| **name != "set-cookie") {
        assert!(
            !replay.headers.contains_key(*name),
            "§8.3: hop-by-hop headers and Date are never replayed: {name}"
        );
    }
    assert_eq!(
        handler.calls(),
        2,
        "§6.4: a replay never reaches the handler: one run per key"
    );
}

/// A response over the response limit (with a known length, or streamed) reaches the first client
/// in full and leaves a tombstone: the retry gets a `not-replayable` 409 and the handler does not
/// run again. A response of exactly the limit is stored.
/// PROTOCOL.md §8.4, §6.3, §7.2.
pub async fn oversized_response_is_delivered_and_leaves_a_tombstone<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    // `x-size` bytes, in `x-chunks` chunks (streamed, no length) or at once.
    let handler = Handler::ok(|call| {
        let size: usize = call
            .header("x-size")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = match call
            .header("x-chunks")
            .and_then(|s| s.parse::<usize>().ok())
        {
            Some(chunks) => streamed(chunks, size / chunks),
            None => Body::from(pattern(size)),
        };
        Response::builder()
            .status(200)
            .header("x-call", call.n.to_string())
            .body(body)
            .expect("a response")
    });
    let svc = service(
        layer(&h, store.clone()).response_body_limit(16),
        handler.clone(),
    );
    let request = |key: &str, size: usize, chunks: Option<usize>| {
        let builder = keyed(Method::POST, "/", key).header("x-size", size.to_string());
        let builder = match chunks {
            Some(chunks) => builder.header("x-chunks", chunks.to_string()),
            None => builder,
        };
        builder.body(Body::empty()).expect("a request")
    };

    for (key, size, chunks) in [("full", 1024, None), ("streamed", 64, Some(8))] {
        let before = handler.calls();
        let first = send(&svc, request(key, size, chunks)).await;
        assert_eq!(
            first.status,
            StatusCode::OK,
            "§8.4: a response over the limit is delivered: {key}"
        );
        assert_eq!(
            first.outcome,
            Some(Outcome::Executed),
            "§6.2, §8.4: a response over the limit is executed, and leaves a tombstone: {key}"
        );
        assert_eq!(
            first.body,
            pattern(size),
            "§8.4: the first client gets the whole body, over the limit: {key}"
        );
        for _ in 0..2 {
            let retry = send(&svc, request(key, size, chunks)).await;
            retry.assert_problem(ProblemKind::NotReplayable, StatusCode::CONFLICT);
            assert!(
                ProblemKind::NotReplayable
                    .type_uri()
                    .ends_with("#not-replayable"),
                "§7.2: the not-replayable kind's documented type URI"
            );
            assert_eq!(
                retry.outcome,
                Some(Outcome::NotReplayable),
                "§6.2, §8.4: a retry of a request that left a tombstone is NotReplayable"
            );
            assert_eq!(
                retry.header(RETRY_AFTER),
                None,
                "§6.3: not-replayable has no Retry-After: retrying will not help"
            );
        }
        assert_eq!(
            handler.calls(),
            before + 1,
            "§8.4: a tombstone keeps the handler from running twice: {key}"
        );
    }

    for (key, chunks) in [("exact", None), ("exact-streamed", Some(2))] {
        let first = send(&svc, request(key, 16, chunks)).await;
        let replay = send(&svc, request(key, 16, chunks)).await;
        assert_replay_of(&replay, &first);
        assert_eq!(
            replay.body,
            pattern(16),
            "§8.4: a body of exactly the limit is stored and replayed"
        );
    }
    assert_eq!(
        handler.calls(),
        4,
        "§8.4: every key ran once, tombstone or stored"
    );
    let calls = store.calls();
    assert_eq!(
        (calls.complete, calls.release),
        (4, 0),
        "§8.4, §9.5: a tombstone is a completion, not a release: {calls:?}"
    );
}

/// A panicking handler gives a 500 problem and releases the claim: the retry runs it again and
/// can succeed, and is replayed after that.
/// PROTOCOL.md §9.4.
pub async fn panicking_handler_gets_500_and_a_retry_runs_again<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        if call.n == 1 {
            panic!("§9.4: the handler panics on its first call (expected by the test)");
        }
        created(format!("call {}", call.n))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());

    let failed = send(&svc, post("k", "x")).await;
    failed.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    assert_eq!(
        failed.outcome,
        Some(Outcome::HandlerFailed),
        "§6.5, §9.4: a panic is HandlerFailed"
    );
    assert_eq!(
        store.calls().release,
        1,
        "§9.4: a panicking handler's claim is released"
    );
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        (retry.status, retry.text()),
        (StatusCode::CREATED, "call 2".into()),
        "§9.4: the retry runs the handler again"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &retry);
    assert_eq!(
        handler.calls(),
        2,
        "§9.4: the panic and the retry ran; the replay did not"
    );
}

/// An inner service that returns `Err` gives a 500 problem and releases the claim.
/// PROTOCOL.md §9.4, §7.1.
pub async fn failing_handler_gets_500_and_releases_the_claim<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::new(|call| async move {
        if call.n == 1 {
            return Err(BoxError::from("the backend is down"));
        }
        Ok(created(format!("call {}", call.n)))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());

    let failed = send(&svc, post("k", "x")).await;
    failed.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    assert!(
        !failed.text().contains("backend is down"),
        "§7.1, §9.4: the handler's error is logged, never sent: {}",
        failed.text()
    );
    let calls = store.calls();
    assert_eq!(
        (calls.complete, calls.release),
        (0, 1),
        "§9.4: a failed handler's claim is released, nothing completed: {calls:?}"
    );
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        (retry.status, retry.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed)),
        "§9.4: the retry runs the handler again"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &retry);
    assert_eq!(
        handler.calls(),
        2,
        "§9.4: the failure and the retry ran; the replay did not"
    );
}

/// Dropping the response future mid-handler (the client went away) does not cancel the handler:
/// it runs to completion, its response is stored, and the retry gets it. The shutdown handle's
/// `wait` returns only after the detached handler finished.
/// PROTOCOL.md §9.3, §9.8.
pub async fn dropped_request_runs_to_completion_and_shutdown_waits_for_it<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "late");
    let layer = layer(&h, h.store());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    let client = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    client.abort();
    assert!(
        client.await.expect_err("aborted").is_cancelled(),
        "§9.3: the client's request is dropped, as a client that goes away"
    );
    assert_eq!(
        shutdown.running(),
        1,
        "§9.3, §9.8: the handler runs on, detached, and is tracked"
    );
    send(&svc, post("k", "x")).await.assert_in_flight();

    let mut wait = Box::pin(shutdown.clone().wait());
    assert!(
        (&mut wait).now_or_never().is_none(),
        "§9.8: Shutdown::wait waits while a detached handler runs"
    );
    gate.notify_one();
    wait.await;
    assert_eq!(
        shutdown.running(),
        0,
        "§9.8: nothing is left running once wait returned"
    );
    assert_eq!(handler.calls(), 1, "§9.3: the detached handler ran once");

    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        retry.outcome,
        Some(Outcome::Replayed),
        "§9.3: the detached handler's response was stored, and the retry gets it: {retry:?}"
    );
    assert_eq!(
        (retry.status, retry.text()),
        (StatusCode::CREATED, "late 1".into()),
        "§9.3, §6.4: the retry replays the detached run's response"
    );
    assert_eq!(handler.calls(), 1, "§9.3: the handler ran once, detached");
}

/// A handler that runs for three leases keeps its claim (the layer renews it): retries meanwhile
/// get 409, never a second execution.
/// PROTOCOL.md §9.2.
pub async fn slow_handler_keeps_its_claim_past_the_lease<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "slow");
    let svc = service(layer(&h, store.clone()), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    for _ in 0..12 {
        h.advance(h.lease() / 4).await;
        send(&svc, post("k", "x")).await.assert_in_flight();
    }
    assert_eq!(
        handler.calls(),
        1,
        "§9.2: retries while a slow handler runs get 409, never a second execution"
    );
    let renewals = store.calls().renew;
    assert!(
        renewals >= 3,
        "§9.2: the lease is renewed every third of it while the handler runs ({renewals} \
         renewals in three leases)"
    );

    gate.notify_one();
    let first = first.await.expect("task");
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::CREATED, "slow 1".into()),
        "§9.2: the slow handler's response reaches its client"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(handler.calls(), 1, "§9.2: the slow handler ran once");
}

/// Renewals that fail several times in a row (a short store fault) are tried again at once and
/// with capped backoff until one lands, not a third of a lease later: the running handler keeps
/// its claim, and retries meanwhile get 409, never a second run.
/// PROTOCOL.md §9.2, §9.10.
pub async fn renewals_lost_to_a_short_fault_keep_the_claim<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "slow");
    let svc = service(layer(&h, store.clone()), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    // The first renewal and the two tries after it fail: with a renewal a third of a lease apart,
    // the lease would run out before the third.
    faulty.fail_renewals(3);
    for _ in 0..8 {
        h.advance(h.lease() / 4).await;
        send(&svc, post("k", "x")).await.assert_in_flight();
    }
    // Later, once renewals have landed, the same fault again: the tries run until the lease as
    // renewed last ends, not the first claim's.
    faulty.fail_renewals(3);
    for _ in 0..8 {
        h.advance(h.lease() / 4).await;
        send(&svc, post("k", "x")).await.assert_in_flight();
    }
    assert_eq!(
        handler.calls(),
        1,
        "§9.2: renewals lost to a short fault are tried again within the lease: no second run"
    );
    assert!(
        store.calls().renew >= 4,
        "§9.2: a failed renewal is tried again ({} renewals)",
        store.calls().renew
    );
    gate.notify_one();
    let first = first.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
}

/// After the dedup window, the key is new: the handler runs again.
/// PROTOCOL.md §8.6.
pub async fn key_is_new_again_after_the_dedup_window<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, h.store()), handler.clone());
    let m = margin(&h);

    let first = send(&svc, post("k", "x")).await;
    h.advance(h.window() - m).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    h.advance(m + m).await;
    let again = send(&svc, post("k", "x")).await;
    assert_eq!(
        (again.outcome, again.text()),
        (Some(Outcome::Executed), "call 2".into()),
        "§8.6: after the dedup window, the key is new: the handler runs again"
    );
    // A new record: a different request with the key is fine now.
    assert_eq!(
        handler.calls(),
        2,
        "§8.6: one run inside the window, one after it"
    );
}

/// The same key in two scopes runs twice, and each scope replays its own response; a scope
/// function's rejection is the client's answer, with no claim.
/// PROTOCOL.md §3.1, §3.2, §7.4.
pub async fn scopes_never_see_each_others_records<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        created(format!(
            "{} call {}",
            call.header("x-account").unwrap_or("-"),
            call.n
        ))
    });
    let layer = layer(&h, store.clone()).scope(|parts: &http::request::Parts| {
        match parts.headers.get("x-account") {
            Some(account) => Ok(Scope::from(account.as_bytes())),
            None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
        }
    });
    let svc = service(layer, handler.clone());
    let request = |account: Option<&str>, body: &'static str| {
        let builder = keyed(Method::POST, "/", "shared-key");
        let builder = match account {
            Some(account) => builder.header("x-account", account),
            None => builder,
        };
        builder.body(Body::from(body)).expect("a request")
    };

    let a = send(&svc, request(Some("acct_a"), "x")).await;
    let b = send(&svc, request(Some("acct_b"), "x")).await;
    assert_eq!(
        (a.outcome, a.text()),
        (Some(Outcome::Executed), "acct_a call 1".into()),
        "§3.1: a key in a scope runs the handler"
    );
    assert_eq!(
        (b.outcome, b.text()),
        (Some(Outcome::Executed), "acct_b call 2".into()),
        "§3.1, §5.1: the same key in another scope is another record: it runs too"
    );
    assert_replay_of(&send(&svc, request(Some("acct_a"), "x")).await, &a);
    assert_replay_of(&send(&svc, request(Some("acct_b"), "x")).await, &b);
    // A different request in a third scope is no mismatch there.
    let c = send(&svc, request(Some("acct_c"), "other")).await;
    assert_eq!(
        c.outcome,
        Some(Outcome::Executed),
        "§3.1, §4.3: a different request with the key in a third scope is no mismatch there"
    );
    assert_eq!(
        handler.calls(),
        3,
        "§3.1: one run per scope; the replays did not run"
    );

    let claims = store.calls().claim;
    let rejected = send(&svc, request(None, "x")).await;
    assert_eq!(
        rejected.status,
        StatusCode::UNAUTHORIZED,
        "§3.2: a scope function's rejection is the client's answer"
    );
    assert_eq!(
        rejected.outcome,
        Some(Outcome::Rejected),
        "§3.2, §6.5: a scope rejection's outcome is Rejected"
    );
    assert_eq!(
        rejected.header(CONTENT_TYPE),
        Some("application/problem+json"),
        "§7.4: a bare-status rejection is an about:blank problem"
    );
    assert_eq!(
        store.calls().claim,
        claims,
        "§3.2: a rejected request claims nothing"
    );
    assert_eq!(
        handler.calls(),
        3,
        "§3.2: a rejected request never reaches the handler"
    );
}

/// 500 concurrent requests with one key: the handler runs exactly once; every other request gets
/// the in-flight 409 or the replay.
/// PROTOCOL.md §6.2, §10.2.
pub async fn concurrent_requests_with_one_key_run_once<H: Harness>(h: H) {
    let handler = Handler::new(|call| async move {
        tokio::task::yield_now().await;
        Ok(created(format!("call {}", call.n)))
    });
    let svc = service(layer(&h, h.store()), handler.clone());
    let tasks: Vec<_> = (0..500)
        .map(|_| spawn_send(&svc, post("one", "x")))
        .collect();
    let (in_flight, replayed) = expect_one_execution(tasks, "call 1").await;
    assert_eq!(
        in_flight + replayed,
        499,
        "§6.2: every other concurrent request gets 409 in flight or the replay"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.2, §10.2: of concurrent requests with one key, exactly one runs the handler"
    );
}

/// 500 concurrent requests with distinct keys all run, and none gets a 409.
/// PROTOCOL.md §6.2.
pub async fn concurrent_requests_with_distinct_keys_all_run<H: Harness>(h: H) {
    let handler = Handler::new(|call| async move {
        tokio::task::yield_now().await;
        Ok(created(call.body))
    });
    let svc = service(layer(&h, h.store()), handler.clone());
    let tasks: Vec<_> = (0..500)
        .map(|i| spawn_send(&svc, post(&format!("key-{i}"), format!("body {i}"))))
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let reply = task.await.expect("task");
        assert_eq!(
            reply.outcome,
            Some(Outcome::Executed),
            "§6.2: requests with distinct keys never get a 409 or 422 because of one another: \
             {reply:?}"
        );
        assert_eq!(
            reply.text(),
            format!("body {i}"),
            "§6.2: each request with its own key gets its own run's response"
        );
    }
    assert_eq!(
        handler.calls(),
        500,
        "§6.2: every request with a distinct key runs"
    );
}

/// With the store failing at claim time, the default (fail closed) answers 503 with `Retry-After`
/// and never runs the handler; once the store is back, the key works.
/// PROTOCOL.md §6.2, §6.3.
pub async fn store_failure_at_claim_fails_closed_with_503<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, store.clone()), handler.clone());

    store.fail(true);
    for _ in 0..2 {
        let reply = send(&svc, post("k", "x")).await;
        reply.assert_problem(
            ProblemKind::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
        );
        assert_eq!(
            reply.outcome,
            Some(Outcome::StoreUnavailable),
            "§6.2, §6.5: a store failure at claim time, fail closed, is StoreUnavailable"
        );
        assert_eq!(
            reply.header(RETRY_AFTER),
            Some("1"),
            "§6.3: a 503 store-unavailable has Retry-After, 1 s by default"
        );
    }
    assert_eq!(
        handler.calls(),
        0,
        "§6.2, §9.7: fail closed never runs the handler"
    );

    store.fail(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§6.2: once the store is back, the key runs"
    );
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(
        handler.calls(),
        1,
        "§6.2: the refused requests did not run; the key ran once"
    );
}

/// With `fail_open(true)`, a store failure at claim time runs the handler unprotected (outcome
/// `FailedOpen`, the key still in the extensions), every time.
/// PROTOCOL.md §9.7.
pub async fn store_failure_at_claim_fails_open_when_configured<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| {
        let key = call
            .key()
            .map(|k| k.as_str().to_owned())
            .unwrap_or_default();
        created(format!("{key} call {}", call.n))
    });
    let svc = service(layer(&h, store.clone()).fail_open(true), handler.clone());

    store.fail(true);
    for n in 1..=2 {
        let reply = send(&svc, post("k", "x")).await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "§9.7: fail open runs the handler and answers its response"
        );
        assert_eq!(
            reply.outcome,
            Some(Outcome::FailedOpen),
            "§6.5, §9.7: a request run unprotected is FailedOpen"
        );
        assert_eq!(
            reply.text(),
            format!("k call {n}"),
            "§2.4, §9.7: fail open still puts the key in the extensions, and runs every time"
        );
        assert!(
            !reply.is_replay(),
            "§9.7: nothing is stored fail open, so nothing is replayed"
        );
    }
    assert_eq!(
        handler.calls(),
        2,
        "§9.7: fail open runs the handler every time the store fails"
    );

    store.fail(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§9.7: nothing was claimed or stored fail open, so the key is new once the store is back"
    );
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(
        handler.calls(),
        3,
        "§6.4: the replay did not run the handler"
    );
}

/// A claim that finds a record the store cannot decode (`StoreError::Codec`: a kind a newer
/// release writes during a rolling deploy, or damaged bytes) is never a store failure to fail open
/// on: a record is there, and the operation may have run. The answer is the 503 of fail-closed,
/// and the handler does not run again, fail-open or not.
/// PROTOCOL.md §9.7, §10.3.
pub async fn fail_open_never_runs_over_a_record_the_store_cannot_decode<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, store.clone()).fail_open(true), handler.clone());

    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed), "{first:?}");
    store.undecodable(true);
    let retry = send(&svc, post("k", "x")).await;
    retry.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert_eq!(
        handler.calls(),
        1,
        "§9.7: fail-open never runs a request over a record it cannot decode"
    );
    store.undecodable(false);
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
}

/// The store bounds its own calls; the layer adds no timeout of its own. A slow claim that the
/// store answers is honoured (one bound per call, not two), and a claim the store gives up on
/// (`StoreError::Timeout`) is a store failure: 503 with `Retry-After`, and the handler does not
/// run. PROTOCOL.md §10.4, §6.2.
pub async fn the_store_alone_bounds_a_claim<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, store.clone()), handler.clone());

    // Slower than any timeout the layer used to add (1 s), but answered.
    store.delay(Some(Duration::from_millis(1500)));
    let slow = send(&svc, post("slow", "x")).await;
    assert_eq!(
        slow.outcome,
        Some(Outcome::Executed),
        "§10.4: the layer adds no timeout of its own; a slow claim the store answers is honoured: \
         {}",
        slow.text()
    );
    store.delay(None);

    store.time_out(true);
    let reply = send(&svc, post("k", "x")).await;
    reply.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert!(
        reply.header(RETRY_AFTER).is_some(),
        "§6.3: a 503 store-unavailable has Retry-After"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.2, §10.4: a claim the store gave up on (Timeout) does not run the handler"
    );

    store.time_out(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§6.2: once the store answers, the key runs"
    );
    assert_eq!(
        handler.calls(),
        2,
        "§6.2: the slow claim's run and this one"
    );
}

/// The layer prepares each claimed request with its store before the handler runs. When a
/// completion that commits with the work does not commit, the handler's response is not
/// delivered: the client gets 503 with `Retry-After`, the write is not retried, and the retry runs
/// the request again, cleanly. PROTOCOL.md §9.9.
pub async fn an_aborted_completion_is_not_reported_as_done<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| {
        let prepared = call.parts.extensions.get::<Prepared>().copied();
        assert!(
            prepared.is_some(),
            "§9.9, §10.1: Store::prepare runs for a claimed request before its handler"
        );
        created(format!("call {}", call.n))
    });
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.abort_completions(true);
    let aborted = send(&svc, post("k", "x")).await;
    aborted.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert!(
        aborted.header(RETRY_AFTER).is_some(),
        "§6.3, §9.9: an aborted completion's 503 has Retry-After"
    );
    assert_ne!(
        aborted.text(),
        "call 1",
        "§9.9: the rolled-back response is not delivered"
    );
    faulty.abort_completions(false);
    shutdown.clone().wait().await;
    assert_eq!(
        store.calls().complete,
        1,
        "§9.9: an aborted completion is not retried"
    );

    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        retry.outcome,
        Some(Outcome::Executed),
        "§9.9: the claim was released, so the retry runs the request again"
    );
    assert_eq!(retry.text(), "call 2", "§9.9: the retry's own run answers");
    assert_replay_of(&send(&svc, post("k", "x")).await, &retry);
    assert_eq!(
        handler.calls(),
        2,
        "§9.9: the aborted run and the retry ran; the replay did not"
    );
}

/// When storing the result fails, the client still gets the handler's response at once, and the
/// write is retried: once the store is back, the result is stored and replayed.
/// PROTOCOL.md §9.5.
pub async fn failed_store_write_still_answers_and_is_retried<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed)),
        "§9.5: a failed completion write still answers the handler's response"
    );
    assert_eq!(
        first.text(),
        "call 1",
        "§9.5: the client gets the handler's response at once"
    );
    faulty.fail_writes(false);
    shutdown.wait().await;
    let completes = store.calls().complete;
    assert!(
        completes >= 2,
        "§9.5: a failed completion write is retried ({completes} attempts)"
    );

    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(
        handler.calls(),
        1,
        "§9.5: the retried write landed, so the handler ran once"
    );
}

/// When storing the result keeps failing for longer than the lease, the write is still retried:
/// once the store answers again, the result is written (the claim ran out, but nobody claimed the
/// key since), and a retry gets the replay. The handler runs once.
/// PROTOCOL.md §9.5, §9.6.
pub async fn store_write_failing_past_the_lease_lands_when_the_store_returns<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::CREATED, "call 1".into()),
        "§9.5: a failed completion write still answers the handler's response"
    );
    h.advance(h.lease() + margin(&h)).await;
    assert_eq!(
        shutdown.running(),
        1,
        "§9.5, §9.6, §9.8: past the lease, the completion is still being retried, and tracked"
    );
    let attempts = store.calls().complete;
    assert!(
        attempts >= 3,
        "§9.5: a failed completion is retried with backoff ({attempts} attempts so far)"
    );

    faulty.fail_writes(false);
    shutdown.wait().await;
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(
        handler.calls(),
        1,
        "§9.6, §10.1: the late completion landed where no record was left, so the handler ran \
         once"
    );
}

/// Completions that fail while every other call works (a replication wait that times out on a
/// record's write, not on a renewal's) are retried for as long as the claim can be ours, and the
/// lease is renewed meanwhile: retries for two leases get 409, never a second run, and once a
/// completion lands they get the replay.
/// PROTOCOL.md §9.2, §9.5.
pub async fn completions_failing_while_renewals_work_keep_the_claim<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_call(StoreCall::Complete, true);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::CREATED, "call 1".into()),
        "§9.5: a failed completion write still answers the handler's response"
    );
    for _ in 0..8 {
        h.advance(h.lease() / 4).await;
        send(&svc, post("k", "x")).await.assert_in_flight();
    }
    assert_eq!(
        handler.calls(),
        1,
        "§9.2, §9.5: while its completion is retried the claim's lease is renewed, so retries \
         get 409 and never run the handler again"
    );
    let calls = store.calls();
    assert!(
        calls.renew >= 3 && calls.complete >= 3,
        "§9.2, §9.5: the completion is retried and the lease renewed meanwhile ({calls:?})"
    );

    faulty.fail_call(StoreCall::Complete, false);
    shutdown.wait().await;
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(handler.calls(), 1, "§9.5: the handler ran once");
}

/// A write retried while the store failed gives up once another claim holds the key: the claim
/// is provably lost, and the new owner's result stands.
/// PROTOCOL.md §9.5, §9.6.
pub async fn retried_write_gives_up_once_another_claim_holds_the_key<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, faulty.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    assert_eq!(
        send(&svc, post("k", "x")).await.text(),
        "call 1",
        "§9.5: a failed completion write still answers the handler's response"
    );
    // Past the lease, with the first write still failing, a retry claims the key and runs.
    h.advance(h.lease() + margin(&h)).await;
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let second_handler = gated_handler(started.clone(), gate.clone(), "second run");
    let second_svc = service(self::layer(&h, faulty.clone()), second_handler);
    let second = spawn_send(&second_svc, post("k", "x"));
    started.notified().await;
    // The first owner's write comes back while the second claim is in flight: refused, given up.
    faulty.fail_writes(false);
    shutdown.wait().await;
    gate.notify_one();
    let second = second.await.expect("the second request");
    assert_eq!(
        second.text(),
        "second run 1",
        "§9.6: past the lease, a retry claims the key and runs"
    );
    assert_replay_of(&send(&svc, post("k", "x")).await, &second);
    assert_eq!(
        handler.calls(),
        1,
        "§9.5, §9.6: the first owner's late write was refused (Ok(false)) and given up; the \
         second run's result stands"
    );
}
