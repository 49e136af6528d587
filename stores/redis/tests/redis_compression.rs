//! `RedisStore::with_compression` against a real `redis-server`: what is stored, what is replayed,
//! instances with and without it sharing records, and a damaged compressed record.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use test_servers::redis_server::RedisServer;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_redis::RedisStore;

/// The system allocator, noting the largest single allocation: what a record declaring a huge
/// length would cost each request that reads it.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

/// A JSON list of charges, about `size` bytes: the shape of a payments API's answer.
fn charges(size: usize) -> String {
    let mut json = String::from(r#"{"object":"list","data":["#);
    let mut n = 0u64;
    while json.len() < size {
        n += 1;
        json.push_str(&format!(
            r#"{{"id":"ch_{:016x}","object":"charge","amount":{},"currency":"eur","status":"succeeded"}},"#,
            n.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            n * 137 % 100_000
        ));
    }
    json.push_str(r#"{}]}"#);
    json
}

/// An app answering every charge with `body`, counting its runs.
fn app(store: RedisStore, body: String, runs: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/charges",
            post(move || {
                runs.fetch_add(1, Ordering::SeqCst);
                let body = body.clone();
                async move {
                    (
                        StatusCode::CREATED,
                        [("content-type", "application/json")],
                        body,
                    )
                }
            }),
        )
        .layer(IdempotencyLayer::new(store))
}

async fn send(app: &Router, key: &str) -> (StatusCode, Option<Outcome>, Vec<u8>) {
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let outcome = response.extensions().get::<Outcome>().copied();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, outcome, body.to_vec())
}

/// The stored value's length and kind byte (`0x80`: compressed).
fn stored(server: &RedisServer) -> (i64, Vec<u8>) {
    let keys = server.keys();
    assert_eq!(keys.len(), 1, "one record: {keys:?}");
    let length = server.command(&["STRLEN", &keys[0]]).as_integer().unwrap();
    let kind = server.command(&["GETRANGE", &keys[0], "1", "1"]);
    (length, kind.as_bytes().unwrap().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_records_are_stored_compressed_and_replayed_byte_for_byte_by_any_instance() {
    let server = RedisServer::start();
    let body = charges(20_480);
    let runs = Arc::new(AtomicUsize::new(0));
    let store = || RedisStore::from_url(&server.url()).unwrap();
    let compressing = app(store().with_compression(1024), body.clone(), runs.clone());
    let plain = app(store(), body.clone(), runs.clone());

    let first = send(&compressing, "large").await;
    assert_eq!(
        (first.0, first.1),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(first.2, body.as_bytes());
    let (length, kind) = stored(&server);
    assert_eq!(kind, [0x80], "stored compressed");
    assert!(
        (length as usize) < body.len() * 2 / 3,
        "{length} bytes stored for a {}-byte response",
        body.len()
    );

    // Replayed byte for byte, by the instance that compressed it and by one that does not.
    for app in [&compressing, &plain] {
        let replay = send(app, "large").await;
        assert_eq!(replay.1, Some(Outcome::Replayed));
        assert_eq!(replay.2, body.as_bytes());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_under_the_threshold_are_stored_as_they_are() {
    let server = RedisServer::start();
    let body = charges(512);
    let store = RedisStore::from_url(&server.url())
        .unwrap()
        .with_compression(1024);
    let app = app(store, body.clone(), Arc::default());
    assert_eq!(send(&app, "small").await.1, Some(Outcome::Executed));
    let (length, kind) = stored(&server);
    assert_ne!(kind, [0x80]);
    assert!(
        length as usize > body.len(),
        "{length} bytes, the whole record"
    );
    assert_eq!(send(&app, "small").await.2, body.as_bytes());
}

/// A compressed record whose bytes were changed is not replayed, and its request is not run
/// again: the layer answers 500 `record-unreadable` (§15.3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_compressed_record_is_neither_replayed_nor_run_again() {
    let server = RedisServer::start();
    let runs = Arc::new(AtomicUsize::new(0));
    let store = RedisStore::from_url(&server.url())
        .unwrap()
        .with_compression(0);
    let app = app(store, charges(4096), runs.clone());
    // Its declared length changed: more than its block can hold, then less than it holds. (A
    // change inside the block that still decompresses is a changed record, as in a record stored
    // as it is: a `SealedStore` is what tells those apart.)
    for (offset, bytes) in [("2", "\u{7f}\u{7f}\u{7f}\u{7f}"), ("2", "\n\0\0\0")] {
        server.flushall();
        assert_eq!(send(&app, "damaged").await.1, Some(Outcome::Executed));
        let key = &server.keys()[0];
        assert!(
            server
                .command(&["SETRANGE", key, offset, bytes])
                .as_integer()
                .is_some()
        );
        let answer = send(&app, "damaged").await;
        assert_eq!(
            (answer.0, answer.1),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Some(Outcome::RecordUnreadable)
            ),
            "damaged at {offset}: {bytes:?}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "one run per record, none after the damage"
    );
}

/// A compressed record declaring about 248 MiB for a block of 1 MiB (within LZ4's 255:1, so a
/// bound on the ratio alone lets it through): refused as unreadable, neither replayed nor run
/// again, and the declared length is never allocated (the bound is 2 MiB by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_declaring_more_than_the_bound_is_refused_before_it_is_allocated() {
    let server = RedisServer::start();
    let runs = Arc::new(AtomicUsize::new(0));
    let store = RedisStore::from_url(&server.url())
        .unwrap()
        .with_compression(0);
    let app = app(store, charges(4096), runs.clone());
    assert_eq!(send(&app, "bomb").await.1, Some(Outcome::Executed));
    let key = &server.keys()[0];
    // 0x0f7f0000 bytes declared (little-endian), and the block grown past 1 MiB.
    let declared = server.command(&["SETRANGE", key, "2", "\0\0\u{7f}\u{f}"]);
    assert!(declared.as_integer().is_some(), "{declared:?}");
    let filler = "x".repeat(1 << 20);
    let grown = server.command(&["APPEND", key, &filler]);
    assert!(
        grown.as_integer().is_some_and(|len| len > 1 << 20),
        "{grown:?}"
    );

    let before = LARGEST.load(Ordering::Relaxed);
    let answer = send(&app, "bomb").await;
    assert_eq!(
        (answer.0, answer.1),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            Some(Outcome::RecordUnreadable)
        )
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "not run again");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < 16 << 20,
        "the largest allocation was {largest} bytes (before the read: {before})"
    );
}
