//! The provider's HTTP API: what its client (`client.rs`) calls, as a service calls a real
//! provider's. An axum [`Router`], served in process: a `Router` is a tower `Service`, so no
//! socket stands between the example and its provider.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/payments` `{"source", "amount", "capture", "reference"}` | `{"id", "outcome"}` |
//! | `GET /v1/payments?created_gte=&limit=` | `{"data": [payment, ...]}`, oldest first |
//! | `POST /v1/payments/{id}/capture`, `/cancel` | `{"id"}` |
//! | `POST /v1/refunds` `{"payment", "amount"}` | `{"id"}` (the refund's) |
//! | `GET /v1/calls/{key}?request=` | `{"id"}` of the call with that key and request, or `404` |
//!
//! Every `POST` needs an `Idempotency-Key`, and may carry its caller's fence in
//! `Idempotency-Fence` (a decimal `u64`; without it, 0). Refusals are `{"error": code}`: `503`
//! `unavailable` (nothing happened), `422` `key_reused`, `412` `superseded`, `400`
//! `amount_too_large` (with `"refundable"`), `404` `no_such_payment`, `400` for a request it
//! cannot read. `500` `unknown` is no refusal: the provider failed midway.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::{Outcome, PaymentRecord, Provider, ProviderError, Source};

/// The header the provider deduplicates on.
pub const KEY_HEADER: &str = "idempotency-key";

/// The header of the caller's fence.
pub const FENCE_HEADER: &str = "idempotency-fence";

/// The body of `POST /v1/payments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewPayment {
    pub source: Source,
    pub amount: i64,
    pub capture: bool,
    /// The caller's own reference, kept with the payment (not part of the request a key binds).
    #[serde(default)]
    pub reference: String,
}

/// A new payment, as the API answers it.
#[derive(Debug, Serialize, Deserialize)]
pub struct PaymentJson {
    pub id: String,
    pub outcome: Outcome,
}

/// The body of `POST /v1/refunds`.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewRefund {
    pub payment: String,
    pub amount: i64,
}

/// The query of `GET /v1/payments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ListQuery {
    /// Milliseconds since the Unix epoch.
    pub created_gte: u64,
    pub limit: usize,
}

/// The query of `GET /v1/calls/{key}`: the call as [`super::Request::describe`] writes it.
#[derive(Debug, Serialize, Deserialize)]
pub struct CallQuery {
    pub request: String,
}

/// A page of payments.
#[derive(Debug, Serialize, Deserialize)]
pub struct PaymentList {
    pub data: Vec<PaymentRecord>,
}

/// What a capture, a cancellation, a refund or a look-up answers: an id.
#[derive(Debug, Serialize, Deserialize)]
pub struct IdJson {
    pub id: String,
}

/// A refusal: `{"error": code}`, and what is left to refund with `amount_too_large`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorJson {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refundable: Option<i64>,
}

/// The provider's API over `provider`.
pub fn router(provider: Provider) -> Router {
    Router::new()
        .route("/v1/payments", post(create_payment).get(list_payments))
        .route("/v1/payments/{id}/capture", post(capture))
        .route("/v1/payments/{id}/cancel", post(cancel))
        .route("/v1/refunds", post(refund))
        .route("/v1/calls/{key}", get(find_call))
        .with_state(provider)
}

/// A refusal of the API.
struct Refusal(StatusCode, &'static str, Option<i64>);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let (error, refundable) = (self.1.to_owned(), self.2);
        (self.0, Json(ErrorJson { error, refundable })).into_response()
    }
}

impl From<ProviderError> for Refusal {
    fn from(err: ProviderError) -> Self {
        let (status, code) = match err {
            ProviderError::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ProviderError::Unknown => (StatusCode::INTERNAL_SERVER_ERROR, "unknown"),
            ProviderError::KeyReused => (StatusCode::UNPROCESSABLE_ENTITY, "key_reused"),
            ProviderError::Superseded => (StatusCode::PRECONDITION_FAILED, "superseded"),
            ProviderError::NoSuchPayment => (StatusCode::NOT_FOUND, "no_such_payment"),
            ProviderError::AmountTooLarge { refundable, .. } => {
                return Refusal(
                    StatusCode::BAD_REQUEST,
                    "amount_too_large",
                    Some(refundable),
                );
            }
        };
        Refusal(status, code, None)
    }
}

/// The request's key and fence (0 without one), or `400`.
fn key_and_fence(headers: &HeaderMap) -> Result<(&str, u64), Refusal> {
    let key = (headers.get(KEY_HEADER).and_then(|key| key.to_str().ok()))
        .filter(|key| !key.is_empty())
        .ok_or(Refusal(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            None,
        ))?;
    let fence = match headers.get(FENCE_HEADER) {
        None => Some(0),
        Some(value) => value.to_str().ok().and_then(|text| text.parse().ok()),
    };
    let fence = fence.ok_or(Refusal(StatusCode::BAD_REQUEST, "fence_invalid", None))?;
    Ok((key, fence))
}

async fn create_payment(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewPayment>,
) -> Result<Json<PaymentJson>, Refusal> {
    let (key, fence) = key_and_fence(&headers)?;
    let payment = provider
        .create_payment(
            key,
            fence,
            new.source,
            new.amount,
            new.capture,
            &new.reference,
        )
        .await?;
    Ok(Json(PaymentJson {
        id: payment.id,
        outcome: payment.outcome,
    }))
}

async fn list_payments(
    State(provider): State<Provider>,
    Query(query): Query<ListQuery>,
) -> Result<Json<PaymentList>, Refusal> {
    let data = provider
        .payments_since(query.created_gte, query.limit)
        .await?;
    Ok(Json(PaymentList { data }))
}

async fn capture(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<IdJson>, Refusal> {
    let (key, fence) = key_and_fence(&headers)?;
    provider.capture(key, fence, &id).await?;
    Ok(Json(IdJson { id }))
}

async fn cancel(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<IdJson>, Refusal> {
    let (key, fence) = key_and_fence(&headers)?;
    provider.cancel(key, fence, &id).await?;
    Ok(Json(IdJson { id }))
}

async fn refund(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewRefund>,
) -> Result<Json<IdJson>, Refusal> {
    let (key, fence) = key_and_fence(&headers)?;
    let id = provider
        .refund(key, fence, &new.payment, new.amount)
        .await?;
    Ok(Json(IdJson { id }))
}

async fn find_call(
    State(provider): State<Provider>,
    Path(key): Path<String>,
    Query(query): Query<CallQuery>,
) -> Result<Json<IdJson>, Refusal> {
    match provider.find_call(&key, &query.request).await? {
        Some(id) => Ok(Json(IdJson { id })),
        None => Err(Refusal(StatusCode::NOT_FOUND, "no_such_call", None)),
    }
}
