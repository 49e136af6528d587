//! The API's errors: `{"error": {"type", "code", "message", ...}}`, as payment APIs write them.
//!
//! (The idempotency layer's own answers, such as 400 for a missing key or 422 for a reused one, are
//! RFC 9457 `application/problem+json` documents instead.)

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

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
        }
    }

    /// 400: the request is malformed.
    pub fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        )
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
        error
    }

    /// 404: no such charge (for this account).
    pub fn no_such_charge(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "resource_missing",
            format!("no such charge: `{id}`"),
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

    /// 422: the provider knows the request's key from another request: the idempotency layer's
    /// record of the key is gone (its window ran out, its store was flushed) but the provider's
    /// is not. Nothing was done; the client sent another request under a used key.
    pub fn idempotency_key_reused() -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_error",
            "idempotency_key_reused",
            "this Idempotency-Key was used for a different request; nothing was done: send a new key"
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
            },
        }
    }
}

impl From<ProviderError> for ApiError {
    fn from(err: ProviderError) -> Self {
        match err {
            ProviderError::Unavailable => Self::provider_unavailable(),
            ProviderError::KeyReused => Self::idempotency_key_reused(),
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
    code: &'static str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'static str>,
    /// The failed charge, when a card is declined.
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
