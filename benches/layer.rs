//! The layer's own cost per request, in process: no network, no HTTP parsing.
//!
//! ```sh
//! cargo bench --bench layer                  # about a minute
//! cargo bench --bench layer -- new-key       # one workload
//! ```
//!
//! One axum `Router` with the same trivial handler as `benches/http.rs` (reads the body, answers
//! 201 with a ~200-byte JSON charge), called with `oneshot` on a current-thread tokio runtime, the
//! response body collected; `bare` without the layer, `memory` behind
//! `IdempotencyLayer::new(MemoryStore::new())`, `boxed` behind the same store chosen at run time
//! (`BoxStore`). Building the request is inside the timed loop for all, so the difference between
//! them is the layer. With the `metrics` feature (the default) and no recorder installed, the
//! layer's metrics calls are measured too; `--no-default-features --features axum` leaves them
//! out. Workloads:
//!
//! - `replay`: one fixed key, primed once: every call is a replay;
//! - `new-key`: a unique key per call (a counter). Each sample starts from a fresh store: one store
//!   for the whole run would reach `MemoryStore::new()`'s 256 MiB cap (a record per call) and turn
//!   into 503s;
//! - `conflict`: the key held in flight by a request whose handler never finishes: every call is
//!   a 409 (for `bare`, the same request answered 201);
//! - `get-passthrough`: `GET` without a key, which the layer passes through untouched.
//!
//! Every call's status is checked, so a bench that measures the wrong path fails.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http_body_util::BodyExt;
use tokio::runtime::Runtime;
use tower::ServiceExt;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};

const PATH: &str = "/v1/charges";
/// The handler's response: a fixed charge object (203 bytes), as in `benches/http.rs`.
const CHARGE: &str = r#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"eur","status":"succeeded","captured":true,"customer":"cus_NffrFeUfNV2Hib","description":"Order #1234","created":1679090539}"#;
/// Every POST's body (64 bytes).
const REQUEST_BODY: &str = r#"{"amount":1099,"currency":"eur","customer":"cus_NffrFeUfNV2Hib"}"#;
const REPLAY_KEY: &str = "bench-replay-8e03978e-40d5-43e8-bc93-6894a57f9324";
const HELD_KEY: &str = "bench-held-8e03978e-40d5-43e8-bc93-6894a57f9324";

/// How many `x-hold` requests reached the handler (they wait there forever).
static HOLDS: AtomicU64 = AtomicU64::new(0);
/// The new-key workload's key counter: keys never repeat within a run.
static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy)]
enum Variant {
    Bare,
    Memory,
    /// The memory store chosen at run time: behind `BoxStore`, each store call's future boxed.
    Boxed,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::Bare, Variant::Memory, Variant::Boxed];

    fn name(self) -> &'static str {
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

fn app(variant: Variant) -> Router {
    let router = Router::new().route(PATH, post(charge).get(charge));
    let router = match variant {
        Variant::Bare => router,
        Variant::Memory => router.layer(IdempotencyLayer::new(MemoryStore::new())),
        Variant::Boxed => router.layer(IdempotencyLayer::new(BoxStore::new(MemoryStore::new()))),
    };
    // Turn the handlers into services once, as `axum::serve` does per connection. A `Router` called
    // before that builds its handler's service, and applies its layers, on every request: the
    // bench would measure `Layer::layer` (the layer's config clone) as part of each call.
    router.with_state(())
}

fn post_request(key: &str, hold: bool) -> Request<Body> {
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

fn get_request() -> Request<Body> {
    Request::builder()
        .method(Method::GET)
        .uri(PATH)
        .body(Body::empty())
        .expect("a valid request")
}

/// Calls the app once and reads the whole response; returns the status.
async fn call(app: &Router, request: Request<Body>) -> StatusCode {
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

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn replay(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("replay");
    group.throughput(Throughput::Elements(1));
    for variant in Variant::ALL {
        let app = app(variant);
        let first = rt.block_on(call(&app, post_request(REPLAY_KEY, false)));
        assert_eq!(first, StatusCode::CREATED, "priming the replay key");
        group.bench_function(variant.name(), |b| {
            b.to_async(&rt).iter(|| async {
                let status = call(&app, post_request(REPLAY_KEY, false)).await;
                assert_eq!(status, StatusCode::CREATED);
            });
        });
    }
    group.finish();
}

fn new_key(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("new-key");
    group.throughput(Throughput::Elements(1));
    for variant in Variant::ALL {
        group.bench_function(variant.name(), |b| {
            b.to_async(&rt).iter_custom(|iters| async move {
                // A fresh store per sample (outside the timing): bounded memory, never full.
                let app = app(variant);
                let mut key = String::with_capacity(32);
                let started = Instant::now();
                for _ in 0..iters {
                    key.clear();
                    key.push_str("bench-new-");
                    key.push_str(&NEXT_KEY.fetch_add(1, Ordering::Relaxed).to_string());
                    let status = call(&app, post_request(&key, false)).await;
                    assert_eq!(status, StatusCode::CREATED);
                }
                started.elapsed()
            });
        });
    }
    group.finish();
}

fn conflict(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("conflict");
    group.throughput(Throughput::Elements(1));
    for variant in Variant::ALL {
        let app = app(variant);
        let expected = match variant {
            // Without the layer there is no 409: the same requests, answered by the handler.
            Variant::Bare => StatusCode::CREATED,
            Variant::Memory | Variant::Boxed => {
                hold(&rt, &app);
                StatusCode::CONFLICT
            }
        };
        group.bench_function(variant.name(), |b| {
            b.to_async(&rt).iter(|| async {
                let status = call(&app, post_request(HELD_KEY, false)).await;
                assert_eq!(status, expected);
            });
        });
    }
    group.finish();
}

/// Holds `HELD_KEY` in flight: a request whose handler never finishes, spawned on `rt`.
fn hold(rt: &Runtime, app: &Router) {
    let holds = HOLDS.load(Ordering::SeqCst);
    let held = app.clone();
    rt.spawn(async move {
        let _ = call(&held, post_request(HELD_KEY, true)).await;
    });
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        // The handler runs only once the key is claimed.
        while HOLDS.load(Ordering::SeqCst) == holds {
            assert!(Instant::now() < deadline, "the holding request never ran");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let probe = call(app, post_request(HELD_KEY, false)).await;
        assert_eq!(probe, StatusCode::CONFLICT, "the held key answers 409");
    });
}

fn get_passthrough(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("get-passthrough");
    group.throughput(Throughput::Elements(1));
    for variant in Variant::ALL {
        let app = app(variant);
        group.bench_function(variant.name(), |b| {
            b.to_async(&rt).iter(|| async {
                let status = call(&app, get_request()).await;
                assert_eq!(status, StatusCode::CREATED);
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // Short by default: `cargo bench --bench layer` takes about a minute. Override on the command
    // line, e.g. `-- --measurement-time 10`.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    targets = replay, new_key, conflict, get_passthrough
}
criterion_main!(benches);
