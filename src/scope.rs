//! Key scopes: who a key belongs to.
//!
//! A key is only unique inside its scope, a value the application derives from each request (the
//! authenticated account, the API key). Records of two scopes never meet, so one tenant cannot
//! replay another's response by guessing its key. Without a scope function every key shares one
//! namespace, which is only right for a single-tenant service.

use std::fmt;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
#[cfg(feature = "axum")]
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};

use crate::problem;

#[cfg(feature = "axum")]
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The scope of a request's key: any bytes, usually an account or tenant id.
///
/// ```
/// use tower_idempotency::Scope;
///
/// assert_eq!(Scope::from("acct_1").as_bytes(), b"acct_1");
/// assert_eq!(Scope::from(String::from("acct_1")), Scope::from("acct_1"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Scope(Bytes);

impl Scope {
    /// The scope's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<&str> for Scope {
    fn from(value: &str) -> Self {
        Self(Bytes::copy_from_slice(value.as_bytes()))
    }
}

impl From<String> for Scope {
    fn from(value: String) -> Self {
        Self(Bytes::from(value))
    }
}

impl From<&[u8]> for Scope {
    fn from(value: &[u8]) -> Self {
        Self(Bytes::copy_from_slice(value))
    }
}

impl From<Vec<u8>> for Scope {
    fn from(value: Vec<u8>) -> Self {
        Self(Bytes::from(value))
    }
}

impl From<Bytes> for Scope {
    fn from(value: Bytes) -> Self {
        Self(value)
    }
}

/// A scope function's refusal: the response the client gets instead (for example a 401 when the
/// request carries no principal). Nothing is claimed and the handler does not run. The response is
/// the application's own: the layer sends it as it is, with [`Outcome::Rejected`] in its
/// extensions, and does not render it ([`IdempotencyLayer::render_problems`]).
///
/// Made from:
///
/// - a bare [`StatusCode`]: an RFC 9457 `application/problem+json` response with that status
///   (`about:blank`);
/// - a `Response<Bytes>`: sent as it is;
/// - with the `axum` feature, anything that implements axum's `IntoResponse`
///   (`Rejection::new`): an API's own error type, `(StatusCode, Json(...))`, a `Response` of
///   any body, and so on. The layer reads its body before it answers (a body that fails is sent
///   empty, and logged).
///
/// The response is boxed, so that a scope function's `Result` stays small.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::Rejection;
///
/// // A bare status becomes an `application/problem+json` response.
/// let rejection = Rejection::from(StatusCode::UNAUTHORIZED);
/// assert_eq!(rejection.status(), StatusCode::UNAUTHORIZED);
/// assert_eq!(rejection.headers()["content-type"], "application/problem+json");
///
/// // A whole response is sent as it is.
/// let forbidden = http::Response::builder().status(403).body("suspended".into()).unwrap();
/// assert_eq!(Rejection::from(forbidden).status(), StatusCode::FORBIDDEN);
/// ```
///
/// [`Outcome::Rejected`]: crate::Outcome::Rejected
/// [`IdempotencyLayer::render_problems`]: crate::IdempotencyLayer::render_problems
#[derive(Debug)]
pub struct Rejection(Box<Response<RejectionBody>>);

/// A rejection's body: whole already, or to be read.
pub(crate) enum RejectionBody {
    Full(Bytes),
    #[cfg(feature = "axum")]
    Stream(UnsyncBoxBody<Bytes, BoxError>),
}

impl fmt::Debug for RejectionBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectionBody::Full(bytes) => f.debug_tuple("Full").field(bytes).finish(),
            #[cfg(feature = "axum")]
            RejectionBody::Stream(_) => f.write_str("Stream"),
        }
    }
}

impl Rejection {
    /// A rejection from anything axum can turn into a response (feature `axum`).
    ///
    /// ```
    /// use axum::Json;
    /// use http::StatusCode;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Rejection, Scope};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope(|parts: &http::request::Parts| {
    ///     match parts.headers.get("x-account") {
    ///         Some(account) => Ok(Scope::from(account.as_bytes())),
    ///         None => Err(Rejection::new((
    ///             StatusCode::UNAUTHORIZED,
    ///             Json(serde_json::json!({"error": {"code": "missing_api_key"}})),
    ///         ))),
    ///     }
    /// });
    /// # let _ = layer;
    /// ```
    #[cfg(feature = "axum")]
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    pub fn new(response: impl axum_core::response::IntoResponse) -> Self {
        let response = response
            .into_response()
            .map(|body| RejectionBody::Stream(body.map_err(Into::into).boxed_unsync()));
        Self(Box::new(response))
    }

    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        self.0.status()
    }

    /// The headers the client gets.
    pub fn headers(&self) -> &HeaderMap {
        self.0.headers()
    }

    pub(crate) fn into_response(self) -> Response<RejectionBody> {
        *self.0
    }
}

impl From<StatusCode> for Rejection {
    fn from(status: StatusCode) -> Self {
        Self(Box::new(
            problem::about_blank(status).map(RejectionBody::Full),
        ))
    }
}

impl From<Response<Bytes>> for Rejection {
    fn from(response: Response<Bytes>) -> Self {
        Self(Box::new(response.map(RejectionBody::Full)))
    }
}

/// Names the scope of a request's key from the request's head (its authenticated principal, a
/// tenant header), or refuses the request with a [`Rejection`] (`docs/PROTOCOL.md` §3.3).
///
/// Implemented for closures `Fn(&http::request::Parts) -> Result<Scope, Rejection>`; set it with
/// [`IdempotencyLayer::scope`](crate::IdempotencyLayer::scope).
///
/// ```
/// use http::request::Parts;
/// use tower_idempotency::{Rejection, Scope, ScopeRequest};
///
/// let by_tenant = |parts: &Parts| match parts.headers.get("x-tenant") {
///     Some(tenant) => Ok(Scope::from(tenant.as_bytes())),
///     None => Err(Rejection::from(http::StatusCode::UNAUTHORIZED)),
/// };
/// let (head, ()) = http::Request::builder().header("x-tenant", "t1").body(()).unwrap().into_parts();
/// assert_eq!(by_tenant.scope(&head).unwrap(), Scope::from("t1"));
/// ```
pub trait ScopeRequest: Send + Sync + 'static {
    /// The scope of the request with this head, or why it is refused.
    fn scope(&self, request: &http::request::Parts) -> Result<Scope, Rejection>;
}

impl<F> ScopeRequest for F
where
    F: Fn(&http::request::Parts) -> Result<Scope, Rejection> + Send + Sync + 'static,
{
    fn scope(&self, request: &http::request::Parts) -> Result<Scope, Rejection> {
        self(request)
    }
}
