//! `IdempotencyLayer`: the builder and its configuration.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, StatusCode};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::problem::ProblemKind;
use crate::scope::{Rejection, Scope};
use crate::service::Idempotency;

type ScopeFn = Arc<dyn Fn(&Parts) -> Result<Scope, Rejection> + Send + Sync>;
type PolicyFn = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

/// A [`Layer`] that makes POST and PATCH requests with an `Idempotency-Key` safe to retry.
///
/// The first request with a key runs the inner service and its response is stored; a retry with
/// the same key and the same request gets that response back, byte for byte, with
/// `Idempotent-Replayed: true`, and the inner service does not run again. See the
/// [crate documentation](crate) for the protocol, and each method below for its default.
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<St> {
    store: St,
    config: Config,
    tracker: TaskTracker,
}

/// The layer's settings; see each builder method of [`IdempotencyLayer`] for its default.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) key_required: bool,
    pub(crate) dedup_window: Duration,
    pub(crate) lease: Duration,
    pub(crate) request_body_limit: usize,
    pub(crate) response_body_limit: usize,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) scope: Option<ScopeFn>,
    pub(crate) store_policy: PolicyFn,
    pub(crate) keep_set_cookie: bool,
    pub(crate) store_timeout: Duration,
    pub(crate) fail_open: bool,
    pub(crate) retry_after: Duration,
    pub(crate) statuses: [StatusCode; ProblemKind::ALL.len()],
}

impl Config {
    pub(crate) fn status(&self, kind: ProblemKind) -> StatusCode {
        self.statuses[kind.index()]
    }
}

/// The default store policy: every 2xx, 3xx and 4xx response is stored except 408, 409, 425 and
/// 429 (which a retry may well change); 1xx and 5xx are not.
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::default_store_policy;
///
/// let none = HeaderMap::new();
/// assert!(default_store_policy(StatusCode::CREATED, &none));
/// assert!(default_store_policy(StatusCode::PAYMENT_REQUIRED, &none));
/// assert!(!default_store_policy(StatusCode::TOO_MANY_REQUESTS, &none));
/// assert!(!default_store_policy(StatusCode::SERVICE_UNAVAILABLE, &none));
/// ```
pub fn default_store_policy(status: StatusCode, _headers: &HeaderMap) -> bool {
    (200..500).contains(&status.as_u16()) && !matches!(status.as_u16(), 408 | 409 | 425 | 429)
}

