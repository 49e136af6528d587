//! The real store a run is over, and how the world makes it forget: everything (a restart without
//! persistence) or one record (an eviction, a failover losing a write).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_idempotency::record::{ClaimToken, Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};
use tower_idempotency::{BoxStore, MemoryStore};

type Forgetting = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Forgets every record of the store.
pub(crate) type Forget = Box<dyn Fn() -> Forgetting + Send + Sync>;
/// Forgets one record of the store.
pub(crate) type Evict = Box<dyn Fn(RecordId) -> Forgetting + Send + Sync>;

/// A real store, how to make it forget, and its clock.
pub(crate) struct Backend {
    pub store: BoxStore,
    pub forget: Forget,
    pub evict: Evict,
    /// On tokio's real clock (a server's store), where the machine's load can stall a run.
    pub real_time: bool,
    /// Whether the store releases, behind it, a claim it answered with an error (`RedisStore`).
    pub releases_behind: bool,
}

impl Backend {
    /// `MemoryStore`s, one per record, so that one record can be forgotten alone.
    pub(crate) fn memory() -> Self {
        let stores = PerRecord::default();
        let (forget, evict) = (stores.clone(), stores.clone());
        Self {
            store: BoxStore::new(stores),
            forget: Box::new(move || {
                forget.lock().clear();
                Box::pin(async {})
            }),
            evict: Box::new(move |id| {
                evict.lock().remove(&id);
                Box::pin(async {})
            }),
            real_time: false,
            releases_behind: false,
        }
    }
}

/// A `MemoryStore` per record id: every call goes to its record's own store, unchanged. Fences
/// still grow across stores: `MemoryStore` numbers claims from the process's clock, past the last
/// fence the process gave (§5.3).
#[derive(Clone, Default)]
struct PerRecord(Arc<Mutex<HashMap<RecordId, MemoryStore>>>);

impl std::fmt::Debug for PerRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PerRecord")
    }
}

impl PerRecord {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, MemoryStore>> {
        self.0.lock().expect("the stores' lock")
    }

    fn of(&self, id: &RecordId) -> MemoryStore {
        self.lock().entry(*id).or_default().clone()
    }
}

impl Store for PerRecord {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.of(id).claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.of(id).complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.of(id).renew(id, token, lease).await
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.of(id).release(id, token).await
    }
}

impl OperatorStore for PerRecord {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        self.of(id).inspect(id).await
    }

    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        self.of(id).forget(id, force).await
    }
}
