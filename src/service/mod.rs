//! `Idempotency<S, St>`: the service the layer builds, and its call path.
//!
//! A request the layer does not cover passes through; a covered one without a valid key, or
//! refused by the scope, is answered here. The rest is split by step: [`claim`] reads, fingerprints
//! and claims the request; [`replay`] answers from a record already under the key; [`wait`] lets a duplicate of a
//! request in flight wait for it (opt-in); [`execute`] runs a claimed request and stores its
//! result; [`capture`] reads a response into a record.

mod body_reader;
mod capture;
mod claim;
mod execute;
mod replay;
#[cfg(feature = "trace-origin")]
mod trace_origin;
mod wait;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

pub(crate) use wait::Waits;

use crate::body::{RequestBody, ResponseBody};
use crate::config::Config;
use crate::detach::Background;
use crate::fingerprint::Fingerprint;
use crate::future::{Covered, ResponseFuture};
use crate::key::IdempotencyKey;
use crate::layer_metrics::{self, Metered};
use crate::lease::Held;
use crate::log_throttle::LayerThrottles;
use crate::outcome::Outcome;
use crate::problem::{self, Problem, ProblemKind};
use crate::protocol_mode::Coverage;
use crate::record::{ClaimToken, RecordId};
use crate::scope::{Rejection, RejectionBody, Scope};
use crate::store::Store;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How often a claim-time store failure is logged while it lasts.
pub(crate) const STORE_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The inner service as the layer runs it: one name for the bounds every step repeats.
pub(crate) trait Handler<ReqBody, ResBody>:
    Service<
        Request<RequestBody<ReqBody>>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: fmt::Display + Send + 'static,
    > + Send
    + 'static
{
}

impl<T, ReqBody, ResBody> Handler<ReqBody, ResBody> for T
where
    T: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    T::Future: Send + 'static,
    T::Error: fmt::Display + Send + 'static,
{
}

/// A request body the layer can read and fingerprint.
pub(crate) trait ReadableBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> ReadableBody for B where B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

/// A response body the layer can store and deliver.
pub(crate) trait StorableBody:
    Body<Data = Bytes, Error: fmt::Display> + Send + 'static
{
}

impl<B> StorableBody for B where B: Body<Data = Bytes, Error: fmt::Display> + Send + 'static {}

/// The service built by [`IdempotencyLayer`](crate::IdempotencyLayer): see its documentation.
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

