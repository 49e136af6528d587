//! `MemoryStore`: records in this process's memory.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque, hash_map};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::{Claim, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, InFlight, Record, RecordId};

/// What one record costs beyond its response: the key and entry (120 bytes in a map that is at
/// most 7/8 full, and about two thirds on average), and its expiry items (40 bytes each, in queues
/// that grow by doubling).
const ENTRY_OVERHEAD: usize = 256;
const SHARDS: usize = 64;
/// How many distinct durations get an expiry lane of their own in each shard; items with any other
/// duration share a heap.
const LANES: usize = 8;
/// The default capacity of [`MemoryStore::new`]: 256 MiB.
pub const DEFAULT_CAPACITY: usize = 256 * 1024 * 1024;

/// An in-process store: the embedded default, for one process and for tests.
///
/// - Sharded: 64 independently locked maps, so concurrent requests on different keys do not wait
///   on one lock.
/// - Records expire on time (on [`tokio::time::Instant`], so paused test time drives expiry).
/// - Bounded by bytes. When full it refuses new claims ([`StoreError::Full`], a 503) rather than
///   evict a live record, because evicting a record would silently shorten the dedup window. A
///   completion that does not fit is kept as a tombstone (the operation is never run twice).
///
/// Records are not shared between processes: behind a load balancer, use a shared store such as
/// `RedisStore`.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::with_capacity(64 * 1024 * 1024));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    used: AtomicUsize,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<RecordId, Entry>,
    /// When entries come due. The item of an entry that has since been renewed, completed or
    /// removed is cancelled (or, in the shared heap, skipped when it comes due).
    expiry: Expiry,
}

/// Expiry times, each taken out once it is due.
///
/// A store is used with a few fixed durations (a layer's lease and dedup window), and items queued
/// with one duration under the shard's lock come due in the order they were queued. So each
/// duration gets a FIFO lane: pushing and popping are O(1) and touch memory in order. A binary
/// heap of all the items would take a cache miss per level to pop, once per request, from a queue
/// of millions. Durations beyond the first [`LANES`] share such a heap.
///
/// An item in a lane is cancelled in place when its entry's expiry changes (a claim completes) or
/// the entry goes, so that collecting it later needs no lookup in a map far larger than the
/// caches: every new key's lease item would otherwise cost one.
#[derive(Debug, Default)]
struct Expiry {
    lanes: Vec<Lane>,
    heap: BinaryHeap<Reverse<(Instant, RecordId)>>,
}

#[derive(Debug)]
struct Lane {
    after: Duration,
    /// The sequence number of the item at the front of `queue`.
    front: u64,
    queue: VecDeque<Due>,
}

/// A queued expiry; `id` is `None` once cancelled.
#[derive(Debug)]
struct Due {
    at: Instant,
    id: Option<RecordId>,
}

/// Where an item sits in the lanes: its lane and sequence number.
#[derive(Debug, Clone, Copy)]
struct Ticket {
    lane: usize,
    seq: u64,
}

#[derive(Debug)]
struct Entry {
    state: State,
    expires_at: Instant,
    size: usize,
    /// Where the entry's expiry is queued, to cancel it there when the entry changes or goes.
    queued: Option<Ticket>,
}

