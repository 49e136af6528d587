//! `tower-idempotency` in an ordinary axum app: the layer on the one route that needs it, beside
//! routes that do not, served so that no client can hold the server open.
//!
//! ```text
//! cargo run --example axum                                  # records in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example axum  # records in Redis
//! curl -si localhost:3000/orders -H 'Idempotency-Key: order-1' \
//!   -H 'Content-Type: application/json' -d '{"item": "book"}'
//! ```
//! Send the `curl` twice: the second answer is the first one, replayed (`idempotent-replayed: true`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::time::{Instant, timeout_at};
use tower::Layer;
use tower_http::timeout::RequestBodyDeadlineLayer;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, Store};

type BoxError = Box<dyn std::error::Error>;

/// How long a client has to send a request's line and headers, then its body: after that its
/// request fails or its connection is closed (axum::serve has no such timeout).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a shutdown may take; keep it below your orchestrator's kill timeout.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

fn app<St: Store + Clone>(idempotency: IdempotencyLayer<St>) -> Router {
    Router::new()
        // Only creating an order has an effect to protect: the layer goes on that route alone.
        .route("/orders", post(create_order).route_layer(idempotency))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/login",
            post(|| async { Json(json!({ "token": "demo" })) }),
        )
}

async fn create_order(Json(order): Json<Value>) -> (StatusCode, Json<Value>) {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        Json(json!({ "id": id, "order": order })),
    )
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = TcpListener::bind(addr).await?;
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::from_url(&url)?;
            store.check().await?; // a wrong REDIS_URL fails now, not at the first request
            serve(listener, store).await
        }
        Err(_) => serve(listener, MemoryStore::new()).await,
    }
}

/// Serves until SIGTERM or Ctrl-C; then lets requests in flight and the layer's detached work
/// finish, within [`SHUTDOWN_TIMEOUT`].
async fn serve<St: Store + Clone>(listener: TcpListener, store: St) -> Result<(), BoxError> {
    let idempotency = IdempotencyLayer::new(store);
    let detached = idempotency.shutdown_handle();
    let app = RequestBodyDeadlineLayer::new(BODY_READ_TIMEOUT).layer(app(idempotency));
    // HTTP/1 only: the header read timeout is an HTTP/1 setting.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    let mut signal = std::pin::pin!(shutdown_signal()?);
    println!("listening on http://{}", listener.local_addr()?);
    loop {
        let stream = tokio::select! {
            () = &mut signal => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, usually: let some close.
                Err(_) => { tokio::time::sleep(Duration::from_millis(100)).await; continue; }
            },
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(graceful.watch(http.serve_connection(TokioIo::new(stream), service)));
    }
    let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
    // Connections still open at the deadline are dropped when `main` returns.
    let _ = timeout_at(deadline, graceful.shutdown()).await;
    let _ = timeout_at(deadline, detached.wait()).await;
    Ok(())
}

/// Resolves at SIGTERM (what orchestrators send) or Ctrl-C. SIGTERM's handler is installed now,
/// before the address is printed, so an early one is not lost.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    })
}
