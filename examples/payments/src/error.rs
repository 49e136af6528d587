//! The API's errors as Stripe writes them and its SDKs read them: `{"error": {"type", "code",
//! "message", ...}}`, with `Stripe-Should-Retry: true` where a retry helps. The idempotency
//! layer's own answers go through [`render_problem`]: RFC 9457 documents that carry the same
//! `error` member, so that a Stripe SDK raises its own error types for them and a problem+json
//! client reads them as before.

use axum::Json;
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tower_idempotency::ProblemKind;
use tower_idempotency::problem::{Problem, RenderedProblem};

use super::provider::ProviderError;
use super::state_machine::Status;

/// Stripe's header that tells its SDKs whether to retry (they retry a 409 or a 5xx without it).
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// The most bytes of a client's input an error message quotes.
pub const QUOTE_LIMIT: usize = 200;

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
    /// Refused before any effect (validation): answered `Cache-Control: no-store`, so that the
    /// layer stores nothing (PROTOCOL §8.2) and the same key with a corrected request runs, as
    /// Stripe saves nothing for a request that failed validation.
    #[serde(skip)]
    no_store: bool,
}

/// `input` as an error message may quote it: at most [`QUOTE_LIMIT`] bytes (cut on a character
/// boundary), then `...[truncated]`.
pub fn quote(input: &str) -> String {
    if input.len() <= QUOTE_LIMIT {
        return input.to_owned();
    }
    let mut end = QUOTE_LIMIT;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...[truncated]", &input[..end])
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
            param: None,
            charge: None,
            decline_code: None,
            no_store: false,
        }
    }

    /// 400: the request is malformed, refused before any effect: not stored.
    pub fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        let kind = "invalid_request_error";
        let mut error = Self::new(StatusCode::BAD_REQUEST, kind, code, message.into());
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

    /// 400 `amount_too_large`: a refund of `amount` with only `refundable` left, in Stripe's
    /// words (minor units shown as major).
    pub fn amount_too_large(amount: i64, refundable: i64) -> Self {
        let money = |cents: i64| format!("${}.{:02}", cents / 100, cents % 100);
        let message = format!(
            "Refund amount ({}) is greater than unrefunded amount on charge ({})",
            money(amount),
            money(refundable)
        );
        Self::invalid_request("amount_too_large", message).with_param("amount")
    }

    /// 401: no API key.
    pub fn unauthorized() -> Self {
        let message = "send your API key as `Authorization: Bearer <key>`";
        let kind = "authentication_error";
        Self::new(
            StatusCode::UNAUTHORIZED,
            kind,
            "missing_api_key",
            message.into(),
        )
    }

    /// 402: the card was declined; the failed charge is recorded.
    pub fn card_declined(charge: &str) -> Self {
        let message = "the card was declined".into();
        let mut error = Self::new(
            StatusCode::PAYMENT_REQUIRED,
            "card_error",
            "card_declined",
            message,
        );
        error.charge = Some(charge.to_owned());
        error.decline_code = Some("generic_decline");
        error
    }

    /// 404: no such charge (for this account).
    pub fn no_such_charge(id: &str) -> Self {
        let message = format!("no such charge: `{}`", quote(id));
        let kind = "invalid_request_error";
        Self::new(StatusCode::NOT_FOUND, kind, "resource_missing", message).with_param("id")
    }

    /// 400 `idempotency_error` (Stripe's status for it, its SDKs' `IdempotencyError`): the key
    /// names another request here, though the layer forgot it (its window ran out, its store
    /// was flushed). Nothing was done.
    pub fn idempotency_key_reused() -> Self {
        let message = "this Idempotency-Key was used for a different request; nothing was done: \
                       send a new key";
        let code = "idempotency_key_reused";
        Self::new(
            StatusCode::BAD_REQUEST,
            "idempotency_error",
            code,
            message.into(),
        )
    }

    /// 409 `idempotency_error`: this run lost its claim of the key (its lease ran out while it
    /// was stalled) and a later run took over; it stopped before its effect. The retry gets the
    /// later run's answer.
    pub fn superseded() -> Self {
        let message = "a later attempt with this Idempotency-Key took this request over; nothing \
                       was done here: retry with the same key to get that attempt's answer";
        let code = "idempotency_key_superseded";
        Self::new(
            StatusCode::CONFLICT,
            "idempotency_error",
            code,
            message.into(),
        )
    }

    /// 503 `api_error` with `code`: nothing happened, retry.
    fn unavailable(code: &'static str, message: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            code,
            message.into(),
        )
    }

    /// 503: the balance ledger is unavailable.
    pub fn ledger_unavailable() -> Self {
        Self::unavailable(
            "ledger_unavailable",
            "the balance is unavailable; try again",
        )
    }

    /// 503: the charges' store failed; the retry with the same key undoes or resumes what the
    /// request began.
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
                "the payment provider is unavailable; nothing was charged, retry with the same \
                 Idempotency-Key",
            ),
            // The outcome is not known yet: the charge is kept, and the retry with the same key
            // learns it (charging nothing twice), as does the reconciler.
            ProviderError::Unknown => Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "api_error",
                "provider_outcome_unknown",
                "the payment provider did not answer in time; the outcome is not known yet: retry \
                 with the same Idempotency-Key to learn it (nothing is charged twice)"
                    .into(),
            ),
            ProviderError::KeyReused => Self::idempotency_key_reused(),
            ProviderError::AmountTooLarge { amount, refundable } => {
                Self::amount_too_large(amount, refundable)
            }
            ProviderError::NoSuchPayment => Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "resource_missing",
                "the provider has no such payment".into(),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        /// `{"error": {...}}`, its fields in Stripe's order.
        #[derive(Serialize)]
        struct Body<'a> {
            error: &'a ApiError,
        }
        let mut response = (self.status, Json(Body { error: &self })).into_response();
        let headers = response.headers_mut();
        if self.no_store {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        // A 503 means nothing was done, a 504 that the outcome is not known yet, a 409 that
        // another attempt is on it: the same request, with the same key, is safe to send again.
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT | StatusCode::CONFLICT
        ) {
            headers.insert(SHOULD_RETRY, HeaderValue::from_static("true"));
        }
        response
    }
}

