//! The store contract: one suite of cases that every [`Store`] runs, written once.
//!
//! A store is done when it passes this suite (PROTOCOL.md §10.7). Each case is a generic
//! `pub async fn case<H: Harness>(h: H)`; a test file supplies a [`Harness`] for its store and
//! invokes [`store_contract!`](crate::store_contract), which expands to one `#[tokio::test]` per
//! case:
//!
//! ```ignore
//! mod support;
//! store_contract!(MemoryHarness::new(), start_paused = true);
//! ```
//!
//! Every time-dependent case is written in terms of the harness's [`Harness::lease`],
//! [`Harness::window`] and [`Harness::advance`], never raw sleeps: the memory harness runs on paused
//! tokio time with a 30 s lease and a 24 h window, a Redis harness on real time with short ones.
//!
//! The cases are of two kinds: store-level cases (`store_*`) that call the [`Store`] methods
//! directly, and HTTP cases that drive [`IdempotencyLayer`] over the store through a real
//! `axum::Router` or `tower::ServiceBuilder`, counting the inner service's calls (and, through
//! [`Counting`], the store's).
//!
//! The module also holds what other test files share: [`Counting`] and [`Faulty`] store wrappers,
//! the counting [`Handler`] service, request builders and the [`Reply`] of a request.

#![allow(dead_code)]

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::AppendHeaders;
use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use http::{Extensions, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::store::{Claim, Store, StoreError};
use tower_idempotency::{
    ClaimToken, Completed, Fingerprint, IDEMPOTENT_REPLAYED, Idempotency, IdempotencyKey,
    IdempotencyLayer, Outcome, ProblemKind, Record, RecordId, Rejection, RequestBody, Scope,
    StoredResponse,
};
use tower_test::mock;

// ---------------------------------------------------------------------------------------------
// The harness and the macro
// ---------------------------------------------------------------------------------------------

/// What a store needs to provide to run the contract.
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store + Clone + fmt::Debug;

    /// A handle onto this harness's storage: every call sees the same records; every harness
    /// instance starts empty.
    fn store(&self) -> Self::Store;

    /// The claim lease the cases configure.
    fn lease(&self) -> Duration;

    /// The dedup window the cases configure: at least two leases.
    fn window(&self) -> Duration;

    /// Lets `d` of time pass: paused tokio time for the memory store, a real sleep for Redis.
    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send;
}

/// Expands to one `#[tokio::test(<attributes>)]` per contract case, each calling the case with a
/// fresh harness from `$harness` (evaluated inside the async test, so it may `.await`).
///
/// ```ignore
/// store_contract!(MemoryHarness::new(), start_paused = true);
/// store_contract!(RedisHarness::start().await, flavor = "multi_thread");
/// ```
#[macro_export]
macro_rules! store_contract {
    (@cases ($harness:expr) $attrs:tt $($case:ident),* $(,)?) => {
        $(
            #[tokio::test $attrs]
            async fn $case() {
                $crate::support::contract::$case($harness).await;
            }
        )*
    };
    ($harness:expr $(, $($attr:tt)*)?) => {
        $crate::store_contract!(@cases ($harness) ($($($attr)*)?)
            // Store level.
            store_claim_is_exclusive,
            store_claims_are_per_record_id,
            store_completed_record_is_returned_intact,
            store_tombstone_is_kept,
            store_completed_record_lives_for_its_ttl_not_the_lease,
            store_lease_expires_without_renewal,
            store_renew_extends_the_lease,
            store_release_frees_the_key,
            store_fencing_stops_an_owner_whose_lease_was_lost,
            store_completed_record_is_final,
            store_complete_writes_a_missing_record_and_nothing_else_does,
            store_complete_after_the_lease_ran_out_writes_the_record,
            store_concurrent_claims_have_one_winner,
            // Through the layer.
            replay_is_byte_identical_through_a_router,
            replay_is_byte_identical_through_service_builder,
            in_flight_request_gets_409_then_the_replay,
            retry_after_never_goes_beyond_the_lease,
            different_request_with_the_same_key_gets_422,
            responses_that_are_not_stored_run_again,
            responses_that_are_stored_replay,
            replay_drops_cookies_hop_by_hop_headers_and_date,
            oversized_response_is_delivered_and_leaves_a_tombstone,
            panicking_handler_gets_500_and_a_retry_runs_again,
            failing_handler_gets_500_and_releases_the_claim,
            dropped_request_runs_to_completion_and_shutdown_waits_for_it,
            slow_handler_keeps_its_claim_past_the_lease,
            key_is_new_again_after_the_dedup_window,
            scopes_never_see_each_others_records,
            concurrent_requests_with_one_key_run_once,
            concurrent_requests_with_distinct_keys_all_run,
            store_failure_at_claim_fails_closed_with_503,
            store_failure_at_claim_fails_open_when_configured,
            the_store_alone_bounds_a_claim,
            failed_store_write_still_answers_and_is_retried,
            an_aborted_completion_is_not_reported_as_done,
            store_write_failing_past_the_lease_lands_when_the_store_returns,
            retried_write_gives_up_once_another_claim_holds_the_key,
        );
    };
}

/// A margin well inside the lease, for "just before" and "just after" a deadline.
pub fn margin<H: Harness>(h: &H) -> Duration {
    h.lease() / 4
}

/// A layer over `store` with the harness's lease and dedup window.
pub fn layer<H: Harness, St>(h: &H, store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .lease(h.lease())
        .dedup_window(h.window())
}

/// `inner` behind `layer`, through `tower::ServiceBuilder`.
pub fn service<St: Clone, S>(layer: IdempotencyLayer<St>, inner: S) -> Idempotency<S, St> {
    ServiceBuilder::new().layer(layer).service(inner)
}

/// Whole seconds, rounded up.
pub fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

// ---------------------------------------------------------------------------------------------
// Store wrappers
// ---------------------------------------------------------------------------------------------

/// How often each store method was called.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    pub claim: usize,
    pub complete: usize,
    pub renew: usize,
    pub release: usize,
}

impl Calls {
    pub fn total(&self) -> usize {
        self.claim + self.complete + self.renew + self.release
    }
}

#[derive(Debug, Default)]
struct CallCounters {
    claim: AtomicUsize,
    complete: AtomicUsize,
    renew: AtomicUsize,
    release: AtomicUsize,
}

/// A store that counts the calls of each method, then delegates.
#[derive(Debug, Clone)]
pub struct Counting<St> {
    inner: St,
    counters: Arc<CallCounters>,
}

impl<St> Counting<St> {
    pub fn new(inner: St) -> Self {
        Self {
            inner,
            counters: Arc::default(),
        }
    }

    pub fn calls(&self) -> Calls {
        Calls {
            claim: self.counters.claim.load(Ordering::SeqCst),
            complete: self.counters.complete.load(Ordering::SeqCst),
            renew: self.counters.renew.load(Ordering::SeqCst),
            release: self.counters.release.load(Ordering::SeqCst),
        }
    }

    pub fn inner(&self) -> &St {
        &self.inner
    }
}

