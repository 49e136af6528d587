//! [`HeldClaim`]: the claim a request's handler runs under, for fencing its own effects.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::record::{ClaimToken, Fence, RecordId};
use crate::store::StoreError;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Asks the store whether a claim is still held (the layer's service, whatever its store).
pub(crate) trait CheckHeld: Send + Sync + 'static {
    fn still_held<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

/// The claim a protected request runs under: its [`Fence`], and a way to ask the store whether the
/// claim is still this request's (§5.3).
///
/// The layer puts it in the request's extensions before the handler runs (with the `axum`
/// feature it is an extractor). A lease is a promise about time: a handler stalled past its
/// lease (a lock, a frozen database, a lost network) may find that a retry took its key over and
/// ran again. The layer refuses the stale run's completion, but not its effects outside the
/// store: those are fenced by the effect's own store, which keeps the largest fence it has seen
/// for the operation and refuses a write with a smaller one.
///
/// ```
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{HeldClaim, IdempotencyKey, IdempotencyLayer, MemoryStore};
///
/// async fn capture(key: IdempotencyKey, claim: HeldClaim) -> Result<String, StatusCode> {
///     // Before an irreversible step: one store round trip, which also renews the lease.
///     if !claim.still_held().await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)? {
///         return Err(StatusCode::CONFLICT);
///     }
///     // The provider keeps the largest fence per key and refuses a smaller one, e.g.
///     // `UPDATE payments SET .. WHERE op = $1 AND fence <= $2`.
///     Ok(format!("capture {} with fence {}", key.derive("psp"), claim.fence()))
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/captures", post(capture))
///     .route_layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
#[derive(Clone)]
pub struct HeldClaim {
    id: RecordId,
    token: ClaimToken,
    store: Arc<dyn CheckHeld>,
}

impl HeldClaim {
    pub(crate) fn new(id: RecordId, token: ClaimToken, store: Arc<dyn CheckHeld>) -> Self {
        Self { id, token, store }
    }

    /// The claim's fence number: larger than that of every earlier claim of this key. Pass it with
    /// each effect, and have the effect's store refuse a smaller one.
    pub fn fence(&self) -> Fence {
        self.token.fence()
    }

    /// Whether the key is still claimed by this request: `false` once its lease ran out and
    /// another claim took the key (or the record is gone). One store round trip, which renews the
    /// lease as it asks.
    ///
    /// A `true` narrows the window, it does not close it: the lease can run out right after the
    /// answer. Ask before slow or external steps; the fence is what makes the effect safe.
    pub async fn still_held(&self) -> Result<bool, StoreError> {
        self.store.still_held(&self.id, &self.token).await
    }
}

impl fmt::Debug for HeldClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the token: only the fence is the handler's to see.
        f.debug_struct("HeldClaim")
            .field("id", &self.id)
            .field("fence", &self.fence())
            .finish_non_exhaustive()
    }
}
