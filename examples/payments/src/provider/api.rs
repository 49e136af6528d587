//! The provider's HTTP API, what its client (`client.rs`) calls as a service calls a real
//! provider's: an axum [`Router`] served in process (a `Router` is a tower `Service`, so no socket
//! stands between the example and its provider).
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/payments` `{"source", "amount", "capture", "reference"}` | `{"id", "outcome"}` |
//! | `POST /v1/payments/{id}/capture`, `/cancel` | `{"id"}` |
//! | `POST /v1/refunds` `{"payment", "amount"}` | `{"id"}` (the refund's) |
//! | `GET /v1/payments?created_gte=&limit=` | `{"data": [payment, ...]}`, oldest first |
//! | `GET /v1/calls/{key}?request=` | `{"id"}` of the call with that key and request |
//!
//! Every `POST` carries an `Idempotency-Key` and its caller's fence in `Idempotency-Fence` (a
//! decimal `u64`; 0 without it). A refusal is `{"error": ...}`, a [`ProviderError`]: `503`
//! `unavailable` (nothing happened), `422` `key_reused`, `412` `superseded`, `400`
//! `amount_too_large`, `404` `no_such_payment` (or no such call). `500` `unknown` is no refusal:
//! the provider failed midway, and the call may have taken effect.

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
    /// The caller's own reference, kept with the payment (not part of what a key binds).
    pub reference: String,
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

/// What the API answers: an id, a payment's outcome, a page of payments.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Answer {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data: Vec<PaymentRecord>,
}

/// A refusal, as the API writes it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Refusal {
    pub error: ProviderError,
}

impl IntoResponse for ProviderError {
    fn into_response(self) -> Response {
        let status = match self {
            ProviderError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProviderError::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
            ProviderError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProviderError::Superseded => StatusCode::PRECONDITION_FAILED,
            ProviderError::NoSuchPayment => StatusCode::NOT_FOUND,
            ProviderError::AmountTooLarge { .. } => StatusCode::BAD_REQUEST,
        };
        (status, Json(Refusal { error: self })).into_response()
    }
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

type Answered = Result<Json<Answer>, Refused>;

/// A refusal: the provider's, or `400` for a request without a key or with a bad fence.
struct Refused(Option<ProviderError>);

impl From<ProviderError> for Refused {
    fn from(err: ProviderError) -> Self {
        Refused(Some(err))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self.0 {
            Some(err) => err.into_response(),
            None => StatusCode::BAD_REQUEST.into_response(),
        }
    }
}

/// The request's key and fence.
fn key_and_fence(headers: &HeaderMap) -> Result<(&str, u64), Refused> {
    let text = |name| headers.get(name).and_then(|value| value.to_str().ok());
    let fence = text(FENCE_HEADER).map_or(Some(0), |fence| fence.parse().ok());
    match (text(KEY_HEADER).filter(|key| !key.is_empty()), fence) {
        (Some(key), Some(fence)) => Ok((key, fence)),
        _ => Err(Refused(None)),
    }
}

fn id(id: String) -> Json<Answer> {
    Json(Answer {
        id,
        ..Answer::default()
    })
}

async fn create_payment(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewPayment>,
) -> Answered {
    let (key, fence) = key_and_fence(&headers)?;
    let (source, amount, capture) = (new.source, new.amount, new.capture);
    let payment = provider
        .create_payment(key, fence, source, amount, capture, &new.reference)
        .await?;
    Ok(Json(Answer {
        id: payment.id,
        outcome: Some(payment.outcome),
        data: Vec::new(),
    }))
}

async fn capture(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(pay): Path<String>,
) -> Answered {
    let (key, fence) = key_and_fence(&headers)?;
    provider.capture(key, fence, &pay).await?;
    Ok(id(pay))
}

async fn cancel(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(pay): Path<String>,
) -> Answered {
    let (key, fence) = key_and_fence(&headers)?;
    provider.cancel(key, fence, &pay).await?;
    Ok(id(pay))
}

async fn refund(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewRefund>,
) -> Answered {
    let (key, fence) = key_and_fence(&headers)?;
    let refund = provider.refund(key, fence, &new.payment, new.amount);
    Ok(id(refund.await?))
}

async fn list_payments(
    State(provider): State<Provider>,
    Query(query): Query<ListQuery>,
) -> Answered {
    let data = provider.payments_since(query.created_gte, query.limit);
    let data = data.await?;
    Ok(Json(Answer {
        data,
        ..Answer::default()
    }))
}

async fn find_call(
    State(provider): State<Provider>,
    Path(key): Path<String>,
    Query(query): Query<CallQuery>,
) -> Answered {
    let found = provider.find_call(&key, &query.request).await?;
    Ok(id(found.ok_or(ProviderError::NoSuchPayment)?))
}
