//! A payments API made safe to retry with `tower-idempotency`.
//!
//! A client that creates a charge and times out cannot know whether the charge happened, so it
//! retries. This example shows the layer doing what a payments API needs:
//!
//! - `POST /v1/charges` needs an `Idempotency-Key`; a retry with the same key gets the first
//!   response back (`Idempotent-Replayed: true`) and the card is charged once.
//! - Keys are scoped to the account: authentication runs *outside* the idempotency layer and
//!   puts an `Account` (`auth.rs`) in the request; the layer's scope function reads it.
//! - A declined card (402) is a decided outcome: stored and replayed. An unavailable provider (503)
//!   is transient: not stored, so the retry runs again.
//! - The handler passes the payment provider its own idempotency key, derived from the client's
//!   key and the account ([`tower_idempotency::IdempotencyKey::derive`]): even a request whose
//!   idempotency record was lost cannot charge twice.
//! - Captures, refunds and cancellations walk one explicit state machine (`state_machine.rs`).
//! - On SIGTERM or Ctrl-C the server stops accepting, lets requests in flight finish, and waits
//!   for the layer's detached work ([`tower_idempotency::Shutdown`]).
//!
//! The ledger and the provider are simulated, in memory; the idempotency records are in memory
//! too, or in Redis when `REDIS_URL` is set.
//!
//! # Run it
//! ```text
//! cargo run --example server                                   # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server  # Redis 7 or newer
//! ```
//! Environment: `ADDR` (default `127.0.0.1:3000`), `REDIS_URL` (unset: in memory),
//! `PSP_LATENCY_MS` (the provider's delay per call, default 0), `RUST_LOG` (default `info`).
//!
//! # Walk through it
//! Any non-empty bearer token is an account. Create a charge:
//! ```text
//! curl -si http://127.0.0.1:3000/v1/charges \
//!   -H 'Authorization: Bearer sk_test_alice' \
//!   -H 'Idempotency-Key: order-1001' \
//!   -d '{"amount": 2500, "currency": "eur", "source": "tok_visa"}'
//!
//! HTTP/1.1 201 Created
//! {"id":"ch_204c358b65c143f8","object":"charge","amount":2500,"currency":"eur", ... "status":"captured", ...}
//! ```
//! Send the same command again, as a client that timed out would: the same response comes back,
//! byte for byte, marked `idempotent-replayed: true`, and nothing is charged again.
//!
//! Change the amount but keep the key: the layer refuses with `422 Unprocessable Entity` (an
//! `application/problem+json` document), because a key names one request.
//!
//! A declined card, with a new key, twice: `402 Payment Required` with
//! `{"error":{"type":"card_error","code":"card_declined",...}}`, the second time replayed. The
//! failed charge is in the list:
//! ```text
//! curl -si http://127.0.0.1:3000/v1/charges \
//!   -H 'Authorization: Bearer sk_test_alice' \
//!   -H 'Idempotency-Key: order-1002' \
//!   -d '{"amount": 2500, "currency": "eur", "source": "tok_chargeDeclined"}'
//! curl -s http://127.0.0.1:3000/v1/charges -H 'Authorization: Bearer sk_test_alice'
//! ```
//! Then: `"capture": false` authorizes only; `POST /v1/charges/{id}/capture`, `/refunds`
//! (`{"amount": ...}`, default the rest) and `/cancel` move it on, each with its own
//! `Idempotency-Key`. `tok_pspUnavailable` answers 503, and retrying it runs again.

mod auth;
mod charges;
mod error;
mod ledger;
pub mod provider;
mod state_machine;

use std::error::Error;
use std::future::Future;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::middleware;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, Store};
use tracing_subscriber::EnvFilter;

pub use ledger::Ledger;
pub use provider::Provider;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub ledger: Arc<Ledger>,
    pub provider: Provider,
}

impl AppState {
    /// An empty ledger, and a simulated provider that takes `provider_latency` per call.
    pub fn new(provider_latency: Duration) -> Self {
        Self {
            ledger: Arc::default(),
            provider: Provider::new(provider_latency),
        }
    }
}

/// The API. `idempotency` is scoped to the authenticated account here; keep its
/// [`shutdown_handle`](IdempotencyLayer::shutdown_handle) to drain its work at shutdown.
pub fn app<St: Store + Clone>(state: AppState, idempotency: IdempotencyLayer<St>) -> Router {
    Router::new()
        .route("/v1/charges", post(charges::create).get(charges::list))
        .route("/v1/charges/{id}", get(charges::get))
        .route("/v1/charges/{id}/capture", post(charges::capture))
        .route("/v1/charges/{id}/refunds", post(charges::refund))
        .route("/v1/charges/{id}/cancel", post(charges::cancel))
        // Layers wrap what comes before them: authentication runs first and puts the `Account`
        // in the request, then the idempotency layer keys its records by that account.
        .layer(idempotency.scope(auth::account_scope))
        .layer(middleware::from_fn(auth::authenticate))
        .with_state(state)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", report(&*err));
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = match std::env::var("PSP_LATENCY_MS") {
        Ok(ms) => ms
            .parse()
            .map_err(|_| format!("PSP_LATENCY_MS must be a number of milliseconds, not {ms:?}"))?,
        Err(_) => 0,
    };
    let state = AppState::new(Duration::from_millis(latency));
    match std::env::var("REDIS_URL")
        .ok()
        .filter(|url| !url.is_empty())
    {
        None => serve(&addr, state, MemoryStore::new(), "memory").await,
        Some(url) => serve(&addr, state, connect_redis(&url).await?, "redis").await,
    }
}

/// Serves until SIGTERM or Ctrl-C, then lets the requests in flight finish.
async fn serve<St: Store + Clone>(
    addr: &str,
    state: AppState,
    store: St,
    store_name: &str,
) -> Result<(), Box<dyn Error>> {
    let idempotency = IdempotencyLayer::new(store);
    let drained = idempotency.shutdown_handle();
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let stop = shutdown_signal()?;
    println!(
        "listening on http://{} (store: {store_name})",
        listener.local_addr()?
    );

    axum::serve(listener, app(state, idempotency))
        .with_graceful_shutdown(stop)
        .await?;
    // Handlers whose client went away run on, detached; let them finish and store their result.
    if tokio::time::timeout(Duration::from_secs(30), drained.wait())
        .await
        .is_err()
    {
        tracing::warn!("gave up waiting for detached requests after 30 s");
    }
    tracing::info!("stopped");
    Ok(())
}

/// A Redis store, checked now so that a wrong `REDIS_URL` fails at start-up, not at the first
/// request.
async fn connect_redis(url: &str) -> Result<RedisStore, String> {
    let store =
        RedisStore::from_url(url).map_err(|err| format!("bad REDIS_URL: {}", report(&err)))?;
    store
        .check()
        .await
        .map_err(|err| format!("cannot use Redis at REDIS_URL: {}", report(&err)))?;
    Ok(store)
}

/// Resolves at the first SIGTERM or Ctrl-C. The handlers are installed now, before the server
/// listens, so an early signal is not lost.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutting down: finishing the requests in flight");
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down: finishing the requests in flight");
    })
}

/// An error and its sources, on one line.
fn report(err: &dyn Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some errors repeat their source in their own message.
        if !line.contains(&cause_text) {
            line.push_str(": ");
            line.push_str(&cause_text);
        }
        source = cause.source();
    }
    line
}
