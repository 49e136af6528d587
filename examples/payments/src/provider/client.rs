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
//! so the charges' state machine does not change. A call whose outcome is not known is
//! [`ProviderError::Unknown`], never [`ProviderError::Unavailable`]: no answer within the
//! deadline, an unreadable one, the provider's `500`, and a final `503` when an earlier attempt
//! of the same call went unanswered (the provider may still be making it). Only a `503` to
//! every attempt says nothing happened.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::http::{Method, Request, StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency_client::IdempotentRetryLayer;

use super::api::{
    CallQuery, ErrorJson, FENCE_HEADER, IdJson, KEY_HEADER, ListQuery, NewPayment, NewRefund,
    PaymentJson, PaymentList,
};
use super::{Payment, PaymentRecord, ProviderError, Request as Call, Source};

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
    retry: IdempotentRetryLayer,
    api: Router,
}

impl ProviderClient {
    /// A client of the provider's API `api` ([`Provider::router`](super::Provider::router)),
    /// served in process.
    pub fn new(api: Router) -> Self {
        let retry = IdempotentRetryLayer::new()
            .max_attempts(ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .deadline(DEADLINE)
            .backoff(BACKOFF.0, BACKOFF.1);
        Self { retry, api }
    }

    /// `GET /v1/payments`: up to `limit` payments made since `since` (ms since the Unix epoch),
    /// oldest first.
    pub async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, ProviderError> {
        let query = ListQuery {
            created_gte: since,
            limit,
        };
        let path = format!("/v1/payments?{}", query_string(&query)?);
        let (status, answer) = self.send(Method::GET, &path, None, None).await?;
        decode::<PaymentList>(status, &answer).map(|list| list.data)
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
        reference: &str,
    ) -> Result<Payment, ProviderError> {
        let body = NewPayment {
            source,
            amount,
            capture,
            reference: reference.to_owned(),
        };
        let (status, answer) = self
            .send(
                Method::POST,
                "/v1/payments",
                Some((key, fence)),
                Some(json(&body)?),
            )
            .await?;
        let payment: PaymentJson = decode(status, &answer)?;
        Ok(Payment {
            id: payment.id,
            outcome: payment.outcome,
        })
    }

    /// `GET /v1/calls/{key}`: the id a call with `key` answered for `call`, or `None` (no such
    /// call reached the provider, or the key was another request's).
    pub async fn find_call(
        &self,
        key: &str,
        call: Call<'_>,
    ) -> Result<Option<String>, ProviderError> {
        let query = query_string(&CallQuery {
            request: call.describe(),
        })?;
        let key: String = form_urlencoded::byte_serialize(key.as_bytes()).collect();
        let path = format!("/v1/calls/{key}?{query}");
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
        decode::<IdJson>(status, &answer)
            .map(|refund| refund.id)
            .map_err(|err| match err {
                ProviderError::AmountTooLarge { refundable, .. } => {
                    ProviderError::AmountTooLarge { amount, refundable }
                }
                err => err,
            })
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
        let unknown = Arc::new(AtomicBool::new(false));
        let watched = Watched {
            api: self.api.clone(),
            unknown: unknown.clone(),
        };
        let response = self
            .retry
            .layer(watched)
            .oneshot(request)
            .await
            .map_err(|err| unusable("calling the provider", &err))?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|err| unusable("reading the answer", &*err))?
            .to_bytes();
        // The provider's last 503 says nothing of an earlier attempt it may still be making.
        if status == StatusCode::SERVICE_UNAVAILABLE && unknown.load(Ordering::SeqCst) {
            tracing::warn!("provider: down now, after an attempt whose answer was lost");
            return Err(ProviderError::Unknown);
        }
        Ok((status, answer))
    }
}

/// The provider's API, noting whether any attempt of one call ended without a decided answer: cut
/// off (its timeout, the deadline) before the answer came, or answered `500`.
#[derive(Clone)]
struct Watched {
    api: Router,
    unknown: Arc<AtomicBool>,
}

type Answer = axum::http::Response<axum::body::Body>;

impl Service<Request<Full<Bytes>>> for Watched {
    type Response = Answer;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // A Router is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let attempt = self.api.clone().oneshot(request);
        let mut pending = Pending(Some(self.unknown.clone()));
        Box::pin(async move {
            let answer = attempt.await;
            if answer
                .as_ref()
                .is_ok_and(|a| a.status() == StatusCode::INTERNAL_SERVER_ERROR)
                && let Some(unknown) = pending.0.take()
            {
                unknown.store(true, Ordering::SeqCst);
            }
            // Answered: nothing to mark.
            drop(pending.0.take());
            answer
        })
    }
}

/// Marks its call's outcome unknown when dropped before its answer came.
struct Pending(Option<Arc<AtomicBool>>);

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(unknown) = self.0.take() {
            unknown.store(true, Ordering::SeqCst);
        }
    }
}

fn json(body: &impl Serialize) -> Result<Bytes, ProviderError> {
    serde_json::to_vec(body)
        .map(Bytes::from)
        .map_err(|err| unusable("encoding the call", &err))
}

/// `query` as a URL's query string.
fn query_string(query: &impl Serialize) -> Result<String, ProviderError> {
    serde_urlencoded::to_string(query).map_err(|err| unusable("encoding the call", &err))
}

/// A `2xx` answer's body, or the provider's refusal as a [`ProviderError`].
fn decode<T: DeserializeOwned>(status: StatusCode, answer: &[u8]) -> Result<T, ProviderError> {
    if status.is_success() {
        return serde_json::from_slice(answer).map_err(|err| unusable("reading the answer", &err));
    }
    let refusal = serde_json::from_slice::<ErrorJson>(answer);
    let code = refusal.as_ref().map(|refusal| refusal.error.as_str());
    match (status, code) {
        (StatusCode::UNPROCESSABLE_ENTITY, Ok("key_reused")) => Err(ProviderError::KeyReused),
        (StatusCode::PRECONDITION_FAILED, Ok("superseded")) => Err(ProviderError::Superseded),
        (StatusCode::NOT_FOUND, Ok("no_such_payment")) => Err(ProviderError::NoSuchPayment),
        (StatusCode::BAD_REQUEST, Ok("amount_too_large")) => Err(ProviderError::AmountTooLarge {
            amount: 0,
            refundable: refusal
                .as_ref()
                .ok()
                .and_then(|refusal| refusal.refundable)
                .unwrap_or(0),
        }),
        // After the layer's last attempt, each a 503: the provider is still down.
        (StatusCode::SERVICE_UNAVAILABLE, _) => Err(ProviderError::Unavailable),
        (status, code) => {
            tracing::warn!(%status, ?code, "provider: an answer this client does not expect");
            Err(ProviderError::Unknown)
        }
    }
}

/// The call failed on this side, or ended without a usable answer: what happened is unknown (a
/// retry with the same key finds out).
fn unusable(what: &str, err: &(dyn std::error::Error + 'static)) -> ProviderError {
    tracing::warn!(error = %crate::report(err), "provider: {what} failed");
    ProviderError::Unknown
}
