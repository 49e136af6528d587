//! The example's client of its provider: every call goes over the provider's HTTP API (`api.rs`),
//! at `PROVIDER_URL` or served in process, through the crate's [`IdempotentRetryLayer`], with the
//! key the handler derived as its `Idempotency-Key`, so every attempt, and every later request
//! that derives the same key, names one operation and gets the first answer. A `503` (the provider
//! down) or a refused connection is retried before the charge gives up; a refusal is not.
//!
//! A call whose outcome is not known is [`ProviderError::Unknown`], never
//! [`ProviderError::Unavailable`], which tells the charge's client that nothing happened: no
//! answer within the deadline, an unreadable one, a `500`, a connection lost once the call was
//! sent, or a last `503` after an attempt that went unanswered (the provider may still be making
//! it). Only when every attempt was refused before the provider acted did nothing happen.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, Response, StatusCode, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceExt};
use tower_idempotency_client::IdempotentRetryLayer;

use super::api::{Id, KEY_HEADER, NewPayment, NewRefund, Page, Refusal, SearchQuery};
use super::{Payment, PaymentRecord, ProviderError, Source};

/// The most times one call is sent: 3, so a provider down for a moment gets two more tries
/// within the charge request, and one down for good costs a request three calls.
pub(super) const ATTEMPTS: u32 = 3;

/// How long one attempt may take: 3 s, far above a provider's usual answer, so that only a
/// provider that hangs times out.
pub(super) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a call may take in all: 8 s, within one attempt of the charge's own client (10 s by
/// default with [`IdempotentRetryLayer`]) and before a shutdown's drain (20 s) cuts it off.
pub(super) const DEADLINE: Duration = Duration::from_secs(8);

/// The backoff between attempts: from 50 ms, doubling, at most 500 ms: a retry inside a request
/// the client is waiting on is worth making soon, or not at all.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(500));

/// The largest answer read: the provider's are a few dozen bytes.
const ANSWER_LIMIT: usize = 64 * 1024;

/// One attempt, and how it reaches the provider.
type Attempt = Request<Full<Bytes>>;
type Transport = BoxCloneSyncService<Attempt, Response<Body>, BoxError>;

/// A client of the provider's API; clones share it.
#[derive(Debug, Clone)]
pub struct ProviderClient {
    retry: IdempotentRetryLayer,
    api: Transport,
}

impl ProviderClient {
    /// A client of the provider's API served in process: `api`
    /// ([`Provider::router`](super::Provider::router)).
    pub fn new(api: Router) -> Self {
        let api = ServiceExt::<Attempt>::map_err(api, |never| match never {});
        Self::over(BoxCloneSyncService::new(api))
    }

    /// A client of the provider's program at `base` (`PROVIDER_URL`, such as
    /// `http://127.0.0.1:12111`), over HTTP/1.1.
    pub fn http(base: &str) -> Result<Self, String> {
        let base: Uri = base
            .parse()
            .map_err(|err| format!("PROVIDER_URL {base:?} is not a URL: {err}"))?;
        if base.scheme_str() != Some("http") || base.authority().is_none() {
            return Err(format!(
                "PROVIDER_URL {base} must be an http:// URL with a host"
            ));
        }
        let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let api = tower::service_fn(move |mut request: Attempt| {
            let client = client.clone();
            let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
            let uri = format!("{}{path}", base.to_string().trim_end_matches('/'));
            async move {
                *request.uri_mut() = uri.parse()?;
                let response = client.request(request).await?;
                Ok::<_, BoxError>(response.map(Body::new))
            }
        });
        Ok(Self::over(BoxCloneSyncService::new(api)))
    }

