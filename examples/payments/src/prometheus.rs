//! `GET /metrics`: the layer's metrics (`idempotency_requests_total{outcome}`,
//! `idempotency_store_call_duration_seconds{operation,result}`, a histogram with the buckets below)
//! and any others, in Prometheus' text format, rendered per request (the exporter has no listener
//! of its own: the API's server serves them).

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use super::AppState;

/// The store latency buckets, in seconds: from a memory store's microseconds to a Redis timeout.
const STORE_CALL_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// How often the recorder drains its histograms between scrapes, so they do not grow unbounded.
const UPKEEP: Duration = Duration::from_secs(5);

/// A Prometheus recorder, not yet installed, and the handle that renders what it records.
pub fn recorder() -> (PrometheusRecorder, PrometheusHandle) {
    let metric = Matcher::Full("idempotency_store_call_duration_seconds".into());
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(metric, STORE_CALL_BUCKETS)
        .expect("the buckets are not empty")
        .build_recorder();
    let handle = recorder.handle();
    (recorder, handle)
}

/// Installs a Prometheus recorder for the whole process, and its upkeep; returns its handle.
pub fn install() -> Result<PrometheusHandle, String> {
    let (recorder, handle) = recorder();
    metrics::set_global_recorder(recorder)
        .map_err(|err| format!("cannot install the metrics recorder: {err}"))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// `GET /metrics`: 404 when the app was built without a recorder.
pub async fn show(State(state): State<AppState>) -> Response {
    let Some(handle) = &state.metrics else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let content_type = [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")];
    (content_type, handle.render()).into_response()
}
