//! The provider's HTTP API: what the example's client ([`super::ProviderClient`]) calls, as it
//! would call a real provider's. It is an axum [`Router`], served in process: a `Router` is a
//! tower `Service`, so no socket stands between the example and its provider.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/payments` `{"source", "amount", "capture", "reference"}` | `200` `{"id", "outcome"}` |
//! | `GET /v1/payments?created_gte=&limit=` | `200` `{"data": [payment, ...]}`, oldest first |
//! | `POST /v1/payments/{id}/capture`, `/cancel` | `200` `{"id"}` |
//! | `POST /v1/refunds` `{"payment", "amount"}` | `200` `{"id"}` (the refund's) |
//! | `GET /v1/payments/by-key/{key}?source=&amount=&capture=` | `200` `{"id", "outcome"}`, or `404` |
//! | `GET /v1/calls/by-key/{key}?request=` | `200` `{"id"}` of the call with that key and request, or `404` |
//!
//! Every `POST` needs an `Idempotency-Key` (`400` `idempotency_key_missing` without one); the
//! provider's [`KeyTable`](super::KeyTable) deduplicates on it, so the same key answers the same
//! request's first reply again. A `POST` may carry its caller's fence in `Idempotency-Fence` (a
//! decimal `u64`; without it, 0). Refusals are `{"error": code}`: `503` `unavailable` (nothing
//! happened, retry with the same key), `422` `key_reused` (the key belongs to another request),
//! `412` `superseded` (the key has seen a larger fence: a later run of the operation called),
//! `400` `amount_too_large` (a refund beyond what is left of its payment, with `"refundable"`),
//! `404` `no_such_payment` (a refund of no payment), `400` for a request the provider cannot
//! read. `500` `unknown` is no refusal: the provider failed midway, and the call may have taken
//! effect.

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use super::{Outcome, Payment, Provider, ProviderError, Source};

/// The header the provider deduplicates on.
pub const KEY_HEADER: &str = "idempotency-key";

/// The header of the caller's fence.
pub const FENCE_HEADER: &str = "idempotency-fence";

/// The query of `GET /v1/calls/by-key/{key}`: the call as [`super::Request::describe`] writes it.
#[derive(Debug, Serialize, Deserialize)]
pub struct CallQuery {
    pub request: String,
}

/// A new payment's parameters: the body of `POST /v1/payments`, and the query of the lookup.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewPayment {
    pub source: String,
    pub amount: i64,
    pub capture: bool,
    /// The caller's own reference, kept with the payment (not part of the request a key binds).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reference: String,
}

/// The query of `GET /v1/payments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ListQuery {
    /// Milliseconds since the Unix epoch.
    pub created_gte: u64,
    pub limit: usize,
}

/// A page of payments.
#[derive(Debug, Serialize, Deserialize)]
pub struct PaymentList {
    pub data: Vec<super::PaymentRecord>,
}

/// The body of `POST /v1/refunds`.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewRefund {
    pub payment: String,
    pub amount: i64,
}

/// A payment, as the API answers it.
#[derive(Debug, Serialize, Deserialize)]
pub struct PaymentJson {
    pub id: String,
    /// `authorized`, `captured` or `declined`.
    pub outcome: String,
}

/// What a capture, a cancellation or a refund answers: the id of the payment or refund.
#[derive(Debug, Serialize, Deserialize)]
pub struct IdJson {
    pub id: String,
}

/// A refusal: `{"error": code}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorJson {
    pub error: String,
    /// With `amount_too_large`: what is left to refund.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refundable: Option<i64>,
}

/// The provider's API over `provider`.
pub fn router(provider: Provider) -> Router {
    Router::new()
        .route("/v1/payments", post(create_payment).get(list_payments))
        .route("/v1/payments/by-key/{key}", get(find_payment))
        .route("/v1/calls/by-key/{key}", get(find_call))
        .route("/v1/payments/{id}/capture", post(capture))
        .route("/v1/payments/{id}/cancel", post(cancel))
        .route("/v1/refunds", post(refund))
        .with_state(provider)
}