pub(crate) struct Shared<St> {
    /// The store, its calls timed (`layer_metrics`).
    store: Metered<St>,
    config: Config,
    background: Background,
    /// Claim-time store failures and records that do not open repeat with every request: logged
    /// once per interval (shared by every service of one layer).
    throttles: Arc<LayerThrottles>,
    /// The keys that duplicates are waiting on (shared by every service of one layer).
    waits: Waits,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(
        inner: S,
        store: St,
        config: Config,
        background: Background,
        waits: Waits,
        throttles: Arc<LayerThrottles>,
    ) -> Self {
        layer_metrics::describe();
        Self {
            inner,
            shared: Arc::new(Shared {
                store: Metered(store),
                config,
                background,
                throttles,
                waits,
            }),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.shared.store)
            .field("config", &self.shared.config)
            .finish()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: fmt::Display,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = &self.shared.config;

        let covered = match &config.protocol_mode {
            None => config.methods.contains(req.method()),
            // A protocol mode decides alone: no setting of `methods` can open its paths (§16.1).
            Some(mode) => match mode.covers(req.method(), req.uri()) {
                Coverage::Covered => true,
                Coverage::Passthrough => false,
                Coverage::Refused(response) => {
                    let response = response.map(ResponseBody::full);
                    return ResponseFuture::ready(finish(response, Outcome::Rejected));
                }
            },
        };
        if !covered {
            return ResponseFuture::passthrough(
                inner.call(req.map(RequestBody::passthrough)),
                None,
            );
        }
        let key = match IdempotencyKey::from_headers(req.headers(), &config.header) {
            Ok(Some(key)) => key,
            Ok(None) if !config.key_required => {
                tracing::debug!(target: "tower_idempotency", outcome = %Outcome::Unprotected, "idempotency outcome");
                layer_metrics::outcome(Outcome::Unprotected);
                let future = inner.call(req.map(RequestBody::passthrough));
                return ResponseFuture::passthrough(future, Some(Outcome::Unprotected));
            }
            Ok(None) => {
                let detail = format!("this request needs an `{}` header", config.header);
                return self.shared.reject(ProblemKind::MissingKey, detail);
            }
            Err(err) => {
                return self.shared.reject(ProblemKind::InvalidKey, err.to_string());
            }
        };
        let (parts, body) = req.into_parts();
        let scope = match &config.scope {
            None => Scope::default(),
            Some(scope) => match scope.scope(&parts) {
                Ok(scope) => scope,
                Err(rejection) => return reject_with(rejection),
            },
        };
        let id = RecordId::new(scope.as_bytes(), key.as_str());
        let span = tracing::info_span!(
            target: "tower_idempotency",
            "idempotency",
            key = %id.tag(),
            scope = %crate::operator::scope_tag(scope.as_bytes()),
            // Where the record a request is answered from came from (`trace_origin::show_origin`).
            origin.traceparent = tracing::field::Empty,
            origin.trace_id = tracing::field::Empty,
            origin.span_id = tracing::field::Empty,
        );
        if body.size_hint().lower() > config.request_body_limit as u64 {
            let _entered = span.enter();
            return self
                .shared
                .reject(ProblemKind::BodyTooLarge, too_large(config));
        }
        let shared = self.shared.clone();
        // Boxed where it is made, then instrumented: the large future is not moved again.
        let protect: Covered<ResBody> = Box::pin(shared.protect(inner, parts, body, key, id));
        ResponseFuture::covered(protect.instrument(span))
    }
}

/// Answers with a scope function's rejection: at once when its body is whole, or once it is read.
fn reject_with<F, B>(rejection: Rejection) -> ResponseFuture<F, B>
where
    B: Send + 'static,
{
    let (parts, body) = rejection.into_response().into_parts();
    // Without the `axum` feature, a rejection's body is always whole.
    #[cfg_attr(not(feature = "axum"), allow(clippy::infallible_destructuring_match))]
    let body = match body {
        RejectionBody::Full(bytes) => bytes,
        #[cfg(feature = "axum")]
        RejectionBody::Stream(body) => {
            let read: Covered<B> = Box::pin(read_rejection(parts, body));
            return ResponseFuture::covered(read.instrument(tracing::Span::none()));
        }
    };
    let response = Response::from_parts(parts, ResponseBody::full(body));
    ResponseFuture::ready(finish(response, Outcome::Rejected))
}

/// Reads a rejection's body, then answers with it: empty if it fails.
#[cfg(feature = "axum")]
async fn read_rejection<B>(
    mut parts: http::response::Parts,
    body: http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>,
) -> Response<ResponseBody<B>> {
    use http_body_util::BodyExt;
    let body = match body.collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            tracing::error!(
                target: "tower_idempotency",
                error = %crate::error_chain::ErrorChain(&*err),
                "the scope function's rejection body failed; sending it empty"
            );
            parts.headers.remove(http::header::CONTENT_LENGTH);
            Bytes::new()
        }
    };
    let response = Response::from_parts(parts, ResponseBody::full(body));
    finish(response, Outcome::Rejected)
}

pub(super) fn too_large(config: &Config) -> String {
    format!(
        "the request body is larger than {} bytes",
        config.request_body_limit
    )
}

impl<St: Store> Shared<St> {
    fn reject<F, B>(
        &self,
        kind: ProblemKind,
        detail: impl Into<Cow<'static, str>>,
    ) -> ResponseFuture<F, B> {
        ResponseFuture::ready(self.problem(kind, detail))
    }

