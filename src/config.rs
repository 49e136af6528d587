//! The layer's settings, with their defaults: a private struct behind the builder methods of
//! [`IdempotencyLayer`](crate::IdempotencyLayer), each of which documents its default.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use crate::fingerprint::Fingerprint;
use crate::problem::{ProblemJson, ProblemKind, RenderProblem};
use crate::protocol_mode::ProtocolMode;
use crate::retention::Retention;
use crate::scope::ScopeRequest;
use crate::store_policy::{DefaultStorePolicy, StorePolicy};

/// The layer's settings; see each builder method of [`IdempotencyLayer`](crate::IdempotencyLayer)
/// for its default.
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
    #[cfg(feature = "canonical-json")]
    pub(crate) canonical_json: bool,
    pub(crate) scope: Option<Arc<dyn ScopeRequest>>,
    pub(crate) tenancy: Tenancy,
    pub(crate) store_policy: Arc<dyn StorePolicy>,
    pub(crate) keep_set_cookie: bool,
    pub(crate) fail_open: bool,
    pub(crate) retry_after: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) statuses: [StatusCode; ProblemKind::ALL.len()],
    pub(crate) render: Arc<dyn RenderProblem>,
    pub(crate) retention: Option<Retention>,
    /// A protocol's own rules over HTTP (the gRPC mode), or none for plain HTTP.
    pub(crate) protocol_mode: Option<Arc<dyn ProtocolMode>>,
    /// Whether completed records keep the trace context of their execution
    /// (`IdempotencyLayer::trace_origin`).
    #[cfg(feature = "trace-origin")]
    pub(crate) trace_origin: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            methods: vec![Method::POST, Method::PATCH],
            key_required: true,
            dedup_window: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            request_body_limit: 1024 * 1024,
            response_body_limit: 1024 * 1024,
            fingerprint_headers: Vec::new(),
            #[cfg(feature = "canonical-json")]
            canonical_json: false,
            scope: None,
            tenancy: Tenancy::Unstated,
            store_policy: Arc::new(DefaultStorePolicy),
            keep_set_cookie: false,
            fail_open: false,
            retry_after: Duration::from_secs(1),
            wait: None,
            statuses: ProblemKind::ALL.map(ProblemKind::default_status),
            render: Arc::new(ProblemJson),
            retention: None,
            protocol_mode: None,
            #[cfg(feature = "trace-origin")]
            trace_origin: false,
        }
    }
}

/// What the application said of its tenants, for a layer without a scope function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tenancy {
    /// Nothing: a layer without a scope warns once.
    Unstated,
    /// One tenant (`IdempotencyLayer::single_tenant`): no scope is needed, and none is warned of.
    Single,
    /// A scope is required (`IdempotencyLayer::require_scope`): a layer without one is refused.
    ScopeRequired,
}

impl Config {
    pub(crate) fn status(&self, kind: ProblemKind) -> StatusCode {
        self.statuses[kind.index()]
    }

    /// The request's fingerprint: of its canonical JSON body when the layer asks for it and the
    /// body is such JSON, else of its bytes.
    pub(crate) fn fingerprint(&self, parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
        let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
        let allow_listed = &self.fingerprint_headers;
        #[cfg(feature = "canonical-json")]
        if self.canonical_json
            && let Some(fingerprint) =
                Fingerprint::of_json(method, uri, headers, allow_listed, body)
        {
            return fingerprint;
        }
        Fingerprint::of(method, uri, headers, allow_listed, body)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Config");
        d.field("header", &self.header)
            .field("methods", &self.methods)
            .field("key_required", &self.key_required)
            .field("dedup_window", &self.dedup_window)
            .field("lease", &self.lease)
            .field("request_body_limit", &self.request_body_limit)
            .field("response_body_limit", &self.response_body_limit)
            .field("fingerprint_headers", &self.fingerprint_headers);
        #[cfg(feature = "canonical-json")]
        d.field("canonical_json", &self.canonical_json);
        d.field("scoped", &self.scope.is_some())
            .field("tenancy", &self.tenancy)
            .field("keep_set_cookie", &self.keep_set_cookie)
            .field("fail_open", &self.fail_open)
            .field("retry_after", &self.retry_after)
            .field("wait", &self.wait)
            .field("retention", &self.retention)
            .field("protocol_mode", &self.protocol_mode);
        #[cfg(feature = "trace-origin")]
        d.field("trace_origin", &self.trace_origin);
        d.finish_non_exhaustive()
    }
}
