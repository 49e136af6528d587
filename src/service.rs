//! `Idempotency<S, St>`: the service the layer builds.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::header::{CACHE_CONTROL, DATE, SET_COOKIE};
use http::response::Parts as ResponseParts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio_util::task::TaskTracker;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::fingerprint::Fingerprint;
use crate::future::{Covered, Detachable, ResponseFuture};
use crate::key::IdempotencyKey;
use crate::layer::Config;
use crate::lease::{self, ErrorChain, Held, panic_message};
use crate::outcome::Outcome;
use crate::problem::{Problem, ProblemKind};
use crate::record::{ClaimToken, Completed, Record, RecordId, StoredResponse};
use crate::scope::Scope;
use crate::store::{Claim, Store, StoreError};
use crate::throttle::Throttle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How often a claim-time store failure is logged while it lasts.
const STORE_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The service built by [`IdempotencyLayer`](crate::IdempotencyLayer): see its documentation.
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

pub(crate) struct Shared<St> {
    store: St,
    config: Config,
    tracker: TaskTracker,
    /// Claim-time store failures repeat with every request: logged once per interval.
    store_failures: Throttle,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, store: St, config: Config, tracker: TaskTracker) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                store,
                config,
                tracker,
                store_failures: Throttle::new(STORE_FAILURE_LOG_INTERVAL),
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

        if !config.methods.contains(req.method()) {
            return ResponseFuture::passthrough(
                inner.call(req.map(RequestBody::passthrough)),
                None,
            );
        }
        let key = match IdempotencyKey::from_headers(req.headers(), &config.header) {
            Ok(Some(key)) => key,
            Ok(None) if !config.key_required => {
                tracing::debug!(target: "tower_idempotency", outcome = %Outcome::Unprotected, "idempotency outcome");
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
            Some(scope) => match scope(&parts) {
                Ok(scope) => scope,
                Err(rejection) => {
                    let response = rejection.into_response().map(ResponseBody::full);
                    return ResponseFuture::ready(finish(response, Outcome::Rejected));
                }
            },
        };
        let id = RecordId::for_key(scope.as_bytes(), &key);
        let span = tracing::info_span!(
            target: "tower_idempotency",
            "idempotency",
            key = %id.tag(),
            scope = %ScopeTag(&scope),
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

fn too_large(config: &Config) -> String {
    format!(
        "the request body is larger than {} bytes",
        config.request_body_limit
    )
}

/// What running the handler produced, before it is stored.
enum Handled<B> {
    /// The store policy or `Cache-Control: no-store` says: do not store; release the claim.
    NotStored(Response<B>),
    /// The whole body, within the response limit.
    Buffered(ResponseParts, Bytes),
    /// The body outgrew the response limit (or carries trailers): deliver it, keep a tombstone.
    Unstorable(Response<ResponseBody<B>>),
    /// The body failed while it was read; the handler did run.
    BodyFailed(String),
}

impl<St: Store> Shared<St> {
    fn reject<F, B>(&self, kind: ProblemKind, detail: String) -> ResponseFuture<F, B> {
        ResponseFuture::ready(self.problem(kind, detail))
    }

    fn problem<B>(&self, kind: ProblemKind, detail: String) -> Response<ResponseBody<B>> {
        self.problem_with(kind, detail, None)
    }

    fn problem_with<B>(
        &self,
        kind: ProblemKind,
        detail: String,
        retry_after: Option<u64>,
    ) -> Response<ResponseBody<B>> {
        let mut problem = Problem::new(kind, self.config.status(kind), detail);
        if let Some(seconds) = retry_after {
            problem = problem.retry_after(seconds);
        }
        let outcome = match kind {
            ProblemKind::InFlight => Outcome::InFlight,
            ProblemKind::Mismatch => Outcome::Mismatch,
            ProblemKind::NotReplayable => Outcome::NotReplayable,
            ProblemKind::StoreUnavailable => Outcome::StoreUnavailable,
            ProblemKind::HandlerFailed => Outcome::HandlerFailed,
            _ => Outcome::Rejected,
        };
        finish(problem.into_response().map(ResponseBody::full), outcome)
    }

    fn timed<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        lease::timed(self.config.store_timeout, call)
    }

    fn held<'a>(&'a self, id: &'a RecordId, token: &'a ClaimToken) -> Held<'a, St> {
        Held {
            store: &self.store,
            id,
            token,
            lease: self.config.lease,
            timeout: self.config.store_timeout,
        }
    }

    /// Buffers and fingerprints a request with a key, claims the key, and answers from the record
    /// or runs the handler.
    async fn protect<S, ReqBody, ResBody>(
        self: Arc<Self>,
        inner: S,
        mut parts: http::request::Parts,
        body: ReqBody,
        key: IdempotencyKey,
        id: RecordId,
    ) -> Response<ResponseBody<ResBody>>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: fmt::Display + Send + 'static,
        ReqBody: Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        let config = &self.config;
        let body = match collect_limited(body, config.request_body_limit).await {
            Ok(body) => body,
            Err(err) if err.is::<LengthLimitError>() => {
                return self.problem(ProblemKind::BodyTooLarge, too_large(config));
            }
            Err(err) => {
                let detail = format!("the request body could not be read: {err}");
                return self.problem(ProblemKind::BodyUnreadable, detail);
            }
        };
        let fingerprint = Fingerprint::of(
            &parts.method,
            &parts.uri,
            &parts.headers,
            &config.fingerprint_headers,
            &body,
        );
        let token = match self
            .timed(self.store.claim(&id, &fingerprint, config.lease))
            .await
        {
            Ok(Claim::Claimed(token)) => token,
            Ok(Claim::Existing(record)) => return self.answer_existing(record, &fingerprint),
            Err(err) if config.fail_open => {
                if let Some(held_back) = self.store_failures.admit() {
                    tracing::warn!(
                        target: "tower_idempotency",
                        outcome = %Outcome::FailedOpen,
                        error = %ErrorChain(&err),
                        held_back,
                        "idempotency store failed; running requests without protection (fail-open)"
                    );
                }
                parts.extensions.insert(key);
                let request = Request::from_parts(parts, RequestBody::buffered(body));
                return self.run_unprotected(inner, request).await;
            }
            Err(err) => {
                if let Some(held_back) = self.store_failures.admit() {
                    tracing::warn!(
                        target: "tower_idempotency",
                        outcome = %Outcome::StoreUnavailable,
                        error = %ErrorChain(&err),
                        held_back,
                        "idempotency store failed at claim time; refusing requests (fail-closed)"
                    );
                }
                let (detail, retry_after) = match err {
                    StoreError::Full { retry_after } => (
                        "the idempotency store has no room for this request's record; the \
                         request was not run",
                        retry_after.unwrap_or(config.retry_after),
                    ),
                    _ => (
                        "the idempotency store is unavailable; the request was not run",
                        config.retry_after,
                    ),
                };
                let retry_after = Some(whole_seconds(retry_after));
                return self.problem_with(
                    ProblemKind::StoreUnavailable,
                    detail.into(),
                    retry_after,
                );
            }
        };

        parts.extensions.insert(key);
        let request = Request::from_parts(parts, RequestBody::buffered(body));
        // The handler runs in this request's task; if the client goes away first, `Detachable`
        // moves the rest of the work to a task of its own, so the handler still runs to completion
        // and its result is stored for the client's retry. The tracker counts it either way.
        Detachable::new(self.start(inner, request, id, token, fingerprint)).await
    }

    /// Runs a request without protection (fail-open), turning a failure into a 500 problem. Boxed,
    /// so that the inner service's future does not swell every protected request's future.
    fn run_unprotected<S, ReqBody, ResBody>(
        self: Arc<Self>,
        mut inner: S,
        request: Request<RequestBody<ReqBody>>,
    ) -> Covered<ResBody>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: fmt::Display + Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Send + 'static,
    {
        Box::pin(async move {
            let run = AssertUnwindSafe(inner.call(request)).catch_unwind().await;
            let failure = match run {
                Ok(Ok(response)) => {
                    return finish(response.map(ResponseBody::inner), Outcome::FailedOpen);
                }
                Ok(Err(err)) => format!("the handler failed: {err}"),
                Err(panic) => format!("the handler panicked: {}", panic_message(&*panic)),
            };
            tracing::error!(target: "tower_idempotency", error = %failure, "the unprotected request failed");
            self.problem(
                ProblemKind::HandlerFailed,
                String::from("the request failed"),
            )
        })
    }

    fn answer_existing<B>(
        &self,
        record: Record,
        fingerprint: &Fingerprint,
    ) -> Response<ResponseBody<B>> {
        if record.fingerprint() != fingerprint {
            let detail = String::from(
                "this Idempotency-Key was used for a different request (method, path, query or body); \
                 use a new key for a new request",
            );
            return self.problem(ProblemKind::Mismatch, detail);
        }
        match record {
            Record::InFlight(in_flight) => {
                let lease_end = whole_seconds(in_flight.lease_remaining);
                let retry_after = whole_seconds(self.config.retry_after).min(lease_end);
                let detail = String::from(
                    "a request with this Idempotency-Key is still being processed; retry later",
                );
                self.problem_with(ProblemKind::InFlight, detail, Some(retry_after))
            }
            Record::Completed(Completed {
                response: Some(stored),
                ..
            }) => {
                let (status, mut headers, body) = match Arc::try_unwrap(stored) {
                    // Decoded for this request (a shared store): moved, not copied.
                    Ok(stored) => (stored.status, stored.headers, stored.body),
                    // Shared with the store (the memory store): copied, with room for the marker.
                    Err(stored) => {
                        let mut headers = HeaderMap::with_capacity(stored.headers.len() + 1);
                        for (name, value) in &stored.headers {
                            headers.append(name, value.clone());
                        }
                        (stored.status, headers, stored.body.clone())
                    }
                };
                headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                let mut response = Response::new(ResponseBody::full(body));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                finish(response, Outcome::Replayed)
            }
            Record::Completed(Completed { response: None, .. }) => {
                let detail = String::from(
                    "the request with this Idempotency-Key completed, but its response could not be stored \
                     (too large, or it failed while it was produced), so it cannot be replayed",
                );
                self.problem(ProblemKind::NotReplayable, detail)
            }
        }
    }

    /// The work of a claimed request, boxed where it is made (it is large), in this request's span
    /// and counted by the shutdown tracker.
    fn start<S, ReqBody, ResBody>(
        self: Arc<Self>,
        inner: S,
        request: Request<RequestBody<ReqBody>>,
        id: RecordId,
        token: ClaimToken,
        fingerprint: Fingerprint,
    ) -> impl Future<Output = Response<ResponseBody<ResBody>>> + Unpin + Send + 'static
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: fmt::Display + Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        let tracker = self.tracker.clone();
        // The handler's work and what follows it are boxed apart: each box stays under 1 KiB,
        // which allocators serve from their fast per-thread caches, where one box of both would
        // not be.
        let work = Box::pin(self.clone().run(inner, request));
        let execute = Box::pin(self.execute(work, id, token, fingerprint));
        tracker.track_future(execute.instrument(tracing::Span::current()))
    }

    /// Calls the handler and reads its response.
    async fn run<S, ReqBody, ResBody>(
        self: Arc<Self>,
        mut inner: S,
        request: Request<RequestBody<ReqBody>>,
    ) -> Result<Handled<ResBody>, String>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
        S::Error: fmt::Display,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        let response = inner.call(request).await.map_err(|err| err.to_string())?;
        Ok(self.buffer_response(response).await)
    }

    /// Runs a claimed request's work to completion, renewing the lease meanwhile, then stores or
    /// releases.
    async fn execute<W, ResBody>(
        self: Arc<Self>,
        work: Pin<Box<W>>,
        id: RecordId,
        token: ClaimToken,
        fingerprint: Fingerprint,
    ) -> Response<ResponseBody<ResBody>>
    where
        W: Future<Output = Result<Handled<ResBody>, String>>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        let config = &self.config;
        let result = self
            .held(&id, &token)
            .renewing(AssertUnwindSafe(work).catch_unwind())
            .await;

        // What to store (a response, or `None` for a tombstone) and what to answer, or why the
        // claim is released instead.
        let (stored, response) = match result {
            Ok(Ok(Handled::Buffered(parts, body))) => {
                let stored = StoredResponse {
                    status: parts.status,
                    headers: replayable_headers(&parts.headers, config.keep_set_cookie),
                    body: body.clone(),
                };
                let response = Response::from_parts(parts, ResponseBody::full(body));
                (Some(Arc::new(stored)), finish(response, Outcome::Executed))
            }
            Ok(Ok(Handled::Unstorable(response))) => (None, finish(response, Outcome::Executed)),
            Ok(Ok(Handled::BodyFailed(err))) => {
                // The handler ran: keep a tombstone so a retry does not run it again.
                tracing::error!(
                    target: "tower_idempotency",
                    error = %err,
                    "the response body failed while it was read; keeping a tombstone"
                );
                let detail = String::from(
                    "the response failed while it was produced; the operation may have completed, \
                     so a retry with this key will not run it again",
                );
                (None, self.problem(ProblemKind::HandlerFailed, detail))
            }
            Ok(Ok(Handled::NotStored(response))) => {
                let response = finish(response.map(ResponseBody::inner), Outcome::NotStored);
                return self.release(&id, &token, response).await;
            }
            Ok(Err(err)) => {
                return self
                    .fail(&id, &token, format!("the handler failed: {err}"))
                    .await;
            }
            Err(panic) => {
                let failure = format!("the handler panicked: {}", panic_message(&*panic));
                return self.fail(&id, &token, failure).await;
            }
        };
        let completed = Completed {
            fingerprint,
            response: stored,
        };
        self.complete(&id, &token, completed, response).await
    }

    /// The handler failed or panicked: a 500 problem, and the claim is released.
    async fn fail<B>(
        self: &Arc<Self>,
        id: &RecordId,
        token: &ClaimToken,
        failure: String,
    ) -> Response<ResponseBody<B>> {
        tracing::error!(target: "tower_idempotency", error = %failure, "releasing the claim");
        let detail =
            String::from("the request failed; it was not stored, and a retry runs it again");
        let response = self.problem(ProblemKind::HandlerFailed, detail);
        self.release(id, token, response).await
    }

    /// Reads the response body up to the response limit, or decides it is not to be stored.
    async fn buffer_response<B>(&self, response: Response<B>) -> Handled<B>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: fmt::Display,
    {
        let config = &self.config;
        let no_store = response.headers().get_all(CACHE_CONTROL).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split(',')
                    .any(|d| d.trim().eq_ignore_ascii_case("no-store"))
            })
        });
        if no_store || !(config.store_policy)(response.status(), response.headers()) {
            return Handled::NotStored(response);
        }
        let (parts, body) = response.into_parts();
        let limit = config.response_body_limit;
        let mut body = Box::pin(body);
        if body.size_hint().lower() > limit as u64 {
            return Handled::Unstorable(Response::from_parts(
                parts,
                ResponseBody::chained(Bytes::new(), None, body),
            ));
        }
        let mut chunks = Chunks::default();
        loop {
            match body.frame().await {
                None => break,
                Some(Err(err)) => return Handled::BodyFailed(err.to_string()),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        chunks.push(data);
                        if chunks.len > limit {
                            let prefix = chunks.into_bytes();
                            let body = ResponseBody::chained(prefix, None, body);
                            return Handled::Unstorable(Response::from_parts(parts, body));
                        }
                    }
                    Err(frame) => {
                        // Trailers cannot be replayed faithfully: deliver them, keep a tombstone.
                        let trailers = frame.into_trailers().ok().map(Box::new);
                        let body = ResponseBody::chained(chunks.into_bytes(), trailers, body);
                        return Handled::Unstorable(Response::from_parts(parts, body));
                    }
                },
            }
        }
        Handled::Buffered(parts, chunks.into_bytes())
    }

    /// Stores the result, then answers: after the write, so that a retry that follows the response
    /// finds it. A failed write answers at once and is retried on a task of its own.
    async fn complete<B>(
        self: &Arc<Self>,
        id: &RecordId,
        token: &ClaimToken,
        completed: Completed,
        response: Response<B>,
    ) -> Response<B> {
        let ttl = self.config.dedup_window;
        let written = self
            .timed(self.store.complete(id, token, &completed, ttl))
            .await;
        self.after_write(id, token, Some(completed), written);
        response
    }

    /// Releases the claim, then answers, like [`Shared::complete`].
    async fn release<B>(
        self: &Arc<Self>,
        id: &RecordId,
        token: &ClaimToken,
        response: Response<B>,
    ) -> Response<B> {
        let released = self.timed(self.store.release(id, token)).await;
        self.after_write(id, token, None, released);
        response
    }

    /// Logs a lost claim, and hands a failed write (a completion, or a release when `completed` is
    /// `None`) to a task that retries it: a completion for as long as the claim can still be ours
    /// (up to the dedup window), a release for up to a lease.
    fn after_write(
        self: &Arc<Self>,
        id: &RecordId,
        token: &ClaimToken,
        completed: Option<Completed>,
        written: Result<bool, StoreError>,
    ) {
        let what = if completed.is_some() {
            "complete"
        } else {
            "release"
        };
        match written {
            Ok(true) => {}
            Ok(false) => lease::not_written(what),
            Err(err) => {
                tracing::warn!(
                    target: "tower_idempotency",
                    operation = what,
                    error = %ErrorChain(&err),
                    "store write failed; answering now and retrying the write"
                );
                let (shared, id, token) = (self.clone(), *id, *token);
                let retry = async move {
                    let held = shared.held(&id, &token);
                    let store = &shared.store;
                    match &completed {
                        Some(done) => {
                            let ttl = shared.config.dedup_window;
                            held.complete_with(ttl, 1, || store.complete(&id, &token, done, ttl))
                                .await
                        }
                        None => held.release_with(1, || store.release(&id, &token)).await,
                    };
                };
                self.tracker
                    .spawn(retry.instrument(tracing::Span::current()));
            }
        }
    }
}

