//! `IdempotencyLayer`: the builder; its settings live in [`Config`](crate::config::Config).

use std::fmt;
use std::sync::{Arc, Once};
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use tower_layer::Layer;

use crate::config::{Config, Tenancy};
use crate::detach::{Background, Shutdown};
use crate::log_throttle::LayerThrottles;
use crate::problem::{ProblemKind, RenderProblem};
use crate::retention::{Retention, RetentionFormat};
use crate::scope::ScopeRequest;
use crate::service::{Idempotency, STORE_FAILURE_LOG_INTERVAL, Waits};
use crate::store_policy::StorePolicy;

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
///     // The layer on the one route with an effect to protect...
///     .route(
///         "/v1/charges",
///         post(|| async { "charged" }).route_layer(IdempotencyLayer::new(MemoryStore::new())),
///     )
///     // ...not on routes where a key makes no sense.
///     .route("/login", post(|| async { "signed in" }));
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<St> {
    store: St,
    pub(crate) config: Config,
    background: Background,
    waits: Waits,
    throttles: Arc<LayerThrottles>,
    /// The warning of a layer without a scope, given once per layer.
    unscoped_warning: Arc<Once>,
}

impl<St> IdempotencyLayer<St> {
    /// A layer over `store` with the default settings.
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: Config::default(),
            background: Background::default(),
            waits: Waits::default(),
            throttles: Arc::new(LayerThrottles::new(STORE_FAILURE_LOG_INTERVAL)),
            unscoped_warning: Arc::new(Once::new()),
        }
    }

    /// The request header that carries the key. Default: `Idempotency-Key`.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// The methods the layer protects; every other request passes through untouched (no buffering,
    /// no store call). Default: `POST` and `PATCH`. In gRPC mode it does not apply: the named
    /// methods are covered whatever the HTTP method (`docs/PROTOCOL.md` §16.1).
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

    /// Whether a JSON body (`Content-Type: application/json` or `application/*+json`) is
    /// fingerprinted by its RFC 8785 canonical form rather than its bytes, so that a retry whose
    /// client serialised the same value again (members in another order, other whitespace, `1.0`
    /// for `1`) replays instead of getting 422. A body that is not JSON, or not JSON the canonical
    /// form keeps whole (invalid, a duplicate member name, a number a double does not hold
    /// exactly), keeps its byte fingerprint; so do other content types. See
    /// [`Fingerprint::of_json`](crate::record::Fingerprint::of_json).
    ///
    /// Default: `false`. Turn it on when clients may re-serialise a retry (SDKs that rebuild the
    /// request from objects, retries through a queue). Records stored with it off do not match
    /// retries fingerprinted with it on, for as long as the dedup window: switch it when a 422
    /// for some in-flight retries is acceptable.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).canonical_json(true);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "canonical-json")]
    #[cfg_attr(docsrs, doc(cfg(feature = "canonical-json")))]
    pub fn canonical_json(mut self, canonical: bool) -> Self {
        self.config.canonical_json = canonical;
        self
    }

    /// The scope of each request's key, from its parts (usually the authenticated account that an
    /// outer layer put in the extensions). Keys of different scopes never see each other's
    /// records. The function may refuse a request with a [`Rejection`](crate::Rejection) (a 401 when there is no
    /// principal): nothing is claimed, and the client gets the rejection.
    ///
    /// Default: none, and every key shares one namespace. **That is only right for a
    /// single-tenant service**: with many tenants, one could replay another's response by
    /// sending its key. A layer without a scope warns once, when it is applied to a service,
    /// unless it is declared [`single_tenant`](Self::single_tenant); with
    /// [`require_scope`](Self::require_scope) it is refused.
    ///
    /// ```
    /// use http::StatusCode;
    /// use http::request::Parts;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Rejection, Scope};
    ///
    /// #[derive(Clone)]
    /// struct Account(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope(|parts: &Parts| {
    ///     match parts.extensions.get::<Account>() {
    ///         Some(account) => Ok(Scope::from(account.0.as_str())),
    ///         None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
    ///     }
    /// });
    /// # let _ = layer;
    /// ```
    pub fn scope(mut self, scope: impl ScopeRequest) -> Self {
        self.config.scope = Some(Arc::new(scope));
        self
    }

    /// Refuses a layer without a [`scope`](Self::scope) (`docs/PROTOCOL.md` §3.3): [`check`]
    /// answers [`ConfigError::ScopeRequired`], and applying the layer to a service panics with
    /// the same message, at start-up (when the router is built), never per request. For
    /// multi-tenant services, where forgetting the scope would let a tenant replay another's
    /// responses. Default: `false`.
    ///
    /// [`check`]: Self::check
    ///
    /// ```
    /// use tower_idempotency::{ConfigError, IdempotencyLayer, MemoryStore, Scope};
    ///
    /// let forgot = IdempotencyLayer::new(MemoryStore::new()).require_scope(true);
    /// assert_eq!(forgot.check(), Err(ConfigError::ScopeRequired));
    ///
    /// let scoped = forgot.scope(|parts: &http::request::Parts| Ok(Scope::from(parts.uri.path())));
    /// assert_eq!(scoped.check(), Ok(()));
    /// ```
    pub fn require_scope(mut self, required: bool) -> Self {
        self.config.tenancy = if required {
            Tenancy::ScopeRequired
        } else {
            Tenancy::Unstated
        };
        self
    }

    /// Declares the service single-tenant: every client may share one key space (the keys of one
    /// tenant's clients, `docs/PROTOCOL.md` §3.3), so a layer without a [`scope`](Self::scope)
    /// does not warn of it. Undoes [`require_scope`](Self::require_scope).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    /// assert_eq!(layer.check(), Ok(()));
    /// ```
    pub fn single_tenant(mut self) -> Self {
        self.config.tenancy = Tenancy::Single;
        self
    }

    /// Whether the layer's settings can serve: `Err` names the first that cannot. Call it at
    /// start-up to turn a misconfiguration into an error of the application's own, rather than
    /// the panic of applying the layer.
    ///
    /// # Errors
    /// [`ConfigError::ScopeRequired`]: [`require_scope`](Self::require_scope) without a
    /// [`scope`](Self::scope). With the `grpc` feature, `ConfigError::GrpcMethods`: a gRPC mode
    /// (`grpc`) whose methods are not gRPC paths.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// assert!(IdempotencyLayer::new(MemoryStore::new()).check().is_ok());
    /// ```
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.config.tenancy == Tenancy::ScopeRequired && self.config.scope.is_none() {
            return Err(ConfigError::ScopeRequired);
        }
        if let Some(mode) = &self.config.protocol_mode {
            mode.check()?;
        }
        Ok(())
    }

    /// Which responses are stored for replay, from the response's head: its status, headers and
    /// extensions, before the body is read. A response that is not stored releases the claim, so a
    /// retry runs the handler again. A response with `Cache-Control: no-store` is never stored,
    /// whatever the policy says.
    /// Default: [`DefaultStorePolicy`](crate::DefaultStorePolicy) (2xx, 3xx and the 4xx a handler
    /// decides, such as 402; not a request that failed validation or authentication, nor 408, 409,
    /// 425 and 429). [`Every4xxStorePolicy`](crate::Every4xxStorePolicy) stores every 4xx but
    /// 408, 409, 425 and 429 (PROTOCOL §8.1).
    ///
    /// The extensions let a handler mark one response by type, without a header that would reach
    /// the client:
    ///
    /// ```
    /// use axum::{Router, http::StatusCode, response::IntoResponse, routing::post};
    /// use http::response::Parts;
    /// use tower_idempotency::{DefaultStorePolicy, IdempotencyLayer, MemoryStore, StorePolicy};
    ///
    /// /// Put in a response's extensions: a retry should run the handler again.
    /// #[derive(Clone)]
    /// struct DoNotStore;
    ///
    /// async fn create() -> axum::response::Response {
    ///     // A quote that is only valid for a minute: never replayed.
    ///     let mut response = (StatusCode::CREATED, "quote: 42 EUR").into_response();
    ///     response.extensions_mut().insert(DoNotStore);
    ///     response
    /// }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).store_policy(|head: &Parts| {
    ///     DefaultStorePolicy.store(head) && head.extensions.get::<DoNotStore>().is_none()
    /// });
    /// let app: Router = Router::new().route("/v1/quotes", post(create)).route_layer(layer);
    /// ```
    pub fn store_policy(mut self, policy: impl StorePolicy) -> Self {
        self.config.store_policy = Arc::new(policy);
        self
    }

    /// Whether `Set-Cookie` headers are stored and replayed. Default: `false` (a replay to another
    /// client must not hand out the first client's session).
    pub fn keep_set_cookie(mut self, keep: bool) -> Self {
        self.config.keep_set_cookie = keep;
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

    /// States on every stored response, first and replayed, when its key's record expires: the
    /// header `name`, in `format`. The moment is the completion's time plus the
    /// [`dedup_window`](Self::dedup_window), rounded down to the second, and is stored with the
    /// response, so every replay repeats it; the record is kept at least until then. A `409`
    /// while the key's first request is in flight states now plus the window: the earliest its
    /// record can expire, as it completes no earlier than now (not the claim's lease end: a lease
    /// runs out only when its owner stopped without completing, and then no record is kept).
    /// Responses that leave no record (not stored, failed) and the layer's other problems carry
    /// no header.
    ///
    /// Default: off. Turn it on when clients should know how long they may retry with a key (a
    /// queue that redelivers after hours, a client that retries a day later): past the moment,
    /// the key is new and a retry runs the request again. The usual name is
    /// [`IDEMPOTENCY_KEY_EXPIRES`](crate::IDEMPOTENCY_KEY_EXPIRES).
    ///
    /// ```
    /// use tower_idempotency::{IDEMPOTENCY_KEY_EXPIRES, IdempotencyLayer, MemoryStore, RetentionFormat};
    ///
    /// // `Idempotency-Key-Expires: Fri, 02 Jan 2026 10:00:00 GMT` on a response completed a day before.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .retention_header(IDEMPOTENCY_KEY_EXPIRES, RetentionFormat::HttpDate);
    /// # let _ = layer;
    /// ```
    pub fn retention_header(mut self, name: HeaderName, format: RetentionFormat) -> Self {
        self.config.retention = Some(Retention {
            header: name,
            format,
        });
        self
    }

    /// Lets a duplicate of a request that is still running wait up to `bound` for the first to
    /// finish, and get its replay, instead of `409` at once. Past the bound it gets the `409` with
    /// `Retry-After`; if the first request's claim is released (its handler failed, or its
    /// response is not stored), a waiting duplicate claims the key and runs, as a new request
    /// would. Duplicates of one key share one wait, which asks the store at most every 250 ms
    /// (at once when this layer finishes the first request, or when the store signals that another
    /// instance did: [`Store::changed`](crate::store::Store::changed),
    /// `PgStore::with_notifications`), however many wait; a duplicate whose client goes away stops
    /// waiting. A bound of zero turns waiting off.
    ///
    /// Default: off (`409` at once, the IETF draft's answer). Turn it on when clients retry while
    /// the first attempt still runs (a client timeout shorter than the handler's slowest answers)
    /// and give up after a few `409`s, as Stripe's SDKs do: a bound of a few seconds turns those
    /// `409`s into replays. Each waiting duplicate holds its connection for up to the bound.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).wait_for_in_flight(Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn wait_for_in_flight(mut self, bound: Duration) -> Self {
        self.config.wait = Some(bound).filter(|bound| !bound.is_zero());
        self
    }

    /// The number of keys that duplicates are waiting on now, across this layer's services
    /// ([`wait_for_in_flight`](Self::wait_for_in_flight)).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// assert_eq!(IdempotencyLayer::new(MemoryStore::new()).waiting(), 0);
    /// ```
    pub fn waiting(&self) -> usize {
        self.waits.len()
    }

    /// The status of one kind of problem response. Defaults: the IETF draft's (400 for a missing
    /// or invalid key, 409 in flight, 422 mismatch) and [`ProblemKind::default_status`] for the
    /// rest. Prior art answers a mismatch with 400 or 409:
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::problem::ProblemKind;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .problem_status(ProblemKind::Mismatch, StatusCode::CONFLICT);
    /// # let _ = layer;
    /// ```
    pub fn problem_status(mut self, kind: ProblemKind, status: StatusCode) -> Self {
        self.config.statuses[kind.index()] = status;
        self
    }

    /// How the layer's own responses (its [`Problem`](crate::problem::Problem)s: 400, 409, 413,
    /// 422, 500, 503) are written: the body and its headers, per problem, in the API's own error
    /// format. The layer keeps the status, `Cache-Control: no-store`, `Retry-After`, and the
    /// [`ProblemKind`] and [`Outcome`](crate::Outcome) in the extensions. A scope function's
    /// [`Rejection`](crate::Rejection) is the application's own response and is not rendered.
    /// Default: [`ProblemJson`](crate::problem::ProblemJson), RFC 9457
    /// `application/problem+json`.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tower_idempotency::problem::{Problem, ProblemKind, RenderedProblem};
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // `{"error": {"code", "message"}}`, as the rest of the API answers.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).render_problems(|problem: &Problem| {
    ///     let code = match problem.kind() {
    ///         ProblemKind::InFlight => "request_in_progress",
    ///         ProblemKind::Mismatch => "idempotency_key_reused",
    ///         _ => "idempotency_error",
    ///     };
    ///     let body = serde_json::json!({"error": {"code": code, "message": problem.detail()}});
    ///     RenderedProblem::new(HeaderValue::from_static("application/json"), body.to_string())
    /// });
    /// # let _ = layer;
    /// ```
    ///
    /// [`RenderProblem`] has a complete example.
    pub fn render_problems(mut self, renderer: impl RenderProblem) -> Self {
        self.config.render = Arc::new(renderer);
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
        self.background.shutdown()
    }

    /// Whether a completed record keeps the trace context of the execution that completed it
    /// (PROTOCOL.md §5.6): the request's W3C `traceparent` header (and `tracestate`, at most 512
    /// bytes), or, with the feature `opentelemetry` and no valid header, the OpenTelemetry
    /// context of the request's span. A malformed header is ignored. A replay then logs where
    /// its record came from (`origin.trace_id`, `origin.span_id` on its span, §12.1) and, with
    /// `opentelemetry`, links its span to the original. A sealed record keeps it in its seal.
    ///
    /// A request with a valid `traceparent` keeps the header's context: the span of the caller
    /// that sent it (a client's attempt, an upstream service's call), not the server span that
    /// ran the handler, so a replay's link points at the caller's span, whose child the run is
    /// when the application continues the caller's trace. With the feature `opentelemetry`, the
    /// application's OpenTelemetry layer must be of the releases the layer reads
    /// (`tracing-opentelemetry` 0.34, `opentelemetry` 0.33, re-exported in `otel`): when a
    /// request's span has no OpenTelemetry context it can read, the layer warns once per process.
    ///
    /// Default: `false`: releases before this one refuse a record that keeps an origin (`503`
    /// at claim, or `500 record-unreadable` for a sealed one), so turn it on only once every
    /// instance sharing the store runs a release that reads it. Turning it off again is safe at
    /// any time.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).trace_origin(true);
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "trace-origin")]
    #[cfg_attr(docsrs, doc(cfg(feature = "trace-origin")))]
    pub fn trace_origin(mut self, record: bool) -> Self {
        self.config.trace_origin = record;
        self
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    /// # Panics
    /// When [`check`](IdempotencyLayer::check) fails: a layer that must not serve as configured
    /// (a required scope missing) stops the application at start-up instead.
    fn layer(&self, inner: S) -> Self::Service {
        if let Err(err) = self.check() {
            panic!("IdempotencyLayer: {err}");
        }
        if self.config.scope.is_none() && self.config.tenancy == Tenancy::Unstated {
            self.unscoped_warning.call_once(|| {
                tracing::warn!(
                    target: "tower_idempotency",
                    "IdempotencyLayer protects routes without a scope: every client shares one \
                     key space, and a client that sends another tenant's key gets its response. \
                     Set `.scope(..)` for a multi-tenant service, or `.single_tenant()` to say \
                     there is one tenant"
                );
            });
        }
        Idempotency::new(
            inner,
            self.store.clone(),
            self.config.clone(),
            self.background.clone(),
            self.waits.clone(),
            self.throttles.clone(),
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

/// A layer whose settings cannot serve ([`IdempotencyLayer::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// [`IdempotencyLayer::require_scope`] is on, and no [`IdempotencyLayer::scope`] is set.
    #[error(
        "a scope is required (`require_scope(true)`) and none is set: call `.scope(..)` with the \
         request's tenant, or `.single_tenant()` if there is one"
    )]
    ScopeRequired,
    /// [`IdempotencyLayer::grpc`] named a method that is not a gRPC path
    /// (`/package.Service/Method`), or none.
    #[cfg(feature = "grpc")]
    #[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
    #[error("gRPC mode: {0}")]
    GrpcMethods(String),
}
