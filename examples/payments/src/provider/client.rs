//! The example's client of its provider: every call goes over the provider's HTTP API
//! (`api.rs`) through the crate's [`IdempotentRetryLayer`], with the key the handler derived as
//! its `Idempotency-Key` and its claim's fence as `Idempotency-Fence`: every attempt, and every
//! later request that derives the same key, names one operation, and the provider answers a
//! repeat with the first reply. A `503` (the provider down) is retried before the charge gives
//! up; a refusal is not.
//!
//! A call whose outcome is not known is [`ProviderError::Unknown`], never
//! [`ProviderError::Unavailable`]: no answer within the deadline, an unreadable one, the
//! provider's `500`, and a final `503` after an attempt that went unanswered (the provider may
//! still be making it). Only a `503` to every attempt says nothing happened.

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
use tower::{Layer, Service, ServiceExt};
use tower_idempotency_client::IdempotentRetryLayer;

use super::api::{
    Answer, CallQuery, FENCE_HEADER, KEY_HEADER, ListQuery, NewPayment, NewRefund, Refusal,
};
use super::{Payment, PaymentRecord, ProviderError, Request as Call, Source};

/// The most times one call is sent: 3, so a provider down for a moment gets two more tries
/// within the charge request, and one down for good costs a request three calls.
pub const ATTEMPTS: u32 = 3;

/// How long one attempt may take: 3 s, far above a provider's usual answer, so that only a
/// provider that hangs times out.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a call may take in all: 8 s, within one attempt of the charge's own client (10 s by
/// default with [`IdempotentRetryLayer`]) and before a shutdown's drain (20 s) cuts it off.
pub const DEADLINE: Duration = Duration::from_secs(8);

/// The backoff between attempts: from 50 ms, doubling, at most 500 ms: a retry inside a request
/// the client is waiting on is worth making soon, or not at all.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(500));

/// The largest answer read: the provider's are a few dozen bytes.
const ANSWER_LIMIT: usize = 64 * 1024;

/// A client of the provider's API; clones share it.
#[derive(Debug, Clone)]
pub struct ProviderClient {
    retry: IdempotentRetryLayer,
    api: Router,
}

impl ProviderClient {
    /// A client of the provider's API `api` ([`Provider::router`](super::Provider::router)).
    pub fn new(api: Router) -> Self {
        let retry = IdempotentRetryLayer::new()
            .max_attempts(ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .deadline(DEADLINE)
            .backoff(BACKOFF.0, BACKOFF.1);
        Self { retry, api }
    }

    /// `POST /v1/payments`: a payment of `amount` from `source`, authorized only or captured,
    /// under the claim numbered `fence`; `reference` is kept with it.
    pub async fn create_payment(
        &self,
        key: &str,
        fence: u64,
        source: Source,
        amount: i64,
        capture: bool,
        reference: &str,
    ) -> Result<Payment, ProviderError> {
        let reference = reference.to_owned();
        let body = json(&NewPayment {
            source,
            amount,
            capture,
            reference,
        })?;
        let answer = self
            .call(Method::POST, "/v1/payments", Some((key, fence)), body)
            .await?;
        let outcome = answer
            .outcome
            .ok_or_else(|| unusable("reading the answer", &Missing))?;
        Ok(Payment {
            id: answer.id,
            outcome,
        })
    }

    /// `POST /v1/payments/{id}/capture`.
    pub async fn capture(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/capture");
        self.call(Method::POST, &path, Some((key, fence)), Bytes::new())
            .await
            .map(drop)
    }

    /// `POST /v1/refunds`: the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        fence: u64,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        let body = json(&NewRefund {
            payment: payment.to_owned(),
            amount,
        })?;
        let answer = self
            .call(Method::POST, "/v1/refunds", Some((key, fence)), body)
            .await?;
        Ok(answer.id)
    }

    /// `POST /v1/payments/{id}/cancel`.
    pub async fn cancel(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/cancel");
        self.call(Method::POST, &path, Some((key, fence)), Bytes::new())
            .await
            .map(drop)
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
        match self.call(Method::GET, &path, None, Bytes::new()).await {
            Ok(answer) => Ok(Some(answer.id)),
            Err(ProviderError::NoSuchPayment) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// `GET /v1/payments`: up to `limit` payments made since `since` (ms since the epoch),
    /// oldest first: the provider's payments report.
    pub async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, ProviderError> {
        let query = query_string(&ListQuery {
            created_gte: since,
            limit,
        })?;
        let path = format!("/v1/payments?{query}");
        Ok(self
            .call(Method::GET, &path, None, Bytes::new())
            .await?
            .data)
    }

    /// Sends one call through the retry layer, with a key and its fence if given, and a JSON
    /// `body` unless empty: the answer, or the provider's refusal.
    async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<(&str, u64)>,
        body: Bytes,
    ) -> Result<Answer, ProviderError> {
        let mut request = Request::builder().method(method).uri(path);
        if let Some((key, fence)) = key {
            request = request
                .header(KEY_HEADER, key)
                .header(FENCE_HEADER, fence.to_string());
        }
        if !body.is_empty() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request =
            (request.body(Full::new(body))).map_err(|err| unusable("building the call", &err))?;
        let unknown = Arc::new(AtomicBool::new(false));
        let watched = Watched {
            api: self.api.clone(),
            unknown: unknown.clone(),
        };
        let response = (self.retry.layer(watched).oneshot(request).await)
            .map_err(|err| unusable("calling the provider", &err))?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), ANSWER_LIMIT)
            .collect()
            .await;
        let answer = answer
            .map_err(|err| unusable("reading the answer", &*err))?
            .to_bytes();
        if status.is_success() {
            return serde_json::from_slice(&answer)
                .map_err(|err| unusable("reading the answer", &err));
        }
        match serde_json::from_slice::<Refusal>(&answer).map(|refusal| refusal.error) {
            // The last 503 says nothing of an earlier attempt the provider may still be making.
            Ok(ProviderError::Unavailable) if unknown.load(Ordering::SeqCst) => {
                tracing::warn!("provider: down now, after an attempt whose answer was lost");
                Err(ProviderError::Unknown)
            }
            Ok(refusal) => Err(refusal),
            Err(err) => {
                tracing::warn!(%status, %err, "provider: an answer this client does not expect");
                Err(ProviderError::Unknown)
            }
        }
    }
}

/// The provider's API, noting whether any attempt of one call ended without a decided answer: cut
/// off (its timeout, the deadline) before the answer came, or answered `500`.
#[derive(Clone)]
struct Watched {
    api: Router,
    unknown: Arc<AtomicBool>,
}

type Reply = axum::http::Response<axum::body::Body>;

impl Service<Request<Full<Bytes>>> for Watched {
    type Response = Reply;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Reply, Infallible>> + Send>>;

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
    let encoded = serde_json::to_vec(body).map_err(|err| unusable("encoding the call", &err))?;
    Ok(Bytes::from(encoded))
}

/// `query` as a URL's query string.
fn query_string(query: &impl Serialize) -> Result<String, ProviderError> {
    serde_urlencoded::to_string(query).map_err(|err| unusable("encoding the call", &err))
}

/// An answer without the part it must have.
#[derive(Debug, thiserror::Error)]
#[error("the answer lacks a field")]
struct Missing;

/// The call failed on this side, or ended without a usable answer: what happened is unknown (a
/// retry with the same key finds out).
fn unusable(what: &str, err: &(dyn std::error::Error + 'static)) -> ProviderError {
    tracing::warn!(error = %crate::report(err), "provider: {what} failed");
    ProviderError::Unknown
}
