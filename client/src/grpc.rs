//! The client's half for gRPC (this crate's feature `grpc`): [`GrpcRetryLayer`] over tonic's
//! `Channel`, or any tonic transport.
//!
//! Not a tonic interceptor: an interceptor sees one request on its way out and cannot send it
//! again. The layer goes between the generated (or hand-written) client and the channel, as a
//! tower layer, and runs each call of a named unary method as [`IdempotentRetryLayer`] runs an
//! HTTP request: one `idempotency-key` (a UUID v4, unless the caller set one in the request's
//! metadata) and the same message bytes on every attempt, retried after a transport failure or
//! an attempt's timeout, and after a status that says "later":
//!
//! | the attempt's answer | retried? |
//! |---|---|
//! | the channel failed: refused, reset, the answer cut off | yes |
//! | the attempt's timeout ran out | yes |
//! | `UNAVAILABLE` (the store away, or the server's own) | yes, after its `RetryInfo` if it has one |
//! | `ABORTED` (a call with the key in flight, or the server's own conflict) | yes, after its `RetryInfo` if it has one |
//! | `RESOURCE_EXHAUSTED` with a `RetryInfo` (a quota spent for now, as HTTP's `429`) | yes, after its `RetryInfo` |
//! | any other status: `OK`, `INVALID_ARGUMENT`, `FAILED_PRECONDITION` (the key used for another call), `ALREADY_EXISTS`, `INTERNAL`, `RESOURCE_EXHAUSTED` without a `RetryInfo` (a limit such as a message's size), ... | no: an answer |
//! | no `grpc-status` (not a gRPC answer: a proxy's 503) | as an HTTP answer ([module docs](super)) |
//!
//! The status is read where the server put it: in a trailers-only answer's headers, or in the
//! trailers, for which the answer is read whole (up to [`GrpcRetryLayer::response_limit`]; a
//! larger one is delivered as it comes and judged by its headers alone). Calls of other methods
//! (streaming ones, and unary ones not named) go to the channel untouched: no key, no buffering,
//! no retry. The caller finds [`Attempts`](crate::Attempts) in the response's extensions
//! (`tonic::Response::extensions`).
//!
//! ```no_run
//! use tonic::transport::Endpoint;
//! use tower::ServiceBuilder;
//! use tower_idempotency_client::IdempotentRetryLayer;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = Endpoint::from_static("http://127.0.0.1:50051").connect_lazy();
//! let channel = ServiceBuilder::new()
//!     .layer(IdempotentRetryLayer::new().max_attempts(5).grpc(["/payments.v1.Payments/CreateCharge"]))
//!     .service(channel);
//! // Any tonic client over it: a generated `PaymentsClient::new(channel)`, or tonic's own.
//! let client = tonic::client::Grpc::new(channel);
//! # let _ = client;
//! # Ok(())
//! # }
//! ```

use std::collections::HashSet;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{StreamExt, TryStreamExt, stream};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use tonic::Code;
use tower_layer::Layer;
use tower_service::Service;

use crate::BoxError;
use crate::classify::{Reason, Retryable};
use crate::error::Error;
use crate::layer::{Config, IdempotentRetryLayer};
use crate::service::IdempotentRetry;

/// The largest answer read whole to find its status by default: tonic's default limit on a
/// decoded message.
const DEFAULT_RESPONSE_LIMIT: usize = 4 * 1024 * 1024;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl IdempotentRetryLayer {
    /// The same retries for a gRPC client (feature `grpc`): the unary `methods`, each named by
    /// its path (`/package.Service/Method`), are retried with one `idempotency-key`; every other
    /// call passes through untouched. The settings made so far (attempts, timeouts, backoff,
    /// budget, the key's header name) carry over. See the [`grpc`](crate::grpc) module.
    ///
    /// ```
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().grpc(["/payments.v1.Payments/CreateCharge"]);
    /// # let _ = layer;
    /// ```
    pub fn grpc<I>(self, methods: I) -> GrpcRetryLayer
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        GrpcRetryLayer {
            config: Arc::new(self.config),
            methods: Arc::new(methods.into_iter().map(|m| Box::from(m.as_ref())).collect()),
            response_limit: DEFAULT_RESPONSE_LIMIT,
        }
    }
}

/// A [`Layer`] for tonic clients: retries the calls of the unary methods it names, with one
/// `idempotency-key` and the same message on every attempt (the [`grpc`](crate::grpc) module).
/// Made by [`IdempotentRetryLayer::grpc`].
///
/// ```
/// use tower_idempotency_client::IdempotentRetryLayer;
///
/// let layer = IdempotentRetryLayer::new()
///     .grpc(["/payments.v1.Payments/CreateCharge"])
///     .response_limit(1024 * 1024);
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct GrpcRetryLayer {
    config: Arc<Config>,
    methods: Arc<HashSet<Box<str>>>,
    response_limit: usize,
}

