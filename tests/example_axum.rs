//! `examples/axum.rs`, driven in-process through its `app()` with `oneshot`: the layer protects
//! the one route it is on, and only that one.

#[allow(dead_code)]
#[path = "../examples/axum.rs"]
mod example;

use std::convert::Infallible;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn app() -> Router {
    example::app(IdempotencyLayer::new(MemoryStore::new()))
}

/// A request to `path` with `key` as its `Idempotency-Key`, if any.
fn request(method: Method, path: &str, key: Option<&str>, body: Body) -> Request<Body> {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(body).expect("a valid request")
}

async fn send(app: &Router, request: Request<Body>) -> (Response<()>, Bytes) {
    let response = app
        .clone()
        .oneshot(request)
        .await
        .unwrap_or_else(|err: Infallible| match err {});
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.expect("a readable body").to_bytes();
    (Response::from_parts(parts, ()), bytes)
}

async fn post(
    app: &Router,
    path: &str,
    key: Option<&str>,
    body: &'static str,
) -> (Response<()>, Bytes) {
    send(app, request(Method::POST, path, key, Body::from(body))).await
}

fn replayed(response: &Response<()>) -> bool {
    response.headers().contains_key("idempotent-replayed")
}

#[tokio::test]
async fn the_protected_route_replays_a_retry() {
    let app = app();
    let book = r#"{"item": "book"}"#;
    let (first, first_body) = post(&app, "/orders", Some("order-1"), book).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    let order: Value = serde_json::from_slice(&first_body).expect("a JSON order");
    assert_eq!(order["order"]["item"], "book", "{order}");

    let (retry, retry_body) = post(&app, "/orders", Some("order-1"), book).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry_body, first_body, "the same order, byte for byte");

    // Another key is another order: the handler runs again and numbers it anew.
    let (other, other_body) = post(&app, "/orders", Some("order-2"), book).await;
    assert_eq!(other.status(), StatusCode::CREATED);
    assert!(!replayed(&other));
    let other: Value = serde_json::from_slice(&other_body).expect("a JSON order");
    assert_ne!(other["id"], order["id"]);
}

#[tokio::test]
async fn the_protected_route_needs_a_key() {
    let (response, body) = post(&app(), "/orders", None, r#"{"item": "book"}"#).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    assert!(!body.is_empty());
}

/// The routes without the layer need no key, and are never replayed, even when a client sends
/// one.
#[tokio::test]
async fn the_other_routes_need_no_key() {
    let app = app();
    let (login, _) = post(&app, "/login", None, "{}").await;
    assert_eq!(login.status(), StatusCode::OK, "a POST without a key");
    for _ in 0..2 {
        let (login, _) = post(&app, "/login", Some("login-1"), "{}").await;
        assert_eq!(login.status(), StatusCode::OK);
        assert!(
            !replayed(&login),
            "a key on an unprotected route is ignored"
        );
    }
    let (health, body) = send(&app, request(Method::GET, "/health", None, Body::empty())).await;
    assert_eq!(health.status(), StatusCode::OK);
    assert_eq!(body, "ok");
}

/// A body that never finishes fails its request at the example's body deadline, and claims
/// nothing: the retry with the whole body runs.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_fails_at_the_deadline() {
    let app = app();
    let never = Body::from_stream(futures_util::stream::pending::<Result<Bytes, Infallible>>());
    let started = tokio::time::Instant::now();
    let (response, body) = send(&app, request(Method::POST, "/orders", Some("slow"), never)).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&body).contains("body-unreadable"),
        "{body:?}"
    );
    assert_eq!(started.elapsed(), example::BODY_TIMEOUT);

    let (retry, _) = post(&app, "/orders", Some("slow"), r#"{"item": "book"}"#).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(&retry));
}