impl<St: Store> Store for Counting<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.counters.claim.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.counters.complete.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.counters.renew.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(id, token, lease).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut Extensions) {
        self.inner.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.counters.release.fetch_add(1, Ordering::SeqCst);
        self.inner.release(id, token).await
    }
}

#[derive(Debug, Default)]
struct Faults {
    /// Every call fails.
    all: AtomicBool,
    /// Complete, renew and release fail; claims work.
    writes: AtomicBool,
    /// Every call waits this long before it reaches the store.
    delay: Mutex<Option<Duration>>,
    /// Every call fails as a store that gave up waiting does.
    time_out: AtomicBool,
    /// Completions roll back: the claim is released and `complete` answers `Aborted`.
    abort: AtomicBool,
}

/// What [`Faulty`]'s `prepare` puts into a claimed request's extensions: the claim's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared(pub ClaimToken);

/// A store whose calls fail with [`StoreError::Unavailable`] (or time out) while a shared flag is
/// set, or are slowed down; otherwise it delegates. Clones share the flags.
#[derive(Debug, Clone)]
pub struct Faulty<St> {
    inner: St,
    faults: Arc<Faults>,
}

impl<St> Faulty<St> {
    pub fn new(inner: St) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// Makes every call fail (`true`) or work (`false`).
    pub fn fail(&self, failing: bool) {
        self.faults.all.store(failing, Ordering::SeqCst);
    }

    /// Makes complete, renew and release fail (`true`) or work (`false`); claims keep working.
    pub fn fail_writes(&self, failing: bool) {
        self.faults.writes.store(failing, Ordering::SeqCst);
    }

    /// Makes every call fail with [`StoreError::Timeout`] (`true`) or work (`false`).
    pub fn time_out(&self, timing_out: bool) {
        self.faults.time_out.store(timing_out, Ordering::SeqCst);
    }

    /// Makes every completion roll back as a transactional store's does when its commit fails:
    /// the claim is released and `complete` answers [`StoreError::Aborted`].
    pub fn abort_completions(&self, aborting: bool) {
        self.faults.abort.store(aborting, Ordering::SeqCst);
    }

    /// Makes every call wait `delay` before it reaches the store.
    pub fn delay(&self, delay: Option<Duration>) {
        *self.faults.delay.lock().unwrap_or_else(|e| e.into_inner()) = delay;
    }

    async fn enter(&self, write: bool) -> Result<(), StoreError> {
        let delay = *self.faults.delay.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        if self.faults.time_out.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout(Duration::from_secs(1)));
        }
        if self.faults.all.load(Ordering::SeqCst)
            || (write && self.faults.writes.load(Ordering::SeqCst))
        {
            return Err(StoreError::Unavailable(Box::new(std::io::Error::other(
                "injected store failure",
            ))));
        }
        Ok(())
    }
}

impl<St: Store> Store for Faulty<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.enter(false).await?;
        self.inner.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.enter(true).await?;
        if self.faults.abort.load(Ordering::SeqCst) {
            self.inner.release(id, token).await?;
            return Err(StoreError::Aborted(Box::new(std::io::Error::other(
                "injected failed commit",
            ))));
        }
        self.inner.complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.enter(true).await?;
        self.inner.renew(id, token, lease).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut Extensions) {
        extensions.insert(Prepared(*token));
        self.inner.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.enter(true).await?;
        self.inner.release(id, token).await
    }
}

// ---------------------------------------------------------------------------------------------
// The inner service
// ---------------------------------------------------------------------------------------------

/// One call of a [`Handler`]: its number (from 1), the request's parts and its whole body.
#[derive(Debug)]
pub struct Call {
    pub n: usize,
    pub parts: http::request::Parts,
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

// ---------------------------------------------------------------------------------------------
// Requests and replies
// ---------------------------------------------------------------------------------------------

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
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: Option<Outcome>,
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

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.text()))
    }

    pub fn is_replay(&self) -> bool {
        self.header(IDEMPOTENT_REPLAYED) == Some("true")
    }

    /// Asserts an RFC 9457 problem of `kind` with `status`: the content type, `Cache-Control:
    /// no-store`, and a JSON body whose `type`, `title` and `status` match.
    #[track_caller]
    pub fn assert_problem(&self, kind: ProblemKind, status: StatusCode) {
        assert_eq!(self.status, status, "status of {self:?}");
        assert_eq!(
            self.header(CONTENT_TYPE),
            Some("application/problem+json"),
            "content type of {self:?}"
        );
        assert_eq!(
            self.header(CACHE_CONTROL),
            Some("no-store"),
            "cache control of {self:?}"
        );
        let json = self.json();
        assert_eq!(json["type"], kind.type_uri(), "type of {json}");
        assert_eq!(json["status"], status.as_u16(), "status member of {json}");
        assert!(
            json["title"].as_str().is_some_and(|t| !t.is_empty()),
            "title of {json}"
        );
        assert!(
            json["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "detail of {json}"
        );
        assert!(!self.is_replay(), "a problem is never a replay: {self:?}");
    }

    /// Asserts the in-flight 409 with a `Retry-After` of whole seconds, and returns the seconds.
    #[track_caller]
    pub fn assert_in_flight(&self) -> u64 {
        self.assert_problem(ProblemKind::InFlight, StatusCode::CONFLICT);
        assert_eq!(self.outcome, Some(Outcome::InFlight));
        let retry_after = self.header(RETRY_AFTER).expect("a 409 has Retry-After");
        retry_after
            .parse()
            .unwrap_or_else(|_| panic!("Retry-After is not whole seconds: {retry_after:?}"))
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

// ---------------------------------------------------------------------------------------------
// Store-level cases
// ---------------------------------------------------------------------------------------------

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn record_id(key: &str) -> RecordId {
    RecordId::new(b"contract", key)
}

async fn claimed<St: Store>(
    store: &St,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> ClaimToken {
    match store.claim(id, fp, lease).await {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("expected a new claim of {id:?}, got {other:?}"),
    }
}

async fn existing<St: Store>(
    store: &St,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> Record {
    match store.claim(id, fp, lease).await {
        Ok(Claim::Existing(record)) => record,
        other => panic!("expected the existing record of {id:?}, got {other:?}"),
    }
}

async fn existing_in_flight<St: Store>(
    store: &St,
    id: &RecordId,
    lease: Duration,
) -> tower_idempotency::InFlight {
    match existing(store, id, &fingerprint(0xee), lease).await {
        Record::InFlight(in_flight) => in_flight,
        other => panic!("expected an in-flight record, got {other:?}"),
    }
}

async fn existing_completed<St: Store>(store: &St, id: &RecordId, lease: Duration) -> Completed {
    match existing(store, id, &fingerprint(0xee), lease).await {
        Record::Completed(completed) => completed,
        other => panic!("expected a completed record, got {other:?}"),
    }
}

/// A completed record whose response has repeated, empty and non-UTF-8 header values and a
/// binary body.
fn completed_with_response(fp: Fingerprint) -> Completed {
    let mut headers = HeaderMap::new();
    headers.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.append("x-multi", HeaderValue::from_static("first"));
    headers.append("x-multi", HeaderValue::from_static("second"));
    headers.append("x-empty", HeaderValue::from_static(""));
    headers.append(
        "x-bytes",
        HeaderValue::from_bytes(b"caf\xe9 \xff").expect("obs-text is a valid header value"),
    );
    headers.append("x-multi", HeaderValue::from_static("third"));
    headers.append(LOCATION, HeaderValue::from_static("/v1/charges/ch_1"));
    let mut body = b"{\"id\":\"ch_1\"}\x00\xff\r\n".to_vec();
    body.extend(pattern(1000));
    Completed {
        fingerprint: fp,
        response: Some(Arc::new(StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from(body),
        })),
    }
}

fn header_pairs(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// A claim on a free key succeeds; a second claim, with the same or another fingerprint, gets
/// the in-flight record unchanged, and the first claimant still owns it.
/// PROTOCOL.md §10.1, §10.2.
pub async fn store_claim_is_exclusive<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("exclusive");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;

    for fp in [fingerprint(1), fingerprint(2)] {
        match existing(&store, &id, &fp, lease).await {
            Record::InFlight(in_flight) => {
                assert_eq!(
                    in_flight.fingerprint,
                    fingerprint(1),
                    "the claimant's fingerprint"
                );
                assert!(
                    in_flight.lease_remaining > Duration::ZERO
                        && in_flight.lease_remaining <= lease,
                    "lease remaining {:?} of {lease:?}",
                    in_flight.lease_remaining
                );
            }
            other => panic!("expected in flight, got {other:?}"),
        }
    }
    assert!(store.renew(&id, &token, lease).await.expect("renew"));
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, h.window())
            .await
            .expect("complete"),
        "the first claimant still owns the record"
    );
}

/// Records of different ids (the same key in two scopes) are independent.
/// PROTOCOL.md §5.1, §5.3, §10.2.
pub async fn store_claims_are_per_record_id<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let a = RecordId::new(b"acct_a", "same-key");
    let b = RecordId::new(b"acct_b", "same-key");
    assert_ne!(a, b);
    let token_a = claimed(&store, &a, &fingerprint(1), lease).await;
    let token_b = claimed(&store, &b, &fingerprint(2), lease).await;
    assert_ne!(token_a, token_b, "tokens are unique per claim");
    // A token fences only its own record.
    assert!(!store.release(&b, &token_a).await.expect("release"));
    assert!(!store.renew(&a, &token_b, lease).await.expect("renew"));
    assert!(store.release(&a, &token_a).await.expect("release"));
    assert_eq!(
        existing_in_flight(&store, &b, lease).await.fingerprint,
        fingerprint(2)
    );
}