impl GrpcRetryLayer {
    /// The largest answer read whole to find its status in its trailers. A larger one is
    /// delivered as it arrives and retried only if its headers hold a status that says "later".
    /// Default: 4 MiB (tonic's default limit on a message).
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.response_limit = bytes;
        self
    }
}

impl fmt::Debug for GrpcRetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut methods: Vec<_> = self.methods.iter().collect();
        methods.sort();
        f.debug_struct("GrpcRetryLayer")
            .field("config", &self.config)
            .field("methods", &methods)
            .field("response_limit", &self.response_limit)
            .finish()
    }
}

impl<S> Layer<S> for GrpcRetryLayer {
    type Service = GrpcRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcRetry {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`GrpcRetryLayer`]: a tonic transport (`Channel`) whose calls of the named
/// unary methods are retried safely.
#[derive(Clone, Debug)]
pub struct GrpcRetry<S> {
    inner: S,
    layer: GrpcRetryLayer,
}

impl<S> GrpcRetry<S> {
    /// The inner service.
    ///
    /// ```
    /// use tower::Layer;
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// let retry = IdempotentRetryLayer::new().grpc(["/a.B/C"]).layer("transport");
    /// assert_eq!(*retry.get_ref(), "transport");
    /// ```
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ResBody> Service<Request<tonic::body::Body>> for GrpcRetry<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<tonic::body::Body>;
    type Error = Error;
    type Future = BoxFuture<Result<Self::Response, Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|err| Error::Transport {
            attempts: 0,
            source: err.into(),
        })
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        // The readied service goes to this call; a clone stays for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.layer.methods.contains(request.uri().path()) {
            let call = inner.call(request);
            return Box::pin(async move {
                match call.await {
                    Ok(response) => Ok(response.map(tonic::body::Body::new)),
                    Err(err) => Err(Error::Transport {
                        attempts: 1,
                        source: err.into(),
                    }),
                }
            });
        }
        let attempt = Attempt {
            inner,
            limit: self.layer.response_limit,
        };
        let mut retry = IdempotentRetry::new(attempt, self.layer.config.clone());
        Box::pin(retry.call(request))
    }
}

/// One attempt of a protected call: the buffered request to the transport, and its answer read
/// whole, its status noted ([`GrpcAnswer`]) for the retry policy.
#[derive(Clone)]
pub(crate) struct Attempt<S> {
    inner: S,
    limit: usize,
}

impl<S, ResBody> Service<Request<Full<Bytes>>> for Attempt<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let call = self.inner.call(request.map(tonic::body::Body::new));
        let limit = self.limit;
        Box::pin(async move {
            let response = call.await.map_err(Into::into)?;
            read_answer(response, limit).await
        })
    }
}

/// Reads an answer whole (up to `limit`), and notes its status. A body that fails is the
/// attempt's failure: the answer was lost on the way, and the key makes another attempt safe.
async fn read_answer<B>(
    response: Response<B>,
    limit: usize,
) -> Result<Response<tonic::body::Body>, BoxError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    let mut data = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame.map_err(Into::into)?.into_data() {
            Ok(chunk) => {
                data.extend_from_slice(&chunk);
                if data.len() > limit {
                    // Too large to hold: delivered as it comes, judged by its headers alone.
                    note_answer(&mut parts, None);
                    let read = stream::once(async move { Ok(Frame::data(data.freeze())) });
                    let rest = TryStreamExt::map_err(BodyStream::new(body), Into::<BoxError>::into);
                    let body = tonic::body::Body::new(StreamBody::new(read.chain(rest)));
                    return Ok(Response::from_parts(parts, body));
                }
            }
            Err(frame) => {
                if let Ok(fields) = frame.into_trailers() {
                    trailers = Some(Box::new(fields));
                    break;
                }
            }
        }
    }
    note_answer(&mut parts, trailers.as_deref());
    let trailers = async move { trailers.map(|fields| Ok(*fields)) };
    let body = tonic::body::Body::new(Full::new(data.freeze()).with_trailers(trailers));
    Ok(Response::from_parts(parts, body))
}

/// Notes the answer's status, from its headers (trailers-only) or its trailers, with the wait
/// its `RetryInfo` asks for.
fn note_answer(parts: &mut http::response::Parts, trailers: Option<&HeaderMap>) {
    let fields = [Some(&parts.headers), trailers]
        .into_iter()
        .flatten()
        .find(|fields| fields.contains_key("grpc-status"));
    let Some(fields) = fields else { return };
    let code = Code::from_bytes(fields["grpc-status"].as_bytes());
    // Read through tonic's binary metadata, which refuses bad base64 rather than panicking; only
    // the details' value is copied, and only when there is one.
    let details = fields.get("grpc-status-details-bin").and_then(|value| {
        let mut only = HeaderMap::new();
        only.insert("grpc-status-details-bin", value.clone());
        let metadata = tonic::metadata::MetadataMap::from_headers(only);
        metadata.get_bin("grpc-status-details-bin")?.to_bytes().ok()
    });
    let retry_delay = details.and_then(|details| {
        tower_idempotency::grpc::retry_delay(&tonic::Status::with_details(code, "", details))
    });
    parts.extensions.insert(GrpcAnswer { code, retry_delay });
}

