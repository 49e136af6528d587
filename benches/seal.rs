//! What sealing adds to a request, in bytes stored and in instructions run in process: a probe
//! meant to be run under callgrind, which counts instructions exactly, where a timer on a shared
//! machine would not.
//!
//! ```sh
//! cargo bench --bench seal --no-run
//! for store in memory redis; do for seal in plain sealed; do for work in new replay; do
//!   for n in 200 400; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/deps/seal-* $store $seal $work $n 2>&1 | grep Collected; done
//! done; done; done
//! ```
//!
//! Arguments: the store (`memory`, or `redis` on a `redis-server` of its own), `plain` or
//! `sealed` (`SealedStore` over the store), `new` (a new key per request) or `replay` (one key,
//! primed), and the number of requests. Instructions per request are the difference between two
//! runs (200 and 400 requests) over the 200 requests between them, so start-up cancels out; with
//! Redis they are the application's only (the server's own are not in the count). It prints the
//! stored record's size. The request and response are `benches/layer.rs`'s (a 64-byte body, a
//! 203-byte JSON charge).

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{BoxStore, Fingerprint, IdempotencyLayer, MemoryStore, Record, RecordId};
use tower_idempotency::{RedisStore, Scope};

const CHARGE: &str = r#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"eur","status":"succeeded","captured":true,"customer":"cus_NffrFeUfNV2Hib","description":"Order #1234","created":1679090539}"#;
const REQUEST_BODY: &str = r#"{"amount":1099,"currency":"eur","customer":"cus_NffrFeUfNV2Hib"}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, seal, work, n] = <[String; 4]>::try_from(args)
        .map_err(|_| "usage: seal memory|redis plain|sealed new|replay N")?;
    let n: usize = n.parse()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let server = (store == "redis").then(redis_server::RedisServer::start);
    let inner = match &server {
        Some(server) => BoxStore::new(RedisStore::from_url(&server.url())?),
        None => BoxStore::new(MemoryStore::new()),
    };
    let store = match seal.as_str() {
        "sealed" => BoxStore::new(SealedStore::new(
            inner.clone(),
            SealKeys::new([SealKey::new("2025-01", [7; 32])?])?,
        )),
        _ => inner.clone(),
    };
    let layer = IdempotencyLayer::new(store).scope(|_| Ok(Scope::from("acct_1")));
    let app = Router::new()
        .route(
            "/v1/charges",
            post(|| async {
                (
                    StatusCode::CREATED,
                    [(header::CONTENT_TYPE, "application/json")],
                    CHARGE,
                )
            }),
        )
        .layer(layer)
        .with_state::<()>(());
    let request = |key: &str| {
        Request::builder()
            .method(Method::POST)
            .uri("/v1/charges")
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Body::from(REQUEST_BODY))
            .expect("a request")
    };
    runtime.block_on(async {
        let call = |key: String| {
            let app = app.clone();
            let request = request(&key);
            async move {
                let response = app.oneshot(request).await.expect("infallible");
                assert_eq!(response.status(), StatusCode::CREATED);
                response.into_body().collect().await.expect("a body");
            }
        };
        call("primed".into()).await;
        for i in 0..n {
            let key = if work == "replay" {
                "primed".into()
            } else {
                format!("key-{i}")
            };
            call(key).await;
        }
        let id = RecordId::new(b"acct_1", "primed");
        let fp = Fingerprint::from_bytes([0; 32]);
        if let Ok(Claim::Existing(Record::Completed(done))) =
            inner.claim(&id, &fp, Duration::from_secs(30)).await
        {
            println!("stored record: {} bytes", done.encode()?.len());
        }
        Ok(())
    })
}
