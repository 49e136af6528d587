//! Which responses are stored for replay: the [`StorePolicy`] hook and its default.

use http::StatusCode;
use http::response::Parts;

/// Decides whether a response is stored for replay (`docs/PROTOCOL.md` §8.1), from its status,
/// headers and extensions. A response it refuses releases the claim: a retry runs the handler
/// again. `Cache-Control: no-store` is never stored, whatever the policy says.
///
/// Implemented for closures `Fn(&http::response::Parts) -> bool`, and by [`DefaultStorePolicy`];
/// set it with [`IdempotencyLayer::store_policy`](crate::IdempotencyLayer::store_policy).
///
/// ```
/// use http::StatusCode;
/// use http::response::Parts;
/// use tower_idempotency::{DefaultStorePolicy, StorePolicy};
///
/// // Store what the default stores, except a 404: the resource may exist on the retry.
/// let policy = |head: &Parts| head.status != StatusCode::NOT_FOUND && DefaultStorePolicy.store(head);
/// let (head, ()) = http::Response::builder().status(404).body(()).unwrap().into_parts();
/// assert!(!policy.store(&head));
/// ```
pub trait StorePolicy: Send + Sync + 'static {
    /// Whether the response with this head is stored.
    fn store(&self, response: &Parts) -> bool;
}

impl<F> StorePolicy for F
where
    F: Fn(&Parts) -> bool + Send + Sync + 'static,
{
    fn store(&self, response: &Parts) -> bool {
        self(response)
    }
}

/// The default store policy: every 2xx, 3xx and 4xx response is stored except 408, 409, 425 and
/// 429 (which a retry may well change); 1xx and 5xx are not. A policy of your own can start from
/// it.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::DefaultStorePolicy;
///
/// assert!(DefaultStorePolicy::stores(StatusCode::CREATED));
/// assert!(DefaultStorePolicy::stores(StatusCode::PAYMENT_REQUIRED));
/// assert!(!DefaultStorePolicy::stores(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!DefaultStorePolicy::stores(StatusCode::SERVICE_UNAVAILABLE));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

impl DefaultStorePolicy {
    /// Whether the default policy stores a response with `status`: it looks at nothing else.
    pub fn stores(status: StatusCode) -> bool {
        (200..500).contains(&status.as_u16()) && !matches!(status.as_u16(), 408 | 409 | 425 | 429)
    }
}

impl StorePolicy for DefaultStorePolicy {
    fn store(&self, response: &Parts) -> bool {
        Self::stores(response.status)
    }
}
