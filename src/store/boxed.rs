//! [`BoxStore`]: a store chosen at run time, behind one type.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, RecordId};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`Store`] in a form that can be a trait object: each call's future boxed.
trait DynStore: Send + Sync + 'static {
    fn claim<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
        completed: &'a Completed,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions);

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    fn changed(&self, id: &RecordId) -> Option<BoxFuture<'static, ()>>;

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
    ) -> BoxFuture<'a, Result<Option<Inspected>, StoreError>>;

    fn forget<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
    ) -> BoxFuture<'a, Result<ForgetOutcome, StoreError>>;
}

impl<S: OperatorStore> DynStore for S {
    fn claim<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(Store::claim(self, id, fingerprint, lease))
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
        completed: &'a Completed,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::complete(self, id, token, completed, ttl))
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::renew(self, id, token, lease))
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        Store::prepare(self, id, token, extensions);
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::release(self, id, token))
    }

    fn changed(&self, id: &RecordId) -> Option<BoxFuture<'static, ()>> {
        Store::changed(self, id).map(|changed| Box::pin(changed) as BoxFuture<'static, ()>)
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
    ) -> BoxFuture<'a, Result<Option<Inspected>, StoreError>> {
        Box::pin(OperatorStore::inspect(self, id))
    }

    fn forget<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
    ) -> BoxFuture<'a, Result<ForgetOutcome, StoreError>> {
        Box::pin(OperatorStore::forget(self, id, force))
    }
}

/// Any [`OperatorStore`], behind one type: for a store chosen at run time (from configuration, say), so
/// that the layer, the services it builds and the code around them exist once, as
/// `IdempotencyLayer<BoxStore>`, whatever the store.
///
/// Every method is forwarded, [`Store::prepare`], [`Store::changed`] and the operator's
/// [`OperatorStore::inspect`] and [`OperatorStore::forget`] included, so that a boxed store is
/// as much a store as the one it holds (every store of the workspace is an `OperatorStore`). A
/// call's future is boxed, one small allocation per store call; clones share the store.
///
/// ```
/// use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
/// use tower_idempotency_redis::RedisStore;
///
/// fn store(redis_url: Option<&str>) -> Result<BoxStore, Box<dyn std::error::Error>> {
///     Ok(match redis_url {
///         Some(url) => BoxStore::new(RedisStore::from_url(url)?),
///         None => BoxStore::new(MemoryStore::new()),
///     })
/// }
///
/// // One layer type, whichever store the configuration names.
/// let layer: IdempotencyLayer<BoxStore> = IdempotencyLayer::new(store(None)?);
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct BoxStore {
    inner: Arc<dyn DynStore>,
    /// The boxed store's type, for `Debug`.
    name: &'static str,
}

impl BoxStore {
    /// Boxes `store`.
    pub fn new<S: OperatorStore>(store: S) -> Self {
        Self {
            inner: Arc::new(store),
            name: std::any::type_name::<S>(),
        }
    }
}

impl fmt::Debug for BoxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BoxStore").field(&self.name).finish()
    }
}

impl Store for BoxStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(id, token, lease).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        self.inner.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.inner.release(id, token).await
    }

    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.inner.changed(id)
    }
}

impl OperatorStore for BoxStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        self.inner.inspect(id).await
    }

    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        self.inner.forget(id, force).await
    }
}

/// A shared store is a store: every method is forwarded, [`Store::prepare`] and
/// [`Store::changed`] included.
impl<S: Store> Store for Arc<S> {
    crate::forward_store!(* => claim, complete, renew, prepare, release, changed);
}

/// A shared operator's store is one too.
impl<S: OperatorStore> OperatorStore for Arc<S> {
    crate::forward_store!(* => inspect, forget);
}