/// `404` for a route the API does not have, as Stripe answers it, so that an SDK call to an
/// endpoint the example lacks raises a clear error instead of failing to read the answer.
pub async fn unrecognized_url(method: Method, uri: Uri) -> ApiError {
    let message = format!(
        "Unrecognized request URL ({method}: {}). This example serves /v1/charges, \
         /v1/charges/{{id}}, its /capture, /refunds and /cancel, and /v1/balance.",
        quote(uri.path())
    );
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "", message)
}

/// The idempotency layer's answers in the API's format (`IdempotencyLayer::render_problems`): the
/// layer's RFC 9457 document plus the `error` member a Stripe SDK reads, and
/// `Stripe-Should-Retry`: `true` while the key's first request runs (409), the store is away
/// (503) or the quota is spent (429), `false` elsewhere (an SDK would retry those in vain).
pub fn render_problem(problem: &Problem) -> RenderedProblem {
    let (kind, code) = match problem.kind() {
        ProblemKind::MissingKey => ("invalid_request_error", "idempotency_key_missing"),
        ProblemKind::InvalidKey => ("invalid_request_error", "idempotency_key_invalid"),
        ProblemKind::BodyTooLarge => ("invalid_request_error", "request_too_large"),
        ProblemKind::BodyUnreadable => ("invalid_request_error", "request_unreadable"),
        ProblemKind::InFlight => ("idempotency_error", "idempotency_key_in_use"),
        ProblemKind::Mismatch => ("idempotency_error", "idempotency_key_reused"),
        ProblemKind::NotReplayable => ("idempotency_error", "idempotency_response_unavailable"),
        ProblemKind::StoreUnavailable => ("api_error", "idempotency_store_unavailable"),
        // The database refused the charge's writes at commit: sending it again would be too.
        ProblemKind::CommitRejected => ("invalid_request_error", "request_rejected"),
        // A 429, which Stripe's SDKs raise as their `RateLimitError` and retry after its wait.
        ProblemKind::QuotaExceeded => ("invalid_request_error", "rate_limit"),
        _ => ("api_error", "internal_error"),
    };
    let document = serde_json::json!({
        "type": problem.type_uri(),
        "title": problem.title(),
        "status": problem.status().as_u16(),
        "detail": problem.detail(),
        "error": { "type": kind, "code": code, "message": problem.detail() },
    });
    let retry = matches!(
        problem.kind(),
        ProblemKind::InFlight | ProblemKind::StoreUnavailable | ProblemKind::QuotaExceeded
    );
    let content_type = HeaderValue::from_static("application/problem+json");
    RenderedProblem::new(content_type, document.to_string()).header(
        SHOULD_RETRY,
        HeaderValue::from_static(if retry { "true" } else { "false" }),
    )
}
