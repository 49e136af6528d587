//! `MemoryStore`: records in this process's memory.

use std::collections::{HashMap, hash_map};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::time::Instant;

mod budget;
mod expiry;
mod scopes;

use super::{
    Claim, CompletedView, ForgetOutcome, InFlightView, Inspected, OperatorStore, Store, StoreError,
};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, Fence, InFlight, Record, RecordId, encode_tombstone};
use budget::{Budget, Refused};
use expiry::{Expiry, Ticket};

const SHARDS: usize = 64;
/// The most due records one store call collects from its shard. More than a call creates (one),
/// so collection keeps up; few enough that records coming due together (all of them, after the
/// store sat idle for a window) are collected over many calls, a few microseconds each, not by one
/// call that holds the shard's lock, and every request waiting on it, for tens of milliseconds.
const COLLECT_PER_CALL: usize = 4;
/// The most due records collected under one hold of a shard's lock when every due record must go
/// (the store is full, or its size is asked): the rest wait for the next hold.
const COLLECT_PER_HOLD: usize = 1024;
/// The default capacity of [`MemoryStore::new`]: 256 MiB.
pub(super) const DEFAULT_CAPACITY: usize = 256 * 1024 * 1024;

/// An in-process store: the embedded default, for one process and for tests.
///
/// - Sharded: 64 independently locked maps, so concurrent requests on different keys do not wait
///   on one lock.
/// - Records expire on time (on [`tokio::time::Instant`], so paused test time drives expiry).
/// - Bounded by bytes. When full it refuses new claims ([`StoreError::Full`], a 503 whose
///   `Retry-After` says when the next record comes due) rather than evict a live record, because
///   evicting a record would silently shorten the dedup window. A completion that does not fit is
///   kept as a tombstone (the operation is never run twice).
/// - Optionally bounded per scope ([`MemoryStore::with_scope_limit`]), so that one tenant filling
///   the store cannot refuse service to the others.
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
    budget: Budget,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<RecordId, Entry>,
    /// When entries come due. The item of an entry that has since been renewed, completed or
    /// removed is cancelled (or, in the shared heap, skipped when it comes due).
    expiry: Expiry,
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
    /// A completed record is kept encoded, as the shared stores keep it (its fingerprint
    /// included): one allocation for the whole record, rather than a response, its header map and
    /// its body held apart for the whole dedup window. A replay decodes it. With the fence of
    /// the claim that completed it, for an operator ([`OperatorStore::inspect`]).
    Completed { encoded: Bytes, fence: Fence },
}

/// A live record as a claim found it, decoded once the shard's lock is let go.
enum Found {
    InFlight(InFlight),
    Completed(Bytes),
}