#[derive(Debug)]
enum State {
    InFlight {
        token: ClaimToken,
        fingerprint: Fingerprint,
    },
    Completed(Completed),
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store bounded to 256 MiB of records.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// A store bounded to `bytes` of records (responses plus a per-record overhead of about
    /// 256 bytes).
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                used: AtomicUsize::new(0),
                capacity: bytes,
            }),
        }
    }

    /// The bytes the live records hold now.
    pub fn used_bytes(&self) -> usize {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// The number of records, expired ones removed first.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.inner
            .shards
            .iter()
            .map(|shard| {
                let mut shard = lock(shard);
                shard.expire(now, &self.inner.used);
                shard.map.len()
            })
            .sum()
    }

    /// Whether the store holds no live record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, id: &RecordId) -> MutexGuard<'_, Shard> {
        // The id is a hash: its first byte spreads records evenly.
        lock(&self.inner.shards[usize::from(id.as_bytes()[0]) % SHARDS])
    }

    fn reserve(&self, bytes: usize) -> bool {
        self.inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes)
                    .filter(|total| *total <= self.inner.capacity)
            })
            .is_ok()
    }

    fn free(&self, bytes: usize) {
        self.inner.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn expire_all(&self) {
        for shard in self.inner.shards.iter() {
            let mut shard = lock(shard);
            shard.expire(Instant::now(), &self.inner.used);
        }
    }

    fn claim_now(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        if let Some(claim) = self.try_claim(id, fingerprint, lease) {
            return Ok(claim);
        }
        // Full. Records that expired in other shards may still hold bytes: collect them, retry.
        self.expire_all();
        self.try_claim(id, fingerprint, lease)
            .ok_or(StoreError::Full)
    }

    /// Claims `id`, or returns its live record; `None` when the store has no room for a claim.
    fn try_claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Option<Claim> {
        let mut guard = self.shard(id);
        let now = Instant::now();
        guard.expire(now, &self.inner.used);
        let shard = &mut *guard;
        let new_claim = |expiry: &mut Expiry| {
            if !self.reserve(ENTRY_OVERHEAD) {
                return None;
            }
            let (token, mut entry) = Entry::claimed(fingerprint, now + lease);
            entry.queued = expiry.push(lease, entry.expires_at, *id);
            Some((token, entry))
        };
        // One probe of the map for both the lookup and the insert.
        let token = match shard.map.entry(*id) {
            hash_map::Entry::Occupied(entry) if entry.get().is_live(now) => {
                return Some(Claim::Existing(entry.get().record(now)));
            }
            // Due, but not collected yet: gone. The claim takes its place.
            hash_map::Entry::Occupied(mut entry) => {
                self.free(entry.get().size);
                shard.expiry.cancel(entry.get().queued);
                let Some((token, claimed)) = new_claim(&mut shard.expiry) else {
                    entry.remove();
                    return None;
                };
                entry.insert(claimed);
                token
            }
            hash_map::Entry::Vacant(vacant) => {
                let (token, claimed) = new_claim(&mut shard.expiry)?;
                vacant.insert(claimed);
                token
            }
        };
        Some(Claim::Claimed(token))
    }

    fn complete_now(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut guard = self.shard(id);
        let now = Instant::now();
        guard.expire(now, &self.inner.used);
        let shard = &mut *guard;
        let entry = match shard.map.entry(*id) {
            hash_map::Entry::Occupied(entry) if entry.get().is_owned_by(token, now) => {
                entry.into_mut()
            }
            hash_map::Entry::Occupied(entry) if entry.get().is_live(now) => return Ok(false),
            // The claim ran out (due, not collected yet) and nobody claimed the key since: the
            // work did run, so its result takes the place of the stale claim.
            hash_map::Entry::Occupied(mut entry) => {
                self.free(entry.get().size);
                shard.expiry.cancel(entry.get().queued);
                if !self.reserve(ENTRY_OVERHEAD) {
                    entry.remove();
                    return Err(StoreError::Full);
                }
                entry.insert(Entry::bare(completed, now));
                entry.into_mut()
            }
            hash_map::Entry::Vacant(vacant) => {
                if !self.reserve(ENTRY_OVERHEAD) {
                    return Err(StoreError::Full);
                }
                vacant.insert(Entry::bare(completed, now))
            }
        };
        // The entry holds only its overhead so far: reserve the response's bytes.
        let extra = completed.response.as_ref().map_or(0, |r| r.size());
        let mut completed = completed.clone();
        if self.reserve(extra) {
            entry.size += extra;
        } else {
            tracing::warn!(
                target: "tower_idempotency",
                bytes = ENTRY_OVERHEAD + extra,
                "memory store full: keeping a tombstone instead of the response"
            );
            completed.response = None;
        }
        entry.state = State::Completed(completed);
        entry.expires_at = now + ttl;
        shard.expiry.cancel(entry.queued);
        entry.queued = shard.expiry.push(ttl, entry.expires_at, *id);
        Ok(true)
    }

    fn renew_now(&self, id: &RecordId, token: &ClaimToken, lease: Duration) -> bool {
        self.update_owned(id, token, lease, |entry, now| {
            entry.expires_at = now + lease
        })
    }

    /// Changes the in-flight entry claimed with `token`, which then expires `after` from now, and
    /// queues its new expiry; `false`, and no change, when the entry is gone or carries another
    /// claim's token.
    fn update_owned(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        after: Duration,
        change: impl FnOnce(&mut Entry, Instant),
    ) -> bool {
        let mut guard = self.shard(id);
        let now = Instant::now();
        guard.expire(now, &self.inner.used);
        let shard = &mut *guard;
        let Some(entry) = shard.map.get_mut(id).filter(|e| e.is_owned_by(token, now)) else {
            return false;
        };
        change(entry, now);
        shard.expiry.cancel(entry.queued);
        entry.queued = shard.expiry.push(after, entry.expires_at, *id);
        true
    }

    fn release_now(&self, id: &RecordId, token: &ClaimToken) -> bool {
        let mut shard = self.shard(id);
        let now = Instant::now();
        shard.expire(now, &self.inner.used);
        if !shard.map.get(id).is_some_and(|e| e.is_owned_by(token, now)) {
            return false;
        }
        if let Some(entry) = shard.map.remove(id) {
            shard.expiry.cancel(entry.queued);
            self.free(entry.size);
        }
        true
    }
}

