//! The layer's own answers in the API's error format, and its metrics in Prometheus' text format.
//!
//! An API whose errors look like `{"error": {"code", "message"}}` wants the layer's `409`, `422`
//! and `503` to look the same, so that its clients parse one format. The metrics go to whatever
//! recorder the process installs; here, `metrics-exporter-prometheus`, served at `GET /metrics`.
//!
//! ```text
//! cargo run --example render
//! curl -si localhost:3000/v1/orders -d '{}'                              # 400
//! # {"error":{"code":"idempotency_key_missing","message":"..."}}
//! curl -s localhost:3000/metrics | grep idempotency_requests_total
//! # idempotency_requests_total{outcome="rejected"} 1
//! ```

use std::error::Error;

use axum::http::{HeaderValue, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{Value, json};
use tower_idempotency::problem::{Problem, ProblemKind, RenderedProblem};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// Store latency buckets, in seconds. Without them the exporter renders the layer's latency
/// histogram as a summary (quantiles), which cannot be aggregated across instances.
pub const STORE_CALL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// The API's error document for each of the layer's answers.
fn render(problem: &Problem) -> RenderedProblem {
    let code = match problem.kind() {
        ProblemKind::MissingKey => "idempotency_key_missing",
        ProblemKind::InvalidKey => "idempotency_key_invalid",
        ProblemKind::InFlight => "request_in_progress",
        ProblemKind::Mismatch => "idempotency_key_reused",
        ProblemKind::StoreUnavailable => "service_unavailable",
        _ => "idempotency_error",
    };
    let body = json!({ "error": { "code": code, "message": problem.detail() } });
    RenderedProblem::new(
        HeaderValue::from_static("application/json"),
        body.to_string(),
    )
}

/// The API: orders behind the layer, the metrics beside it.
pub fn app(metrics: PrometheusHandle) -> Router {
    let idempotency = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .render_problems(render);
    Router::new()
        .route("/v1/orders", post(create_order).route_layer(idempotency))
        .route("/metrics", get(move || async move { metrics.render() }))
}

async fn create_order(Json(order): Json<Value>) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, Json(json!({ "order": order })))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_call_duration_seconds".into()),
            STORE_CALL_BUCKETS,
        )?
        .install_recorder()?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(metrics)).await?;
    Ok(())
}

#[cfg(test)]
mod tests;