impl Found {
    fn decode(self) -> Result<Record, StoreError> {
        match self {
            Found::InFlight(in_flight) => Ok(Record::InFlight(in_flight)),
            Found::Completed(bytes) => {
                Record::decode(bytes).map_err(|err| StoreError::Codec(Box::new(err)))
            }
        }
    }
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
        Self::with_budget(Budget::new(bytes, None))
    }

    /// Bounds the records of each scope (each tenant: see
    /// [`IdempotencyLayer::scope`](crate::IdempotencyLayer::scope)) to `bytes`, so that one scope
    /// filling the store cannot lock the others out. A claim past its scope's limit is refused
    /// ([`StoreError::Full`], a 503 whose `Retry-After` says when the scope's next record comes
    /// due), and a completion that does not fit is kept as a tombstone, as when the whole store is
    /// full. Each record then costs about 32 bytes more. Default: no per-scope limit.
    ///
    /// Set it when building the store: the store it returns starts empty, apart from clones of
    /// this one.
    ///
    /// ```
    /// use tower_idempotency::MemoryStore;
    ///
    /// let capacity = 256 * 1024 * 1024;
    /// // No tenant may hold more than a tenth of the store.
    /// let store = MemoryStore::with_capacity(capacity).with_scope_limit(capacity / 10);
    /// # let _ = store;
    /// ```
    pub fn with_scope_limit(self, bytes: usize) -> Self {
        Self::with_budget(Budget::new(self.inner.budget.capacity(), Some(bytes)))
    }

    fn with_budget(budget: Budget) -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                budget,
            }),
        }
    }

    /// The bytes the live records hold now.
    pub fn used_bytes(&self) -> usize {
        self.inner.budget.used()
    }

    /// The number of records, expired ones removed first.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.inner
            .shards
            .iter()
            .map(|shard| self.expire_shard(shard, now).map.len())
            .sum()
    }

    /// Whether the store holds no live record.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::record::{Fingerprint, RecordId};
    /// use tower_idempotency::store::Store;
    /// use tower_idempotency::MemoryStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = MemoryStore::new();
    /// assert!(store.is_empty());
    /// let (id, fingerprint) = (RecordId::new(b"", "k"), Fingerprint::from_bytes([1; 32]));
    /// store.claim(&id, &fingerprint, Duration::from_secs(30)).await?;
    /// assert!(!store.is_empty());
    /// assert_eq!(store.len(), 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, id: &RecordId) -> MutexGuard<'_, Shard> {
        // The id is a hash: its first byte spreads records evenly.
        lock(&self.inner.shards[usize::from(id.as_bytes()[0]) % SHARDS])
    }

    /// The shard of `id`, locked, and the time of this call, once a few of the shard's due
    /// records are collected.
    fn shard_now(&self, id: &RecordId) -> (MutexGuard<'_, Shard>, Instant) {
        let mut shard = self.shard(id);
        let now = Instant::now();
        shard.expire(now, &self.inner.budget, COLLECT_PER_CALL);
        (shard, now)
    }

    /// Collects every record that is due in any shard; returns how long until the next one comes
    /// due.
    fn expire_all(&self) -> Option<Duration> {
        let now = Instant::now();
        let shards = self
            .inner
            .shards
            .iter()
            .filter_map(|shard| self.expire_shard(shard, now).expiry.next_due());
        shards.min().map(|at| at.saturating_duration_since(now))
    }

    /// Collects every record due by `now` in `shard`, letting go of its lock between batches so
    /// that calls on the shard are not held up behind all of them; returns the shard, locked.
    fn expire_shard<'a>(&self, shard: &'a Mutex<Shard>, now: Instant) -> MutexGuard<'a, Shard> {
        loop {
            let mut guard = lock(shard);
            if guard.expire(now, &self.inner.budget, COLLECT_PER_HOLD) < COLLECT_PER_HOLD {
                return guard;
            }
        }
    }

    fn claim_now(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let claimed = match self.try_claim(id, fingerprint, lease) {
            Ok(claimed) => claimed,
            Err(_) => {
                // Full. Records that expired in other shards may still hold bytes: collect them,
                // retry.
                let next_due = self.expire_all();
                // Refused again: say when room may free, when the scope's next completed record
                // comes due, or the store's next record; within a lease when nothing else is known.
                self.try_claim(id, fingerprint, lease).map_err(|refused| {
                    let room_at = match refused {
                        Refused::Scope(room_at) => room_at,
                        Refused::Store => next_due,
                    };
                    StoreError::Full {
                        retry_after: Some(room_at.unwrap_or(lease)),
                    }
                })?
            }
        };
        match claimed {
            Ok(token) => Ok(Claim::Claimed(token)),
            Err(found) => found.decode().map(Claim::Existing),
        }
    }

    /// Claims `id` (its token), or finds its live record; refused when there is no room for a
    /// claim.
    fn try_claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Result<ClaimToken, Found>, Refused> {
        let budget = &self.inner.budget;
        let (mut guard, now) = self.shard_now(id);
        let shard = &mut *guard;
        let new_claim = |expiry: &mut Expiry| {
            budget.reserve(id, budget.overhead(), now)?;
            let (token, mut entry) = Entry::claimed(fingerprint, now + lease, budget.overhead());
            entry.queued = expiry.push(lease, entry.expires_at, *id);
            Ok((token, entry))
        };
        // One probe of the map for both the lookup and the insert.
        let token = match shard.map.entry(*id) {
            hash_map::Entry::Occupied(entry) if entry.get().is_live(now) => {
                return Ok(Err(entry.get().found(now)));
            }
            // Due, but not collected yet: gone. The claim takes its place.
            hash_map::Entry::Occupied(mut entry) => {
                budget.free(id, entry.get().size);
                shard.expiry.cancel(entry.get().queued);
                match new_claim(&mut shard.expiry) {
                    Ok((token, claimed)) => {
                        entry.insert(claimed);
                        token
                    }
                    Err(refused) => {
                        entry.remove();
                        return Err(refused);
                    }
                }
            }
            hash_map::Entry::Vacant(vacant) => {
                let (token, claimed) = new_claim(&mut shard.expiry)?;
                vacant.insert(claimed);
                token
            }
        };
        Ok(Ok(token))
    }

    fn complete_now(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        // Encoded before the shard is locked: the lock is held for the map's work only.
        let mut encoded = match completed.encode() {
            Ok(bytes) => Bytes::from(bytes),
            Err(err) => return Err(StoreError::Codec(Box::new(err))),
        };
        let budget = &self.inner.budget;
        let (mut guard, now) = self.shard_now(id);
        let shard = &mut *guard;
        let entry = match shard.map.entry(*id) {
            hash_map::Entry::Occupied(entry) if entry.get().is_owned_by(token, now) => {
                entry.into_mut()
            }
            // This completion, sent again: already written.
            hash_map::Entry::Occupied(entry) if entry.get().holds(&encoded, now) => {
                return Ok(true);
            }
            hash_map::Entry::Occupied(entry) if entry.get().is_live(now) => return Ok(false),
            // The claim ran out (due, not collected yet) and nobody claimed the key since: the
            // work did run, so its result takes the place of the stale claim.
            hash_map::Entry::Occupied(mut entry) => {
                budget.free(id, entry.get().size);
                shard.expiry.cancel(entry.get().queued);
                if budget.reserve(id, budget.overhead(), now).is_err() {
                    entry.remove();
                    return Err(StoreError::Full { retry_after: None });
                }
                entry.insert(Entry::bare(now, budget.overhead()));
                entry.into_mut()
            }
            hash_map::Entry::Vacant(vacant) => {
                if budget.reserve(id, budget.overhead(), now).is_err() {
                    return Err(StoreError::Full { retry_after: None });
                }
                vacant.insert(Entry::bare(now, budget.overhead()))
            }
        };
        // The entry holds only its overhead so far, which covers a tombstone: reserve a
        // response's encoded bytes, or a trace origin's (without room, the bare tombstone
        // below keeps neither).
        let bare = completed.response.is_none() && completed.origin.is_none();
        let extra = if bare { 0 } else { encoded.len() };
        match budget.reserve(id, extra, now) {
            Ok(()) => entry.size += extra,
            Err(refused) => {
                tracing::warn!(
                    target: "tower_idempotency",
                    bytes = entry.size + extra,
                    full = if refused == Refused::Store { "store" } else { "scope" },
                    "memory store full: keeping a tombstone instead of the response"
                );
                encoded = Bytes::from(encode_tombstone(&completed.fingerprint));
            }
        }
        entry.state = State::Completed {
            encoded,
            fence: token.fence(),
        };
        entry.expires_at = now + ttl;
        budget.completed(id, entry.expires_at, now);
        shard.expiry.cancel(entry.queued);
        entry.queued = shard.expiry.push(ttl, entry.expires_at, *id);
        Ok(true)
    }

    /// Extends the in-flight entry claimed with `token` to `lease` from now, and queues its new
    /// expiry; `false`, and no change, when the entry is gone or carries another claim's token.
    fn renew_now(&self, id: &RecordId, token: &ClaimToken, lease: Duration) -> bool {
        let (mut guard, now) = self.shard_now(id);
        let shard = &mut *guard;
        let Some(entry) = shard.map.get_mut(id).filter(|e| e.is_owned_by(token, now)) else {
            return false;
        };
        entry.expires_at = now + lease;
        shard.expiry.cancel(entry.queued);
        entry.queued = shard.expiry.push(lease, entry.expires_at, *id);
        true
    }

    fn release_now(&self, id: &RecordId, token: &ClaimToken) -> bool {
        let (mut shard, now) = self.shard_now(id);
        if !shard.map.get(id).is_some_and(|e| e.is_owned_by(token, now)) {
            return false;
        }
        if let Some(entry) = shard.map.remove(id) {
            shard.expiry.cancel(entry.queued);
            self.inner.budget.free(id, entry.size);
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

impl OperatorStore for MemoryStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        let (shard, now) = self.shard_now(id);
        let seen = shard
            .map
            .get(id)
            .filter(|entry| entry.is_live(now))
            .map(|entry| entry.seen(now));
        drop(shard);
        seen.map(Seen::decode).transpose()
    }

    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        let (mut guard, now) = self.shard_now(id);
        let shard = &mut *guard;
        let Some(entry) = shard.map.get(id).filter(|entry| entry.is_live(now)) else {
            return Ok(ForgetOutcome::Absent);
        };
        let seen = entry.seen(now);
        if let (Seen::InFlight(view), false) = (&seen, force) {
            return Ok(ForgetOutcome::Refused(view.clone()));
        }
        // The next claim's fence comes from the process's clock and counter, past every fence
        // this store gave: forgetting the record loses nothing fences need.
        if let Some(entry) = shard.map.remove(id) {
            shard.expiry.cancel(entry.queued);
            self.inner.budget.free(id, entry.size);
        }
        drop(guard);
        seen.decode().map(ForgetOutcome::Forgotten)
    }
}

