//! The replay cache: a store wrapper that keeps the records this process completed in memory
//! until they expire, so that a replay of one costs no store call ([`ReplayCache`]).
//!
//! Why a cached copy is right: a completed record is final until it expires (PROTOCOL.md §5.2), so
//! a copy answers as the store would for as long as the store keeps the record. The copy must die
//! no later than the record. The store does not say when a record it returns expires, so only
//! records this process completed are cached: their expiry is known. The deadline is taken on this
//! process's clock *before* the completion is sent, plus the dedup window; the store counts the
//! window from the moment it receives the write, which is later, so the copy dies first. The
//! retention header's moment is not used for records read from the store: it is written on the
//! completing instance's wall clock, which another instance's clock may trail, and only when that
//! instance has the header on.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use quick_cache::Weighter;
use quick_cache::sync::Cache;
use tokio::time::Instant;

use super::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, Record, RecordId};

/// A store with a replay cache in front: the records this process completes through it are kept
/// in memory, up to about `max_entries` records and `max_bytes` bytes (of stored responses,
/// headers and a little bookkeeping), so that a claim of one answers with the record without a
/// store call. A replay from the cache is the store's answer: the same bytes, a different request
/// with the key still gets `422`, and keys of different scopes never share an entry. Either bound
/// at zero turns the cache off; when a bound is reached, the least useful entries are evicted
/// (S3-FIFO), and their claims ask the store again. `docs/PROTOCOL.md` §6.7.
///
/// Use it when replays are frequent (clients or queues that retry after timeouts, webhooks
/// redelivered) and the store's round trip matters: with Redis or PostgreSQL, a replay then costs
/// about what a memory store's does. A claim answered from the cache counts as a store call in
/// the layer's metrics, a fast one.
///
/// **Why a copy is right, and until when.** A completed record never changes until it expires,
/// so a copy answers as the store would for as long as the store keeps the record. Only records
/// this process completed are cached, because their expiry is known: the copy's deadline is the
/// completion's time to live from just before the completion was sent, on this process's
/// monotonic clock, and the store counts it from when it received the write, a moment later; the
/// copy dies first. A record read from the store (a replay of another instance's request) is not
/// cached: the store does not say when it expires. A completion the store did not take at once
/// (failed and retried, or refused) is not cached either.
///
/// **When the store loses data** (a flushed or failed-over Redis, a restored database), the cache
/// may still replay a record the store forgot, until the copy's deadline: the protocol promised
/// that replay for the whole window anyway, and the request is not run twice. In a
/// **multi-instance deployment** each instance caches only its own completions: a retry that
/// reaches another instance asks the store, and gets the same record.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
/// use tower_idempotency::store::ReplayCache;
///
/// // Up to 10 000 records and 64 MiB in front of the store.
/// let layer = IdempotencyLayer::new(ReplayCache::new(MemoryStore::new(), 10_000, 64 << 20));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct ReplayCache<St> {
    store: St,
    entries: Option<Entries>,
}

impl<St> ReplayCache<St> {
    /// `store` behind a cache of at most about `max_entries` records and `max_bytes` bytes (a
    /// bound is exceeded by at most one entry per shard); no cache when either is zero.
    pub fn new(store: St, max_entries: usize, max_bytes: usize) -> Self {
        Self {
            store,
            entries: Entries::new(max_entries, max_bytes),
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &St {
        &self.store
    }
}

impl<St: fmt::Debug> fmt::Debug for ReplayCache<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayCache")
            .field("store", &self.store)
            .field("entries", &self.entries)
            .finish()
    }
}

impl<St: Store> Store for ReplayCache<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        if let Some(completed) = self.entries.as_ref().and_then(|entries| entries.get(id)) {
            return Ok(Claim::Existing(Record::Completed(completed)));
        }
        self.store.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        // Before the write: the store counts the window from a later moment, so the copy dies
        // first.
        let deadline = self.entries.as_ref().and(Entries::deadline(ttl));
        let written = self.store.complete(id, token, completed, ttl).await;
        if let (Some(entries), Some(deadline), Ok(true)) = (&self.entries, deadline, &written) {
            entries.insert(*id, completed.clone(), deadline);
        }
        written
    }

    crate::forward_store!(store => renew, prepare, release, changed);
}

impl<St: OperatorStore> OperatorStore for ReplayCache<St> {
    /// The store's own answer: the cache holds copies of what the store holds, and the operator
    /// asks what the store holds.
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        self.store.inspect(id).await
    }

    /// Forgets the record in the store, and this process's copy of it, whatever the store
    /// answers: a forgotten record is never replayed from here. The copies other processes keep
    /// are theirs (`docs/PROTOCOL.md` §6.7).
    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        if let Some(entries) = &self.entries {
            entries.entries.remove(id);
        }
        let forgotten = self.store.forget(id, force).await;
        // Again: a completion of this process that landed while the store forgot.
        if let Some(entries) = &self.entries {
            entries.entries.remove(id);
        }
        forgotten
    }
}

/// The bytes an entry costs besides its response: the id, fingerprint, deadline and the cache's
/// own bookkeeping, roughly.
const ENTRY_OVERHEAD: usize = 128;

/// A completed record and the moment its copy dies.
#[derive(Clone)]
struct Entry {
    completed: Completed,
    expires: Instant,
}