impl Store for MemoryStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.claim_now(id, fingerprint, lease)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.complete_now(id, token, completed, ttl)
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.renew_now(id, token, lease))
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        Ok(self.release_now(id, token))
    }
}

impl Shard {
    /// Removes every record whose time has come.
    fn expire(&mut self, now: Instant, used: &AtomicUsize) {
        while let Some(id) = self.expiry.pop_due(now) {
            if self.map.get(&id).is_some_and(|e| !e.is_live(now))
                && let Some(entry) = self.map.remove(&id)
            {
                used.fetch_sub(entry.size, Ordering::AcqRel);
            }
        }
    }
}

impl Entry {
    /// A new in-flight entry, and the token of its claim.
    fn claimed(fingerprint: &Fingerprint, expires_at: Instant) -> (ClaimToken, Self) {
        let token = ClaimToken::generate();
        let entry = Self {
            state: State::InFlight {
                token,
                fingerprint: *fingerprint,
            },
            expires_at,
            size: ENTRY_OVERHEAD,
            queued: None,
        };
        (token, entry)
    }

    /// An entry that holds only its overhead, for a completion to fill in.
    fn bare(completed: &Completed, now: Instant) -> Self {
        Self {
            state: State::Completed(Completed {
                fingerprint: completed.fingerprint,
                response: None,
            }),
            expires_at: now,
            size: ENTRY_OVERHEAD,
            queued: None,
        }
    }

    /// Whether the entry is live and in flight under `token`'s claim.
    fn is_owned_by(&self, token: &ClaimToken, now: Instant) -> bool {
        self.is_live(now) && matches!(&self.state, State::InFlight { token: t, .. } if t == token)
    }

    /// Whether the entry has not expired by `now`. An expired entry can stay in the map for a
    /// moment after it comes due (until its shard collects it), and counts as gone.
    fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }

    fn record(&self, now: Instant) -> Record {
        match &self.state {
            State::InFlight { fingerprint, .. } => Record::InFlight(InFlight {
                fingerprint: *fingerprint,
                lease_remaining: self.expires_at.saturating_duration_since(now),
            }),
            State::Completed(completed) => Record::Completed(completed.clone()),
        }
    }
}

impl Expiry {
    /// Queues `id` to come due at `at`, which is `after` from now. Returns where it sits, unless
    /// it went to the shared heap (which cannot cancel).
    fn push(&mut self, after: Duration, at: Instant, id: RecordId) -> Option<Ticket> {
        let index = match self.lanes.iter().position(|lane| lane.after == after) {
            Some(index) => index,
            None if self.lanes.len() < LANES => {
                self.lanes.push(Lane {
                    after,
                    front: 0,
                    queue: VecDeque::new(),
                });
                self.lanes.len() - 1
            }
            None => {
                self.heap.push(Reverse((at, id)));
                return None;
            }
        };
        let lane = &mut self.lanes[index];
        // Times are read under the shard's lock, so they arrive in order; should the clock ever
        // step back, the item comes due with the one before it, and the entry's own time still
        // decides whether it is live.
        let at = lane.queue.back().map_or(at, |last| at.max(last.at));
        lane.queue.push_back(Due { at, id: Some(id) });
        Some(Ticket {
            lane: index,
            seq: lane.front + (lane.queue.len() as u64 - 1),
        })
    }