/// A completed record comes back exactly: status, every header value in order (repeated, empty
/// and non-UTF-8 values), and the body bytes; whatever fingerprint the later claim carries.
/// PROTOCOL.md §10.1.
pub async fn store_completed_record_is_returned_intact<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("intact");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, h.window())
            .await
            .expect("complete")
    );

    for fp in [fingerprint(1), fingerprint(9)] {
        let Record::Completed(got) = existing(&store, &id, &fp, lease).await else {
            panic!("expected a completed record");
        };
        assert_eq!(got, done);
        let (got, want) = (
            got.response.expect("a stored response"),
            done.response.clone().expect("a response"),
        );
        assert_eq!(
            header_pairs(&got.headers),
            header_pairs(&want.headers),
            "header order"
        );
        assert_eq!(got.body, want.body);
    }
}

/// A tombstone (`Completed` without a response) is kept as such.
/// PROTOCOL.md §5.2, §10.1.
pub async fn store_tombstone_is_kept<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("tombstone");
    let token = claimed(&store, &id, &fingerprint(3), lease).await;
    let tombstone = Completed {
        fingerprint: fingerprint(3),
        response: None,
    };
    assert!(
        store
            .complete(&id, &token, &tombstone, h.window())
            .await
            .expect("complete")
    );
    h.advance(h.lease() + margin(&h)).await;
    assert_eq!(existing_completed(&store, &id, lease).await, tombstone);
}

/// A completed record lives for the TTL given to `complete` (the dedup window), not for the
/// claim's lease; after it, the key is free.
/// PROTOCOL.md §5.2, §10.1.
pub async fn store_completed_record_lives_for_its_ttl_not_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window, m) = (h.lease(), h.window(), margin(&h));
    let id = record_id("ttl");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect("complete")
    );

    h.advance(lease + m).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "past the lease"
    );
    h.advance(window - lease - m - m).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "just inside the window"
    );
    h.advance(m + m).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// An in-flight record without renewal lives for its lease, then the key is free.
/// PROTOCOL.md §5.2, §10.2.
pub async fn store_lease_expires_without_renewal<H: Harness>(h: H) {
    let store = h.store();
    let (lease, m) = (h.lease(), margin(&h));
    let id = record_id("lease");
    claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease - m).await;
    let in_flight = existing_in_flight(&store, &id, lease).await;
    assert!(
        in_flight.lease_remaining <= m + m / 2,
        "lease remaining {:?} after {:?} of a {lease:?} lease",
        in_flight.lease_remaining,
        lease - m
    );
    h.advance(m + m).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// `renew` extends the lease to a full lease from now.
/// PROTOCOL.md §10.1 (renew).
pub async fn store_renew_extends_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let (lease, m) = (h.lease(), margin(&h));
    let id = record_id("renew");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease - m).await;
    assert!(store.renew(&id, &token, lease).await.expect("renew"));
    let in_flight = existing_in_flight(&store, &id, lease).await;
    assert!(
        in_flight.lease_remaining > lease - m,
        "a renewed lease has {:?} left",
        in_flight.lease_remaining
    );
    // Past the first lease's end, the claim holds.
    h.advance(m + m).await;
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(1)
    );
    // Past the renewed lease's end, the key is free.
    h.advance(lease).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// `release` deletes the owner's in-flight record; the key can be claimed again, and the old token
/// no longer works.
/// PROTOCOL.md §5.3, §10.1 (release).
pub async fn store_release_frees_the_key<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("release");
    let first = claimed(&store, &id, &fingerprint(1), lease).await;
    assert!(store.release(&id, &first).await.expect("release"));
    let second = claimed(&store, &id, &fingerprint(2), lease).await;
    assert_ne!(first, second);
    assert!(!store.release(&id, &first).await.expect("release"));
    assert!(!store.renew(&id, &first, lease).await.expect("renew"));
    let done = completed_with_response(fingerprint(1));
    assert!(
        !store
            .complete(&id, &first, &done, h.window())
            .await
            .expect("complete")
    );
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(2)
    );
}