/// A gRPC answer's status, noted for the retry policy (`classify`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GrpcAnswer {
    code: Code,
    retry_delay: Option<Duration>,
}

impl GrpcAnswer {
    /// Whether the answer says "later": `UNAVAILABLE` and `ABORTED`, after their `RetryInfo`, and
    /// `RESOURCE_EXHAUSTED` when a `RetryInfo` says when (a quota spent for now, as HTTP's 429;
    /// without one it is a limit the same call meets again, such as a message over the size).
    pub(crate) fn retryable(&self) -> Option<Retryable> {
        let reason = match self.code {
            Code::Unavailable => Reason::Unavailable,
            Code::Aborted => Reason::Aborted,
            Code::ResourceExhausted if self.retry_delay.is_some() => Reason::RateLimited,
            _ => return None,
        };
        Some(Retryable {
            reason,
            retry_after: self.retry_delay,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unavailable_aborted_and_a_quota_with_its_wait_are_retried() {
        for n in 0..=16 {
            let code = Code::from_i32(n);
            let answer = GrpcAnswer {
                code,
                retry_delay: Some(Duration::from_secs(1)),
            };
            let retried = matches!(
                code,
                Code::Unavailable | Code::Aborted | Code::ResourceExhausted
            );
            assert_eq!(answer.retryable().is_some(), retried, "{code:?}");
            let without_a_wait = GrpcAnswer {
                code,
                retry_delay: None,
            };
            let retried = matches!(code, Code::Unavailable | Code::Aborted);
            assert_eq!(without_a_wait.retryable().is_some(), retried, "{code:?}");
            if let Some(retryable) = answer.retryable() {
                assert_eq!(retryable.retry_after, Some(Duration::from_secs(1)));
            }
        }
    }

    #[test]
    fn the_status_is_read_from_headers_first_then_trailers() {
        let parts = |status: Option<&'static str>| {
            let mut response = Response::new(());
            if let Some(status) = status {
                response
                    .headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static(status));
            }
            response.into_parts().0
        };
        let trailers = HeaderMap::from_iter([(
            http::HeaderName::from_static("grpc-status"),
            http::HeaderValue::from_static("14"),
        )]);
        let mut only = parts(Some("10"));
        note_answer(&mut only, Some(&trailers));
        assert_eq!(
            only.extensions.get::<GrpcAnswer>().unwrap().code,
            Code::Aborted
        );
        let mut trailing = parts(None);
        note_answer(&mut trailing, Some(&trailers));
        assert_eq!(
            trailing.extensions.get::<GrpcAnswer>().unwrap().code,
            Code::Unavailable
        );
        let mut none = parts(None);
        note_answer(&mut none, None);
        assert!(none.extensions.get::<GrpcAnswer>().is_none());
    }

    #[test]
    fn the_wait_is_read_from_retry_info_and_bad_details_are_ignored() {
        // google.rpc.Status { code: 14, details: [Any { RetryInfo { retry_delay: 2 s } }] }.
        let type_url = b"type.googleapis.com/google.rpc.RetryInfo";
        let mut any = vec![0x0a, type_url.len() as u8];
        any.extend_from_slice(type_url);
        any.extend_from_slice(&[0x12, 0x04, 0x0a, 0x02, 0x08, 0x02]);
        let mut status = vec![0x08, 14, 0x1a, any.len() as u8];
        status.extend_from_slice(&any);
        let with_details = tonic::Status::with_details(Code::Unavailable, "", status.into())
            .into_http::<()>()
            .into_parts()
            .0;
        let mut parts = Response::new(()).into_parts().0;
        note_answer(&mut parts, Some(&with_details.headers));
        let answer = parts.extensions.get::<GrpcAnswer>().unwrap();
        assert_eq!(
            (answer.code, answer.retry_delay),
            (Code::Unavailable, Some(Duration::from_secs(2)))
        );

        // Details that are not base64: the status stands, with no wait, and nothing panics.
        let mut trailers = with_details.headers;
        trailers.insert(
            "grpc-status-details-bin",
            http::HeaderValue::from_static("not base64!"),
        );
        let mut parts = Response::new(()).into_parts().0;
        note_answer(&mut parts, Some(&trailers));
        let answer = parts.extensions.get::<GrpcAnswer>().unwrap();
        assert_eq!((answer.code, answer.retry_delay), (Code::Unavailable, None));
    }
}
