//! What the cases drive the layer with: a counting inner service, request builders, and the
//! [`Reply`] a client sees.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::{BoxError, Service, ServiceExt};

use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::{OperatorStore, ScopeQuota, Store};
use tower_idempotency::{
    IDEMPOTENT_REPLAYED, Idempotency, IdempotencyKey, IdempotencyLayer, Outcome, Rejection, Scope,
};

/// One call of a [`Handler`]: its number (from 1), the request's parts and its whole body.
#[derive(Debug)]
pub struct Call {
    /// The call's number: 1 for the first.
    pub n: usize,
    /// The request's method, URI, headers and extensions.
    pub parts: http::request::Parts,
    /// The whole request body.
    pub body: Bytes,
}

impl Call {
    /// A request header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.parts.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The key the layer put in the request's extensions.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.parts.extensions.get::<IdempotencyKey>()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Respond = dyn Fn(Call) -> BoxFuture<Result<Response<Body>, BoxError>> + Send + Sync;

/// A mock inner service that counts its calls, reads the whole request body, and answers with a
/// function of the call.
#[derive(Clone)]
pub struct Handler {
    calls: Arc<AtomicUsize>,
    respond: Arc<Respond>,
}

impl Handler {
    /// A handler whose answer is a future (it may wait, fail or panic).
    pub fn new<F, Fut>(respond: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<Body>, BoxError>> + Send + 'static,
    {
        Self {
            calls: Arc::default(),
            respond: Arc::new(move |call| Box::pin(respond(call))),
        }
    }

    /// A handler that answers at once.
    pub fn ok<F>(respond: F) -> Self
    where
        F: Fn(Call) -> Response<Body> + Send + Sync + 'static,
    {
        let respond = Arc::new(respond);
        Self::new(move |call| {
            let respond = respond.clone();
            async move { Ok(respond(call)) }
        })
    }

    /// How often the handler ran.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl fmt::Debug for Handler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handler")
            .field("calls", &self.calls())
            .finish_non_exhaustive()
    }
}

impl<B> Service<Request<B>> for Handler
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Response<Body>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let calls = self.calls.clone();
        let respond = self.respond.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body = body.collect().await.map_err(Into::into)?.to_bytes();
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            respond(Call { n, parts, body }).await
        })
    }
}

/// A response with `status` and `body`.
pub fn respond(status: u16, body: impl Into<Body>) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(body.into())
        .expect("a valid response")
}

/// A 201 response with `body`.
pub fn created(body: impl Into<Body>) -> Response<Body> {
    respond(201, body)
}

/// A request builder for `method` `uri` with `Idempotency-Key: key`.
pub fn keyed(method: Method, uri: &str, key: &str) -> http::request::Builder {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("idempotency-key", key)
}

/// `POST /` with `key` and `body`.
pub fn post(key: &str, body: impl Into<Body>) -> Request<Body> {
    keyed(Method::POST, "/", key)
        .body(body.into())
        .expect("a valid request")
}

/// A response as the client sees it: status, headers, the whole body, and the layer's outcome.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The response's status.
    pub status: StatusCode,
    /// Every header, in order.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// The layer's [`Outcome`], from the response's extensions.
    pub outcome: Option<Outcome>,
    /// The [`ProblemKind`] of a response the layer made itself, from its extensions.
    pub problem: Option<ProblemKind>,
}

impl Reply {
    /// A header as text (`None` when absent or not text).
    pub fn header(&self, name: impl http::header::AsHeaderName) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every value of a header, in order.
    pub fn all(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    }

