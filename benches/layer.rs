//! The layer's own cost per request, in process: no network, no HTTP parsing.
//!
//! ```sh
//! cargo bench -p benches --bench layer                  # about a minute
//! cargo bench -p benches --bench layer -- new-key       # one workload
//! ```
//!
//! One axum `Router` with the same trivial handler as `benches/http/main.rs` (reads the body, answers
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use benches::app::{self, HELD_KEY, REPLAY_KEY, Variant, app, call, get_request, post_request};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tokio::runtime::Runtime;

/// The new-key workload's key counter: keys never repeat within a run.
static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

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
    rt.block_on(app::hold(app));
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
    // Short by default: `cargo bench -p benches --bench layer` takes about a minute. Override on the command
    // line, e.g. `-- --measurement-time 10`.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    targets = replay, new_key, conflict, get_passthrough
}
criterion_main!(benches);
