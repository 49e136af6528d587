//! What the in-process benches share: one axum `Router` with a trivial charge handler (reads the
//! body, answers 201 with a ~200-byte JSON charge, as `benches/http/main.rs` does), bare or behind the
//! layer, and the requests they send.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::store::Store;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};

pub const PATH: &str = "/v1/charges";
/// The handler's response: a fixed charge object (203 bytes), as in `benches/http/main.rs`.
pub const CHARGE: &str = r#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"eur","status":"succeeded","captured":true,"customer":"cus_NffrFeUfNV2Hib","description":"Order #1234","created":1679090539}"#;
/// Every POST's body (64 bytes).
pub const REQUEST_BODY: &str =
    r#"{"amount":1099,"currency":"eur","customer":"cus_NffrFeUfNV2Hib"}"#;
pub const REPLAY_KEY: &str = "bench-replay-8e03978e-40d5-43e8-bc93-6894a57f9324";
pub const HELD_KEY: &str = "bench-held-8e03978e-40d5-43e8-bc93-6894a57f9324";

/// How many `x-hold` requests reached the handler (they wait there forever).
pub static HOLDS: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Variant {
    Bare,
    Memory,
    /// The memory store chosen at run time: behind `BoxStore`, each store call's future boxed.
    Boxed,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Bare, Variant::Memory, Variant::Boxed];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Bare => "bare",
            Variant::Memory => "memory",
            Variant::Boxed => "boxed",
        }
    }
}

async fn charge(headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    if headers.contains_key("x-hold") {
        HOLDS.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<()>().await;
    }
    black_box(&body);
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        CHARGE,
    )
}

pub fn app(variant: Variant) -> Router {
    match variant {
        Variant::Bare => ready(router()),
        Variant::Memory => layered(MemoryStore::new()),
        Variant::Boxed => layered(BoxStore::new(MemoryStore::new())),
    }
}

/// The app behind a layer over `store`.
pub fn layered<St: Store + Clone>(store: St) -> Router {
    layered_with(IdempotencyLayer::new(store))
}

/// The app behind `layer`, configured by the caller.
pub fn layered_with<St: Store + Clone>(layer: IdempotencyLayer<St>) -> Router {
    ready(router().layer(layer))
}

fn router() -> Router {
    Router::new().route(PATH, post(charge).get(charge))
}

/// Turns the handlers into services once, as `axum::serve` does per connection. A `Router` called
/// before that builds its handler's service, and applies its layers, on every request: the bench
/// would measure `Layer::layer` (the layer's config clone) as part of each call.
fn ready(router: Router) -> Router {
    router.with_state(())
}

pub fn post_request(key: &str, hold: bool) -> Request<Body> {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(PATH)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key);
    if hold {
        request = request.header("x-hold", "1");
    }
    request
        .body(Body::from(REQUEST_BODY))
        .expect("a valid request")
}

pub fn get_request() -> Request<Body> {
    Request::builder()
        .method(Method::GET)
        .uri(PATH)
        .body(Body::empty())
        .expect("a valid request")
}

/// Calls the app once and reads the whole response; returns the status.
pub async fn call(app: &Router, request: Request<Body>) -> StatusCode {
    let response = match app.clone().oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("the response body")
        .to_bytes();
    black_box(body);
    status
}

/// Sends a request with [`HELD_KEY`] whose handler never finishes, so that the key stays in
/// flight: every later request with it is a 409. Returns once the handler holds it.
pub async fn hold(app: &Router) {
    let holds = HOLDS.load(Ordering::SeqCst);
    let held = app.clone();
    tokio::spawn(async move {
        let _ = call(&held, post_request(HELD_KEY, true)).await;
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    // The handler runs only once the key is claimed.
    while HOLDS.load(Ordering::SeqCst) == holds {
        assert!(Instant::now() < deadline, "the holding request never ran");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let probe = call(app, post_request(HELD_KEY, false)).await;
    assert_eq!(probe, StatusCode::CONFLICT, "the held key answers 409");
}
