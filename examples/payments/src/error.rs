//! The API's errors, as Stripe writes them and its SDKs read them: `{"error": {"type", "code",
//! "message", ...}}`, with `Stripe-Should-Retry: true` where a retry helps.
//!
//! The idempotency layer's own answers (a missing key, a key reused for another request, a key
//! whose request is still running, a store away) go through [`render_problem`]: RFC 9457
//! `application/problem+json` documents that carry the same `error` member, so that a Stripe SDK
//! raises its own error types for them and a problem+json client reads them as before.

use axum::Json;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tower_idempotency::ProblemKind;
use tower_idempotency::problem::{Problem, RenderedProblem};

use super::provider::ProviderError;
use super::state_machine::Status;

/// An error answer of the API.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
    param: Option<&'static str>,
    charge: Option<String>,
    decline_code: Option<&'static str>,
    /// Refused before any effect (a validation error): answered `Cache-Control: no-store`, so
    /// that the idempotency layer stores nothing (PROTOCOL §8.2) and the same key with a
    /// corrected request runs, as Stripe saves nothing for a request that failed validation.
    no_store: bool,
}

/// The most bytes of a client's input an error message quotes: a parameter name or value longer
/// than that is cut, and marked with [`TRUNCATED`].
pub const QUOTE_LIMIT: usize = 200;

/// What marks a quote cut at [`QUOTE_LIMIT`].
pub const TRUNCATED: &str = "...[truncated]";

/// `input` as an error message may quote it: at most [`QUOTE_LIMIT`] bytes (cut on a character
/// boundary), then [`TRUNCATED`].
pub fn quote(input: &str) -> String {
    if input.len() <= QUOTE_LIMIT {
        return input.to_owned();
    }
    let mut end = QUOTE_LIMIT;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{TRUNCATED}", &input[..end])
}

/// Stripe's header that tells its SDKs whether to retry a request (they retry a 409 or a 5xx
/// without it).
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

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
        let mut error = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        );
        error.no_store = true;
        error
    }

    /// 400: a parameter is missing.
    pub fn missing_param(param: &'static str) -> Self {
        Self::invalid_request("parameter_missing", format!("`{param}` is required"))
            .with_param(param)
    }

    /// 400: a parameter has an invalid value.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_request("parameter_invalid", message).with_param(param)
    }

    /// 400: the charge's state does not allow the operation.
    pub fn invalid_state(status: Status, operation: &str) -> Self {
        Self::invalid_request(
            "invalid_state",
            format!(
                "the charge is {}; it cannot be {operation}",
                status.as_str()
            ),
        )
    }

    /// 401: no API key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing_api_key",
            "send your API key as `Authorization: Bearer <key>`".into(),
        )
    }

    /// 402: the card was declined; the failed charge is recorded.
    pub fn card_declined(charge: &str) -> Self {
        let mut error = Self::new(
            StatusCode::PAYMENT_REQUIRED,
            "card_error",
            "card_declined",
            "the card was declined".into(),
        );
        error.charge = Some(charge.to_owned());
        error.decline_code = Some("generic_decline");
        error
    }

    /// 404: no such charge (for this account).
    pub fn no_such_charge(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "resource_missing",
            format!("no such charge: `{}`", quote(id)),
        )
        .with_param("id")
    }

    /// 503: the payment provider is unavailable; nothing happened, retry with the same key.
    pub fn provider_unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "provider_unavailable",
            "the payment provider is unavailable; nothing was charged, retry with the same Idempotency-Key"
                .into(),
        )
    }

    /// 504: the provider's answer was lost (a timeout, a connection lost after the call was
    /// sent): whether it took effect is not known yet. The charge is kept where it was; the same
    /// request with the same key learns the outcome (and charges nothing twice), and so does the
    /// reconciler.
    pub fn provider_outcome_unknown() -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "api_error",
            "provider_outcome_unknown",
            "the payment provider did not answer in time; the outcome is not known yet: retry \
             with the same Idempotency-Key to learn it (nothing is charged twice)"
                .into(),
        )
    }

    /// 400 `amount_too_large`: a refund of `amount` with only `refundable` left, in Stripe's
    /// words (amounts in minor units, shown as major).
    pub fn amount_too_large(amount: i64, refundable: i64) -> Self {
        let money = |cents: i64| format!("${}.{:02}", cents / 100, cents % 100);
        Self::invalid_request(
            "amount_too_large",
            format!(
                "Refund amount ({}) is greater than unrefunded amount on charge ({})",
                money(amount),
                money(refundable)
            ),
        )
        .with_param("amount")
    }

    /// 400 `idempotency_error` (Stripe's status for it, which its SDKs raise as their
    /// `IdempotencyError`): the provider knows the request's key from another request: the
    /// idempotency layer's record of the key is gone (its window ran out, its store was flushed)
    /// but the provider's is not. Nothing was done; the client sent another request under a used
    /// key.
    pub fn idempotency_key_reused() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "idempotency_error",
            "idempotency_key_reused",
            "this Idempotency-Key was used for a different request; nothing was done: send a new key"
                .into(),
        )
    }

    /// 409 `idempotency_error`: this run of the request lost its claim of the key (its lease ran
    /// out while it was stalled) and a later run took over; it stopped before its effect, and
    /// recorded nothing. The retry gets the later run's answer.
    pub fn superseded() -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "idempotency_error",
            "idempotency_key_superseded",
            "a later attempt with this Idempotency-Key took this request over; nothing was done \
             here: retry with the same key to get that attempt's answer"
                .into(),
        )
    }

    /// 503: the balance ledger is unavailable; try again.
    pub fn ledger_unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "ledger_unavailable",
            "the balance is unavailable; try again".into(),
        )
    }

    /// 503: the charges' database failed; whatever the request began is undone or resumed by
    /// its retry with the same `Idempotency-Key`.
    pub fn storage_unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "storage_unavailable",
            "the charges are unavailable; retry with the same Idempotency-Key".into(),
        )
    }

    /// Names the parameter at fault.
    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    fn body(&self) -> ErrorJson<'_> {
        ErrorJson {
            error: ErrorDetail {
                kind: self.kind,
                code: self.code,
                message: &self.message,
                param: self.param,
                charge: self.charge.as_deref(),
                decline_code: self.decline_code,
            },
        }
    }
}