    /// Every header, in order, except `Idempotent-Replayed`.
    pub fn header_list(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(name, _)| **name != IDEMPOTENT_REPLAYED)
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect()
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("§7.1: the body is JSON ({e}): {:?}", self.text()))
    }

    /// Whether the response is marked `Idempotent-Replayed: true`.
    pub fn is_replay(&self) -> bool {
        self.header(IDEMPOTENT_REPLAYED) == Some("true")
    }

    /// Asserts an RFC 9457 problem of `kind` with `status`: the kind in the extensions, the
    /// content type, `Cache-Control: no-store`, and a JSON body whose `type`, `title` and `status`
    /// match.
    #[track_caller]
    pub fn assert_problem(&self, kind: ProblemKind, status: StatusCode) {
        assert_eq!(
            self.status, status,
            "§6.2, §7.3: the {kind:?} problem's status: {self:?}"
        );
        assert_eq!(
            self.problem,
            Some(kind),
            "§6.2, §6.5: a problem response carries its ProblemKind in its extensions: {self:?}"
        );
        assert_eq!(
            self.header(CONTENT_TYPE),
            Some("application/problem+json"),
            "§7.1: a problem is application/problem+json by default: {self:?}"
        );
        assert_eq!(
            self.header(CACHE_CONTROL),
            Some("no-store"),
            "§7.1: a problem has Cache-Control: no-store: {self:?}"
        );
        let uri = kind.type_uri();
        assert_eq!(
            self.header(tower_idempotency::problem::IDEMPOTENCY_PROBLEM),
            uri.rsplit('#').next(),
            "§7.1: a problem names its kind in Idempotency-Problem: {self:?}"
        );
        let json = self.json();
        assert_eq!(
            json["type"],
            kind.type_uri(),
            "§7.1, §7.2: the problem's type is its kind's URI: {json}"
        );
        assert_eq!(
            json["status"],
            status.as_u16(),
            "§7.1: the problem's status member is the status sent: {json}"
        );
        assert!(
            json["title"].as_str().is_some_and(|t| !t.is_empty()),
            "§7.1: a problem has a title: {json}"
        );
        assert!(
            json["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "§7.1: a problem has a detail: {json}"
        );
        assert!(
            !self.is_replay(),
            "§6.4: a problem response is never marked a replay: {self:?}"
        );
    }

    /// Asserts the in-flight 409 with a `Retry-After` of whole seconds, and returns the seconds.
    #[track_caller]
    pub fn assert_in_flight(&self) -> u64 {
        self.assert_problem(ProblemKind::InFlight, StatusCode::CONFLICT);
        assert_eq!(
            self.outcome,
            Some(Outcome::InFlight),
            "§6.5: a 409 in flight has the outcome InFlight: {self:?}"
        );
        let retry_after = self
            .header(RETRY_AFTER)
            .expect("§6.3: a 409 in-flight has Retry-After");
        retry_after
            .parse()
            .unwrap_or_else(|_| panic!("§6.3: Retry-After is in whole seconds: {retry_after:?}"))
    }
}

/// Sends `request` through a clone of `svc` and reads the whole response.
pub fn send<S, B>(svc: &S, request: Request<Body>) -> impl Future<Output = Reply> + use<S, B>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: http_body::Body,
    B::Error: fmt::Debug,
{
    call(svc.clone(), request)
}

/// Sends `request` through `svc` and reads the whole response.
pub async fn call<S, B>(svc: S, request: Request<Body>) -> Reply
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Error: fmt::Debug,
    B: http_body::Body,
    B::Error: fmt::Debug,
{
    let response = svc.oneshot(request).await.expect("the service answers");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the body is read").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
        outcome: parts.extensions.get::<Outcome>().copied(),
        problem: parts.extensions.get::<ProblemKind>().copied(),
    }
}

/// Spawns `send` on a clone of `svc`.
pub fn spawn_send<S, B>(svc: &S, request: Request<Body>) -> tokio::task::JoinHandle<Reply>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: fmt::Debug,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: fmt::Debug,
{
    tokio::spawn(call(svc.clone(), request))
}

/// A body of `n` bytes that differ from one another, so a reordering shows.
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// A streamed body (no size hint) of `chunks` chunks of `size` bytes: `pattern(chunks * size)`.
pub fn streamed(chunks: usize, size: usize) -> Body {
    let bytes = Bytes::from(pattern(chunks * size));
    let parts: Vec<Result<Bytes, Infallible>> = (0..chunks)
        .map(|i| Ok(bytes.slice(i * size..(i + 1) * size)))
        .collect();
    Body::from_stream(futures_util::stream::iter(parts))
}