/// A live record as an operator reads it, decoded once the shard's lock is let go.
enum Seen {
    InFlight(InFlightView),
    Completed {
        encoded: Bytes,
        fence: Fence,
        expires: SystemTime,
    },
}

impl Seen {
    fn decode(self) -> Result<Inspected, StoreError> {
        match self {
            Seen::InFlight(view) => Ok(Inspected::InFlight(view)),
            Seen::Completed {
                encoded,
                fence,
                expires,
            } => match Record::decode(encoded) {
                Ok(Record::Completed(completed)) => Ok(Inspected::Completed(CompletedView {
                    completed,
                    fence: Some(fence),
                    expires,
                })),
                Ok(Record::InFlight(_)) => Err(StoreError::Codec(
                    "a completed entry holds an in-flight record".into(),
                )),
                Err(err) => Err(StoreError::Codec(Box::new(err))),
            },
        }
    }
}

impl Shard {
    /// Removes up to `limit` records whose time has come; returns how many it removed. Records
    /// due but not removed yet count as gone (see [`Entry::is_live`]) and still hold their bytes.
    fn expire(&mut self, now: Instant, budget: &Budget, limit: usize) -> usize {
        let mut removed = 0;
        while removed < limit
            && let Some(id) = self.expiry.pop_due(now)
        {
            if self.map.get(&id).is_some_and(|e| !e.is_live(now))
                && let Some(entry) = self.map.remove(&id)
            {
                budget.free(&id, entry.size);
                removed += 1;
            }
        }
        removed
    }
}

