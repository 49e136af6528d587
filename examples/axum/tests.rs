//! The example, driven in process through its `app()` with `oneshot`: the layer protects the one
//! route it is on, and only that one. And from the outside: served over HTTP with the layer's
//! defaults, it passes every check of the conformance runner (`conformance/`) that it can.

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

/// A request axum's `Json` refuses before the handler runs (malformed JSON: `400`; no JSON
/// content type: `415`) is not stored by the default policy: the corrected request under the same
/// key runs (PROTOCOL §8.1).
#[tokio::test]
async fn a_corrected_request_under_the_same_key_runs() {
    let app = app();
    let malformed = post(&app, "/orders", Some("fix-1"), r#"{"item": "book""#).await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST, "{malformed:?}");
    let text = Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("content-type", "text/plain")
        .header("idempotency-key", "fix-2")
        .body(Body::from(r#"{"item": "book"}"#))
        .expect("a valid request");
    let text = send(&app, text).await;
    assert_eq!(text.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{text:?}");

    for key in ["fix-1", "fix-2"] {
        let corrected = post(&app, "/orders", Some(key), r#"{"item": "book"}"#).await;
        assert_eq!(
            corrected.status,
            StatusCode::CREATED,
            "{key}: {corrected:?}"
        );
        assert!(!replayed(&corrected), "{key}");
        let retry = post(&app, "/orders", Some(key), r#"{"item": "book"}"#).await;
        assert_eq!(retry.headers["idempotent-replayed"], "true", "{key}");
        assert_eq!(retry.body, corrected.body, "{key}");
    }
}

/// Serves the example with the layer's defaults on a free port, and runs every conformance check
/// against it with `config` (whose `base_url` it sets).
async fn conformance(
    mut config: tower_idempotency_conformance::Config,
) -> tower_idempotency_conformance::Report {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app()).await });
    config.base_url = format!("http://{addr}");
    tower_idempotency_conformance::run(&config)
        .await
        .expect("the example answers")
}

/// The endpoint, and a request that fails validation: malformed JSON, which axum's `Json` refuses
/// with a `400` before the handler runs. Everything else is the runner's default.
fn orders() -> tower_idempotency_conformance::Config {
    use tower_idempotency_conformance::{Config, Variant};
    let mut config = Config::new(
        "http://127.0.0.1",
        "/orders",
        r#"{"item":"book","note":"{{unique}}"}"#,
    );
    config.invalid = Some(Variant::body(r#"{"item":"book","note":"{{unique}}""#));
    config
}

/// Asserts that the runner's `report` failed nothing, passed `validation-not-stored`, and found
/// not applicable only the checks that need what the example does not have (a second tenant, a
/// request that gets a 5xx, a retention header), as the runner reports them.
#[track_caller]
fn assert_conforms(report: &tower_idempotency_conformance::Report) {
    use tower_idempotency_conformance::Verdict;
    assert_eq!(report.summary.fail, 0, "{}", report.table());
    let named = |pass: bool| -> Vec<&str> {
        (report.checks.iter())
            .filter(|check| matches!(check.verdict, Verdict::Pass { .. }) == pass)
            .map(|check| check.name)
            .collect()
    };
    let (passed, not_applicable) = (named(true), named(false));
    assert!(
        passed.contains(&"validation-not-stored"),
        "{}",
        report.table()
    );
    let expected = ["tenant-scope", "server-error-not-stored", "retention"];
    assert_eq!(not_applicable, expected, "{}", report.table());
}

/// Served over HTTP with the layer's defaults, the example passes every conformance check,
/// `validation-not-stored` included, with the runner's defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_passes_every_conformance_check_with_the_defaults() {
    let report = conformance(orders()).await;
    println!(
        "examples/axum on memory, the runner's defaults:\n{}",
        report.table()
    );
    assert_conforms(&report);
}

/// The same, with what the example adds for a stricter look: ids told apart by `/id`, and a
/// replay known by its header, which a first response must not carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_passes_the_conformance_checks_by_id_and_replay_header() {
    let mut config = orders();
    config.id_pointer = Some("/id".into());
    config.replay_header = Some("Idempotent-Replayed".into());
    config.pause = std::time::Duration::from_millis(500);
    let report = conformance(config).await;
    println!(
        "examples/axum on memory, by id and replay header:\n{}",
        report.table()
    );
    assert_conforms(&report);
}
