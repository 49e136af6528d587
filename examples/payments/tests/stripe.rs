//! The payments example, in process on memory, as Stripe's Python SDK (stripe-python 16.1.0)
//! talks to it: the exact headers and form body it sends (captured from the SDK itself), its key
//! format, and the fields it reads back to build a charge or to pick the error it raises:
//!
//! - 2xx: the JSON object (`id`, `object`, ...);
//! - an error: `error.type`, `error.code`, `error.message`, `error.param`, `error.decline_code`;
//!   400 with `type: idempotency_error` is its `IdempotencyError`, 402 its `CardError`, 401 its
//!   `AuthenticationError`, anything else its `APIError`;
//! - `Stripe-Should-Retry`, which it obeys before its own rule (retry a 409 or a 5xx).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;
use tower_idempotency::store::OperatorStore;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_test::Faulty;

use example_payments::app;
use example_payments::provider::WINDOW;
use support::api::{self, Reply};
use support::process::Server;
use support::stack::Parts;
use support::wait_until;

/// A key as stripe-python makes one when none is given: 16 random bytes in a UUID's groups.
const SDK_KEY: &str = "189e0d67-52a9-d895-0de9-f4f83245023f";
/// The body of `stripe.Charge.create(amount=2000, currency="usd", source="tok_visa",
/// capture=False, description="a red bicycle", metadata={"order_id": "6735"})`, byte for byte.
const CREATE: &str = "amount=2000&currency=usd&source=tok_visa&capture=false\
                      &description=a+red+bicycle&metadata[order_id]=6735";

/// What stripe-python says of itself with each request.
const CLIENT_USER_AGENT: &str = r#"{"bindings_version": "16.1.0", "lang": "python", "httplib": "requests", "telemetry_id": "18632798ed9c6be9b01bea828018e658", "lang_version": "3.11.7", "platform": "Linux-6.18.44-x86_64-with-glibc2.36"}"#;

/// A request exactly as stripe-python sends it (its headers in its order; `Host` and
/// `Content-Length` are the HTTP client's).
fn sdk_request(key: &str, body: &str) -> Request<Body> {
    Request::post("/v1/charges")
        .header("User-Agent", "Stripe/v1 PythonBindings/16.1.0")
        .header("Accept-Encoding", "gzip, deflate")
        .header("Accept", "*/*")
        .header("Connection", "keep-alive")
        .header("X-Stripe-Client-User-Agent", CLIENT_USER_AGENT)
        .header("Authorization", "Bearer sk_test_alice")
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .header("Stripe-Version", "2026-10-28.endive")
        .header("Content-Length", body.len())
        .body(Body::from(body.to_owned()))
        .expect("a request")
}

/// What the SDK makes of an answer (whose `error` it reads into its exception's fields).
impl Reply {
    /// Which exception stripe-python raises for this answer (`_specific_v1_api_error`), or
    /// `None` for a success.
    fn sdk_exception(&self) -> Option<&'static str> {
        let message = self.error()["message"].as_str();
        let readable = message.is_some_and(|m| !m.is_empty());
        assert!(self.status.is_success() || readable, "{self:?}");
        Some(match self.status.as_u16() {
            200..=299 => return None,
            429 => "RateLimitError",
            400 | 404 if self.error()["type"] == "idempotency_error" => "IdempotencyError",
            400 | 404 => "InvalidRequestError",
            401 => "AuthenticationError",
            402 => "CardError",
            _ => "APIError",
        })
    }

    /// Whether stripe-python retries this answer (`_should_retry`, with retries left).
    fn sdk_retries(&self) -> bool {
        match self.header("stripe-should-retry") {
            Some("true") => true,
            Some("false") => false,
            _ => self.status == StatusCode::CONFLICT || self.status.is_server_error(),
        }
    }

    /// What the SDK sees of an answer: the status, the exception it raises (or `none`), the
    /// `error.code` it carries, and whether it sends the request again.
    fn sdk_sees(&self) -> (u16, &'static str, &str, bool) {
        let (status, exception) = (self.status.as_u16(), self.sdk_exception());
        (
            status,
            exception.unwrap_or("none"),
            self.error_code(),
            self.sdk_retries(),
        )
    }
}

