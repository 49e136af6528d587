//! The provider's HTTP API, what its client (`client.rs`) calls as a service calls a real
//! provider's: served by the provider's own program (`src/bin/provider.rs`), or in process (a
//! `Router` is a tower `Service`, so no socket stands between the example and its provider).
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/payments` `{"source", "amount", "capture", "metadata"}` | `{"id", "outcome"}` |
//! | `POST /v1/payments/{id}/capture`, `/cancel` | `{"id"}` |
//! | `POST /v1/refunds` `{"payment", "amount"}` | `{"id"}` (the refund's) |
//! | `GET /v1/payments?created_gte=&limit=` | `{"data": [payment, ...]}`, oldest first |
//! | `GET /v1/payments/search?field=&value=` | `{"data": [payment, ...]}` whose metadata has `value` under `field` |
//!
//! Every `POST` carries an `Idempotency-Key`, bound to its request for the provider's window. A
//! refusal is `{"error": ...}`, a [`ProviderError`]: `503` `unavailable` (nothing happened), `422`
//! `key_reused`, `400` `amount_too_large`, `404` `no_such_payment`. `500` `unknown` is no
//! refusal: the provider failed midway, and the call may have taken effect.

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::{Outcome, PaymentRecord, Provider, ProviderError, Source};

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
        .route("/v1/payments/search", get(search_payments))
        .with_state(provider)
}

type Answered = Result<Json<Answer>, Refused>;

/// A refusal: the provider's, or `400` for a request without a key.
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

/// The request's idempotency key.
fn key(headers: &HeaderMap) -> Result<&str, Refused> {
    let key = headers
        .get(KEY_HEADER)
        .and_then(|value| value.to_str().ok());
    key.filter(|key| !key.is_empty()).ok_or(Refused(None))
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
    let call = (new.source, new.amount, new.capture);
    let payment = provider.create_payment(key(&headers)?, call, new.metadata);
    let payment = payment.await?;
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
    provider.capture(key(&headers)?, &pay).await?;
    Ok(id(pay))
}

async fn cancel(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Path(pay): Path<String>,
) -> Answered {
    provider.cancel(key(&headers)?, &pay).await?;
    Ok(id(pay))
}

async fn refund(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(new): Json<NewRefund>,
) -> Answered {
    let refund = provider.refund(key(&headers)?, &new.payment, new.amount);
    Ok(id(refund.await?))
}

async fn list_payments(
    State(provider): State<Provider>,
    Query(query): Query<ListQuery>,
) -> Json<Answer> {
    let data = provider
        .payments_since(query.created_gte, query.limit)
        .await;
    Json(Answer {
        data,
        ..Answer::default()
    })
}

async fn search_payments(
    State(provider): State<Provider>,
    Query(query): Query<SearchQuery>,
) -> Json<Answer> {
    let data = provider.search(&query.field, &query.value).await;
    Json(Answer {
        data,
        ..Answer::default()
    })
}
