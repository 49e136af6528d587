//! `tower-idempotency` in an ordinary axum app: the layer on the one route with an effect, beside
//! routes that need no key. Records in Redis when `REDIS_URL` is set, in memory otherwise.
//!
//! ```text
//! cargo run --example axum
//! curl -si localhost:3000/orders -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"item": "book"}'
//! ```
//! Send the `curl` twice: the second answer is the first one, replayed (`idempotent-replayed: true`).

use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::routing::{get, post};
use axum::{Json, Router, http::StatusCode};
use serde_json::{Value, json};
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use tower_http::timeout::RequestBodyDeadlineLayer;
use tower_idempotency::store::Store;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_redis::RedisStore;

/// How long a request's body may take to arrive.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a shutdown may take to finish the requests in flight.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// `route_layer`: only `/orders` needs an `Idempotency-Key`; `/login` and `/health` need none.
pub fn app<St: Store + Clone>(idempotency: IdempotencyLayer<St>) -> Router {
    Router::new()
        .route("/orders", post(create_order).route_layer(idempotency))
        .route("/login", post(|| async { "signed in" }))
        .route("/health", get(|| async { "ok" }))
        .layer(RequestBodyDeadlineLayer::new(BODY_TIMEOUT))
}

async fn create_order(Json(order): Json<Value>) -> (StatusCode, Json<Value>) {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let order = json!({ "id": NEXT_ID.fetch_add(1, Ordering::Relaxed), "order": order });
    (StatusCode::CREATED, Json(order))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let Ok(url) = std::env::var("REDIS_URL") else {
        return serve(MemoryStore::new()).await;
    };
    // Fail now, not at the first request, if Redis is unreachable or older than 7.0.
    let store = async {
        let store = RedisStore::from_url(&url)?;
        store.check().await.map(|()| store)
    };
    match store.await {
        Ok(store) => serve(store).await,
        Err(err) => {
            let cause = err
                .source()
                .map_or(String::new(), |cause| format!(": {cause}"));
            eprintln!("error: cannot use Redis at REDIS_URL: {err}{cause}");
            std::process::exit(1);
        }
    }
}

/// Serves until SIGTERM or Ctrl-C, then lets the requests in flight and the handlers whose client
/// went away finish, for up to [`SHUTDOWN_TIMEOUT`]; connections still open then are dropped.
async fn serve<St: Store + Clone>(store: St) -> std::io::Result<()> {
    let idempotency = IdempotencyLayer::new(store);
    let detached = idempotency.shutdown_handle();
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    #[cfg(unix)] // before the address is printed, so that an early SIGTERM is not lost
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    println!("listening on http://{}", listener.local_addr()?);
    let stop = CancellationToken::new();
    let server = axum::serve(listener, app(idempotency))
        .with_graceful_shutdown(stop.clone().cancelled_owned());
    let server = tokio::spawn(async move { server.await });
    #[cfg(unix)]
    tokio::select! { _ = sigterm.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    stop.cancel();
    let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
    let _ = timeout_at(deadline, server).await;
    let _ = timeout_at(deadline, detached.wait()).await;
    Ok(())
}

#[cfg(test)]
mod tests;