/// An owner whose lease ran out, and whose key was claimed again, can neither complete, renew nor
/// release the new owner's record.
/// PROTOCOL.md §5.3, §10.2.
pub async fn store_fencing_stops_an_owner_whose_lease_was_lost<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("fencing");
    let old = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease + margin(&h)).await;
    let new = claimed(&store, &id, &fingerprint(2), lease).await;
    assert_ne!(old, new);

    let stale = completed_with_response(fingerprint(1));
    assert!(
        !store
            .complete(&id, &old, &stale, window)
            .await
            .expect("complete")
    );
    assert!(!store.release(&id, &old).await.expect("release"));
    assert!(!store.renew(&id, &old, lease).await.expect("renew"));
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(2),
        "the record is still the new owner's claim"
    );

    let done = Completed {
        fingerprint: fingerprint(2),
        response: completed_with_response(fingerprint(2)).response,
    };
    assert!(
        store
            .complete(&id, &new, &done, window)
            .await
            .expect("complete")
    );
    assert_eq!(existing_completed(&store, &id, lease).await, done);
}

/// Once completed, a record is final: the claim's token can no longer complete, renew or release
/// it.
/// PROTOCOL.md §5.2, §5.3.
pub async fn store_completed_record_is_final<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("final");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect("complete")
    );

    let other = Completed {
        fingerprint: fingerprint(1),
        response: None,
    };
    assert!(
        !store
            .complete(&id, &token, &other, window)
            .await
            .expect("complete")
    );
    assert!(!store.renew(&id, &token, lease).await.expect("renew"));
    assert!(!store.release(&id, &token).await.expect("release"));
    assert_eq!(existing_completed(&store, &id, lease).await, done);
}

/// Renew and release on a key without a record do nothing and create nothing; complete writes
/// the record, since the work it records did run.
/// PROTOCOL.md §10.1, §9.5.
pub async fn store_complete_writes_a_missing_record_and_nothing_else_does<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("missing");
    let token = ClaimToken::generate();
    assert!(!store.renew(&id, &token, lease).await.expect("renew"));
    assert!(!store.release(&id, &token).await.expect("release"));
    claimed(&store, &id, &fingerprint(1), lease).await;

    let other = record_id("missing-then-completed");
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&other, &token, &done, window)
            .await
            .expect("complete")
    );
    assert_eq!(existing_completed(&store, &other, lease).await, done);
}

/// An owner whose lease ran out while nobody claimed the key since still completes it: the record
/// vanished, but the work ran, and a retry must get its result rather than run it again.
/// PROTOCOL.md §10.1, §9.6.
pub async fn store_complete_after_the_lease_ran_out_writes_the_record<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("late");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease + margin(&h)).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect("complete")
    );
    assert_eq!(existing_completed(&store, &id, lease).await, done);
    // Kept for the window, like any completion.
    h.advance(lease + margin(&h)).await;
    assert_eq!(existing_completed(&store, &id, lease).await, done);
}

/// Of many concurrent claims of one key, exactly one wins.
/// PROTOCOL.md §10.2.
pub async fn store_concurrent_claims_have_one_winner<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("race");
    let tasks: Vec<_> = (0..100u8)
        .map(|n| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&id, &fingerprint(n), lease).await })
        })
        .collect();
    let mut winners = Vec::new();
    let mut in_flight = 0;
    for task in tasks {
        match task.await.expect("the task").expect("claim") {
            Claim::Claimed(token) => winners.push(token),
            Claim::Existing(Record::InFlight(_)) => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim wins");
    assert_eq!(in_flight, 99);
    assert!(store.release(&id, &winners[0]).await.expect("release"));
}

// ---------------------------------------------------------------------------------------------
// Cases through the layer
// ---------------------------------------------------------------------------------------------

/// Asserts that `replay` repeats `first` byte for byte, marked as a replay.
#[track_caller]
fn assert_replay_of(replay: &Reply, first: &Reply) {
    assert_eq!(first.outcome, Some(Outcome::Executed), "{first:?}");
    assert!(
        !first.is_replay(),
        "the first response is not marked: {first:?}"
    );
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert_eq!(
        replay.headers.get_all(IDEMPOTENT_REPLAYED).iter().count(),
        1
    );
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.status, first.status);
    assert_eq!(
        replay.header_list(),
        first.header_list(),
        "every header value, in order"
    );
    assert_eq!(replay.body, first.body);
}

/// Through an `axum::Router`: the replay repeats the status, every header value in order and the
/// body, adds `Idempotent-Replayed: true`, and the handler runs once.
/// PROTOCOL.md §6.4.
pub async fn replay_is_byte_identical_through_a_router<H: Harness>(h: H) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new()
        .route(
            "/v1/charges",
            axum::routing::post(move |body: Bytes| {
                let counter = counter.clone();
                async move {
                    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut out =
                        format!("{{\"charge\":{n},\"bytes\":{}}}", body.len()).into_bytes();
                    out.extend_from_slice(b"\x00\xff");
                    (
                        StatusCode::CREATED,
                        [(CONTENT_TYPE, "application/json")],
                        AppendHeaders([("x-multi", "first"), ("x-multi", "second")]),
                        AppendHeaders([
                            (LOCATION, "/v1/charges/1"),
                            (HeaderName::from_static("x-multi"), "third"),
                        ]),
                        out,
                    )
                }
            }),
        )
        .layer(layer(&h, h.store()));
    let charge = || {
        keyed(
            Method::POST,
            "/v1/charges",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
        )
        .body(Body::from("amount=100&currency=eur"))
        .expect("a request")
    };

    let first = send(&app, charge()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.all("x-multi"), [&b"first"[..], b"second", b"third"]);
    let replay = send(&app, charge()).await;
    assert_replay_of(&replay, &first);
    assert_eq!(replay.all("x-multi"), [&b"first"[..], b"second", b"third"]);
    let again = send(&app, charge()).await;
    assert_replay_of(&again, &first);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// Through `tower::ServiceBuilder`, with repeated, empty and non-UTF-8 header values and a binary
