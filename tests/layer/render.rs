//! The layer's own responses rendered in an API's format (`IdempotencyLayer::render_problems`):
//! a Stripe-style JSON renderer, a plain-text one and the default problem+json, each on every
//! problem kind, made through the layer as a client meets them. The layer keeps the status,
//! `Cache-Control`, `Retry-After` and the `ProblemKind` and `Outcome` in the extensions.
//! PROTOCOL.md §7.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use tokio::sync::Notify;
use tower::BoxError;
use tower_idempotency::problem::{
    Problem, ProblemJson, ProblemKind, RenderProblem, RenderedProblem,
};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{
    Faulty, Handler, Reply, created, gated_handler, keyed, post, send, service, spawn_send,
};

/// Every kind, each with the outcome its response carries.
const KINDS: [(ProblemKind, Outcome); 10] = [
    (ProblemKind::MissingKey, Outcome::Rejected),
    (ProblemKind::InvalidKey, Outcome::Rejected),
    (ProblemKind::BodyTooLarge, Outcome::Rejected),
    (ProblemKind::BodyUnreadable, Outcome::Rejected),
    (ProblemKind::InFlight, Outcome::InFlight),
    (ProblemKind::Mismatch, Outcome::Mismatch),
    (ProblemKind::NotReplayable, Outcome::NotReplayable),
    (ProblemKind::StoreUnavailable, Outcome::StoreUnavailable),
    (ProblemKind::HandlerFailed, Outcome::HandlerFailed),
    (ProblemKind::CommitRejected, Outcome::CommitRejected),
];

const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// Stripe's error code for each kind.
fn stripe_code(kind: ProblemKind) -> &'static str {
    match kind {
        ProblemKind::MissingKey => "idempotency_key_missing",
        ProblemKind::InvalidKey => "idempotency_key_invalid",
        ProblemKind::BodyTooLarge => "request_too_large",
        ProblemKind::BodyUnreadable => "request_unreadable",
        ProblemKind::InFlight => "idempotency_key_in_use",
        ProblemKind::Mismatch => "idempotency_key_reused",
        ProblemKind::NotReplayable => "idempotency_response_unavailable",
        ProblemKind::StoreUnavailable => "idempotency_store_unavailable",
        ProblemKind::CommitRejected => "request_rejected",
        _ => "api_error",
    }
}

/// Retrying helps while the first request runs and while the store is away; nowhere else.
fn retrying_helps(kind: ProblemKind) -> bool {
    matches!(kind, ProblemKind::InFlight | ProblemKind::StoreUnavailable)
}

/// `{"error": {"type", "code", "message"}}` and `Stripe-Should-Retry`, as Stripe answers.
fn stripe(problem: &Problem) -> RenderedProblem {
    let kind = match problem.kind() {
        ProblemKind::InFlight | ProblemKind::Mismatch | ProblemKind::NotReplayable => {
            "idempotency_error"
        }
        ProblemKind::StoreUnavailable | ProblemKind::HandlerFailed => "api_error",
        _ => "invalid_request_error",
    };
    let body = serde_json::json!({
        "error": {
            "type": kind,
            "code": stripe_code(problem.kind()),
            "message": problem.detail(),
        }
    });
    let retry = if retrying_helps(problem.kind()) {
        "true"
    } else {
        "false"
    };
    RenderedProblem::new(
        HeaderValue::from_static("application/json"),
        body.to_string(),
    )
    .header(SHOULD_RETRY, HeaderValue::from_static(retry))
}

/// The title and the detail, one per line.
fn plain_text(problem: &Problem) -> RenderedProblem {
    let text = format!("{}\n{}\n", problem.title(), problem.detail());
    RenderedProblem::new(HeaderValue::from_static("text/plain; charset=utf-8"), text)
}

/// A layer over `store` that renders with `render`.
fn layer<St>(store: St, render: impl RenderProblem + Clone) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store).render_problems(render)
}

fn ok() -> Handler {
    Handler::ok(|call| created(format!("call {}", call.n)))
}