/// Reads a whole body of at most `limit` bytes. (Not `BodyExt::collect`: a body of one chunk, the
/// common case, is returned as it came, with no allocation.)
async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut chunks = Chunks::default();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            chunks.push(data);
        }
    }
    Ok(chunks.into_bytes())
}

/// Body chunks gathered into one buffer, copied only when there is more than one.
#[derive(Default)]
struct Chunks {
    first: Option<Bytes>,
    joined: Option<BytesMut>,
    len: usize,
}

impl Chunks {
    fn push(&mut self, data: Bytes) {
        self.len += data.len();
        if let Some(joined) = &mut self.joined {
            joined.extend_from_slice(&data);
        } else if let Some(first) = self.first.take() {
            let mut joined = BytesMut::with_capacity(first.len() + data.len());
            joined.extend_from_slice(&first);
            joined.extend_from_slice(&data);
            self.joined = Some(joined);
        } else {
            self.first = Some(data);
        }
    }

    fn into_bytes(self) -> Bytes {
        match (self.joined, self.first) {
            (Some(joined), _) => joined.freeze(),
            (None, first) => first.unwrap_or_default(),
        }
    }
}

/// The headers of a response that a replay repeats: every value in order, minus hop-by-hop
/// headers, `Date`, and (unless kept) `Set-Cookie`.
fn replayable_headers(headers: &HeaderMap, keep_set_cookie: bool) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let hop_by_hop = matches!(
            name.as_str(),
            "connection" | "keep-alive" | "transfer-encoding" | "te" | "trailer" | "upgrade"
        ) || name.as_str().starts_with("proxy-");
        if hop_by_hop || name == DATE || (name == SET_COOKIE && !keep_set_cookie) {
            continue;
        }
        out.append(name, value.clone());
    }
    out
}