/// body.
/// PROTOCOL.md §6.4, §10.1.
pub async fn replay_is_byte_identical_through_service_builder<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        let mut body = format!("run {} of ", call.n).into_bytes();
        body.extend_from_slice(&call.body);
        body.extend(pattern(300));
        Response::builder()
            .status(StatusCode::ACCEPTED)
            .header("x-multi", "a")
            .header(CONTENT_TYPE, "application/octet-stream")
            .header("x-multi", "b")
            .header("x-empty", "")
            .header(
                "x-bytes",
                HeaderValue::from_bytes(b"\xff\xfe").expect("obs-text"),
            )
            .header("x-multi", "c")
            .body(Body::from(body))
            .expect("a response")
    });
    let svc = service(layer(&h, h.store()), handler.clone());

    let first = send(&svc, post("k-1", "payload")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert!(first.body.starts_with(b"run 1 of payload"));
    let replay = send(&svc, post("k-1", "payload")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(replay.all("x-multi"), [&b"a"[..], b"b", b"c"]);
    assert_eq!(replay.all("x-empty"), [&b""[..]]);
    assert_eq!(replay.all("x-bytes"), [&b"\xff\xfe"[..]]);
    assert_eq!(handler.calls(), 1);
}

/// While the first request is held in flight (a tower-test mock), the same request gets 409 with
/// `Retry-After: 1` and a different one 422, and the inner service sees one request; once the
/// first finishes, a retry gets its replay.
/// PROTOCOL.md §6.2, §6.3, §4.3.
pub async fn in_flight_request_gets_409_then_the_replay<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let (mock, mut handle) = mock::pair::<Request<RequestBody<Body>>, Response<Body>>();
    let svc = service(layer(&h, store.clone()), mock);

    let first = spawn_send(&svc, post("k", "pay 10"));
    let (request, respond) = handle
        .next_request()
        .await
        .expect("the first request reaches the inner service");
    assert_eq!(
        request
            .extensions()
            .get::<IdempotencyKey>()
            .map(IdempotencyKey::as_str),
        Some("k")
    );
    let body = request
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(body, "pay 10");

    for _ in 0..3 {
        let conflict = send(&svc, post("k", "pay 10")).await;
        assert_eq!(
            conflict.assert_in_flight(),
            1,
            "Retry-After is 1 by default"
        );
    }
    let mismatch = send(&svc, post("k", "pay 20")).await;
    mismatch.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        handle.poll_request().is_pending(),
        "only the first request reached the inner service"
    );

    respond.send_response(
        Response::builder()
            .status(201)
            .header("x-charge", "ch_1")
            .body(Body::from("charged"))
            .expect("a response"),
    );
    let first = first.await.expect("the first request's task");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "charged");
    let replay = send(&svc, post("k", "pay 10")).await;
    assert_replay_of(&replay, &first);
    assert!(
        handle.poll_request().is_pending(),
        "the replay did not reach the inner service"
    );
    let calls = store.calls();
    assert_eq!((calls.complete, calls.release), (1, 0), "{calls:?}");
}

/// A configured `Retry-After` longer than the lease is cut to the lease's end.
/// PROTOCOL.md §6.3.
pub async fn retry_after_never_goes_beyond_the_lease<H: Harness>(h: H) {
    let (mock, mut handle) = mock::pair::<Request<RequestBody<Body>>, Response<Body>>();
    let layer = layer(&h, h.store()).retry_after(h.lease() * 100);
    let svc = service(layer, mock);

    let first = spawn_send(&svc, post("k", "x"));
    let (_request, respond) = handle.next_request().await.expect("the first request");
    let seconds = send(&svc, post("k", "x")).await.assert_in_flight();
    assert!(
        (1..=whole_seconds(h.lease())).contains(&seconds),
        "Retry-After {seconds} s with a {:?} lease",
        h.lease()
    );
    respond.send_response(created("done"));
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
}