/// Meets every kind of problem through a layer rendering with `render`, as a client does.
async fn every_kind(render: impl RenderProblem + Clone) -> Vec<(ProblemKind, Reply)> {
    let mut replies = Vec::new();
    let svc = service(layer(MemoryStore::new(), render.clone()), ok());

    let no_key = Request::post("/").body(Body::from("x")).expect("a request");
    replies.push((ProblemKind::MissingKey, send(&svc, no_key).await));
    replies.push((ProblemKind::InvalidKey, send(&svc, post("a,b", "x")).await));

    let small = service(
        layer(MemoryStore::new(), render.clone()).request_body_limit(4),
        ok(),
    );
    let too_large = send(&small, post("large", "12345")).await;
    replies.push((ProblemKind::BodyTooLarge, too_large));

    let cut: Vec<Result<Bytes, BoxError>> = vec![
        Ok(Bytes::from_static(b"half a ")),
        Err("the connection was cut".into()),
    ];
    let unreadable = keyed(Method::POST, "/", "cut")
        .body(Body::from_stream(futures_util::stream::iter(cut)))
        .expect("a request");
    replies.push((ProblemKind::BodyUnreadable, send(&svc, unreadable).await));

    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let gated = service(
        layer(MemoryStore::new(), render.clone()),
        gated_handler(started.clone(), gate.clone(), "held"),
    );
    let first = spawn_send(&gated, post("held", "x"));
    started.notified().await;
    replies.push((ProblemKind::InFlight, send(&gated, post("held", "x")).await));
    gate.notify_one();
    assert_eq!(first.await.expect("the first request").status, 201);

    assert_eq!(send(&svc, post("used", "a")).await.status, 201);
    replies.push((ProblemKind::Mismatch, send(&svc, post("used", "b")).await));

    let tiny = service(
        layer(MemoryStore::new(), render.clone()).response_body_limit(4),
        ok(),
    );
    let delivered = send(&tiny, post("big", "x")).await;
    assert_eq!(delivered.outcome, Some(Outcome::Executed));
    replies.push((
        ProblemKind::NotReplayable,
        send(&tiny, post("big", "x")).await,
    ));

    let store = Faulty::new(MemoryStore::new());
    store.fail(true);
    let down = service(layer(store, render.clone()), ok());
    replies.push((
        ProblemKind::StoreUnavailable,
        send(&down, post("down", "x")).await,
    ));

    let failing = Handler::new(|_| async { Err(BoxError::from("the backend is down")) });
    let failing = service(layer(MemoryStore::new(), render.clone()), failing);
    replies.push((
        ProblemKind::HandlerFailed,
        send(&failing, post("fail", "x")).await,
    ));

    let store = Faulty::new(MemoryStore::new());
    store.reject_completions(true);
    let rejecting = service(layer(store, render), ok());
    replies.push((
        ProblemKind::CommitRejected,
        send(&rejecting, post("rejected", "x")).await,
    ));

    let met: Vec<_> = replies.iter().map(|(kind, _)| *kind).collect();
    assert_eq!(met, KINDS.map(|(kind, _)| kind), "every kind, once");
    replies
}

/// What the layer sets whatever the renderer: the status, `Cache-Control: no-store`,
/// `Retry-After` where it belongs, the kind and the outcome in the extensions.
#[track_caller]
fn assert_layer_parts(kind: ProblemKind, reply: &Reply) {
    let outcome = KINDS.iter().find(|(k, _)| *k == kind).map(|(_, o)| *o);
    assert_eq!(reply.status, kind.default_status(), "{kind:?}: {reply:?}");
    assert_eq!(reply.problem, Some(kind), "{reply:?}");
    assert_eq!(reply.outcome, outcome, "{reply:?}");
    assert_eq!(reply.header(CACHE_CONTROL), Some("no-store"), "{reply:?}");
    let retry_after = reply.header(RETRY_AFTER);
    if retrying_helps(kind) {
        assert_eq!(retry_after, Some("1"), "{kind:?}: {reply:?}");
    } else {
        assert_eq!(retry_after, None, "{kind:?}: {reply:?}");
    }
    assert!(!reply.is_replay(), "{reply:?}");
}