/// Whole seconds, rounded up, at least 1.
fn whole_seconds(duration: Duration) -> u64 {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    seconds.max(1)
}

/// Marks a response with its outcome and logs it (inside the request's span, which carries the
/// hashed key and scope).
fn finish<B>(mut response: Response<B>, outcome: Outcome) -> Response<B> {
    let status = response.status().as_u16();
    match outcome {
        // Store failures are warned of once per interval where they happen, with a count: one
        // warning per request would flood the log for as long as the store is away or full.
        Outcome::HandlerFailed => {
            tracing::warn!(target: "tower_idempotency", %outcome, status, "idempotency outcome")
        }
        Outcome::InFlight | Outcome::Mismatch | Outcome::NotReplayable | Outcome::Rejected => {
            tracing::info!(target: "tower_idempotency", %outcome, status, "idempotency outcome")
        }
        _ => tracing::debug!(target: "tower_idempotency", %outcome, status, "idempotency outcome"),
    }
    response.extensions_mut().insert(outcome);
    response
}

/// A short, non-reversible tag of a scope for logs.
struct ScopeTag<'a>(&'a Scope);

impl fmt::Display for ScopeTag<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = blake3::hash(self.0.as_bytes());
        for b in &digest.as_bytes()[..4] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_seconds_round_up() {
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::from_millis(300)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn replay_drops_hop_by_hop_date_and_cookies_and_keeps_repeats() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "close"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("upgrade", "h2c"),
            ("proxy-authenticate", "Basic"),
            ("date", "Wed, 02 Dec 2026 10:00:00 GMT"),
            ("set-cookie", "a=1"),
            ("x-repeat", "1"),
            ("x-repeat", "2"),
            ("content-type", "application/json"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        let kept = replayable_headers(&headers, false);
        let names: Vec<_> = kept.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-repeat", "content-type"]);
        assert_eq!(
            kept.get_all("x-repeat").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert!(replayable_headers(&headers, true).contains_key(SET_COOKIE));
    }
}