/// The same key with a different body, path, query or method gets 422 and the handler does not
/// run; the original record is undisturbed. Both POST-then-PATCH and PATCH-then-POST.
/// PROTOCOL.md §4.1, §4.3.
pub async fn different_request_with_the_same_key_gets_422<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        created(format!(
            "{} {} #{}",
            call.parts.method, call.parts.uri, call.n
        ))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());
    let request = |method: Method, uri: &str, key: &str, body: &'static str| {
        keyed(method, uri, key)
            .body(Body::from(body))
            .expect("a request")
    };

    let first = send(&svc, request(Method::POST, "/orders?page=1", "k", "a")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for (method, uri, body) in [
        (Method::POST, "/orders?page=1", "b"),
        (Method::POST, "/orders?page=1", "a "),
        (Method::POST, "/orders?page=1", ""),
        (Method::POST, "/other?page=1", "a"),
        (Method::POST, "/orders?page=2", "a"),
        (Method::POST, "/orders", "a"),
        (Method::PATCH, "/orders?page=1", "a"),
    ] {
        let reply = send(&svc, request(method.clone(), uri, "k", body)).await;
        reply.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            reply.outcome,
            Some(Outcome::Mismatch),
            "{method} {uri} {body:?}"
        );
    }
    assert_eq!(handler.calls(), 1, "no mismatch reached the handler");
    let replay = send(&svc, request(Method::POST, "/orders?page=1", "k", "a")).await;
    assert_replay_of(&replay, &first);

    let first = send(&svc, request(Method::PATCH, "/orders/1", "k2", "a")).await;
    assert_eq!(first.body, "PATCH /orders/1 #2");
    let reply = send(&svc, request(Method::POST, "/orders/1", "k2", "a")).await;
    reply.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(handler.calls(), 2);
    let calls = store.calls();
    assert_eq!((calls.complete, calls.release), (2, 0), "{calls:?}");
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
        if let Some(cc) = call.header("x-cache-control") {
            response.headers_mut().insert(
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

pub fn status_request(key: &str, status: u16, cache_control: Option<&str>) -> Request<Body> {
    let builder = keyed(Method::POST, "/", key).header("x-status", status.to_string());
    let builder = match cache_control {
        Some(cc) => builder.header("x-cache-control", cc),
        None => builder,
    };
    builder.body(Body::from("x")).expect("a request")
}

/// 5xx, 408, 409, 425 and 429 responses, and any with `Cache-Control: no-store`, are not stored:
/// the claim is released and a retry runs the handler again.
/// PROTOCOL.md §8.1, §8.2.
pub async fn responses_that_are_not_stored_run_again<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = status_handler();
    let svc = service(layer(&h, store.clone()), handler.clone());
    let cases = [
        (500, None),
        (502, None),
        (503, None),
        (408, None),
        (409, None),
        (425, None),
        (429, None),
        (200, Some("no-store")),
        (201, Some("private, no-store")),
        (200, Some("No-Store")),
        (404, Some("max-age=0, no-store")),
    ];
    for (i, (status, cache_control)) in cases.into_iter().enumerate() {
        let key = format!("not-stored-{i}");
        let before = handler.calls();
        for attempt in 1..=2 {
            let reply = send(&svc, status_request(&key, status, cache_control)).await;
            assert_eq!(reply.status.as_u16(), status, "{status} {cache_control:?}");
            assert_eq!(
                reply.outcome,
                Some(Outcome::NotStored),
                "{status} {cache_control:?}"
            );
            assert!(!reply.is_replay());
            assert_eq!(
                reply.text(),
                format!("status {status} call {}", before + attempt)
            );
        }
        assert_eq!(
            handler.calls(),
            before + 2,
            "{status} {cache_control:?}: the retry ran the handler again"
        );
    }
    let calls = store.calls();
    assert_eq!(calls.complete, 0, "{calls:?}");
    assert_eq!(calls.release, 2 * cases.len(), "{calls:?}");
}

/// 2xx, 3xx and 4xx responses (402 included) are stored and replayed.
/// PROTOCOL.md §8.1.
pub async fn responses_that_are_stored_replay<H: Harness>(h: H) {
    let handler = status_handler();
    let svc = service(layer(&h, h.store()), handler.clone());
    let cases = [
        (200, Some("private, max-age=60")),
        (201, None),
        (204, None),
        (302, None),
        (400, None),
        (402, None),
        (404, None),
        (410, None),
        (422, None),
    ];
    for (i, (status, cache_control)) in cases.into_iter().enumerate() {
        let key = format!("stored-{i}");
        let first = send(&svc, status_request(&key, status, cache_control)).await;
        assert_eq!(first.status.as_u16(), status);
        let replay = send(&svc, status_request(&key, status, cache_control)).await;
        assert_replay_of(&replay, &first);
        assert_eq!(handler.calls(), i + 1, "{status}: the handler ran once");
        if status == 302 {
            assert_eq!(replay.header(LOCATION), Some("/elsewhere"));
        }
    }
}

/// `Set-Cookie`, hop-by-hop headers and `Date` reach the first client but are not replayed;
/// repeated headers are. With `keep_set_cookie(true)`, `Set-Cookie` is replayed too.
/// PROTOCOL.md §8.3.
pub async fn replay_drops_cookies_hop_by_hop_headers_and_date<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        let mut response = created(format!("call {}", call.n));
        let headers = response.headers_mut();
        for (name, value) in [
            ("set-cookie", "session=abc; HttpOnly"),
            ("x-multi", "1"),
            ("connection", "keep-alive, x-conn"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x-checksum"),
            ("upgrade", "h2c"),
            ("proxy-authenticate", "Basic"),
            ("proxy-connection", "keep-alive"),
            ("date", "Wed, 02 Dec 2026 10:00:00 GMT"),
            ("set-cookie", "theme=dark"),
            ("x-multi", "2"),
            ("content-type", "text/plain"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        response
    });
    let dropped = [
        "set-cookie",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-connection",
        "date",
    ];
    let store = h.store();

    let svc = service(layer(&h, store.clone()), handler.clone());
    let first = send(&svc, post("default", "x")).await;
    for name in dropped {
        assert!(
            first.headers.contains_key(name),
            "the first client gets {name}"
        );
    }
    let replay = send(&svc, post("default", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    for name in dropped {
        assert!(
            !replay.headers.contains_key(name),
            "{name} is not replayed: {replay:?}"
        );
    }
    assert_eq!(replay.all("x-multi"), [&b"1"[..], b"2"]);
    assert_eq!(replay.header(CONTENT_TYPE), Some("text/plain"));
    assert_eq!(handler.calls(), 1);

    let svc = service(layer(&h, store).keep_set_cookie(true), handler.clone());
    let first = send(&svc, post("cookies", "x")).await;
    let replay = send(&svc, post("cookies", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(
        replay.all("set-cookie"),
        [&b"session=abc; HttpOnly"[..], b"theme=dark"],
        "kept cookies are replayed in order"
    );
    for name in dropped.iter().filter(|name| **name != "set-cookie") {
        assert!(
            !replay.headers.contains_key(*name),
            "{name} is not replayed"
        );
    }
    assert_eq!(handler.calls(), 2);
}

/// A response over the response limit (with a known length, or streamed) reaches the first client
/// in full and leaves a tombstone: the retry gets a `not-replayable` 409 and the handler does not
/// run again. A response of exactly the limit is stored.
/// PROTOCOL.md §8.4, §6.3, §7.2.
pub async fn oversized_response_is_delivered_and_leaves_a_tombstone<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    // `x-size` bytes, in `x-chunks` chunks (streamed, no length) or at once.
    let handler = Handler::ok(|call| {
        let size: usize = call
            .header("x-size")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = match call
            .header("x-chunks")
            .and_then(|s| s.parse::<usize>().ok())
        {
            Some(chunks) => streamed(chunks, size / chunks),
            None => Body::from(pattern(size)),
        };
        Response::builder()
            .status(200)
            .header("x-call", call.n.to_string())
            .body(body)
            .expect("a response")
    });
    let svc = service(
        layer(&h, store.clone()).response_body_limit(16),
        handler.clone(),
    );
    let request = |key: &str, size: usize, chunks: Option<usize>| {
        let builder = keyed(Method::POST, "/", key).header("x-size", size.to_string());
        let builder = match chunks {
            Some(chunks) => builder.header("x-chunks", chunks.to_string()),
            None => builder,
        };
        builder.body(Body::empty()).expect("a request")
    };

    for (key, size, chunks) in [("full", 1024, None), ("streamed", 64, Some(8))] {
        let before = handler.calls();
        let first = send(&svc, request(key, size, chunks)).await;
        assert_eq!(first.status, StatusCode::OK, "{key}");
        assert_eq!(first.outcome, Some(Outcome::Executed), "{key}");
        assert_eq!(
            first.body,
            pattern(size),
            "{key}: the first client gets the whole body"
        );
        for _ in 0..2 {
            let retry = send(&svc, request(key, size, chunks)).await;
            retry.assert_problem(ProblemKind::NotReplayable, StatusCode::CONFLICT);
            assert!(
                ProblemKind::NotReplayable
                    .type_uri()
                    .ends_with("#not-replayable"),
                "the documented type URI"
            );
            assert_eq!(retry.outcome, Some(Outcome::NotReplayable));
            assert_eq!(retry.header(RETRY_AFTER), None, "retrying will not help");
        }
        assert_eq!(handler.calls(), before + 1, "{key}: the handler ran once");
    }

    for (key, chunks) in [("exact", None), ("exact-streamed", Some(2))] {
        let first = send(&svc, request(key, 16, chunks)).await;
        let replay = send(&svc, request(key, 16, chunks)).await;
        assert_replay_of(&replay, &first);
        assert_eq!(replay.body, pattern(16));
    }
    assert_eq!(handler.calls(), 4);
    let calls = store.calls();
    assert_eq!((calls.complete, calls.release), (4, 0), "{calls:?}");
}

/// A panicking handler gives a 500 problem and releases the claim: the retry runs it again and
/// can succeed, and is replayed after that.
/// PROTOCOL.md §9.4.
pub async fn panicking_handler_gets_500_and_a_retry_runs_again<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        if call.n == 1 {
            panic!("the handler panics on its first call (expected by the test)");
        }
        created(format!("call {}", call.n))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());

    let failed = send(&svc, post("k", "x")).await;
    failed.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    assert_eq!(failed.outcome, Some(Outcome::HandlerFailed));
    assert_eq!(store.calls().release, 1);
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        (retry.status, retry.text()),
        (StatusCode::CREATED, "call 2".into())
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &retry);
    assert_eq!(handler.calls(), 2);
}

/// An inner service that returns `Err` gives a 500 problem and releases the claim.
/// PROTOCOL.md §9.4, §7.1.
pub async fn failing_handler_gets_500_and_releases_the_claim<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::new(|call| async move {
        if call.n == 1 {
            return Err(BoxError::from("the backend is down"));
        }
        Ok(created(format!("call {}", call.n)))
    });
    let svc = service(layer(&h, store.clone()), handler.clone());

    let failed = send(&svc, post("k", "x")).await;
    failed.assert_problem(
        ProblemKind::HandlerFailed,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
    assert!(
        !failed.text().contains("backend is down"),
        "the handler's error is logged, not sent: {}",
        failed.text()
    );
    let calls = store.calls();
    assert_eq!((calls.complete, calls.release), (0, 1), "{calls:?}");
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(
        (retry.status, retry.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &retry);
    assert_eq!(handler.calls(), 2);
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

/// Dropping the response future mid-handler (the client went away) does not cancel the handler:
/// it runs to completion, its response is stored, and the retry gets it. The shutdown handle's
/// `wait` returns only after the detached handler finished.
/// PROTOCOL.md §9.3, §9.8.
pub async fn dropped_request_runs_to_completion_and_shutdown_waits_for_it<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "late");
    let layer = layer(&h, h.store());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    let client = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    client.abort();
    assert!(client.await.expect_err("aborted").is_cancelled());
    assert_eq!(shutdown.running(), 1, "the handler runs on, detached");
    send(&svc, post("k", "x")).await.assert_in_flight();

    let mut wait = Box::pin(shutdown.clone().wait());
    assert!(
        (&mut wait).now_or_never().is_none(),
        "shutdown waits while the handler runs"
    );
    gate.notify_one();
    wait.await;
    assert_eq!(shutdown.running(), 0);
    assert_eq!(handler.calls(), 1);

    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{retry:?}");
    assert_eq!(
        (retry.status, retry.text()),
        (StatusCode::CREATED, "late 1".into())
    );
    assert_eq!(handler.calls(), 1, "the handler ran once");
}

/// A handler that runs for three leases keeps its claim (the layer renews it): retries meanwhile
/// get 409, never a second execution.
/// PROTOCOL.md §9.2.
pub async fn slow_handler_keeps_its_claim_past_the_lease<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "slow");
    let svc = service(layer(&h, store.clone()), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    for _ in 0..12 {
        h.advance(h.lease() / 4).await;
        send(&svc, post("k", "x")).await.assert_in_flight();
    }
    assert_eq!(
        handler.calls(),
        1,
        "no second execution while the first runs"
    );
    let renewals = store.calls().renew;
    assert!(renewals >= 3, "the lease was renewed ({renewals} times)");

    gate.notify_one();
    let first = first.await.expect("task");
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::CREATED, "slow 1".into())
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(handler.calls(), 1);
}

