//! The example, driven in process through its `app()` with `oneshot`: the layer protects the one
//! route it is on, and only that one. And from the outside: served over HTTP, it passes the
//! conformance runner's checks (`conformance/`).

use super as example;
use std::convert::Infallible;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Method, Request, StatusCode};
use serde_json::Value;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_test::{Reply, send};

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

async fn post(app: &Router, path: &str, key: Option<&str>, body: &'static str) -> Reply {
    send(app, request(Method::POST, path, key, Body::from(body))).await
}

fn replayed(reply: &Reply) -> bool {
    reply.headers.contains_key("idempotent-replayed")
}

#[tokio::test]
async fn the_protected_route_replays_a_retry() {
    let app = app();
    let book = r#"{"item": "book"}"#;
    let first = post(&app, "/orders", Some("order-1"), book).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!replayed(&first));
    let order: Value = serde_json::from_slice(&first.body).expect("a JSON order");
    assert_eq!(order["order"]["item"], "book", "{order}");

    let retry = post(&app, "/orders", Some("order-1"), book).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body, "the same order, byte for byte");

    // Another key is another order: the handler runs again and numbers it anew.
    let other = post(&app, "/orders", Some("order-2"), book).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!replayed(&other));
    let other: Value = serde_json::from_slice(&other.body).expect("a JSON order");
    assert_ne!(other["id"], order["id"]);
}

#[tokio::test]
async fn the_protected_route_needs_a_key() {
    let response = post(&app(), "/orders", None, r#"{"item": "book"}"#).await;
    assert_eq!(response.status, StatusCode::BAD_REQUEST);
    assert_eq!(response.headers["content-type"], "application/problem+json");
    assert!(!response.body.is_empty());
}

/// The routes without the layer need no key, and are never replayed, even when a client sends
/// one.
#[tokio::test]
async fn the_other_routes_need_no_key() {
    let app = app();
    let login = post(&app, "/login", None, "{}").await;
    assert_eq!(login.status, StatusCode::OK, "a POST without a key");
    for _ in 0..2 {
        let login = post(&app, "/login", Some("login-1"), "{}").await;
        assert_eq!(login.status, StatusCode::OK);
        assert!(
            !replayed(&login),
            "a key on an unprotected route is ignored"
        );
    }
    let health = send(&app, request(Method::GET, "/health", None, Body::empty())).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.body, "ok");
}

/// A body that never finishes fails its request at the example's body deadline, and claims
/// nothing: the retry with the whole body runs.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_fails_at_the_deadline() {
    let app = app();
    let never = Body::from_stream(futures_util::stream::pending::<Result<Bytes, Infallible>>());
    let started = tokio::time::Instant::now();
    let response = send(&app, request(Method::POST, "/orders", Some("slow"), never)).await;
    assert_eq!(response.status, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&response.body).contains("body-unreadable"),
        "{response:?}"
    );
    assert_eq!(started.elapsed(), example::BODY_TIMEOUT);

    let retry = post(&app, "/orders", Some("slow"), r#"{"item": "book"}"#).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!replayed(&retry));
}

/// Served over HTTP, the example passes every conformance check that applies to one route of one
/// tenant: the ones that need a second tenant, a request that fails validation, a 5xx or a
/// retention header say why they do not apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_passes_the_conformance_checks() {
    use tower_idempotency_conformance::{Config, Verdict, run};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app()).await });
    let mut config = Config::new(
        format!("http://{addr}"),
        "/orders",
        r#"{"item":"book","note":"{{unique}}"}"#,
    );
    config.id_pointer = Some("/id".into());
    config.replay_header = Some("Idempotent-Replayed".into());
    config.pause = std::time::Duration::from_millis(500);
    // No `[invalid]` request: a body that axum's `Json` refuses gets a 400 from inside the
    // protected route, which the layer stores as any answer of a handler (PROTOCOL §8.1, §8.2), so a
    // corrected body under the key is a 422. The payments example marks its validation errors
    // `Cache-Control: no-store` and passes that check.

    let report = run(&config).await.expect("the example answers");
    println!("examples/axum on memory:\n{}", report.table());
    assert_eq!(report.summary.fail, 0, "{}", report.table());
    let not_applicable: Vec<&str> = (report.checks.iter())
        .filter(|check| matches!(check.verdict, Verdict::NotApplicable { .. }))
        .map(|check| check.name)
        .collect();
    assert_eq!(
        not_applicable,
        [
            "tenant-scope",
            "server-error-not-stored",
            "validation-not-stored",
            "retention"
        ],
        "{}",
        report.table()
    );
}