impl From<ProviderError> for ApiError {
    fn from(err: ProviderError) -> Self {
        match err {
            ProviderError::Unavailable => Self::provider_unavailable(),
            ProviderError::Unknown => Self::provider_outcome_unknown(),
            ProviderError::KeyReused => Self::idempotency_key_reused(),
            ProviderError::Superseded => Self::superseded(),
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

/// `{"error": {...}}`
#[derive(Debug, Serialize)]
struct ErrorJson<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
struct ErrorDetail<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    code: &'static str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'static str>,
    /// The failed charge, when a card is declined.
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<&'a str>,
    /// Why the card was declined.
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.no_store {
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        // A 503 means nothing was done, a 504 that the outcome is not known yet, and a 409 that
        // another attempt is on it: the same request, with the same key, is safe to send again.
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT | StatusCode::CONFLICT
        ) {
            response
                .headers_mut()
                .insert(SHOULD_RETRY, HeaderValue::from_static("true"));
        }
        response
    }
}

/// `404` for a route the API does not have, as Stripe answers it (`invalid_request_error`, naming
/// the method and path), so that an SDK call to an endpoint the example lacks raises a clear
/// error instead of failing to read the answer.
pub async fn unrecognized_url(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "",
        format!(
            "Unrecognized request URL ({method}: {}). This example serves /v1/charges, \
             /v1/charges/{{id}}, its /capture, /refunds and /cancel, and /v1/balance.",
            quote(uri.path())
        ),
    )
}

/// The idempotency layer's answers in the API's format (`IdempotencyLayer::render_problems`): the
/// RFC 9457 document the layer writes by default (`type`, `title`, `status`, `detail`), plus the
/// `error` member a Stripe SDK reads, and `Stripe-Should-Retry`: `true` while the key's first
/// request runs (409) and while the store is away (503), `false` elsewhere (a Stripe SDK would
/// otherwise retry the 409 of a response that cannot be replayed, or a 500, in vain).
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
        // The database refused the charge's writes at commit: nothing was done, and sending the
        // same request again would be refused again.
        ProblemKind::CommitRejected => ("invalid_request_error", "request_rejected"),
        // The account's quota of stored requests is spent for now: a 429, which Stripe's SDKs
        // raise as their `RateLimitError`, and retry after `Retry-After`.
        ProblemKind::QuotaExceeded => ("invalid_request_error", "rate_limit"),
        _ => ("api_error", "internal_error"),
    };
    let document = serde_json::json!({
        "type": problem.type_uri(),
        "title": problem.title(),
        "status": problem.status().as_u16(),
        "detail": problem.detail(),
        "error": {
            "type": kind,
            "code": code,
            "message": problem.detail(),
        },
    });
    let retry = matches!(
        problem.kind(),
        ProblemKind::InFlight | ProblemKind::StoreUnavailable | ProblemKind::QuotaExceeded
    );
    RenderedProblem::new(
        HeaderValue::from_static("application/problem+json"),
        document.to_string(),
    )
    .header(
        SHOULD_RETRY,
        HeaderValue::from_static(if retry { "true" } else { "false" }),
    )
}