    pub(super) fn problem<B>(
        &self,
        kind: ProblemKind,
        detail: impl Into<Cow<'static, str>>,
    ) -> Response<ResponseBody<B>> {
        self.problem_with(kind, detail, None)
    }

    pub(super) fn problem_with<B>(
        &self,
        kind: ProblemKind,
        detail: impl Into<Cow<'static, str>>,
        retry_after: Option<u64>,
    ) -> Response<ResponseBody<B>> {
        let (response, outcome) = self.unfinished_problem(kind, detail, retry_after);
        finish(response, outcome)
    }

    /// A problem response and its outcome, not yet marked, logged or counted ([`finish`]).
    pub(super) fn unfinished_problem<B>(
        &self,
        kind: ProblemKind,
        detail: impl Into<Cow<'static, str>>,
        retry_after: Option<u64>,
    ) -> (Response<ResponseBody<B>>, Outcome) {
        let problem =
            Problem::new(kind, self.config.status(kind), detail).with_retry_after(retry_after);
        let response = match &self.config.protocol_mode {
            Some(mode) => mode.respond(&problem),
            None => problem::respond(&problem, &*self.config.render),
        };
        (response.map(ResponseBody::full), kind.outcome())
    }

    /// The `429` of a request whose claim would write a record past its scope's quota: `wait` is
    /// the time the budget takes to refill to a claim.
    pub(super) fn quota_exceeded<B>(&self, wait: Duration) -> Response<ResponseBody<B>> {
        let detail = "this account has stored its quota of requests for now; retry after the time \
             given, with the same key";
        let retry_after = Some(whole_seconds(wait));
        self.problem_with(ProblemKind::QuotaExceeded, detail, retry_after)
    }

    pub(super) fn held<'a>(&'a self, claimed: &'a Claimed) -> Held<'a, Metered<St>> {
        Held {
            store: &self.store,
            id: &claimed.id,
            token: &claimed.token,
            lease: self.config.lease,
        }
    }
}

/// A key this request claimed, and what it was claimed for: all that the steps after the claim
/// (running, completing, releasing, retrying a write) need to know of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claimed {
    pub(super) id: RecordId,
    pub(super) token: ClaimToken,
    pub(super) fingerprint: Fingerprint,
}

/// Whole seconds, rounded up, at least 1.
pub(super) fn whole_seconds(duration: Duration) -> u64 {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    seconds.max(1)
}

/// Marks a response with its outcome, logs it (inside the request's span, which carries the
/// hashed key and scope) and counts it.
pub(super) fn finish<B>(mut response: Response<B>, outcome: Outcome) -> Response<B> {
    let status = response.status().as_u16();
    match outcome {
        // Store failures are warned of once per interval where they happen, with a count: one
        // warning per request would flood the log for as long as the store is away or full.
        Outcome::HandlerFailed | Outcome::CommitRejected => {
            tracing::warn!(target: "tower_idempotency", %outcome, status, "idempotency outcome")
        }
        Outcome::InFlight | Outcome::Mismatch | Outcome::NotReplayable | Outcome::Rejected => {
            tracing::info!(target: "tower_idempotency", %outcome, status, "idempotency outcome")
        }
        _ => tracing::debug!(target: "tower_idempotency", %outcome, status, "idempotency outcome"),
    }
    layer_metrics::outcome(outcome);
    response.extensions_mut().insert(outcome);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_inner_service_the_store_and_the_settings() {
        use tower_layer::Layer as _;

        #[derive(Debug)]
        struct Inner;
        let layer = crate::IdempotencyLayer::new(crate::MemoryStore::new());
        let debug = format!("{:?}", layer.layer(Inner));
        for part in [
            "Idempotency",
            "inner: Inner",
            "store: MemoryStore",
            "config: Config",
        ] {
            assert!(debug.contains(part), "{part} in {debug}");
        }
    }

    #[test]
    fn whole_seconds_round_up() {
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::from_millis(300)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
    }
}