/// A handler that answers with the status in `x-status` and, if given, the `Cache-Control` in
/// `x-cache-control`, and a body naming the call.
pub fn status_handler() -> Handler {
    Handler::ok(|call| {
        let status: u16 = call
            .header("x-status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(200);
        let mut response = respond(status, format!("status {status} call {}", call.n));
        // `|` separates header lines: `private|no-store` is two Cache-Control fields.
        for cc in call
            .header("x-cache-control")
            .into_iter()
            .flat_map(|cc| cc.split('|'))
        {
            response.headers_mut().append(
                CACHE_CONTROL,
                HeaderValue::from_str(cc).expect("a header value"),
            );
        }
        if status / 100 == 3 {
            response
                .headers_mut()
                .insert(LOCATION, HeaderValue::from_static("/elsewhere"));
        }
        response
    })
}

/// A request for [`status_handler`]: `POST /` with `key`, asking for `status` and, if given,
/// `cache_control` (`|` between values makes one header line of each).
pub fn status_request(key: &str, status: u16, cache_control: Option<&str>) -> Request<Body> {
    let builder = keyed(Method::POST, "/", key).header("x-status", status.to_string());
    let builder = match cache_control {
        Some(cc) => builder.header("x-cache-control", cc),
        None => builder,
    };
    builder.body(Body::from("x")).expect("a request")
}

/// A handler that signals `started` and waits for `gate` on its first call.
pub fn gated_handler(started: Arc<Notify>, gate: Arc<Notify>, body: &'static str) -> Handler {
    Handler::new(move |call| {
        let (started, gate) = (started.clone(), gate.clone());
        async move {
            if call.n == 1 {
                started.notify_one();
                gate.notified().await;
            }
            Ok(created(format!("{body} {}", call.n)))
        }
    })
}

/// Awaits concurrent requests that all carry one key and checks what the protocol promises of
/// them: exactly one executed, answering `body`; every other got the in-flight 409 or the replay
/// of that answer. Returns how many were in flight and how many replayed.
///
/// # Panics
/// On any other outcome, or a number of executions other than one.
pub async fn expect_one_execution(
    tasks: Vec<tokio::task::JoinHandle<Reply>>,
    body: &str,
) -> (usize, usize) {
    let (mut executed, mut in_flight, mut replayed) = (0, 0, 0);
    for task in tasks {
        let reply = task.await.expect("the request's task");
        match reply.outcome {
            Some(Outcome::Executed) => {
                executed += 1;
                assert_eq!(
                    reply.text(),
                    body,
                    "§6.2: the request that ran answers the handler's response"
                );
            }
            Some(Outcome::InFlight) => {
                reply.assert_in_flight();
                in_flight += 1;
            }
            Some(Outcome::Replayed) => {
                assert_eq!(
                    (reply.status, reply.text()),
                    (StatusCode::CREATED, body.into()),
                    "§6.4: a replay repeats the stored status and body"
                );
                replayed += 1;
            }
            other => panic!(
                "§6.2: of concurrent requests with one key, each runs, gets 409 in flight or the \
                 replay; got {other:?}: {reply:?}"
            ),
        }
    }
    assert_eq!(
        executed, 1,
        "§6.2, §10.2: of concurrent requests with one key, exactly one runs the handler \
         ({in_flight} in flight, {replayed} replayed)"
    );
    (in_flight, replayed)
}

/// The scope of a request: its `x-account` header (empty without one).
pub fn account_scope(parts: &http::request::Parts) -> Result<Scope, Rejection> {
    let account = parts.headers.get("x-account").map(HeaderValue::as_bytes);
    Ok(Scope::from(account.unwrap_or_default()))
}

/// `POST /` with `key`, in `account` (`x-account`, read by [`account_scope`]).
pub fn account_post(account: &str, key: &str) -> Request<Body> {
    keyed(Method::POST, "/", key)
        .header("x-account", account)
        .body(Body::from("charge"))
        .expect("a valid request")
}

/// What one account writing records as fast as it can does: `requests` requests of `account`,
/// each with a fresh key, one after another. Stops at the first that does not run, and returns
/// how many ran and that reply (`None` when all ran).
pub async fn flood<S, B>(svc: &S, account: &str, requests: usize) -> (usize, Option<Reply>)
where
    S: Service<Request<Body>, Response = Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: http_body::Body,
    B::Error: fmt::Debug,
{
    for n in 0..requests {
        let reply = send(svc, account_post(account, &format!("{account}-{n}"))).await;
        if reply.outcome != Some(Outcome::Executed) {
            return (n, Some(reply));
        }
    }
    (requests, None)
}

/// Asserts what a quota per scope is for (PROTOCOL.md §3.4), on a store that fills: one tenant
/// writing 60 KB records as fast as it can into a store shared with another fills it without a
/// quota, and the other tenant gets `503`; with `quota`, the flooding tenant gets `429` and the
/// other's requests run. `fresh` gives the store empty, once for each half; `quota` is the bytes
/// of the [`ScopeQuota`] around it.
pub async fn assert_a_quota_keeps_a_flood_off_the_others<St, F>(fresh: F, quota: u64)
where
    St: OperatorStore + Clone,
    F: Fn() -> St,
{
    let handler = Handler::ok(|_| created(pattern(60 * 1024)));
    fn app<St: Store + Clone>(store: St, handler: &Handler) -> Idempotency<Handler, St> {
        let layer = IdempotencyLayer::new(store).scope(account_scope);
        tower::ServiceBuilder::new()
            .layer(layer)
            .service(handler.clone())
    }

    let unbounded = app(fresh(), &handler);
    let (ran, full) = flood(&unbounded, "acct_flood", 10_000).await;
    let full = full.expect("the store fills");
    assert_eq!(
        full.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a full store refuses, after {ran} records: {full:?}"
    );
    let other = send(&unbounded, account_post("acct_other", "k")).await;
    assert_eq!(
        other.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "without a quota, one tenant's flood refuses the others: {other:?}"
    );

    let bounded = app(ScopeQuota::new(fresh(), quota), &handler);
    let (_, refused) = flood(&bounded, "acct_flood", 10_000).await;
    let refused = refused.expect("§3.4: the quota refuses the flood");
    refused.assert_problem(ProblemKind::QuotaExceeded, StatusCode::TOO_MANY_REQUESTS);
    for n in 0..5 {
        let other = send(&bounded, account_post("acct_other", &format!("k{n}"))).await;
        assert_eq!(
            other.outcome,
            Some(Outcome::Executed),
            "§3.4: with a quota, the other tenants' requests run: {other:?}"
        );
    }
}
