//! Quotas per scope: a store wrapper that bounds how many bytes of records each scope (each
//! tenant) writes through one instance, so that one tenant cannot fill a shared store for the
//! others ([`ScopeQuota`], `docs/PROTOCOL.md` §3.4).

mod budgets;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use self::budgets::{CLAIM_COST, Quotas, completion_cost};
use super::{Claim, Inspected, OperatorStore, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, InFlight, Record, RecordId};

/// A store that bounds the bytes of records each scope writes through it: through one instance
/// of the layer, at most `bytes` per scope and dedup window (`docs/PROTOCOL.md` §3.4).
///
/// Each scope has a budget of `bytes / 2` that refills at `bytes / 2` per dedup window (the
/// window the layer completes its records with: the `ttl` of the last completion, 24 h until the
/// first). A claim spends 256 bytes; a stored response spends its size (body, headers and
/// trailers). It bounds new writes only: a claim whose scope has less than a claim's cost left is
/// answered from its key's record, read without a claim ([`OperatorStore::inspect`], so the store
/// behind it must have it: a replay, a `409`
/// while it runs, a `422` for another request: nothing written, nothing spent); only one whose
/// key has no record, so that the claim would write one, is refused with
/// [`StoreError::QuotaExceeded`], which the layer answers `429` `quota-exceeded` with a
/// `Retry-After` of the time the budget takes to refill that much (seconds, not the dedup
/// window), fail-open or not: a request past its quota is never run unprotected. Over any dedup
/// window a scope so writes at most `bytes` through one instance, plus the responses of the
/// requests it had running when its budget ran out; with `n` instances, at most `n` times that
/// in the store. Size the store for the tenants you have: `tenants × instances × bytes` never
/// fills it.
///
/// A scope's steady rate is `bytes / 2` per dedup window: `ScopeQuota::new(store, 512 << 20)`
/// with the 24 h window lets a tenant store about 3 KiB of records a second, indefinitely, and
/// 256 MiB in a burst. The scope is the layer's ([`IdempotencyLayer::scope`](crate::IdempotencyLayer::scope)),
/// read from each record id's scope tag; without a scope, every request shares one budget. Put
/// it over a `CircuitBreaker` (feature `circuit-breaker`), not under it, so that a scope past its
/// quota is refused while the breaker is open too. Clones share the budgets.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::store::{MemoryStore, ScopeQuota};
/// use tower_idempotency::{IdempotencyLayer, Rejection, Scope};
///
/// // Each tenant may write at most 64 MiB of records a day through this instance.
/// let store = ScopeQuota::new(MemoryStore::new(), 64 << 20);
/// assert_eq!(store.bytes(), 64 << 20);
/// let layer = IdempotencyLayer::new(store)
///     .scope(|parts: &http::request::Parts| match parts.headers.get("x-account") {
///         Some(account) => Ok(Scope::from(account.as_bytes())),
///         None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
///     });
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct ScopeQuota<St> {
    store: St,
    bytes: u64,
    shared: Arc<Shared>,
}

/// What the clones of one quota share.
struct Shared {
    budgets: Quotas,
    /// The dedup window the budgets refill over, in nanoseconds: the last completion's `ttl`.
    window: AtomicU64,
}

/// The dedup window until a completion says otherwise: the layer's default.
const DEFAULT_WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

impl<St> ScopeQuota<St> {
    /// `store`, with at most `bytes` of records per scope and dedup window written through it
    /// (see the type's documentation for the burst and the steady rate it allows). At least 2
    /// claims' worth (512 bytes).
    ///
    /// ```
    /// use tower_idempotency::store::{MemoryStore, ScopeQuota};
    ///
    /// assert_eq!(ScopeQuota::new(MemoryStore::new(), 0).bytes(), 512);
    /// ```
    pub fn new(store: St, bytes: u64) -> Self {
        let bytes = bytes.max(2 * CLAIM_COST);
        Self {
            store,
            bytes,
            shared: Arc::new(Shared {
                budgets: Quotas::new(bytes),
                window: AtomicU64::new(DEFAULT_WINDOW.as_nanos() as u64),
            }),
        }
    }

    /// The bound it was made with.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The store behind the quota.
    pub fn inner(&self) -> &St {
        &self.store
    }

    fn window(&self) -> Duration {
        Duration::from_nanos(self.shared.window.load(Ordering::Relaxed))
    }

