//! Authentication: `Authorization: Bearer <api key>`, outside the idempotency layer. The middleware
//! puts the caller's [`Account`] in the request, where the layer's scope reads it, so two accounts
//! never share an idempotency key. The API key stops here: past this module (handlers, scope,
//! charges, events, records, Redis keys) only the account's opaque id is seen, so a credential
//! never lands in a store, a log line or a key name.

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_idempotency::{Rejection, Scope};

use super::error::ApiError;

/// The caller: an opaque account id, `acct_` and 32 hex digits. Any non-empty API key is an
/// account here; a real service would look the key up and get its account's id.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Account(String);

impl Account {
    /// The account of `api_key`: `acct_` and 128 bits of its blake3 hash (a context of its own).
    /// The same key always gives the same id, so balances outlive a restart and every instance
    /// agrees; the id does not give the key back.
    pub fn for_api_key(api_key: &str) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key("tower-idempotency example account id v1");
        hasher.update(api_key.as_bytes());
        let hex = hasher.finalize().to_hex();
        Self(format!("acct_{}", &hex[..32]))
    }

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
    let account = Account::for_api_key(api_key);
    request.extensions_mut().insert(account);
    next.run(request).await
}

/// The idempotency layer's scope: the authenticated account.
pub fn account_scope(parts: &Parts) -> Result<Scope, Rejection> {
    match parts.extensions.get::<Account>() {
        Some(account) => Ok(Scope::from(account.id())),
        // Only if the layer were mounted outside `authenticate`.
        None => Err(Rejection::new(ApiError::unauthorized())),
    }
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}