impl<St> IdempotencyLayer<St> {
    /// A layer over `store` with the default settings.
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: Config {
                header: HeaderName::from_static("idempotency-key"),
                methods: vec![Method::POST, Method::PATCH],
                key_required: true,
                dedup_window: Duration::from_secs(24 * 60 * 60),
                lease: Duration::from_secs(30),
                request_body_limit: 1024 * 1024,
                response_body_limit: 1024 * 1024,
                fingerprint_headers: Vec::new(),
                scope: None,
                store_policy: Arc::new(default_store_policy),
                keep_set_cookie: false,
                store_timeout: Duration::from_secs(1),
                fail_open: false,
                retry_after: Duration::from_secs(1),
                statuses: ProblemKind::ALL.map(ProblemKind::default_status),
            },
            tracker: TaskTracker::new(),
        }
    }

    /// The request header that carries the key. Default: `Idempotency-Key`.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// The methods the layer protects; every other request passes through untouched (no buffering,
    /// no store call). Default: `POST` and `PATCH`.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether a protected request without a key is refused with 400 (`true`) or passed through
    /// without protection (`false`). Default: `true`.
    pub fn key_required(mut self, required: bool) -> Self {
        self.config.key_required = required;
        self
    }

    /// How long a completed record is kept, and so how long a retry is recognised. After it the
    /// key is new again. Default: 24 hours.
    pub fn dedup_window(mut self, window: Duration) -> Self {
        self.config.dedup_window = window;
        self
    }

    /// How long a claim lives without renewal. The layer renews it every third of the lease while
    /// the handler runs, so a slow handler keeps its claim and a crashed instance frees its keys
    /// within one lease. Default: 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease.max(Duration::from_millis(3));
        self
    }

    /// The largest request body the layer buffers and fingerprints; a larger one gets 413 and
    /// nothing is claimed. Default: 1 MiB.
    pub fn request_body_limit(mut self, bytes: usize) -> Self {
        self.config.request_body_limit = bytes;
        self
    }

    /// The largest response body the layer stores. A larger response is delivered to the client
    /// in full and leaves a tombstone: a retry gets a `not-replayable` problem, and the handler
    /// never runs twice. Default: 1 MiB.
    pub fn response_body_limit(mut self, bytes: usize) -> Self {
        self.config.response_body_limit = bytes;
        self
    }

    /// Request headers whose values are part of the fingerprint, besides the method, path, query
    /// and body (`Content-Type` is a common choice). Default: none.
    pub fn fingerprint_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.fingerprint_headers = names.into_iter().collect();
        self
    }

    /// The scope of each request's key, from its parts (usually the authenticated account that an
    /// outer layer put in the extensions). Keys of different scopes never see each other's
    /// records. The function may refuse a request with a [`Rejection`] (a 401 when there is no
    /// principal): nothing is claimed, and the client gets the rejection.
    ///
    /// Default: none, and every key shares one namespace. **That is only right for a
    /// single-tenant service**: with many tenants, one could replay another's response by
    /// sending its key.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Rejection, Scope};
    ///
    /// #[derive(Clone)]
    /// struct Account(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope(|parts| {
    ///     match parts.extensions.get::<Account>() {
    ///         Some(account) => Ok(Scope::from(account.0.as_str())),
    ///         None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
    ///     }
    /// });
    /// # let _ = layer;
    /// ```
    pub fn scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> Result<Scope, Rejection> + Send + Sync + 'static,
    {
        self.config.scope = Some(Arc::new(scope));
        self
    }

    /// Which responses are stored for replay, from the status and headers. A response that is not
    /// stored releases the claim, so a retry runs the handler again. A response with
    /// `Cache-Control: no-store` is never stored, whatever the policy says.
    /// Default: [`default_store_policy`] (2xx, 3xx and 4xx except 408, 409, 425 and 429).
    pub fn store_policy<F>(mut self, policy: F) -> Self
    where
        F: Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    {
        self.config.store_policy = Arc::new(policy);
        self
    }

    /// Whether `Set-Cookie` headers are stored and replayed. Default: `false` (a replay to another
    /// client must not hand out the first client's session).
    pub fn keep_set_cookie(mut self, keep: bool) -> Self {
        self.config.keep_set_cookie = keep;
        self
    }

    /// The longest the layer waits for one store call. A claim that takes longer is treated as a
    /// store failure (503, or fail-open). Default: 1 second.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config.store_timeout = timeout;
        self
    }

    /// What to do when the store fails at claim time: `false` refuses the request with 503 and
    /// `Retry-After` (fail closed: no request ever runs unprotected); `true` runs the handler
    /// without protection and logs a warning (fail open: availability over exactly-once).
    /// Default: `false`.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.fail_open = fail_open;
        self
    }

    /// The `Retry-After` of a 409 while the key's first request is in flight, in whole seconds
    /// (rounded up, at least 1), never beyond the end of the running claim's lease.
    /// Default: 1 second (a live owner renews its lease, so it is working and usually done soon).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.config.retry_after = retry_after;
        self
    }

    /// The status of one kind of problem response. Defaults: the IETF draft's (400 for a missing
    /// or invalid key, 409 in flight, 422 mismatch) and [`ProblemKind::default_status`] for the
    /// rest. Prior art answers a mismatch with 400 or 409:
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, ProblemKind};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .problem_status(ProblemKind::Mismatch, StatusCode::CONFLICT);
    /// # let _ = layer;
    /// ```
    pub fn problem_status(mut self, kind: ProblemKind, status: StatusCode) -> Self {
        self.config.statuses[kind.index()] = status;
        self
    }

    /// A handle that waits, at shutdown, for the handlers this layer runs detached from their
    /// connections (a claimed request runs to completion even when its client goes away).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// let shutdown = layer.shutdown_handle();
    /// // ... serve with `layer` until a shutdown signal, then:
    /// shutdown.wait().await;
    /// # }
    /// ```
    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            tracker: self.tracker.clone(),
        }
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(
            inner,
            self.store.clone(),
            self.config.clone(),
            self.tracker.clone(),
        )
    }
}

impl<St: fmt::Debug> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("header", &self.header)
            .field("methods", &self.methods)
            .field("key_required", &self.key_required)
            .field("dedup_window", &self.dedup_window)
            .field("lease", &self.lease)
            .field("request_body_limit", &self.request_body_limit)
            .field("response_body_limit", &self.response_body_limit)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("scoped", &self.scope.is_some())
            .field("keep_set_cookie", &self.keep_set_cookie)
            .field("store_timeout", &self.store_timeout)
            .field("fail_open", &self.fail_open)
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

/// Waits for the layer's detached handler work; from [`IdempotencyLayer::shutdown_handle`].
#[derive(Debug, Clone)]
pub struct Shutdown {
    tracker: TaskTracker,
}

impl Shutdown {
    /// Waits until every handler the layer started has finished and its result is stored. Call it
    /// after the server stopped accepting requests, and bound it with `tokio::time::timeout`: a
    /// result whose store write failed is retried for as long as the store stays away.
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// How many detached tasks are running now: handlers whose client went away, and store writes
    /// being retried.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }
}
