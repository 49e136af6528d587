//! The layer's allocations per request stay small enough for the allocator's per-thread caches:
//! glibc's serves blocks up to about 1 KiB from a cache of its own thread, and anything larger from
//! its shared arenas, more slowly and under their locks. The futures the layer boxes per request
//! (one for the claim and replay, one for the claimed work) are the largest of its allocations.
//!
//! And what the memory store keeps per record is one block: blocks that live for the whole dedup
//! window, millions of them, fragment the heap and miss the cache, so they are kept few.
//!
//! Counted per thread (each test runs on a current-thread runtime), so tests running side by side
//! do not count each other's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The largest block glibc serves from its per-thread cache, less its chunk header.
const THREAD_CACHED: usize = 1024;

/// Counts, per thread, the allocations larger than [`THREAD_CACHED`] and the blocks live.
struct Counting;

thread_local! {
    // Const-initialised and without a destructor: reading them allocates nothing.
    static LARGE: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

/// Adds `by` to this thread's `counter` (nothing while the thread is being torn down).
fn count<T: Copy + std::ops::Add<Output = T>>(
    counter: &'static std::thread::LocalKey<Cell<T>>,
    by: T,
) {
    let _ = counter.try_with(|c| c.set(c.get() + by));
}

fn large() -> usize {
    LARGE.with(Cell::get)
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > THREAD_CACHED {
            count(&LARGE, 1);
        }
        count(&LIVE, 1);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(&LIVE, -1);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > THREAD_CACHED {
            count(&LARGE, 1);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn app(layered: bool) -> Router {
    let router = Router::new().route("/charges", post(|| async { (StatusCode::CREATED, "{}") }));
    let router = match layered {
        true => router.layer(IdempotencyLayer::new(MemoryStore::new())),
        false => router,
    };
    router.with_state(())
}

/// Sends a charge with key `n` and reads its answer, which must be `201 Created` (a first run or
/// its replay).
async fn send(app: &Router, n: usize) {
    let request = Request::post("/charges")
        .header("idempotency-key", n.to_string())
        .body(Body::from(r#"{"amount":1099}"#))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    response.into_body().collect().await.unwrap();
}

/// The allocations over [`THREAD_CACHED`] made by `requests` requests (the nth with key `n`, or
/// all with key `0` when `one_key`), after one warm-up request.
async fn large_allocations(app: &Router, requests: usize, one_key: bool) -> usize {
    send(app, 0).await;
    let before = large();
    for n in 1..=requests {
        send(app, if one_key { 0 } else { n }).await;
    }
    large() - before
}

#[tokio::test(flavor = "current_thread")]
async fn the_layer_adds_no_allocation_too_large_for_the_thread_cache() {
    const REQUESTS: usize = 1000;
    let bare = large_allocations(&app(false), REQUESTS, false).await;
    // The store's 64 maps grow by doubling, which takes a few large blocks each over these
    // requests: far fewer than one per request.
    let slack = REQUESTS / 4;
    let new_keys = large_allocations(&app(true), REQUESTS, false).await;
    assert!(
        new_keys <= bare + slack,
        "{new_keys} large allocations for {REQUESTS} new keys, {bare} without the layer"
    );
    let replays = large_allocations(&app(true), REQUESTS, true).await;
    assert!(
        replays <= bare + slack,
        "{replays} large allocations for {REQUESTS} replays, {bare} without the layer"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn the_memory_store_keeps_one_block_per_completed_record() {
    const RECORDS: usize = 2000;
    // A response as handlers make them: a body of its own and a few headers, one not standard.
    let handler = |body: String| async move {
        let headers = [
            ("content-type", String::from("application/json")),
            ("x-request-id", format!("req_{}", body.len())),
        ];
        (
            StatusCode::CREATED,
            headers,
            format!(r#"{{"id":"ch_1","echo":{body}}}"#),
        )
    };
    let store = MemoryStore::new();
    let app = Router::new()
        .route("/charges", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    send(&app, 0).await;
    let before = live();
    for n in 1..=RECORDS {
        send(&app, n).await;
    }
    let per_record = (live() - before) as f64 / RECORDS as f64;
    assert_eq!(store.len(), RECORDS + 1);
    // One block for the record, plus the shards' maps and expiry queues growing as they fill
    // (a fraction of a block per record, as they double).
    assert!(
        per_record < 1.5,
        "{per_record:.2} blocks kept per completed record"
    );
}