    fn over(api: Transport) -> Self {
        let retry = IdempotentRetryLayer::new()
            .max_attempts(ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .deadline(DEADLINE)
            .backoff(BACKOFF.0, BACKOFF.1);
        Self { retry, api }
    }

    /// `POST /v1/payments`: a payment of `amount` from `source`, authorized only or captured;
    /// `metadata` is kept with it, and finds it again.
    pub async fn create_payment(
        &self,
        key: &str,
        (source, amount, capture): (Source, i64, bool),
        metadata: BTreeMap<String, String>,
    ) -> Result<Payment, ProviderError> {
        let body = json(&NewPayment {
            source,
            amount,
            capture,
            metadata,
        })?;
        self.call(Method::POST, "/v1/payments", Some(key), body)
            .await
    }

    /// `POST /v1/payments/{id}/capture`.
    pub async fn capture(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/capture");
        let answer = self.call::<Id>(Method::POST, &path, Some(key), Bytes::new());
        answer.await.map(drop)
    }

    /// `POST /v1/refunds`: the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        let body = json(&NewRefund {
            payment: payment.to_owned(),
            amount,
        })?;
        let answer = self.call::<Id>(Method::POST, "/v1/refunds", Some(key), body);
        answer.await.map(|refund| refund.id)
    }

    /// `POST /v1/payments/{id}/cancel`.
    pub async fn cancel(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let path = format!("/v1/payments/{payment}/cancel");
        let answer = self.call::<Id>(Method::POST, &path, Some(key), Bytes::new());
        answer.await.map(drop)
    }

    /// `GET /v1/payments/search`: the payments whose metadata has `value` under `field`.
    pub async fn search(
        &self,
        field: &str,
        value: &str,
    ) -> Result<Vec<PaymentRecord>, ProviderError> {
        let query = SearchQuery {
            field: field.to_owned(),
            value: value.to_owned(),
        };
        let query = serde_urlencoded::to_string(&query)
            .map_err(|err| unusable("encoding the call", &err))?;
        let path = format!("/v1/payments/search?{query}");
        let answer = self.call::<Page>(Method::GET, &path, None, Bytes::new());
        answer.await.map(|page| page.data)
    }

    /// Sends one call through the retry layer, with a key if given, and a JSON `body` unless
    /// empty: the answer, or the provider's refusal.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Bytes,
    ) -> Result<T, ProviderError> {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            request = request.header(KEY_HEADER, key);
        }
        if !body.is_empty() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request =
            (request.body(Full::new(body))).map_err(|err| unusable("building the call", &err))?;
        let unknown = Arc::new(AtomicBool::new(false));
        let watched = watched(self.api.clone(), unknown.clone());
        let response = match self.retry.layer(watched).oneshot(request).await {
            Ok(response) => response,
            // Every attempt was refused before the provider acted: nothing happened.
            Err(err) if !unknown.load(Ordering::SeqCst) => {
                tracing::warn!(error = %crate::report(&err), "provider: unreachable");
                return Err(ProviderError::Unavailable);
            }
            Err(err) => return Err(unusable("calling the provider", &err)),
        };
        let status = response.status();
        let answer = (Limited::new(response.into_body(), ANSWER_LIMIT).collect()).await;
        let answer = (answer.map_err(|err| unusable("reading the answer", &*err))?).to_bytes();
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

/// The provider's API, setting `unknown` when an attempt of one call ends without a decided
/// answer: cut off (its timeout, the deadline) before the answer came, answered `500`, or failed
/// once its connection was made (the call may have been sent).
fn watched(
    api: Transport,
    unknown: Arc<AtomicBool>,
) -> impl Service<Attempt, Response = Response<Body>, Error = BoxError, Future: Send> + Clone {
    tower::service_fn(move |request: Attempt| {
        let (api, mut pending) = (api.clone(), Pending(Some(unknown.clone())));
        async move {
            let answer = api.oneshot(request).await;
            let decided = match &answer {
                Ok(answer) => answer.status() != StatusCode::INTERNAL_SERVER_ERROR,
                Err(err) => refused_before_sending(&**err),
            };
            if decided {
                pending.0.take();
            }
            answer
        }
    })
}

/// Marks its call's outcome unknown when dropped still armed: before a decided answer came.
struct Pending(Option<Arc<AtomicBool>>);

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(unknown) = self.0.take() {
            unknown.store(true, Ordering::SeqCst);
        }
    }
}

/// Whether a transport failure came before anything was sent: no connection could be made.
fn refused_before_sending(err: &(dyn std::error::Error + 'static)) -> bool {
    err.downcast_ref::<hyper_util::client::legacy::Error>()
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
}

fn json(body: &impl Serialize) -> Result<Bytes, ProviderError> {
    let encoded = serde_json::to_vec(body).map_err(|err| unusable("encoding the call", &err))?;
    Ok(Bytes::from(encoded))
}

/// The call failed on this side, or ended without a usable answer: what happened is unknown (a
/// retry with the same key finds out).
fn unusable(what: &str, err: &(dyn std::error::Error + 'static)) -> ProviderError {
    tracing::warn!(error = %crate::report(err), "provider: {what} failed");
    ProviderError::Unknown
}
