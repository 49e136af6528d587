//! The payments API as the tests call it: a request built with [`Call`] (or by hand) and sent to
//! the app's `Router` with `oneshot`, its answer read whole into a [`Reply`].

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode, request};
use axum::response::Response;
use http_body_util::BodyExt;
use serde::Serialize;
use serde_json::{Value, json};
use tower::ServiceExt;
use tower_idempotency::{IDEMPOTENT_REPLAYED, Outcome};

use example_payments::auth::Account;

/// API keys: what a client sends.
pub(crate) const ALICE: &str = "sk_test_alice";
pub(crate) const BOB: &str = "sk_test_bob";

/// The account id an API key stands for: what the events, the ledger and the stores know.
pub(crate) fn account(api_key: &str) -> String {
    Account::for_api_key(api_key).id().to_owned()
}

/// A charge of `amount` euro cents on the card that pays, captured at once.
pub(crate) fn visa(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "eur", "source": "tok_visa" })
}

/// The same charge, authorized only (`capture: false`).
pub(crate) fn authorize(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "eur", "source": "tok_visa", "capture": false })
}

/// `POST /v1/charges` as `api_key`, under the idempotency key `key`, with `body` as JSON.
pub(crate) fn create_charge(router: &Router, api_key: &str, key: &str, body: &Value) -> Call {
    Call::post(router, "/v1/charges")
        .auth(api_key)
        .key(key)
        .json(body)
}

/// One request being built, for one app.
pub(crate) struct Call {
    router: Router,
    request: request::Builder,
    body: Body,
}

impl Call {
    /// `method path` to `router`, with no header and no body yet.
    pub(crate) fn new(router: &Router, method: Method, path: &str) -> Self {
        Self {
            router: router.clone(),
            request: Request::builder().method(method).uri(path),
            body: Body::empty(),
        }
    }

    pub(crate) fn post(router: &Router, path: &str) -> Self {
        Self::new(router, Method::POST, path)
    }

    pub(crate) fn get(router: &Router, path: &str) -> Self {
        Self::new(router, Method::GET, path)
    }

    /// `Authorization: Bearer api_key`.
    pub(crate) fn auth(self, api_key: &str) -> Self {
        self.header("authorization", &format!("Bearer {api_key}"))
    }

    pub(crate) fn header(mut self, name: &str, value: &str) -> Self {
        self.request = self.request.header(name, value);
        self
    }

    /// `Idempotency-Key: key`.
    pub(crate) fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// `body` as JSON, with its content type.
    pub(crate) fn json(mut self, body: impl Serialize) -> Self {
        self.request = self.request.header("content-type", "application/json");
        self.body = Body::from(serde_json::to_string(&body).expect("a JSON body"));
        self
    }

    /// A form body, as Stripe's SDKs send it.
    pub(crate) fn form(mut self, body: &str) -> Self {
        self.request = self
            .request
            .header("content-type", "application/x-www-form-urlencoded");
        self.body = Body::from(body.to_owned());
        self
    }

    /// `body` as it is, with no content type.
    pub(crate) fn raw(mut self, body: impl Into<Body>) -> Self {
        self.body = body.into();
        self
    }

    /// Sends the request to its app, and reads the whole answer.
    pub(crate) async fn send(self) -> Reply {
        let request = self.request.body(self.body).expect("a valid request");
        send(&self.router, request).await
    }
}

/// Sends `request` to `router`, and reads the whole answer.
pub(crate) async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router
        .clone()
        .oneshot(request)
        .await
        .expect("the router is infallible");
    Reply::read(response).await
}

/// One answer, read whole.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub bytes: Bytes,
    /// The body as JSON; `Null` when it is not JSON.
    pub json: Value,
    /// The idempotency layer's [`Outcome`], from the response's extensions.
    pub outcome: Option<Outcome>,
}

impl Reply {
    pub(crate) async fn read(response: Response) -> Self {
        let status = response.status();
        let headers = response.headers().clone();
        let outcome = response.extensions().get::<Outcome>().copied();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("a readable body")
            .to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Self {
            status,
            headers,
            bytes,
            json,
            outcome,
        }
    }

    /// The body as text (invalid UTF-8 replaced).
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// Whether the answer is a replay: `Idempotent-Replayed: true`. The layer sends no other
    /// value, so any other one fails the test.
    #[track_caller]
    pub(crate) fn replayed(&self) -> bool {
        match self.headers.get(IDEMPOTENT_REPLAYED) {
            None => false,
            Some(value) if value == "true" => true,
            Some(value) => panic!("Idempotent-Replayed: {value:?}, not `true`: {self:?}"),
        }
    }

    /// A header as text (`None` when absent or not text).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The `Content-Type`, or `""`.
    pub(crate) fn content_type(&self) -> &str {
        self.header("content-type").unwrap_or_default()
    }

    /// The API error's object (`Null` when there is none).
    pub(crate) fn error(&self) -> &Value {
        &self.json["error"]
    }

    /// The `code` of an API error, or `""`.
    pub(crate) fn error_code(&self) -> &str {
        self.error()["code"].as_str().unwrap_or_default()
    }

    /// Asserts an API error: `status`, JSON, its `type` and `code`, and a message.
    #[track_caller]
    pub(crate) fn assert_error(&self, status: StatusCode, kind: &str, code: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.content_type(), "application/json", "{}", self.text());
        assert_eq!(self.error()["type"], kind, "{}", self.text());
        assert_eq!(self.error_code(), code, "{}", self.text());
        assert!(
            self.error()["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{}",
            self.text()
        );
    }

    /// Asserts the answer to a provider call whose outcome is not known: `504`
    /// `provider_outcome_unknown`, never "nothing was charged".
    #[track_caller]
    pub(crate) fn assert_outcome_unknown(&self) {
        self.assert_error(
            StatusCode::GATEWAY_TIMEOUT,
            "api_error",
            "provider_outcome_unknown",
        );
        assert!(
            !self.text().contains("nothing was charged"),
            "{}",
            self.text()
        );
    }
}
