//! The axum extractors for [`IdempotencyKey`] and [`HeldClaim`] (feature `axum`).

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;

use crate::held_claim::HeldClaim;
use crate::key::IdempotencyKey;
use crate::problem;

/// The request has no [`IdempotencyKey`]: the route is not behind an
/// [`IdempotencyLayer`](crate::IdempotencyLayer), or the request was not protected (a method the
/// layer does not cover, or no key where keys are optional). Answers 500, since it is a wiring
/// error; extract `Option<IdempotencyKey>` where a key may be absent.
#[derive(Debug, thiserror::Error)]
#[error("the request has no idempotency key: is the route behind an IdempotencyLayer?")]
pub struct MissingKeyExtension;

impl IntoResponse for MissingKeyExtension {
    fn into_response(self) -> Response {
        problem::about_blank(http::StatusCode::INTERNAL_SERVER_ERROR)
            .map(axum_core::body::Body::from)
    }
}

/// Extracts the validated key of a protected request.
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};
///
/// async fn create_charge(key: IdempotencyKey) -> String {
///     // The payment provider's own idempotency key, derived from ours.
///     key.derive("psp")
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(create_charge))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = MissingKeyExtension;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MissingKeyExtension)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}

/// The request has no [`HeldClaim`]: the route is not behind an
/// [`IdempotencyLayer`](crate::IdempotencyLayer), or the request runs without a claim (not
/// protected, or run unprotected because the store failed and the layer fails open). Answers 500;
/// extract `Option<HeldClaim>` where a claim may be absent.
#[derive(Debug, thiserror::Error)]
#[error("the request runs under no idempotency claim: is the route behind an IdempotencyLayer?")]
pub struct MissingClaimExtension;

impl IntoResponse for MissingClaimExtension {
    fn into_response(self) -> Response {
        problem::about_blank(http::StatusCode::INTERNAL_SERVER_ERROR)
            .map(axum_core::body::Body::from)
    }
}

/// Extracts the claim a protected request runs under: see [`HeldClaim`].
impl<S: Send + Sync> FromRequestParts<S> for HeldClaim {
    type Rejection = MissingClaimExtension;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<HeldClaim>()
            .cloned()
            .ok_or(MissingClaimExtension)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldClaim {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<HeldClaim>().cloned())
    }
}