/// After the dedup window, the key is new: the handler runs again.
/// PROTOCOL.md §8.6.
pub async fn key_is_new_again_after_the_dedup_window<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, h.store()), handler.clone());
    let m = margin(&h);

    let first = send(&svc, post("k", "x")).await;
    h.advance(h.window() - m).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    h.advance(m + m).await;
    let again = send(&svc, post("k", "x")).await;
    assert_eq!(
        (again.outcome, again.text()),
        (Some(Outcome::Executed), "call 2".into())
    );
    // A new record: a different request with the key is fine now.
    assert_eq!(handler.calls(), 2);
}

/// The same key in two scopes runs twice, and each scope replays its own response; a scope
/// function's rejection is the client's answer, with no claim.
/// PROTOCOL.md §3.1, §3.2, §7.4.
pub async fn scopes_never_see_each_others_records<H: Harness>(h: H) {
    let store = Counting::new(h.store());
    let handler = Handler::ok(|call| {
        created(format!(
            "{} call {}",
            call.header("x-account").unwrap_or("-"),
            call.n
        ))
    });
    let layer = layer(&h, store.clone()).scope(|parts| match parts.headers.get("x-account") {
        Some(account) => Ok(Scope::from(account.as_bytes())),
        None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
    });
    let svc = service(layer, handler.clone());
    let request = |account: Option<&str>, body: &'static str| {
        let builder = keyed(Method::POST, "/", "shared-key");
        let builder = match account {
            Some(account) => builder.header("x-account", account),
            None => builder,
        };
        builder.body(Body::from(body)).expect("a request")
    };

    let a = send(&svc, request(Some("acct_a"), "x")).await;
    let b = send(&svc, request(Some("acct_b"), "x")).await;
    assert_eq!(
        (a.outcome, a.text()),
        (Some(Outcome::Executed), "acct_a call 1".into())
    );
    assert_eq!(
        (b.outcome, b.text()),
        (Some(Outcome::Executed), "acct_b call 2".into())
    );
    assert_replay_of(&send(&svc, request(Some("acct_a"), "x")).await, &a);
    assert_replay_of(&send(&svc, request(Some("acct_b"), "x")).await, &b);
    // A different request in a third scope is no mismatch there.
    let c = send(&svc, request(Some("acct_c"), "other")).await;
    assert_eq!(c.outcome, Some(Outcome::Executed));
    assert_eq!(handler.calls(), 3);

    let claims = store.calls().claim;
    let rejected = send(&svc, request(None, "x")).await;
    assert_eq!(rejected.status, StatusCode::UNAUTHORIZED);
    assert_eq!(rejected.outcome, Some(Outcome::Rejected));
    assert_eq!(
        rejected.header(CONTENT_TYPE),
        Some("application/problem+json")
    );
    assert_eq!(
        store.calls().claim,
        claims,
        "a rejected request claims nothing"
    );
    assert_eq!(handler.calls(), 3);
}

/// 500 concurrent requests with one key: the handler runs exactly once; every other request gets
/// the in-flight 409 or the replay.
/// PROTOCOL.md §6.2, §10.2.
pub async fn concurrent_requests_with_one_key_run_once<H: Harness>(h: H) {
    let handler = Handler::new(|call| async move {
        tokio::task::yield_now().await;
        Ok(created(format!("call {}", call.n)))
    });
    let svc = service(layer(&h, h.store()), handler.clone());
    let tasks: Vec<_> = (0..500)
        .map(|_| spawn_send(&svc, post("one", "x")))
        .collect();
    let (mut executed, mut in_flight, mut replayed) = (0, 0, 0);
    for task in tasks {
        let reply = task.await.expect("task");
        match reply.outcome {
            Some(Outcome::Executed) => {
                executed += 1;
                assert_eq!(reply.text(), "call 1");
            }
            Some(Outcome::InFlight) => {
                reply.assert_in_flight();
                in_flight += 1;
            }
            Some(Outcome::Replayed) => {
                assert_eq!(
                    (reply.status, reply.text()),
                    (StatusCode::CREATED, "call 1".into())
                );
                replayed += 1;
            }
            other => panic!("unexpected outcome {other:?}: {reply:?}"),
        }
    }
    assert_eq!(executed, 1, "{in_flight} in flight, {replayed} replayed");
    assert_eq!(in_flight + replayed, 499);
    assert_eq!(handler.calls(), 1);
}

/// 500 concurrent requests with distinct keys all run, and none gets a 409.
/// PROTOCOL.md §6.2.
pub async fn concurrent_requests_with_distinct_keys_all_run<H: Harness>(h: H) {
    let handler = Handler::new(|call| async move {
        tokio::task::yield_now().await;
        Ok(created(call.body))
    });
    let svc = service(layer(&h, h.store()), handler.clone());
    let tasks: Vec<_> = (0..500)
        .map(|i| spawn_send(&svc, post(&format!("key-{i}"), format!("body {i}"))))
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let reply = task.await.expect("task");
        assert_eq!(reply.outcome, Some(Outcome::Executed), "{reply:?}");
        assert_eq!(reply.text(), format!("body {i}"));
    }
    assert_eq!(handler.calls(), 500);
}

