//! The example's client of its provider: every call goes over the provider's HTTP API
//! (`api.rs`) through the crate's [`IdempotentRetryLayer`], as a service calls a real provider.
//!
//! Each call carries the key the handler derived from the client's `Idempotency-Key` as its own
//! `Idempotency-Key` (the layer keeps a caller's key), so every attempt, and every later request
//! that derives the same key, names one operation, and the provider's key table answers a repeat
//! with the first reply. The layer retries what may not have happened or what the provider asks
//! to have again: a `503` (the provider down: `tok_pspUnavailable`, an outage) is retried before
//! the charge gives up; a `422` (a key used for another request) is not.
//!
//! Each call also carries the handler's fence (the number of the claim it runs under) as
//! `Idempotency-Fence`: the provider refuses a call whose fence is smaller than one the key has
//! seen (`412` `superseded`, [`ProviderError::Superseded`], not retried).
//!
//! The answers map back to [`Payment`] and [`ProviderError`], as the in-process calls answered,
//! so the charges' state machine does not change. An answer the client cannot use (no answer
//! within the deadline, an unreadable one) is [`ProviderError::Unavailable`], as a failure of the
//! provider's own key table is: what happened is unknown, and a retry with the same key finds out.

use std::time::Duration;

use axum::Router;
use axum::http::{Method, Request, StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::{Layer, ServiceExt};
use tower_idempotency_client::{IdempotentRetry, IdempotentRetryLayer};

use super::api::{
    self, CallQuery, ErrorJson, FENCE_HEADER, IdJson, KEY_HEADER, NewPayment, NewRefund,
    PaymentJson,
};
use super::{Outcome, Payment, Provider, ProviderError, Request as Call, Source};

/// The most times one provider call is sent: 3, so a provider that is down for a moment (a
/// `503`) gets two more tries within the charge request, and one that is down for good costs a
/// request three calls, not more.
pub const ATTEMPTS: u32 = 3;

/// How long one attempt may take: 3 s, far above a provider's usual answer (and the test's
/// slowest simulated provider, 2 s), so that only a provider that hangs times out.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a provider call may take in all, attempts and waits: 8 s. The call runs inside a
/// charge request whose own client is waiting: it ends well before that client's attempt
/// timeout (10 s by default with [`IdempotentRetryLayer`]), after which the client retries and is
/// answered `409` while this request still runs, and well before a shutdown's drain
/// (`SHUTDOWN_TIMEOUT_MS`, 20 s), which would cut the request off.
pub const DEADLINE: Duration = Duration::from_secs(8);

/// The backoff between attempts: up to 50 ms before the first retry, doubling, at most 500 ms. A
/// retry inside a request the client is waiting on is worth making soon, or not at all.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(500));

/// The largest answer read from the provider: its answers are a few dozen bytes.
const ANSWER_LIMIT: usize = 64 * 1024;

/// A client of the provider's API; clones share the provider.
#[derive(Debug, Clone)]
pub struct ProviderClient {
    api: IdempotentRetry<Router>,
}

impl ProviderClient {
    /// A client of `provider`'s API, served in process.
    pub fn new(provider: Provider) -> Self {
        let layer = IdempotentRetryLayer::new()
            .max_attempts(ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .deadline(DEADLINE)
            .backoff(BACKOFF.0, BACKOFF.1);
        Self {
            api: layer.layer(api::router(provider)),
        }
    }

    /// `POST /v1/payments`: creates a payment of `amount` from `source`, authorized only or
    /// also captured, under the claim numbered `fence`.
    pub async fn create_payment(
        &self,
        key: &str,
        fence: u64,
        source: Source,
        amount: i64,
        capture: bool,
    ) -> Result<Payment, ProviderError> {
        let body = new_payment(source, amount, capture);
        let (status, answer) = self
            .send(
                Method::POST,
                "/v1/payments",
                Some((key, fence)),
                Some(json(&body)?),
            )
            .await?;
        payment(decode(status, &answer)?)
    }

    /// `GET /v1/payments/by-key/{key}`: the payment a create call with `key` made for this
    /// request, or `None` (see [`Provider::find_payment`]).
    #[allow(dead_code)] // with the postgres feature
    pub async fn find_payment(
        &self,
        key: &str,
        source: Source,
        amount: i64,
        capture: bool,
    ) -> Result<Option<Payment>, ProviderError> {
        let query = new_payment(source, amount, capture);
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("source", &query.source)
            .append_pair("amount", &query.amount.to_string())
            .append_pair("capture", if capture { "true" } else { "false" })
            .finish();
        let key: String = form_urlencoded::byte_serialize(key.as_bytes()).collect();
        let path = format!("/v1/payments/by-key/{key}?{query}");
        let (status, answer) = self.send(Method::GET, &path, None, None).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        payment(decode(status, &answer)?).map(Some)
    }

    /// `GET /v1/calls/by-key/{key}`: the id a call with `key` answered for `call`, or `None` (see
    /// [`Provider::find_call`]).
    #[allow(dead_code)] // with the postgres feature
    pub async fn find_call(
        &self,
        key: &str,
        call: Call<'_>,
    ) -> Result<Option<String>, ProviderError> {
        let query = CallQuery {
            request: call.describe(),
        };
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("request", &query.request)
            .finish();
        let key: String = form_urlencoded::byte_serialize(key.as_bytes()).collect();
        let path = format!("/v1/calls/by-key/{key}?{query}");
        let (status, answer) = self.send(Method::GET, &path, None, None).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        decode::<IdJson>(status, &answer).map(|call| Some(call.id))
    }

    /// `POST /v1/payments/{id}/capture`: captures an authorized payment.
    pub async fn capture(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/capture");
        let (status, answer) = self
            .send(Method::POST, &path, Some((key, fence)), None)
            .await?;
        decode::<IdJson>(status, &answer).map(drop)
    }

    /// `POST /v1/refunds`: refunds `amount` of a captured payment; answers the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        fence: u64,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        let body = NewRefund {
            payment: payment.to_owned(),
            amount,
        };
        let (status, answer) = self
            .send(
                Method::POST,
                "/v1/refunds",
                Some((key, fence)),
                Some(json(&body)?),
            )
            .await?;
        decode::<IdJson>(status, &answer).map(|refund| refund.id)
    }

    /// `POST /v1/payments/{id}/cancel`: releases an authorized payment.
    pub async fn cancel(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/cancel");
        let (status, answer) = self
            .send(Method::POST, &path, Some((key, fence)), None)
            .await?;
        decode::<IdJson>(status, &answer).map(drop)
    }

    /// Sends one call through the retry layer, with a key and its fence and a JSON `body` if
    /// given: the final answer's status and body.
    async fn send(
        &self,
        method: Method,
        path: &str,
        key: Option<(&str, u64)>,
        body: Option<Bytes>,
    ) -> Result<(StatusCode, Bytes), ProviderError> {
        let mut request = Request::builder().method(method).uri(path);
        if let Some((key, fence)) = key {
            request = request
                .header(KEY_HEADER, key)
                .header(FENCE_HEADER, fence.to_string());
        }
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|err| unusable("building the call", &err))?;
        let response = self
            .api
            .clone()
            .oneshot(request)
            .await
            .map_err(|err| unusable("calling the provider", &err))?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|err| unusable("reading the answer", &*err))?
            .to_bytes();
        Ok((status, answer))
    }
}