/// Sends `request`, and checks that its answer is JSON: the SDK parses every answer as JSON.
async fn send(app: &Router, request: Request<Body>) -> Reply {
    let answer = api::send(app, request).await;
    assert!(!answer.json.is_null(), "not JSON: {answer:?}");
    answer
}

/// The app, its records in `store`, and its parts.
fn app_on(store: impl OperatorStore) -> (Router, Parts) {
    let parts = Parts::memory(WINDOW);
    let layer = IdempotencyLayer::new(BoxStore::new(store));
    (app(parts.state(), layer), parts)
}

/// No API key (its `AuthenticationError`), then create, the SDK's retry (a replay), the key
/// reused with other parameters (its `IdempotencyError`), and a declined card (its `CardError`),
/// retried alike.
#[tokio::test]
async fn no_api_key_create_retry_mismatch_and_decline_as_stripe_python_sees_them() {
    let (app, parts) = app_on(MemoryStore::new());
    let mut request = sdk_request(SDK_KEY, CREATE);
    request.headers_mut().remove("authorization");
    let anonymous = send(&app, request).await;
    let seen = (401, "AuthenticationError", "missing_api_key", false);
    assert_eq!(anonymous.sdk_sees(), seen, "{anonymous:?}");
    assert_eq!(parts.probe.calls(), 0);
    let created = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    assert_eq!(created.sdk_sees(), (201, "none", "", false), "{created:?}");
    let id = created.json["id"].as_str().unwrap_or_default();
    assert!(id.starts_with("ch_"), "{created:?}");
    #[rustfmt::skip]
    let charge = json!({ // what the SDK builds its `Charge` of
        "object": "charge", "amount": 2000, "currency": "usd", "status": "authorized",
        "captured": false, "description": "a red bicycle", "metadata": { "order_id": "6735" },
    });
    for (name, value) in charge.as_object().into_iter().flatten() {
        assert_eq!(&created.json[name], value, "{name}: {created:?}");
    }

    // The SDK's retry (a timeout, a dropped connection): the same headers and bytes.
    let retried = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(retried.bytes, created.bytes, "the same charge");
    assert!(retried.replayed());

    // The same key with other parameters: the SDK's error, still an RFC 9457 document.
    let other = CREATE.replace("amount=2000", "amount=3000");
    let reused = send(&app, sdk_request(SDK_KEY, &other)).await;
    let seen = (400, "IdempotencyError", "idempotency_key_reused", false);
    assert_eq!(reused.sdk_sees(), seen, "{reused:?}");
    assert_eq!(reused.content_type(), "application/problem+json");
    assert_eq!(reused.json["status"], 400);
    assert_eq!(parts.probe.calls(), 1, "one payment for the key");

    // A declined card, under a key of its own; the SDK's retry of it is the same decline.
    let key = "5b1f7c2e-0a4d-4e8b-9c3f-6d2a1e0b7f84";
    let body = "amount=700&currency=usd&source=tok_chargeDeclined";
    let declined = send(&app, sdk_request(key, body)).await;
    let seen = (402, "CardError", "card_declined", false);
    assert_eq!(declined.sdk_sees(), seen, "{declined:?}");
    let error = declined.error();
    assert_eq!(error["decline_code"], "generic_decline");
    let failed = error["charge"].as_str().unwrap_or_default();
    assert!(failed.starts_with("ch_"), "the failed charge: {error}");
    let again = send(&app, sdk_request(key, body)).await;
    assert_eq!(again.bytes, declined.bytes);
    assert!(again.replayed());
    assert_eq!(parts.probe.calls(), 2);
}

