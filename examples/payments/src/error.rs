//! The API's errors as Stripe writes them and its SDKs read them: `{"error": {"type", "code",
//! "message", ...}}`, with `Stripe-Should-Retry: true` where a retry helps; and the layer's own
//! answers in that form too ([`render_problem`]).

use std::collections::BTreeMap;

use axum::Json;
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tower_idempotency::problem::{Problem, ProblemKind, RenderedProblem};

use super::provider::ProviderError;
use super::state_machine::Status;

/// Stripe's header that tells its SDKs whether to retry (they retry a 409 or a 5xx without it).
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// The most bytes of a client's input an error message quotes.
pub const QUOTE_LIMIT: usize = 200;

const INVALID: &str = "invalid_request_error";
const IDEMPOTENCY: &str = "idempotency_error";

/// An error answer of the API.
#[derive(Debug, Clone, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    code: &'static str,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'static str>,
    /// The failed charge, when a card is declined.
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'static str>,
    /// Refused before any effect (validation): `Cache-Control: no-store`, so the layer stores
    /// nothing (PROTOCOL §8.2) and the same key with a corrected request runs, as Stripe saves
    /// nothing for a request that failed validation.
    #[serde(skip)]
    no_store: bool,
}

/// `input` as an error message may quote it: at most [`QUOTE_LIMIT`] bytes (cut on a character
/// boundary), then `...[truncated]`.
pub fn quote(input: &str) -> String {
    let end = input.floor_char_boundary(QUOTE_LIMIT);
    let cut = (end < input.len()).then_some("...[truncated]");
    format!("{}{}", &input[..end], cut.unwrap_or_default())
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: &str) -> Self {
        Self {
            status,
            kind,
            code,
            message: message.to_owned(),
            param: None,
            charge: None,
            decline_code: None,
            no_store: false,
        }
    }

    /// 400: the request is malformed, refused before any effect: not stored.
    pub fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        let mut error = Self::new(StatusCode::BAD_REQUEST, INVALID, code, &message.into());
        error.no_store = true;
        error
    }

    /// 400: a parameter is missing.
    pub fn missing_param(param: &'static str) -> Self {
        let message = format!("`{param}` is required");
        Self::invalid_request("parameter_missing", message).with_param(param)
    }

    /// 400: a parameter has an invalid value.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_request("parameter_invalid", message).with_param(param)
    }

    /// 400: the charge's state does not allow the operation.
    pub fn invalid_state(status: Status, operation: &str) -> Self {
        let status = status.as_str();
        let message = format!("the charge is {status}; it cannot be {operation}");
        Self::invalid_request("invalid_state", message)
    }

    /// 400: a refund of `amount` with only `refundable` left, in Stripe's words (as major units).
    pub fn amount_too_large(amount: i64, refundable: i64) -> Self {
        let money = |cents: i64| format!("${}.{:02}", cents / 100, cents % 100);
        let (asked, left) = (money(amount), money(refundable));
        let message =
            format!("Refund amount ({asked}) is greater than unrefunded amount on charge ({left})");
        Self::invalid_request("amount_too_large", message).with_param("amount")
    }

    /// 401: no API key.
    pub fn unauthorized() -> Self {
        let message = "send your API key as `Authorization: Bearer <key>`";
        let status = StatusCode::UNAUTHORIZED;
        Self::new(status, "authentication_error", "missing_api_key", message)
    }

    /// 402: the card was declined; the failed charge is recorded.
    pub fn card_declined(charge: &str) -> Self {
        let (status, message) = (StatusCode::PAYMENT_REQUIRED, "the card was declined");
        let mut error = Self::new(status, "card_error", "card_declined", message);
        error.charge = Some(charge.to_owned());
        error.decline_code = Some("generic_decline");
        error
    }

    /// 404: no such charge (for this account).
    pub fn no_such_charge(id: &str) -> Self {
        let message = format!("no such charge: `{}`", quote(id));
        Self::new(StatusCode::NOT_FOUND, INVALID, "resource_missing", &message).with_param("id")
    }

    /// 400 `idempotency_error`, as Stripe answers it: the key names another request, which the
    /// layer forgot (its window ran out, its store was flushed). Nothing was done.
    pub fn idempotency_key_reused() -> Self {
        let message = "this Idempotency-Key was used for a different request; nothing was done: \
                       send a new key";
        let status = StatusCode::BAD_REQUEST;
        Self::new(status, IDEMPOTENCY, "idempotency_key_reused", message)
    }

    /// 409 `idempotency_error`: this run lost its claim (its lease ran out while it stalled) and a
    /// later run took over; it stopped before its effect. The retry gets the later run's answer.
    pub fn superseded() -> Self {
        let message = "a later attempt with this Idempotency-Key took this request over; nothing \
                       was done here: retry with the same key to get that attempt's answer";
        let status = StatusCode::CONFLICT;
        Self::new(status, IDEMPOTENCY, "idempotency_key_superseded", message)
    }

    fn unavailable(code: &'static str, message: &str) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "api_error", code, message)
    }

    /// 503: the balance ledger is unavailable.
    pub fn ledger_unavailable() -> Self {
        let message = "the balance is unavailable; try again";
        Self::unavailable("ledger_unavailable", message)
    }

    /// 503: the charges' store failed; a retry with the same key resumes the request.
    pub fn storage_unavailable() -> Self {
        let message = "the charges are unavailable; retry with the same Idempotency-Key";
        Self::unavailable("storage_unavailable", message)
    }

    /// Names the parameter at fault.
    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
}

