//! The payments example as Stripe's Python SDK (stripe-python 16.1.0) talks to it: the exact
//! headers and form body it sends (captured from the SDK itself), its key format, and the fields it
//! reads back to build a charge or to pick the error it raises:
//!
//! - 2xx: the JSON object (`id`, `object`, ...);
//! - an error: `error.type`, `error.code`, `error.message`, `error.param`, `error.decline_code`;
//!   400 with `type: idempotency_error` is its `IdempotencyError`, 402 its `CardError`, 401 its
//!   `AuthenticationError`, anything else its `APIError`;
//! - `Stripe-Should-Retry`, which it obeys before its own rule (retry a 409 or a 5xx).
//!
//! Driven in-process with `oneshot`, on the in-memory store.

mod support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::Value;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, Store};
use tower_idempotency_test::Faulty;

use example_payments::app;
use example_payments::provider::WINDOW;
use support::api::{self, Reply};
use support::stack::Parts;

/// A key as stripe-python makes one when none is given: 16 random bytes in a UUID's groups.
const SDK_KEY: &str = "189e0d67-52a9-d895-0de9-f4f83245023f";
/// The body of `stripe.Charge.create(amount=2000, currency="usd", source="tok_visa",
/// capture=False, description="a red bicycle", metadata={"order_id": "6735"})`, byte for byte.
const CREATE: &str = "amount=2000&currency=usd&source=tok_visa&capture=false\
                      &description=a+red+bicycle&metadata[order_id]=6735";

/// A request exactly as stripe-python sends it (its headers in its order; `Host` and
/// `Content-Length` are the HTTP client's).
fn sdk_request(path: &str, key: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("User-Agent", "Stripe/v1 PythonBindings/16.1.0")
        .header("Accept-Encoding", "gzip, deflate")
        .header("Accept", "*/*")
        .header("Connection", "keep-alive")
        .header(
            "X-Stripe-Client-User-Agent",
            r#"{"bindings_version": "16.1.0", "lang": "python", "httplib": "requests", "telemetry_id": "18632798ed9c6be9b01bea828018e658", "lang_version": "3.11.7", "platform": "Linux-6.18.44-x86_64-with-glibc2.36"}"#,
        )
        .header("Authorization", "Bearer sk_test_alice")
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .header("Stripe-Version", "2026-10-28.endive")
        .header("Content-Length", body.len())
        .body(Body::from(body.to_owned()))
        .expect("a request")
}

/// What the SDK makes of an answer. (Its `error` object, [`Reply::error`], is what it reads
/// into its exception's fields.)
impl Reply {
    /// Which exception stripe-python raises for this answer (`_specific_v1_api_error`), or
    /// `None` for a success.
    fn sdk_exception(&self) -> Option<&'static str> {
        if self.status.is_success() {
            return None;
        }
        assert!(
            self.error().is_object(),
            "without `error` the SDK fails to read the answer: {self:?}"
        );
        Some(match self.status.as_u16() {
            429 => "RateLimitError",
            400 | 404 if self.error()["type"] == "idempotency_error" => "IdempotencyError",
            400 | 404 => "InvalidRequestError",
            401 => "AuthenticationError",
            402 => "CardError",
            403 => "PermissionError",
            _ => "APIError",
        })
    }

    /// Whether stripe-python retries this answer (`_should_retry`, retries left).
    fn sdk_retries(&self) -> bool {
        match self.header("stripe-should-retry") {
            Some("true") => true,
            Some("false") => false,
            _ => self.status == StatusCode::CONFLICT || self.status.is_server_error(),
        }
    }
}

/// Sends `request`, and checks that its answer is JSON: the SDK parses every answer as JSON.
async fn send(app: &Router, request: Request<Body>) -> Reply {
    let answer = api::send(app, request).await;
    if let Err(e) = serde_json::from_slice::<Value>(&answer.bytes) {
        panic!(
            "the SDK parses every answer as JSON ({e}): {:?}",
            answer.bytes
        );
    }
    answer
}

/// The app on `store`, its provider taking `latency` per call.
fn app_on(store: impl Store, latency: Duration) -> (Router, Parts) {
    let parts = Parts::memory(WINDOW).latency(latency);
    let app = app(parts.state(), IdempotencyLayer::new(BoxStore::new(store)));
    (app, parts)
}

