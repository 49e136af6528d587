//! A payments API made safe to retry with `tower-idempotency`: charges as a state machine, a
//! provider (a program of its own) called with keys derived from the client's, events through an
//! outbox and an idempotent consumer, a reconciler for unknown outcomes. The money ([`ledger`],
//! [`balance`], [`consumer::Outbox`]) lives in PostgreSQL, for any number of instances, or in
//! memory, for one process; the layer's records in PostgreSQL, Redis (or a Cluster) or memory,
//! chosen at start-up (`config.rs`). [`app`] is the API; `README.md` maps where each idea lives.

pub mod auth;
pub mod balance;
mod charges;
pub mod config;
pub mod consumer;
pub mod error;
pub mod events;
mod http_server;
pub mod ledger;
pub mod outbox;
pub mod params;
pub mod pg;
pub mod prometheus;
pub mod provider;
pub mod reconciler;
mod single_process;
pub mod state_machine;

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::{BoxStore, IdempotencyLayer};

pub use config::{report, run};

use balance::Balances;
use ledger::Ledger;
use provider::ProviderClient;

/// The largest request body the API reads: 128 KiB, above any ASCII charge as Stripe's SDKs send
/// it (the longest description and largest metadata are under 85 KB as a form, every character
/// percent-encoded); a larger one (the largest metadata in a non-Latin script, up to 12 bytes a
/// character) gets `413` from the layer and nothing runs.
pub const REQUEST_LIMIT: usize = 128 * 1024;

/// The largest response the layer stores, and so can replay: 1 MiB. Every answer fits (a charge
/// echoes its request's text, at most 6 bytes a byte in JSON; an error quotes at most 200 bytes),
/// so a client that lost one can always get it back.
pub const RESPONSE_LIMIT: usize = 1024 * 1024;

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    let since = std::time::UNIX_EPOCH.elapsed().unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The charges.
    pub ledger: Arc<dyn Ledger>,
    /// What the ledger consumer made of the events (`GET /v1/balance`).
    pub balances: Arc<dyn Balances>,
    /// The provider's API, through the client retry layer.
    pub provider: ProviderClient,
    /// What `GET /metrics` renders, if the process records metrics.
    pub metrics: Option<PrometheusHandle>,
}

/// The API; `idempotency` is scoped to the account here and given the body limits. Keep its
/// [`shutdown_handle`](IdempotencyLayer::shutdown_handle) to drain its work at shutdown.
pub fn app(state: AppState, idempotency: IdempotencyLayer<BoxStore>) -> Router {
    let idempotency = idempotency
        .request_body_limit(REQUEST_LIMIT)
        .response_body_limit(RESPONSE_LIMIT)
        .scope(auth::account_scope)
        // Stripe answers a key reused for another request with 400, which its SDKs raise as their
        // `IdempotencyError`; and its SDKs read errors from `{"error": {...}}`.
        .problem_status(ProblemKind::Mismatch, StatusCode::BAD_REQUEST)
        .render_problems(error::render_problem);
    Router::new()
        .route("/v1/charges", post(charges::create).get(charges::list))
        .route("/v1/charges/{id}", get(charges::get))
        .route("/v1/charges/{id}/capture", post(charges::capture))
        .route("/v1/charges/{id}/refunds", post(charges::refund))
        .route("/v1/charges/{id}/cancel", post(charges::cancel))
        .route("/v1/balance", get(balance::show))
        // Layers wrap what comes before them: authentication runs first and puts the `Account`
        // in the request, then the idempotency layer keys its records by that account.
        .layer(idempotency)
        .layer(middleware::from_fn(auth::authenticate))
        // After the layers: the scraper needs no API key, and reads nothing idempotent.
        .route("/metrics", get(prometheus::show))
        .fallback(error::unrecognized_url)
        .with_state(state)
}