impl Entry {
    /// A new in-flight entry, and the token of its claim.
    fn claimed(fingerprint: &Fingerprint, expires_at: Instant, size: usize) -> (ClaimToken, Self) {
        // The process's clock, always past the last fence it gave: larger than the fence of any
        // earlier claim of this key that this store made.
        let token = ClaimToken::new(Fence::next_in_process());
        let entry = Self {
            state: State::InFlight {
                token,
                fingerprint: *fingerprint,
            },
            expires_at,
            size,
            queued: None,
        };
        (token, entry)
    }

    /// An entry that holds only its overhead, for a completion to fill in.
    fn bare(now: Instant, size: usize) -> Self {
        Self {
            state: State::Completed {
                encoded: Bytes::new(),
                fence: Fence::new(0),
            },
            expires_at: now,
            size,
            queued: None,
        }
    }

    /// Whether the entry is live and in flight under `token`'s claim.
    fn is_owned_by(&self, token: &ClaimToken, now: Instant) -> bool {
        self.is_live(now) && matches!(&self.state, State::InFlight { token: t, .. } if t == token)
    }

    /// Whether the entry is live and holds exactly this completed record.
    fn holds(&self, encoded: &Bytes, now: Instant) -> bool {
        self.is_live(now)
            && matches!(&self.state, State::Completed { encoded: e, .. } if e == encoded)
    }

    /// Whether the entry has not expired by `now`. An expired entry can stay in the map for a
    /// moment after it comes due (until its shard collects it), and counts as gone.
    fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }

    /// The record as an operator reads it, its times on the wall clock, as far as it can be read
    /// under the shard's lock: an encoded one is decoded after.
    fn seen(&self, now: Instant) -> Seen {
        // The entry's expiry is on tokio's clock: on the wall clock, as far from now.
        let at = SystemTime::now() + self.expires_at.saturating_duration_since(now);
        match &self.state {
            State::InFlight { token, fingerprint } => Seen::InFlight(InFlightView {
                fingerprint: *fingerprint,
                fence: token.fence(),
                lease_ends: at,
            }),
            State::Completed { encoded, fence } => Seen::Completed {
                encoded: encoded.clone(),
                fence: *fence,
                expires: at,
            },
        }
    }

    /// The record, as far as it can be read under the shard's lock: an encoded one is decoded
    /// after.
    fn found(&self, now: Instant) -> Found {
        match &self.state {
            State::InFlight { fingerprint, .. } => Found::InFlight(InFlight {
                fingerprint: *fingerprint,
                lease_remaining: self.expires_at.saturating_duration_since(now),
            }),
            State::Completed { encoded, .. } => Found::Completed(encoded.clone()),
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while a shard was locked cannot leave it half-updated in a way that matters more
    // than losing every record: keep serving.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
