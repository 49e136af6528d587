//! Authentication: `Authorization: Bearer <api key>`, outside the idempotency layer.
//!
//! The middleware puts the caller's [`Account`] in the request's extensions; the idempotency
//! layer's scope function reads it there, so two accounts never share an idempotency key.

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_idempotency::{Rejection, Scope};

use super::error::ApiError;

/// The caller. Any non-empty API key is an account here; a real service would look it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account(String);

impl Account {
    /// The account's id.
    pub fn id(&self) -> &str {
        &self.0
    }
}

/// Middleware: 401 without an API key, or else the request goes on with its [`Account`].
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    let Some(api_key) = bearer_token(request.headers()) else {
        return ApiError::unauthorized().into_response();
    };
    let account = Account(api_key.to_owned());
    request.extensions_mut().insert(account);
    next.run(request).await
}

/// The idempotency layer's scope: the authenticated account.
pub fn account_scope(parts: &Parts) -> Result<Scope, Rejection> {
    match parts.extensions.get::<Account>() {
        Some(account) => Ok(Scope::from(account.id())),
        // Only if the layer were mounted outside `authenticate`.
        None => Err(Rejection::from(ApiError::unauthorized().into_http())),
    }
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}