#[tokio::test(start_paused = true)]
async fn a_stripe_style_renderer_writes_every_kind() {
    for (kind, reply) in every_kind(stripe).await {
        assert_layer_parts(kind, &reply);
        assert_eq!(reply.header(CONTENT_TYPE), Some("application/json"));
        let json = reply.json();
        let error = &json["error"];
        assert_eq!(error["code"], stripe_code(kind), "{json}");
        let expected_type = match kind {
            ProblemKind::InFlight | ProblemKind::Mismatch | ProblemKind::NotReplayable => {
                "idempotency_error"
            }
            ProblemKind::StoreUnavailable | ProblemKind::HandlerFailed => "api_error",
            _ => "invalid_request_error",
        };
        assert_eq!(error["type"], expected_type, "{json}");
        assert!(
            error["message"].as_str().is_some_and(|m| m.len() > 10),
            "{json}"
        );
        assert_eq!(
            json.as_object().map(|o| o.len()),
            Some(1),
            "only `error`: {json}"
        );
        let retry = if retrying_helps(kind) {
            "true"
        } else {
            "false"
        };
        assert_eq!(reply.header(SHOULD_RETRY), Some(retry), "{kind:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_plain_text_renderer_writes_every_kind() {
    for (kind, reply) in every_kind(plain_text).await {
        assert_layer_parts(kind, &reply);
        assert_eq!(
            reply.header(CONTENT_TYPE),
            Some("text/plain; charset=utf-8")
        );
        let text = reply.text();
        let (title, detail) = text
            .trim_end()
            .split_once('\n')
            .unwrap_or_else(|| panic!("two lines: {text:?}"));
        assert_eq!(title, kind.title());
        assert!(detail.len() > 10, "{kind:?}: {text:?}");
        assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());
    }
}

/// The default, named or left unset, is the RFC 9457 document of PROTOCOL.md §7.1, unchanged.
#[tokio::test(start_paused = true)]
async fn the_default_renderer_writes_problem_json_for_every_kind() {
    let named = every_kind(ProblemJson).await;
    for (kind, reply) in &named {
        assert_layer_parts(*kind, reply);
        reply.assert_problem(*kind, kind.default_status());
        let members: Vec<_> = reply
            .json()
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect();
        assert_eq!(members, ["detail", "status", "title", "type"]);
    }
    // Unset: the same bytes as `ProblemJson`, kind by kind (the details of the two runs agree).
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), ok());
    let unset = send(&svc, post("a,b", "x")).await;
    assert_eq!(unset.body, named[1].1.body);
    assert_eq!(unset.headers, named[1].1.headers);
}

/// A status changed with `problem_status` is what the renderer is told, and what is sent.
#[tokio::test(start_paused = true)]
async fn the_renderer_sees_the_configured_status() {
    let svc = service(
        layer(MemoryStore::new(), |problem: &Problem| {
            let text = format!("{} {:?}", problem.status().as_u16(), problem.retry_after());
            RenderedProblem::new(HeaderValue::from_static("text/plain"), text)
        })
        .problem_status(ProblemKind::Mismatch, StatusCode::BAD_REQUEST),
        ok(),
    );
    send(&svc, post("k", "a")).await;
    let mismatch = send(&svc, post("k", "b")).await;
    assert_eq!(mismatch.status, StatusCode::BAD_REQUEST);
    assert_eq!(mismatch.text(), "400 None");
    assert_eq!(mismatch.problem, Some(ProblemKind::Mismatch));
}

/// A renderer runs only for the layer's own responses: a handler's answers, first or replayed,
/// are untouched and carry no kind.
#[tokio::test(start_paused = true)]
async fn handler_responses_are_never_rendered() {
    let svc = service(layer(MemoryStore::new(), plain_text), ok());
    let first = send(&svc, post("k", "a")).await;
    let replay = send(&svc, post("k", "a")).await;
    for reply in [first, replay] {
        assert_eq!(reply.text(), "call 1");
        assert_eq!(reply.problem, None);
        assert_eq!(reply.header(CONTENT_TYPE), None);
    }
}