/// The SDK times out while the charge is still at the provider and retries: it gets a 409 that
/// tells it to retry (`Stripe-Should-Retry: true`, `Retry-After`), and once the charge is done,
/// the charge itself. The provider is called once.
#[tokio::test]
async fn a_retry_while_the_charge_runs_is_told_to_retry_then_replayed() {
    let (app, parts) = app_on(MemoryStore::new());
    let stall = parts.probe.stall().await;
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, sdk_request(SDK_KEY, CREATE)).await }
    });
    wait_until("the charge at the provider", || parts.probe.stalled() == 1).await;

    let busy = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    let seen = (409, "APIError", "idempotency_key_in_use", true);
    assert_eq!(busy.sdk_sees(), seen, "{busy:?}");
    assert_eq!(busy.header("stripe-should-retry"), Some("true"));
    assert_eq!(busy.header("retry-after"), Some("1"));

    drop(stall);
    let first = first.await.expect("the first attempt");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retried = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    assert_eq!(retried.bytes, first.bytes);
    assert!(retried.replayed());
    assert_eq!(parts.probe.calls(), 1);
}

/// Where nothing was done, the SDK is told to retry with the same key: the provider unavailable
/// (the API's own 503, not stored: the retry reaches the provider again) and the idempotency store
/// away (the layer's 503, before anything ran).
#[tokio::test]
async fn unavailable_answers_tell_the_sdk_to_retry() {
    let store = Faulty::new(MemoryStore::new());
    let (app, parts) = app_on(store.clone());
    let body = "amount=1500&currency=eur&source=tok_pspUnavailable";
    for attempt in 1..=2 {
        let down = send(&app, sdk_request(SDK_KEY, body)).await;
        let seen = (503, "APIError", "provider_unavailable", true);
        assert_eq!(down.sdk_sees(), seen, "{down:?}");
        assert_eq!(down.header("stripe-should-retry"), Some("true"));
        // The example's provider client tries 3 times before the charge answers its own 503.
        assert_eq!(parts.probe.calls(), 3 * attempt, "the retry ran");
    }

    store.fail(true);
    let away = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    let seen = (503, "APIError", "idempotency_store_unavailable", true);
    assert_eq!(away.sdk_sees(), seen, "{away:?}");
    assert_eq!(away.header("stripe-should-retry"), Some("true"));
    assert!(away.header("retry-after").is_some());
    assert_eq!(parts.probe.calls(), 6, "nothing ran");
    store.fail(false);
    let back = send(&app, sdk_request(SDK_KEY, CREATE)).await;
    assert_eq!(back.status, StatusCode::CREATED, "{back:?}");
}

/// The official stripe-python, from PyPI into a virtual environment of this test's, runs
/// `tests/sdk/stripe_python.py` against the server process: one charge for a retried key, the
/// SDK's own `IdempotencyError`, `CardError` and `AuthenticationError`, a capture, the list.
#[test]
fn the_official_python_sdk_charges_once_and_raises_its_own_errors() {
    let python = stripe_python();
    let server = Server::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/stripe_python.py");
    let ran = Command::new(&python)
        .arg(script)
        .env("API_BASE", server.url())
        .output()
        .expect("python runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr),
    );
    assert!(
        ran.status.success(),
        "stripe-python failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("every check passed"), "{stdout}");
    server.stop();
}

/// The virtual environment's python, stripe-python 16.1.0 installed in it.
fn stripe_python() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("stripe-python-16.1.0");
    let python = venv.join("bin/python");
    let run = |program: &Path, args: &[&str]| {
        let status = Command::new(program).args(args).status();
        assert!(
            status.as_ref().is_ok_and(|s| s.success()),
            "{} {args:?}: {status:?} (python3 with venv, and PyPI, are needed: .ci/run installs them)",
            program.display()
        );
    };
    if !python.exists() {
        run(
            Path::new("python3"),
            &["-m", "venv", &venv.to_string_lossy()],
        );
    }
    let installed = (Command::new(&python).args(["-c", "import stripe"]))
        .stderr(std::process::Stdio::null())
        .status();
    if !installed.is_ok_and(|s| s.success()) {
        run(
            &python,
            &["-m", "pip", "install", "--quiet", "stripe==16.1.0"],
        );
    }
    python
}
