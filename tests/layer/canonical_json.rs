//! The canonical JSON fingerprint through the layer (MemoryStore, paused time): a retry that
//! re-serialises the same JSON value replays; anything else keeps the byte semantics.
//! PROTOCOL.md §4.4.

use axum::body::Body;
use http::header::CONTENT_TYPE;
use http::{Method, Request, StatusCode};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::{Idempotency, IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{Handler, created, keyed, send, service};

fn request(key: &str, content_type: &str, body: &'static str) -> Request<Body> {
    keyed(Method::POST, "/v1/charges", key)
        .header(CONTENT_TYPE, content_type)
        .body(Body::from(body))
        .expect("a request")
}

fn json(key: &str, body: &'static str) -> Request<Body> {
    request(key, "application/json", body)
}

fn echo() -> Handler {
    Handler::ok(|call| created(format!("call {}", call.n)))
}

/// A service that fingerprints JSON canonically, and its handler.
fn canonical() -> (Idempotency<Handler, MemoryStore>, Handler) {
    let handler = echo();
    let layer = IdempotencyLayer::new(MemoryStore::new()).canonical_json(true);
    (service(layer, handler.clone()), handler)
}

/// Sends `request` and asserts the 422 of a different request with the key.
async fn assert_mismatch(svc: &Idempotency<Handler, MemoryStore>, request: Request<Body>) {
    send(svc, request)
        .await
        .assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test(start_paused = true)]
async fn reordered_members_and_whitespace_replay() {
    let (svc, handler) = canonical();
    let first = send(
        &svc,
        json(
            "k",
            r#"{"amount":2500,"currency":"eur","meta":{"a":1,"b":[true,null]}}"#,
        ),
    )
    .await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let retry = send(
        &svc,
        request(
            "k",
            "application/json; charset=utf-8",
            "{\n  \"meta\": { \"b\": [ true, null ], \"a\": 1.0 },\n  \"currency\": \"\\u0065ur\",\n  \"amount\": 2.5e3\n}",
        ),
    )
    .await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(handler.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_changed_value_is_a_different_request() {
    let (svc, handler) = canonical();
    send(&svc, json("k", r#"{"amount":2500,"currency":"eur"}"#)).await;
    assert_mismatch(&svc, json("k", r#"{"currency":"eur","amount":2501}"#)).await;
    assert_mismatch(&svc, json("k", r#"{"currency":"eur","amount":"2500"}"#)).await;
    assert_mismatch(
        &svc,
        json("k", r#"{"currency":"eur","amount":2500,"x":null}"#),
    )
    .await;
    // Numbers a double does not hold exactly keep their bytes: an exact reader sees two values.
    send(&svc, json("big", r#"{"id":9007199254740993}"#)).await;
    assert_mismatch(&svc, json("big", r#"{"id":9007199254740992}"#)).await;
    assert_mismatch(&svc, json("big", r#"{ "id":9007199254740993}"#)).await;
    assert_eq!(handler.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_is_not_json_keeps_its_bytes() {
    let (svc, handler) = canonical();
    // Another content type: JSON-looking bytes are bytes.
    send(&svc, request("form", "text/plain", r#"{"a":1,"b":2}"#)).await;
    let same = send(&svc, request("form", "text/plain", r#"{"a":1,"b":2}"#)).await;
    assert_eq!(same.outcome, Some(Outcome::Replayed));
    assert_mismatch(&svc, request("form", "text/plain", r#"{"b":2,"a":1}"#)).await;
    // The bytes of a canonical form, first as JSON, then as another type: another request.
    send(&svc, json("typed", r#"{"a":1}"#)).await;
    assert_mismatch(&svc, request("typed", "text/plain", r#"{"a":1}"#)).await;
    assert_eq!(handler.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn invalid_json_falls_back_to_bytes() {
    let (svc, handler) = canonical();
    let first = send(&svc, json("k", r#"{"a":1,"b":"#)).await;
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "the handler decides what to answer"
    );
    let same = send(&svc, json("k", r#"{"a":1,"b":"#)).await;
    assert_eq!(same.outcome, Some(Outcome::Replayed));
    assert_mismatch(&svc, json("k", r#"{ "a":1,"b":"#)).await;
    // A duplicate member name is not JSON the canonical form keeps: bytes.
    send(&svc, json("dup", r#"{"a":1,"a":2}"#)).await;
    assert_mismatch(&svc, json("dup", r#"{"a":2,"a":1}"#)).await;
    assert_eq!(handler.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn off_by_default() {
    let svc = service(IdempotencyLayer::new(MemoryStore::new()), echo());
    send(&svc, json("k", r#"{"a":1,"b":2}"#)).await;
    assert_mismatch(&svc, json("k", r#"{"b":2,"a":1}"#)).await;
}
