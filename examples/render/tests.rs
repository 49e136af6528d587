//! The example, driven in process: the layer's answers come in the API's error format, and its
//! metrics reach the Prometheus text, the store latency as a histogram.

use super as example;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde_json::Value;
use tower_idempotency_test::send;

fn order(key: Option<&str>) -> Request<Body> {
    let mut request = Request::post("/v1/orders").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request
        .body(Body::from(r#"{"item":"book"}"#))
        .expect("a request")
}

#[tokio::test]
async fn errors_come_in_the_api_format_and_metrics_in_prometheus_text() {
    // The example's buckets, on a recorder of this test's own (the process has no other).
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("idempotency_store_call_duration_seconds".into()),
            example::STORE_CALL_BUCKETS,
        )
        .expect("buckets")
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder");
    let app = example::app(handle);

    let missing = send(&app, order(None)).await;
    let body = String::from_utf8_lossy(&missing.body);
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.header("content-type"),
        Some("application/json"),
        "the API's format, not problem+json"
    );
    let error: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(error["error"]["code"], "idempotency_key_missing", "{body}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );

    let first = send(&app, order(Some("order-1"))).await;
    let retry = send(&app, order(Some("order-1"))).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body, "the replay, byte for byte");

    let metrics = send(&app, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        r#"idempotency_requests_total{outcome="rejected"} 1"#,
        r#"idempotency_requests_total{outcome="executed"} 1"#,
        r#"idempotency_requests_total{outcome="replayed"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }
    assert!(
        text.contains("idempotency_store_call_duration_seconds_bucket{"),
        "the store latency as a histogram, with buckets:\n{text}"
    );
}