/// A refusal of the API (and what is left to refund, with `amount_too_large`).
struct Refusal(StatusCode, &'static str, Option<i64>);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = ErrorJson {
            error: self.1.to_owned(),
            refundable: self.2,
        };
        (self.0, Json(body)).into_response()
    }
}

impl From<ProviderError> for Refusal {
    fn from(err: ProviderError) -> Self {
        let refusal = |status, code| Refusal(status, code, None);
        match err {
            ProviderError::Unavailable => refusal(StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ProviderError::Unknown => refusal(StatusCode::INTERNAL_SERVER_ERROR, "unknown"),
            ProviderError::KeyReused => refusal(StatusCode::UNPROCESSABLE_ENTITY, "key_reused"),
            ProviderError::Superseded => refusal(StatusCode::PRECONDITION_FAILED, "superseded"),
            ProviderError::NoSuchPayment => refusal(StatusCode::NOT_FOUND, "no_such_payment"),
            ProviderError::AmountTooLarge { refundable, .. } => Refusal(
                StatusCode::BAD_REQUEST,
                "amount_too_large",
                Some(refundable),
            ),
        }
    }
}

/// The request's idempotency key, or `400`.
fn key(headers: &HeaderMap) -> Result<&str, Refusal> {
    headers
        .get(KEY_HEADER)
        .and_then(|key| key.to_str().ok())
        .filter(|key| !key.is_empty())
        .ok_or(Refusal(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            None,
        ))
}

/// The request's fence: 0 without one, `400` for one that is not a `u64`.
fn fence(headers: &HeaderMap) -> Result<u64, Refusal> {
    match headers.get(FENCE_HEADER) {
        None => Ok(0),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or(Refusal(StatusCode::BAD_REQUEST, "fence_invalid", None)),
    }
}

fn source(token: &str) -> Result<Source, Refusal> {
    Source::parse(token).ok_or(Refusal(StatusCode::BAD_REQUEST, "unknown_source", None))
}

fn payment_json(payment: Payment) -> Json<PaymentJson> {
    let outcome = match payment.outcome {
        Outcome::Authorized => "authorized",
        Outcome::Captured => "captured",
        Outcome::Declined => "declined",
    };
    Json(PaymentJson {
        id: payment.id,
        outcome: outcome.to_owned(),
    })
}

async fn create_payment(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewPayment>,
) -> Result<Json<PaymentJson>, Refusal> {
    let source = source(&new.source)?;
    let payment = provider
        .create_payment(
            key(&headers)?,
            fence(&headers)?,
            source,
            new.amount,
            new.capture,
            &new.reference,
        )
        .await?;
    Ok(payment_json(payment))
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

async fn find_payment(
    State(provider): State<Provider>,
    Path(key): Path<String>,
    Query(new): Query<NewPayment>,
) -> Result<Json<PaymentJson>, Refusal> {
    let source = source(&new.source)?;
    match provider
        .find_payment(&key, source, new.amount, new.capture)
        .await?
    {
        Some(payment) => Ok(payment_json(payment)),
        None => Err(Refusal(StatusCode::NOT_FOUND, "no_such_payment", None)),
    }
}

async fn find_call(
    State(provider): State<Provider>,
    Path(key): Path<String>,
    Query(query): Query<CallQuery>,
) -> Result<Json<IdJson>, Refusal> {
    let known = provider.find_call_described(&key, &query.request).await?;
    match known {
        Some(id) => Ok(Json(IdJson { id })),
        None => Err(Refusal(StatusCode::NOT_FOUND, "no_such_call", None)),
    }
}

async fn capture(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<IdJson>, Refusal> {
    provider
        .capture(key(&headers)?, fence(&headers)?, &id)
        .await?;
    Ok(Json(IdJson { id }))
}

async fn cancel(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<IdJson>, Refusal> {
    provider
        .cancel(key(&headers)?, fence(&headers)?, &id)
        .await?;
    Ok(Json(IdJson { id }))
}

async fn refund(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewRefund>,
) -> Result<Json<IdJson>, Refusal> {
    let id = provider
        .refund(key(&headers)?, fence(&headers)?, &new.payment, new.amount)
        .await?;
    Ok(Json(IdJson { id }))
}
