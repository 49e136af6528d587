//! Key scopes: who a key belongs to.
//!
//! A key is only unique inside its scope, a value the application derives from each request (the
//! authenticated account, the API key). Records of two scopes never meet, so one tenant cannot
//! replay another's response by guessing its key. Without a scope function every key shares one
//! namespace, which is only right for a single-tenant service.

use bytes::Bytes;
use http::{Response, StatusCode};

use crate::problem;

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
/// boxed, so that a scope function's `Result` stays small.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::Rejection;
///
/// // A bare status becomes an `application/problem+json` response.
/// let rejection = Rejection::from(StatusCode::UNAUTHORIZED);
/// assert_eq!(rejection.into_response().status(), StatusCode::UNAUTHORIZED);
/// ```
#[derive(Debug)]
pub struct Rejection(Box<Response<Bytes>>);

impl Rejection {
    /// The response the client gets.
    pub fn into_response(self) -> Response<Bytes> {
        *self.0
    }
}

impl From<StatusCode> for Rejection {
    fn from(status: StatusCode) -> Self {
        Self(Box::new(problem::about_blank(status)))
    }
}

impl From<Response<Bytes>> for Rejection {
    fn from(response: Response<Bytes>) -> Self {
        Self(Box::new(response))
    }
}