    /// Cancels the item at `ticket`, if it is still queued.
    fn cancel(&mut self, ticket: Option<Ticket>) {
        let Some(Ticket { lane, seq }) = ticket else {
            return;
        };
        let lane = &mut self.lanes[lane];
        if let Some(index) = seq.checked_sub(lane.front)
            && let Some(due) = usize::try_from(index)
                .ok()
                .and_then(|index| lane.queue.get_mut(index))
        {
            due.id = None;
        }
    }

    /// Takes out one item that is due by `now`, dropping the cancelled items ahead of it.
    fn pop_due(&mut self, now: Instant) -> Option<RecordId> {
        for lane in &mut self.lanes {
            while let Some(due) = lane.queue.front() {
                let (at, id) = (due.at, due.id);
                if id.is_some() && at > now {
                    break;
                }
                lane.queue.pop_front();
                lane.front += 1;
                if id.is_some() {
                    return id;
                }
            }
        }
        if self.heap.peek().is_some_and(|Reverse((at, _))| *at <= now) {
            return self.heap.pop().map(|Reverse((_, id))| id);
        }
        None
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while a shard was locked cannot leave it half-updated in a way that matters more
    // than losing every record: keep serving.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::StoredResponse;

    fn completed(body: usize) -> Completed {
        Completed {
            fingerprint: Fingerprint::from_bytes([1; 32]),
            response: Some(Arc::new(StoredResponse {
                status: http::StatusCode::OK,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::from(vec![b'x'; body]),
            })),
        }
    }

    fn claim(store: &MemoryStore, n: u32) -> Result<Claim, StoreError> {
        store.claim_now(
            &RecordId::new(b"", &n.to_string()),
            &Fingerprint::from_bytes([1; 32]),
            Duration::from_secs(30),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn full_store_refuses_new_claims_and_keeps_live_records() {
        let store = MemoryStore::with_capacity(ENTRY_OVERHEAD * 3);
        for n in 0..3 {
            assert!(matches!(claim(&store, n), Ok(Claim::Claimed(_))));
        }
        assert!(matches!(claim(&store, 3), Err(StoreError::Full)));
        // The live records are all still there.
        for n in 0..3 {
            assert!(matches!(claim(&store, n), Ok(Claim::Existing(_))));
        }
        // Once their leases run out, their bytes are free again.
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(matches!(claim(&store, 3), Ok(Claim::Claimed(_))));
        assert_eq!(store.len(), 1);
        assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_that_does_not_fit_is_a_tombstone() {
        let store = MemoryStore::with_capacity(ENTRY_OVERHEAD + 100);
        let id = RecordId::new(b"", "k");
        let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
            panic!()
        };
        assert!(
            store
                .complete_now(&id, &token, &completed(1000), Duration::from_secs(60))
                .unwrap()
        );
        let Ok(Claim::Existing(Record::Completed(c))) = claim_id(&store, &id) else {
            panic!()
        };
        assert!(c.response.is_none());
        assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_are_accounted_through_complete_and_expiry() {
        let store = MemoryStore::new();
        let id = RecordId::new(b"", "k");
        let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
            panic!()
        };
        let done = completed(1000);
        assert!(
            store
                .complete_now(&id, &token, &done, Duration::from_secs(60))
                .unwrap()
        );
        assert_eq!(
            store.used_bytes(),
            ENTRY_OVERHEAD + done.response.as_ref().unwrap().size()
        );
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(store.len(), 0);
        assert_eq!(store.used_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn records_with_many_durations_all_expire() {
        // More distinct durations than lanes: the rest go through the shared heap.
        let store = MemoryStore::new();
        let durations = (1..=LANES as u64 * 2).map(Duration::from_secs);
        for (n, lease) in durations.clone().enumerate() {
            let id = RecordId::new(b"", &n.to_string());
            let claimed = store.claim_now(&id, &Fingerprint::from_bytes([1; 32]), lease);
            assert!(matches!(claimed, Ok(Claim::Claimed(_))));
        }
        for (n, lease) in durations.enumerate() {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_eq!(store.len(), LANES * 2 - n - 1, "after {lease:?}");
        }
        assert_eq!(store.used_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn durations_beyond_the_lanes_share_the_heap() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let id = RecordId::new(b"", "k");
        for seconds in 1..=LANES as u64 * 2 {
            let after = Duration::from_secs(seconds);
            let ticket = expiry.push(after, now + after, id);
            assert_eq!(ticket.is_some(), seconds <= LANES as u64, "{seconds} s");
        }
        assert_eq!(expiry.lanes.len(), LANES);
        assert_eq!(expiry.heap.len(), LANES);
        // Each item comes due at its own time, in a lane or in the heap.
        for seconds in 1..=LANES as u64 * 2 {
            assert_eq!(expiry.pop_due(now + Duration::from_secs(seconds)), Some(id));
            assert_eq!(expiry.pop_due(now + Duration::from_secs(seconds)), None);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_stays_in_order_when_a_time_arrives_late() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let lease = Duration::from_secs(10);
        let (a, b) = (RecordId::new(b"", "a"), RecordId::new(b"", "b"));
        expiry.push(lease, now + lease, a);
        // An earlier time behind a later one comes due with the later one, not before.
        expiry.push(lease, now + Duration::from_secs(5), b);
        assert_eq!(expiry.pop_due(now + Duration::from_secs(5)), None);
        assert_eq!(expiry.pop_due(now + lease), Some(a));
        assert_eq!(expiry.pop_due(now + lease), Some(b));
        assert_eq!(expiry.pop_due(now + lease), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_item_never_comes_due() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let lease = Duration::from_secs(10);
        let (a, b) = (RecordId::new(b"", "a"), RecordId::new(b"", "b"));
        let ticket = expiry.push(lease, now + lease, a);
        expiry.push(lease, now + lease, b);
        expiry.cancel(ticket);
        assert_eq!(expiry.pop_due(now + lease), Some(b));
        assert_eq!(expiry.pop_due(now + lease), None);
        // A ticket whose item has gone cancels nothing.
        expiry.cancel(ticket);
        let c = RecordId::new(b"", "c");
        expiry.push(lease, now + lease, c);
        assert_eq!(expiry.pop_due(now + lease), Some(c));
    }

    #[tokio::test(start_paused = true)]
    async fn a_completed_claim_leaves_no_lease_item_behind() {
        let store = MemoryStore::new();
        let id = RecordId::new(b"", "k");
        let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
            panic!()
        };
        assert!(
            store
                .complete_now(&id, &token, &completed(10), Duration::from_secs(60))
                .unwrap()
        );
        // The lease item was cancelled, and the next call on the shard drops it, long before the
        // lease would have run out: only the completion's item is left.
        store.len();
        let queued: usize = {
            let shard = store.shard(&id);
            shard.expiry.lanes.iter().map(|lane| lane.queue.len()).sum()
        };
        assert_eq!(queued, 1);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(store.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_due_but_not_yet_collected_counts_as_gone() {
        let store = MemoryStore::new();
        let id = RecordId::new(b"", "k");
        let Ok(Claim::Claimed(old)) = claim_id(&store, &id) else {
            panic!()
        };
        // Make the entry due without its queue item coming due: nothing collects it.
        {
            let mut shard = store.shard(&id);
            shard.map.get_mut(&id).unwrap().expires_at = Instant::now();
        }
        // Its owner can no longer complete, renew or release it...
        assert!(!store.renew_now(&id, &old, Duration::from_secs(30)));
        assert!(!store.release_now(&id, &old));
        // ...and a new claim takes its place, with its bytes counted once.
        let Ok(Claim::Claimed(new)) = claim_id(&store, &id) else {
            panic!("the due entry was served as live")
        };
        assert_ne!(new, old);
        assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
        assert!(
            store
                .complete_now(&id, &new, &completed(10), Duration::from_secs(60))
                .unwrap()
        );
    }

    fn claim_id(store: &MemoryStore, id: &RecordId) -> Result<Claim, StoreError> {
        store.claim_now(
            id,
            &Fingerprint::from_bytes([1; 32]),
            Duration::from_secs(30),
        )
    }
}