fn json(body: &impl Serialize) -> Result<Bytes, ProviderError> {
    serde_json::to_vec(body)
        .map(Bytes::from)
        .map_err(|err| unusable("encoding the call", &err))
}

fn new_payment(source: Source, amount: i64, capture: bool) -> NewPayment {
    NewPayment {
        source: source.token().to_owned(),
        amount,
        capture,
    }
}

/// A `2xx` answer's body, or the provider's refusal as a [`ProviderError`].
fn decode<T: DeserializeOwned>(status: StatusCode, answer: &[u8]) -> Result<T, ProviderError> {
    if status.is_success() {
        return serde_json::from_slice(answer).map_err(|err| unusable("reading the answer", &err));
    }
    let code = serde_json::from_slice::<ErrorJson>(answer).map(|refusal| refusal.error);
    match (status, code.as_deref()) {
        (StatusCode::UNPROCESSABLE_ENTITY, Ok("key_reused")) => Err(ProviderError::KeyReused),
        (StatusCode::PRECONDITION_FAILED, Ok("superseded")) => Err(ProviderError::Superseded),
        // After the layer's last attempt: the provider is still down.
        (StatusCode::SERVICE_UNAVAILABLE, _) => Err(ProviderError::Unavailable),
        (status, code) => {
            tracing::warn!(%status, ?code, "provider: an answer this client does not expect");
            Err(ProviderError::Unavailable)
        }
    }
}

fn payment(answer: PaymentJson) -> Result<Payment, ProviderError> {
    let outcome = match answer.outcome.as_str() {
        "authorized" => Outcome::Authorized,
        "captured" => Outcome::Captured,
        "declined" => Outcome::Declined,
        other => {
            tracing::warn!(
                outcome = other,
                "provider: a payment outcome this client does not know"
            );
            return Err(ProviderError::Unavailable);
        }
    };
    Ok(Payment {
        id: answer.id,
        outcome,
    })
}

/// The call failed on this side, or ended without a usable answer: what happened is unknown, so
/// it is answered as the provider unavailable (a retry with the same key finds out).
fn unusable(what: &str, err: &(dyn std::error::Error + 'static)) -> ProviderError {
    tracing::warn!(error = %super::super::report(err), "provider: {what} failed");
    ProviderError::Unavailable
}