    fn spend(&self, id: &RecordId, bytes: u64) {
        (self.shared.budgets).spend(id.scope_tag(), bytes, self.window(), Instant::now());
    }
}

impl<St: OperatorStore> ScopeQuota<St> {
    /// Answers a claim whose scope is past its quota from its key's record, read without a
    /// claim: a key without a live record is refused (`wait` is the budget's refill time), as is
    /// one the store cannot say anything of (it failed): refused as a new key, never run
    /// unprotected.
    async fn answer_past_quota(&self, id: &RecordId, wait: Duration) -> Result<Claim, StoreError> {
        let record = match self.store.inspect(id).await {
            Ok(Some(Inspected::Completed(view))) => Record::Completed(view.completed),
            Ok(Some(Inspected::InFlight(view))) => Record::InFlight(InFlight {
                fingerprint: view.fingerprint,
                // The store's clock against this one's, as an operator reads it (§10.9); never
                // zero, as a claim's answer never is (a skewed clock would make it so).
                lease_remaining: (view.lease_ends.duration_since(SystemTime::now()))
                    .unwrap_or_default()
                    .max(Duration::from_millis(1)),
            }),
            Err(err @ StoreError::Unreadable(_)) => return Err(err),
            Ok(None) | Err(_) => return Err(StoreError::QuotaExceeded { retry_after: wait }),
        };
        Ok(Claim::Existing(record))
    }
}

impl<St: fmt::Debug> fmt::Debug for ScopeQuota<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopeQuota")
            .field("store", &self.store)
            .field("bytes", &self.bytes)
            .field("window", &self.window())
            .finish_non_exhaustive()
    }
}

impl<St: OperatorStore> Store for ScopeQuota<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let admitted = (self.shared.budgets).admit(id.scope_tag(), self.window(), Instant::now());
        if let Err(wait) = admitted {
            // Boxed: rare, and its read would otherwise swell every claim's future.
            return Box::pin(self.answer_past_quota(id, wait)).await;
        }
        let claim = self.store.claim(id, fingerprint, lease).await;
        if let Ok(Claim::Claimed(_)) = claim {
            self.spend(id, CLAIM_COST);
        }
        claim
    }

    /// Spends the response's size once the store took it: a completion sent again after a
    /// failure is counted once.
    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let nanos = u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.shared.window.store(nanos, Ordering::Relaxed);
        let written = self.store.complete(id, token, completed, ttl).await;
        if let Ok(true) = written {
            self.spend(id, completion_cost(completed));
        }
        written
    }

    crate::forward_store!(store => renew, prepare, release, changed);
}

impl<St: OperatorStore> OperatorStore for ScopeQuota<St> {
    crate::forward_store!(store => inspect, forget);
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::record::Fence;
    use crate::store::{ForgetOutcome, InFlightView, MemoryStore};

    /// A store whose clock is far behind this process's: every record it reads is in flight,
    /// its lease over by this process's clock.
    struct BehindClock(MemoryStore);

    impl Store for BehindClock {
        crate::forward_store!(0 => claim, complete, renew, prepare, release, changed);
    }

    impl OperatorStore for BehindClock {
        async fn inspect(&self, _: &RecordId) -> Result<Option<Inspected>, StoreError> {
            Ok(Some(Inspected::InFlight(InFlightView {
                fingerprint: Fingerprint::from_bytes([1; 32]),
                fence: Fence::new(1),
                lease_ends: UNIX_EPOCH,
            })))
        }

        async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
            self.0.forget(id, force).await
        }
    }

    #[tokio::test]
    async fn a_record_read_past_the_quota_is_in_flight_for_more_than_zero() {
        let store = ScopeQuota::new(BehindClock(MemoryStore::new()), 0);
        let id = RecordId::new(b"acct_1", "k");
        let fingerprint = Fingerprint::from_bytes([1; 32]);
        let lease = Duration::from_secs(30);
        // The only claim the budget holds, then a read.
        assert!(matches!(
            store.claim(&id, &fingerprint, lease).await,
            Ok(Claim::Claimed(_))
        ));
        let Ok(Claim::Existing(Record::InFlight(in_flight))) =
            store.claim(&id, &fingerprint, lease).await
        else {
            panic!("the record, read past the quota");
        };
        assert!(
            in_flight.lease_remaining > Duration::ZERO,
            "§10.1: a claim's in-flight answer has a lease left, whatever the clocks say"
        );
    }
}
