//! `examples/render.rs`, driven in process: the layer's answers come in the API's error format, and
//! its metrics reach the Prometheus text, the store latency as a histogram.

#[allow(dead_code)]
#[path = "../examples/render.rs"]
mod example;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde_json::Value;
use tower::ServiceExt;

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String, String) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map_or(String::new(), |value| {
            value.to_str().expect("ASCII").to_owned()
        });
    let body = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    (
        status,
        content_type,
        String::from_utf8(body.to_vec()).expect("UTF-8"),
    )
}

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

    let (status, content_type, body) = send(&app, order(None)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        content_type, "application/json",
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
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(retry, first, "the replay, byte for byte");

    let (status, _, text) = send(&app, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
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