/// With the store failing at claim time, the default (fail closed) answers 503 with `Retry-After`
/// and never runs the handler; once the store is back, the key works.
/// PROTOCOL.md §6.2, §6.3.
pub async fn store_failure_at_claim_fails_closed_with_503<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, store.clone()), handler.clone());

    store.fail(true);
    for _ in 0..2 {
        let reply = send(&svc, post("k", "x")).await;
        reply.assert_problem(
            ProblemKind::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
        );
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable));
        assert_eq!(reply.header(RETRY_AFTER), Some("1"));
    }
    assert_eq!(handler.calls(), 0, "fail closed never runs the handler");

    store.fail(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(handler.calls(), 1);
}

/// With `fail_open(true)`, a store failure at claim time runs the handler unprotected (outcome
/// `FailedOpen`, the key still in the extensions), every time.
/// PROTOCOL.md §9.7.
pub async fn store_failure_at_claim_fails_open_when_configured<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| {
        let key = call
            .key()
            .map(|k| k.as_str().to_owned())
            .unwrap_or_default();
        created(format!("{key} call {}", call.n))
    });
    let svc = service(layer(&h, store.clone()).fail_open(true), handler.clone());

    store.fail(true);
    for n in 1..=2 {
        let reply = send(&svc, post("k", "x")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(reply.outcome, Some(Outcome::FailedOpen));
        assert_eq!(reply.text(), format!("k call {n}"));
        assert!(!reply.is_replay());
    }
    assert_eq!(handler.calls(), 2);

    store.fail(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(handler.calls(), 3);
}

/// The store bounds its own calls; the layer adds no timeout of its own. A slow claim that the
/// store answers is honoured (one bound per call, not two), and a claim the store gives up on
/// (`StoreError::Timeout`) is a store failure: 503 with `Retry-After`, and the handler does not
/// run. PROTOCOL.md §10.4, §6.2.
pub async fn the_store_alone_bounds_a_claim<H: Harness>(h: H) {
    let store = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, store.clone()), handler.clone());

    // Slower than any timeout the layer used to add (1 s), but answered.
    store.delay(Some(Duration::from_millis(1500)));
    let slow = send(&svc, post("slow", "x")).await;
    assert_eq!(slow.outcome, Some(Outcome::Executed), "{}", slow.text());
    store.delay(None);

    store.time_out(true);
    let reply = send(&svc, post("k", "x")).await;
    reply.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert!(reply.header(RETRY_AFTER).is_some());
    assert_eq!(
        handler.calls(),
        1,
        "the timed-out claim did not run the handler"
    );

    store.time_out(false);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(handler.calls(), 2);
}

/// The layer prepares each claimed request with its store before the handler runs. When a
/// completion that commits with the work does not commit, the handler's response is not
/// delivered: the client gets 503 with `Retry-After`, the write is not retried, and the retry runs
/// the request again, cleanly. PROTOCOL.md §9.9.
pub async fn an_aborted_completion_is_not_reported_as_done<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| {
        let prepared = call.parts.extensions.get::<Prepared>().copied();
        assert!(prepared.is_some(), "prepare ran before the handler");
        created(format!("call {}", call.n))
    });
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.abort_completions(true);
    let aborted = send(&svc, post("k", "x")).await;
    aborted.assert_problem(
        ProblemKind::StoreUnavailable,
        StatusCode::SERVICE_UNAVAILABLE,
    );
    assert!(aborted.header(RETRY_AFTER).is_some());
    assert_ne!(
        aborted.text(),
        "call 1",
        "the rolled-back response is not delivered"
    );
    faulty.abort_completions(false);
    shutdown.clone().wait().await;
    assert_eq!(
        store.calls().complete,
        1,
        "an aborted completion is not retried"
    );

    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(retry.text(), "call 2");
    assert_replay_of(&send(&svc, post("k", "x")).await, &retry);
    assert_eq!(handler.calls(), 2);
}

/// When storing the result fails, the client still gets the handler's response at once, and the
/// write is retried: once the store is back, the result is stored and replayed.
/// PROTOCOL.md §9.5.
pub async fn failed_store_write_still_answers_and_is_retried<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(first.text(), "call 1");
    faulty.fail_writes(false);
    shutdown.wait().await;
    let completes = store.calls().complete;
    assert!(
        completes >= 2,
        "the write was retried ({completes} attempts)"
    );

    let replay = send(&svc, post("k", "x")).await;
    assert_replay_of(&replay, &first);
    assert_eq!(handler.calls(), 1);
}

/// When storing the result keeps failing for longer than the lease, the write is still retried:
/// once the store answers again, the result is written (the claim ran out, but nobody claimed the
/// key since), and a retry gets the replay. The handler runs once.
/// PROTOCOL.md §9.5, §9.6.
pub async fn store_write_failing_past_the_lease_lands_when_the_store_returns<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let store = Counting::new(faulty.clone());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, store.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    let first = send(&svc, post("k", "x")).await;
    assert_eq!(
        (first.status, first.text()),
        (StatusCode::CREATED, "call 1".into())
    );
    h.advance(h.lease() + margin(&h)).await;
    assert_eq!(shutdown.running(), 1, "the write is still being retried");
    let attempts = store.calls().complete;
    assert!(attempts >= 3, "{attempts} attempts so far");

    faulty.fail_writes(false);
    shutdown.wait().await;
    assert_replay_of(&send(&svc, post("k", "x")).await, &first);
    assert_eq!(handler.calls(), 1);
}

/// A write retried while the store failed gives up once another claim holds the key: the claim
/// is provably lost, and the new owner's result stands.
/// PROTOCOL.md §9.5, §9.6.
pub async fn retried_write_gives_up_once_another_claim_holds_the_key<H: Harness>(h: H) {
    let faulty = Faulty::new(h.store());
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let layer = layer(&h, faulty.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, handler.clone());

    faulty.fail_writes(true);
    assert_eq!(send(&svc, post("k", "x")).await.text(), "call 1");
    // Past the lease, with the first write still failing, a retry claims the key and runs.
    h.advance(h.lease() + margin(&h)).await;
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let second_handler = gated_handler(started.clone(), gate.clone(), "second run");
    let second_svc = service(self::layer(&h, faulty.clone()), second_handler);
    let second = spawn_send(&second_svc, post("k", "x"));
    started.notified().await;
    // The first owner's write comes back while the second claim is in flight: refused, given up.
    faulty.fail_writes(false);
    shutdown.wait().await;
    gate.notify_one();
    let second = second.await.expect("the second request");
    assert_eq!(second.text(), "second run 1");
    assert_replay_of(&send(&svc, post("k", "x")).await, &second);
    assert_eq!(handler.calls(), 1);
}
