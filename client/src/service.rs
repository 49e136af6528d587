//! `IdempotentRetry<S>`: the service the layer builds. It names the request (the key), sets up
//! the operation's retry state, and hands the rest to [`ResponseFuture`].

use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tokio::time::Instant;
use tower::retry::Retry;
use tower::timeout::Timeout;
use tower_service::Service;

use super::BoxError;
use super::classify::idempotent_by_definition;
use super::error::Error;
use super::future::{Operation, ResponseFuture};
use super::layer::Config;
use super::policy::AttemptPolicy;

/// A deadline this far away stands for "none" where adding the configured one would overflow.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Sends each request through `S` until it has an answer worth returning, with one key and the
/// same body on every attempt; built by [`IdempotentRetryLayer`](super::IdempotentRetryLayer).
///
/// `S` is any HTTP client service that takes `Request<Full<Bytes>>`, such as hyper-util's
/// `Client<_, Full<Bytes>>`, or an axum `Router` in tests.
///
/// ```
/// use axum::{Router, routing::post};
/// use http::{Request, StatusCode};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency_client::{Attempts, IdempotentRetryLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // Stands for the remote API: it sees the key the layer made.
/// let api = Router::new().route("/v1/charges", post(|headers: http::HeaderMap| async move {
///     assert!(headers.contains_key("idempotency-key"));
///     StatusCode::CREATED
/// }));
/// let client = ServiceBuilder::new().layer(IdempotentRetryLayer::new()).service(api);
///
/// let request = Request::post("/v1/charges").body(Full::<bytes::Bytes>::from("amount=100")).unwrap();
/// let response = client.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::CREATED);
/// let attempts = response.extensions().get::<Attempts>().unwrap();
/// assert_eq!((attempts.count(), attempts.replayed()), (1, false));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotentRetry<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotentRetry<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|err| Error::Transport {
            attempts: 0,
            source: err.into(),
        })
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let started = Instant::now();
        let config = &self.config;
        let key = match request.headers().get(&config.header) {
            // The caller named the operation: its key is kept, whatever the method.
            Some(key) => Some(key.clone()),
            None if config.key_methods.contains(request.method()) => {
                let key = new_key();
                request
                    .headers_mut()
                    .insert(config.header.clone(), key.clone());
                Some(key)
            }
            None => None,
        };
        let retryable = key.is_some() || idempotent_by_definition(request.method());
        if let Some(budget) = &config.budget {
            budget.deposit();
        }
        let deadline = started
            .checked_add(config.deadline)
            .unwrap_or_else(|| started + FAR_FUTURE);
        let attempts = Arc::new(AtomicU32::new(1));
        let keyed = key.is_some();
        let policy = AttemptPolicy::new(
            config.clone(),
            attempts.clone(),
            started,
            deadline,
            retryable,
            keyed,
        );
        // The readied service goes to this call; a clone stays for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let retry = Retry::new(policy, Timeout::new(inner, config.attempt_timeout));
        let operation = Operation {
            attempts,
            key,
            started,
            deadline,
            body_limit: config.body_limit,
        };
        ResponseFuture::new(request, retry, operation)
    }
}

/// A fresh key: a UUID v4, 122 random bits, as Stripe's SDKs make them.
fn new_key() -> HeaderValue {
    let mut text = [0; uuid::fmt::Hyphenated::LENGTH];
    let text = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut text);
    HeaderValue::from_str(text).expect("a hyphenated UUID is a valid header value")
}