/// Create, the SDK's retry (a replay), the key reused with other parameters (its
/// `IdempotencyError`), and a declined card (its `CardError`).
#[tokio::test]
async fn create_retry_mismatch_and_decline_as_stripe_python_sees_them() {
    let (app, provider) = app_on(MemoryStore::new(), Duration::ZERO);
    let provider = &provider.outage;

    let created = send(&app, sdk_request("/v1/charges", SDK_KEY, CREATE)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    assert_eq!(created.sdk_exception(), None);
    let charge = &created.json;
    assert!(
        charge["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("ch_"))
    );
    assert_eq!(
        charge["object"], "charge",
        "the SDK builds a `Charge` from it"
    );
    assert_eq!(charge["amount"], 2000);
    assert_eq!(charge["currency"], "usd");
    assert_eq!(charge["status"], "authorized");
    assert_eq!(charge["captured"], false);
    assert_eq!(charge["description"], "a red bicycle");
    assert_eq!(charge["metadata"]["order_id"], "6735");
    assert_eq!(created.header("idempotent-replayed"), None);

    // The SDK's retry (a timeout, a dropped connection): the same headers and bytes.
    let retried = send(&app, sdk_request("/v1/charges", SDK_KEY, CREATE)).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(
        retried.bytes, created.bytes,
        "the same charge, byte for byte"
    );
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    assert_eq!(retried.json["id"], charge["id"]);

    // The same key with other parameters.
    let other = CREATE.replace("amount=2000", "amount=3000");
    let reused = send(&app, sdk_request("/v1/charges", SDK_KEY, &other)).await;
    assert_eq!(reused.status, StatusCode::BAD_REQUEST, "{reused:?}");
    assert_eq!(reused.sdk_exception(), Some("IdempotencyError"));
    assert_eq!(reused.error()["type"], "idempotency_error");
    assert_eq!(reused.error()["code"], "idempotency_key_reused");
    assert!(
        reused.error()["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert!(!reused.sdk_retries());
    // ... which stays an RFC 9457 document for a problem+json client.
    assert_eq!(
        reused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reused.json["status"], 400);
    assert!(
        reused.json["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#mismatch"))
    );
    assert_eq!(provider.calls(), 1, "one payment for the key");

    // A declined card, with a key of its own; the SDK's retry of it is the same decline.
    let decline_key = "5b1f7c2e-0a4d-4e8b-9c3f-6d2a1e0b7f84";
    let declined_body = "amount=700&currency=usd&source=tok_chargeDeclined";
    let declined = send(&app, sdk_request("/v1/charges", decline_key, declined_body)).await;
    assert_eq!(
        declined.status,
        StatusCode::PAYMENT_REQUIRED,
        "{declined:?}"
    );
    assert_eq!(declined.sdk_exception(), Some("CardError"));
    let error = declined.error();
    assert_eq!(error["type"], "card_error");
    assert_eq!(error["code"], "card_declined");
    assert_eq!(error["decline_code"], "generic_decline");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(
        error["charge"]
            .as_str()
            .is_some_and(|c| c.starts_with("ch_"))
    );
    assert!(!declined.sdk_retries());
    let again = send(&app, sdk_request("/v1/charges", decline_key, declined_body)).await;
    assert_eq!(again.bytes, declined.bytes);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(provider.calls(), 2);
}

/// The SDK times out while the charge is still running and retries: it gets a 409 that tells it
/// to retry (`Stripe-Should-Retry: true`, `Retry-After`), and once the charge is done, the
/// charge itself. The provider is called once.
#[tokio::test(start_paused = true)]
async fn a_retry_while_the_charge_runs_is_told_to_retry_then_replayed() {
    let (app, provider) = app_on(MemoryStore::new(), Duration::from_secs(2));
    let provider = &provider.outage;
    let body = "amount=1500&currency=eur&source=tok_visa";

    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, sdk_request("/v1/charges", SDK_KEY, body)).await }
    });
    while provider.calls() == 0 {
        tokio::task::yield_now().await;
    }
    let busy = send(&app, sdk_request("/v1/charges", SDK_KEY, body)).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert_eq!(busy.sdk_exception(), Some("APIError"));
    assert_eq!(busy.error()["type"], "idempotency_error");
    assert_eq!(busy.error()["code"], "idempotency_key_in_use");
    assert_eq!(busy.header("stripe-should-retry"), Some("true"));
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert!(busy.sdk_retries());

    let first = first.await.expect("the first attempt");
    assert_eq!(first.status, StatusCode::CREATED);
    let retried = send(&app, sdk_request("/v1/charges", SDK_KEY, body)).await;
    assert_eq!(retried.bytes, first.bytes);
    assert_eq!(provider.calls(), 1);
}

/// Where nothing was done, the SDK is told to retry with the same key: the provider unavailable
/// (the API's own 503, not stored) and the idempotency store away (the layer's 503).
#[tokio::test]
async fn unavailable_answers_tell_the_sdk_to_retry() {
    let store = Faulty::new(MemoryStore::new());
    let (app, provider) = app_on(store.clone(), Duration::ZERO);
    let provider = &provider.outage;
    let body = "amount=1500&currency=eur&source=tok_pspUnavailable";

    for attempt in 1..=2 {
        let down = send(&app, sdk_request("/v1/charges", SDK_KEY, body)).await;
        assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
        assert_eq!(down.sdk_exception(), Some("APIError"));
        assert_eq!(down.error()["code"], "provider_unavailable");
        assert_eq!(down.header("stripe-should-retry"), Some("true"));
        assert_eq!(down.header("idempotent-replayed"), None, "never stored");
        // Each request reaches the provider three times: the example's client layer retries
        // the provider's 503 (3 attempts) before the charge answers its own 503.
        assert_eq!(
            provider.calls(),
            3 * attempt,
            "each retry reaches the provider"
        );
    }

    store.fail(true);
    let away = send(&app, sdk_request("/v1/charges", SDK_KEY, CREATE)).await;
    assert_eq!(away.status, StatusCode::SERVICE_UNAVAILABLE, "{away:?}");
    assert_eq!(away.error()["type"], "api_error");
    assert_eq!(away.error()["code"], "idempotency_store_unavailable");
    assert_eq!(away.header("stripe-should-retry"), Some("true"));
    assert!(away.header("retry-after").is_some());
    assert_eq!(provider.calls(), 6, "nothing ran");
    store.fail(false);
    let back = send(&app, sdk_request("/v1/charges", SDK_KEY, CREATE)).await;
    assert_eq!(back.status, StatusCode::CREATED);
}

/// A request without an API key is the SDK's `AuthenticationError`.
#[tokio::test]
async fn no_api_key_is_the_sdks_authentication_error() {
    let (app, _) = app_on(MemoryStore::new(), Duration::ZERO);
    let mut request = sdk_request("/v1/charges", SDK_KEY, CREATE);
    request.headers_mut().remove("authorization");
    let answer = send(&app, request).await;
    assert_eq!(answer.sdk_exception(), Some("AuthenticationError"));
    assert_eq!(answer.error()["type"], "authentication_error");
}