impl From<ProviderError> for ApiError {
    fn from(err: ProviderError) -> Self {
        match err {
            ProviderError::Unavailable => Self::unavailable(
                "provider_unavailable",
                "the payment provider is unavailable and did nothing (nothing was charged or \
                 refunded): retry with the same Idempotency-Key",
            ),
            // The charge is kept; the retry with its key, or the reconciler, learns the outcome.
            ProviderError::Unknown => Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "api_error",
                "provider_outcome_unknown",
                "the payment provider did not answer in time; the outcome is not known yet: retry \
                 with the same Idempotency-Key to learn it (nothing is charged twice)",
            ),
            ProviderError::KeyReused => Self::idempotency_key_reused(),
            ProviderError::AmountTooLarge { amount, refundable } => {
                Self::amount_too_large(amount, refundable)
            }
            ProviderError::NoSuchPayment => {
                let text = "the provider has no such payment";
                Self::new(StatusCode::BAD_REQUEST, INVALID, "resource_missing", text)
            }
            ProviderError::UnexpectedState => {
                let text = "the provider's payment cannot be captured or canceled in its state";
                Self::new(StatusCode::BAD_REQUEST, INVALID, "unexpected_state", text)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(BTreeMap::from([("error", &self)]));
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        if self.no_store {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        // Nothing was done (503), not known yet (504), another run is on it (409): safe to resend.
        if matches!(self.status.as_u16(), 503 | 504 | 409) {
            headers.insert(SHOULD_RETRY, HeaderValue::from_static("true"));
        }
        response
    }
}

/// `404` for a route the API lacks, as Stripe answers it, so an SDK call to it raises a clear
/// error instead of failing to read the answer.
pub async fn unrecognized_url(method: Method, uri: Uri) -> ApiError {
    let message = format!(
        "Unrecognized request URL ({method}: {}). This example serves /v1/charges, \
         /v1/charges/{{id}}, its /capture, /refunds and /cancel, and /v1/balance.",
        quote(uri.path())
    );
    ApiError::new(StatusCode::NOT_FOUND, INVALID, "", &message)
}

/// The layer's answers (`IdempotencyLayer::render_problems`): the RFC 9457 document a problem+json
/// client reads, plus the `error` member a Stripe SDK reads, and `Stripe-Should-Retry`: `true` only
/// where a retry can succeed (an SDK would retry the rest in vain).
pub fn render_problem(problem: &Problem) -> RenderedProblem {
    let (kind, code, retry) = match problem.kind() {
        ProblemKind::MissingKey => (INVALID, "idempotency_key_missing", false),
        ProblemKind::InvalidKey => (INVALID, "idempotency_key_invalid", false),
        ProblemKind::BodyTooLarge => (INVALID, "request_too_large", false),
        ProblemKind::BodyUnreadable => (INVALID, "request_unreadable", false),
        ProblemKind::InFlight => (IDEMPOTENCY, "idempotency_key_in_use", true),
        ProblemKind::Mismatch => (IDEMPOTENCY, "idempotency_key_reused", false),
        ProblemKind::NotReplayable => (IDEMPOTENCY, "idempotency_response_unavailable", false),
        ProblemKind::StoreUnavailable => ("api_error", "idempotency_store_unavailable", true),
        // The database refused the charge's writes at commit: sending it again would be too.
        ProblemKind::CommitRejected => (INVALID, "request_rejected", false),
        // A 429, which Stripe's SDKs raise as their `RateLimitError` and retry after its wait.
        ProblemKind::QuotaExceeded => (INVALID, "rate_limit", true),
        _ => ("api_error", "internal_error", false),
    };
    let detail = problem.detail();
    let document = serde_json::json!({
        "type": problem.type_uri(), "title": problem.title(), "status": problem.status().as_u16(),
        "detail": detail, "error": { "type": kind, "code": code, "message": detail },
    });
    let retry = HeaderValue::from_static(if retry { "true" } else { "false" });
    let content_type = HeaderValue::from_static("application/problem+json");
    RenderedProblem::new(content_type, document.to_string()).header(SHOULD_RETRY, retry)
}
