//! The provider's HTTP API, which its client (`client.rs`) calls as a service calls a real
//! provider's: served by its own program (`src/bin/provider.rs`), or in process (a `Router` is a
//! tower `Service`: no socket between the example and its provider).
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/payments` `{"source", "amount", "capture", "metadata"}` | `{"id", "outcome"}` |
//! | `POST /v1/payments/{id}/capture`, `/cancel` | `{"id"}` |
//! | `POST /v1/refunds` `{"payment", "amount"}` | `{"id"}` (the refund's) |
//! | `GET /v1/payments?created_gte=&limit=` | `{"data": [payment, ...]}`, oldest first |
//! | `GET /v1/payments/search?field=&value=` | `{"data": [payment, ...]}` whose metadata has `value` under `field` |
//!
//! Every `POST` carries an `Idempotency-Key` (`400` without one), bound to its request for the
//! provider's window. A refusal, `{"error": ...}`, a [`ProviderError`], means nothing happened:
//! `503` `unavailable`, `422` `key_reused`, `400` `amount_too_large` or `unexpected_state` (a
//! capture or cancellation of a payment not authorized), `404` `no_such_payment`.
//! `500` `unknown` is no refusal: the provider failed midway, and the call may have taken effect.

use std::collections::BTreeMap;

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::{Payment, PaymentRecord, Provider, ProviderError, Source};

/// The header the provider deduplicates on.
pub const KEY_HEADER: &str = "idempotency-key";

/// The body of `POST /v1/payments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewPayment {
    pub source: Source,
    pub amount: i64,
    pub capture: bool,
    /// The caller's own key-value pairs, kept with the payment (not part of what a key binds).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
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

/// The query of `GET /v1/payments/search`: a metadata field and its value.
#[derive(Debug, Serialize, Deserialize)]
pub struct SearchQuery {
    pub field: String,
    pub value: String,
}

/// The answer to a capture, a cancellation (the payment's id) or a refund (the refund's).
#[derive(Debug, Serialize, Deserialize)]
pub struct Id {
    pub id: String,
}

/// The answer to a listing or a search.
#[derive(Debug, Serialize, Deserialize)]
pub struct Page {
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
            ProviderError::NoSuchPayment => StatusCode::NOT_FOUND,
            ProviderError::AmountTooLarge { .. } | ProviderError::UnexpectedState => {
                StatusCode::BAD_REQUEST
            }
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
        .route("/v1/payments/search", get(search_payments))
        .with_state(provider)
}

/// A `POST`'s provider and idempotency key: `400` without a key.
struct Keyed(Provider, String);

impl FromRequestParts<Provider> for Keyed {
    type Rejection = StatusCode;

    async fn from_request_parts(
        parts: &mut Parts,
        provider: &Provider,
    ) -> Result<Self, StatusCode> {
        let key = parts.headers.get(KEY_HEADER).and_then(|v| v.to_str().ok());
        let key = key
            .filter(|key| !key.is_empty())
            .ok_or(StatusCode::BAD_REQUEST)?;
        Ok(Keyed(provider.clone(), key.to_owned()))
    }
}

type Answered<T> = Result<Json<T>, ProviderError>;

async fn create_payment(
    Keyed(provider, key): Keyed,
    Json(new): Json<NewPayment>,
) -> Answered<Payment> {
    let call = (new.source, new.amount, new.capture);
    let payment = provider.create_payment(&key, call, new.metadata).await?;
    Ok(Json(payment))
}

async fn capture(Keyed(provider, key): Keyed, Path(id): Path<String>) -> Answered<Id> {
    provider.capture(&key, &id).await?;
    Ok(Json(Id { id }))
}

async fn cancel(Keyed(provider, key): Keyed, Path(id): Path<String>) -> Answered<Id> {
    provider.cancel(&key, &id).await?;
    Ok(Json(Id { id }))
}

async fn refund(Keyed(provider, key): Keyed, Json(new): Json<NewRefund>) -> Answered<Id> {
    let id = provider.refund(&key, &new.payment, new.amount).await?;
    Ok(Json(Id { id }))
}

async fn list_payments(State(provider): State<Provider>, Query(q): Query<ListQuery>) -> Json<Page> {
    let data = provider.payments_since(q.created_gte, q.limit).await;
    Json(Page { data })
}

async fn search_payments(
    State(provider): State<Provider>,
    Query(q): Query<SearchQuery>,
) -> Json<Page> {
    let data = provider.search(&q.field, &q.value).await;
    Json(Page { data })
}