impl Entry {
    fn size(&self) -> usize {
        let response = self.completed.plain();
        ENTRY_OVERHEAD + response.map_or(0, |response| response.size())
    }
}

/// Weighs an entry by its bytes, and at least by the byte bound's share of one entry: the weights
/// then sum to at most the byte bound only when both the bytes and the count are within bounds.
#[derive(Clone)]
struct Weight {
    least: u64,
}

impl Weighter<RecordId, Entry> for Weight {
    fn weight(&self, _id: &RecordId, entry: &Entry) -> u64 {
        (entry.size() as u64).max(self.least)
    }
}

/// A bounded, concurrent cache of completed records, keyed by [`RecordId`] (which names the scope
/// too, so scopes never share an entry). Clones share the entries.
#[derive(Clone)]
struct Entries {
    entries: Arc<Cache<RecordId, Entry, Weight>>,
    max_entries: usize,
    max_bytes: usize,
}

impl Entries {
    /// A cache of at most about `max_entries` records and `max_bytes` bytes (a bound is exceeded by
    /// at most one entry per shard); `None` when either bound is zero.
    fn new(max_entries: usize, max_bytes: usize) -> Option<Self> {
        if max_entries == 0 || max_bytes == 0 {
            return None;
        }
        let least = (max_bytes as u64).div_ceil(max_entries as u64);
        let entries = Cache::with_weighter(max_entries, max_bytes as u64, Weight { least });
        Some(Self {
            entries: Arc::new(entries),
            max_entries,
            max_bytes,
        })
    }

    /// The deadline of a record completed now with `window`: taken before its write is sent.
    /// `None` for a window past the clock's range (such a record is not cached).
    fn deadline(window: Duration) -> Option<Instant> {
        Instant::now().checked_add(window)
    }

    /// Keeps `completed`, written by this process, until `expires`.
    fn insert(&self, id: RecordId, completed: Completed, expires: Instant) {
        self.entries.insert(id, Entry { completed, expires });
    }

    /// The completed record under `id`, while it lives; an expired entry is dropped.
    fn get(&self, id: &RecordId) -> Option<Completed> {
        let entry = self.entries.get(id)?;
        let now = Instant::now();
        if entry.expires <= now {
            self.entries.remove_if(id, |entry| entry.expires <= now);
            return None;
        }
        Some(entry.completed)
    }
}

impl fmt::Debug for Entries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entries")
            .field("max_entries", &self.max_entries)
            .field("max_bytes", &self.max_bytes)
            .field("len", &self.entries.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Fingerprint, Payload, StoredResponse};

    fn completed(body: usize) -> Completed {
        Completed {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            response: Some(Payload::Plain(Arc::new(StoredResponse {
                status: http::StatusCode::OK,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::from(vec![b'x'; body]),
                trailers: None,
            }))),
            origin: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_bound_is_no_cache() {
        assert!(Entries::new(0, 1 << 20).is_none());
        assert!(Entries::new(10, 0).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn both_bounds_hold() {
        let far = Instant::now() + Duration::from_secs(60);
        let by_count = Entries::new(4, 1 << 20).unwrap();
        for n in 0..20 {
            by_count.insert(RecordId::new(b"", &n.to_string()), completed(10), far);
        }
        assert!(by_count.entries.len() <= 4, "{}", by_count.entries.len());

        let by_bytes = Entries::new(1000, 10_000).unwrap();
        for n in 0..20 {
            by_bytes.insert(RecordId::new(b"", &n.to_string()), completed(1000), far);
        }
        let kept = by_bytes.entries.len();
        assert!(kept <= 10_000 / (1000 + ENTRY_OVERHEAD), "{kept}");

        let too_large = Entries::new(1000, 10_000).unwrap();
        too_large.insert(RecordId::new(b"", "big"), completed(20_000), far);
        assert!(too_large.get(&RecordId::new(b"", "big")).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_record_is_not_replayed_from_the_cache() {
        use crate::MemoryStore;
        let store = ReplayCache::new(MemoryStore::new(), 10, 1 << 20);
        let (id, fp, lease) = (
            RecordId::new(b"acct", "k"),
            Fingerprint::from_bytes([7; 32]),
            Duration::from_secs(30),
        );
        let Ok(Claim::Claimed(token)) = store.claim(&id, &fp, lease).await else {
            panic!("a new key is claimed");
        };
        let window = Duration::from_secs(60);
        assert!(
            store
                .complete(&id, &token, &completed(3), window)
                .await
                .unwrap()
        );
        assert!(store.entries.as_ref().unwrap().get(&id).is_some(), "cached");
        assert!(store.forget(&id, false).await.unwrap().forgotten());
        assert!(
            matches!(store.claim(&id, &fp, lease).await, Ok(Claim::Claimed(_))),
            "the key is new again, not replayed from the cache"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_dies_at_its_deadline() {
        let cache = Entries::new(10, 1 << 20).unwrap();
        let id = RecordId::new(b"", "k");
        cache.insert(id, completed(1), Instant::now() + Duration::from_secs(5));
        tokio::time::advance(Duration::from_millis(4999)).await;
        assert!(cache.get(&id).is_some());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.get(&id).is_none());
        assert_eq!(cache.entries.len(), 0, "the expired entry is dropped");
    }
}
