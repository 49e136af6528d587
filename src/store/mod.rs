//! Where records live: the [`Store`] trait and its implementations.
//!
//! The trait is atomic, not get/put: [`Store::claim`] either claims a key or returns the record that
//! is already there, in one step, so two instances can never both run a handler for one key.
//! [`Store::complete`], [`Store::renew`] and [`Store::release`] take the claim's [`ClaimToken`] and
//! do nothing (returning `Ok(false)`) when the record is not that claim's in-flight record: an
//! owner whose lease ran out and whose key was claimed again cannot overwrite or free the new
//! owner's record. `complete` alone also answers `Ok(true)` in two other cases: where the key has
//! no record left, it writes the completion (the work ran, so its result is kept); where the key
//! already holds exactly this completion (sent again after its answer was lost), it writes nothing.
//!
//! Each method's documentation says what the contract suite (the crate `tower-idempotency-test`)
//! checks of it; `docs/PROTOCOL.md` §10.1 and §10.2 are the rules in full.
//!
//! Stores know nothing of HTTP services: the idempotent consumer uses the same trait.
//!
//! A store chosen at run time goes behind [`BoxStore`], so that the layer's type does not depend
//! on it; `Arc<S>` is a store wherever `S` is.

// First: the wrappers below forward through its macro.
mod forward;

mod boxed;
#[cfg(feature = "circuit-breaker")]
mod circuit_breaker;
mod inspect;
mod memory;
#[cfg(feature = "replay-cache")]
mod replay_cache;
#[cfg(feature = "scope-quota")]
mod scope_quota;

use std::future::Future;
use std::time::Duration;

pub use boxed::BoxStore;
#[cfg(feature = "circuit-breaker")]
#[cfg_attr(docsrs, doc(cfg(feature = "circuit-breaker")))]
pub use circuit_breaker::CircuitBreaker;
#[cfg(feature = "circuit-breaker")]
pub(crate) use circuit_breaker::Entered;
pub use inspect::{CompletedView, ForgetOutcome, InFlightView, Inspected};
pub use memory::MemoryStore;
#[cfg(feature = "replay-cache")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay-cache")))]
pub use replay_cache::ReplayCache;
#[cfg(feature = "scope-quota")]
#[cfg_attr(docsrs, doc(cfg(feature = "scope-quota")))]
pub use scope_quota::ScopeQuota;

/// `http`, for [`forward_store!`](crate::forward_store) to name `http::Extensions` whatever the
/// calling crate depends on.
#[doc(hidden)]
pub use http as __http;

use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, Record, RecordId};

/// The answer to [`Store::claim`].
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The key was free and is now claimed for the lease; the token fences later writes.
    Claimed(ClaimToken),
    /// The key already has a record; nothing was written.
    Existing(Record),
}

/// A store failed, or refused the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store (or the record's share of it) is full and refuses new claims rather than evict a
    /// live record.
    #[error("the store is full")]
    Full {
        /// When room is expected to free up, if the store knows: the layer's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// The store did not answer in time.
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    /// The store could not be reached or failed.
    #[error("the store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A completion's transaction did not commit, or may not have: the work's own writes, made in
    /// that transaction, are undone or unknown, so the work must not be reported as done. Nothing
    /// is retried: the record was released, or is left for its lease to settle. Only a store
    /// whose completion commits with the work's effects ([`Store::prepare`]) returns it.
    #[error("the work's transaction did not commit with its record")]
    Aborted(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A completion's transaction was refused for a reason that sending it again cannot fix: the
    /// work's own writes broke a rule of the database (an integrity constraint, invalid data, an
    /// object that does not exist). It rolled back, and the claim was released: the work is not
    /// done, and the same work sent again is refused again until the data it conflicts with
    /// changes. Only a store whose completion commits with the work's effects
    /// ([`Store::prepare`]) returns it.
    #[error("the work's transaction was refused: its writes cannot commit as they are")]
    Rejected(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The stored bytes could not be read or written.
    #[error("a record could not be encoded or decoded")]
    Codec(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The key holds a record whose response cannot be trusted: sealed, and it does not open
    /// (changed, moved from another key, sealed under a retired key), or in clear where sealed
    /// records are required (a `SealedStore`, feature `seal`). Not a failure of the store: the
    /// layer answers `500 record-unreadable`, fail-open or not, and neither replays the record
    /// nor runs the request.
    #[error("the record under the key cannot be opened")]
    Unreadable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store was not called: a circuit breaker in front of it (`CircuitBreaker`, feature
    /// `circuit-breaker`) is open, because the store kept failing. Nothing was read or written.
    /// The layer answers `503` with `retry_after` as its `Retry-After`, or runs the request
    /// unprotected when it fails open.
    #[error("the store was not called: its circuit breaker is open")]
    CircuitOpen {
        /// How long the breaker stays open (zero while its probe runs).
        retry_after: Duration,
    },
    /// The claim's scope has written its quota of records (`ScopeQuota`, feature `scope-quota`),
    /// and its key has no record to answer from: nothing was written. The layer answers `429`,
    /// fail-open or not.
    #[error("the scope has written its quota of records")]
    QuotaExceeded {
        /// How long until the scope's budget has room for a claim.
        retry_after: Duration,
    },
}

/// A place to keep idempotency records, shared by every instance that must agree on them.
///
/// Every method is atomic. Implementations return `impl Future + Send`, so they can be written
/// with `async fn` and nothing is boxed.
///
/// Every call must finish, or fail with [`StoreError::Timeout`], within a bound of the store's own
/// (`RedisStore::with_timeout`, 1 s by default; the memory store never waits on anything but its
/// own locks): the layer and the consumer add no timeout of their own, so that each call has one
/// bound, set where the transport is known. A store that can hang hangs the requests that use it.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::store::{Claim, MemoryStore, Store};
/// use tower_idempotency::record::{Completed, Fingerprint, Record, RecordId};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::store::StoreError> {
/// let store = MemoryStore::new();
/// let id = RecordId::new(b"acct_1", "order-42");
/// let fingerprint = Fingerprint::from_bytes([1; 32]);
///
/// let Claim::Claimed(token) = store.claim(&id, &fingerprint, Duration::from_secs(30)).await? else {
///     unreachable!("a new key is free");
/// };
/// // A second claim sees the first one's record.
/// assert!(matches!(
///     store.claim(&id, &fingerprint, Duration::from_secs(30)).await?,
///     Claim::Existing(Record::InFlight(_))
/// ));
/// let done = Completed::tombstone(fingerprint);
/// assert!(store.complete(&id, &token, &done, Duration::from_secs(86_400)).await?);
/// # Ok(())
/// # }
/// ```
pub trait Store: Send + Sync + 'static {
    /// Claims `id` for `lease` if it has no live record (none, or one past its expiry): writes an
    /// in-flight record with `fingerprint` and a new token, whose [`Fence`](crate::record::Fence)
    /// is larger than that of every earlier claim of `id` (§5.3), and answers [`Claim::Claimed`]
    /// with it. Otherwise writes nothing, whatever `fingerprint` is, and answers
    /// [`Claim::Existing`] with the record unchanged: in flight with its own fingerprint and the
    /// time left on its lease (more than zero, at most the lease), or completed exactly as it was
    /// written (status, every header value in order, body bytes; or a tombstone). Of concurrent
    /// claims of one free id, exactly one answers `Claimed`.
    fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Completes the claim `token` of `id` with `completed`, kept for `ttl` (the dedup window, from
    /// now), by what the key holds:
    ///
    /// - the in-flight record claimed with `token`: replaced by `completed`; `Ok(true)`.
    /// - no live record (the claim's lease ran out, or the store lost it, and nobody claimed the
    ///   key since): `completed` is written all the same, `Ok(true)`: the work did run, and a
    ///   retry must find its result.
    /// - exactly `completed`, written by this claim: the same completion sent again with the same
    ///   token and the same bytes (its first answer was lost). Nothing is written, and the answer
    ///   is `Ok(true)`, so that the caller neither retries it for ever nor reports the work as
    ///   lost.
    /// - another claim's in-flight record, or a completed record other than `completed` (another
    ///   response or a tombstone, even one this claim wrote): nothing is written, `Ok(false)`.
    fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease of the in-flight record claimed with `token` to a full `lease` from now;
    /// `Ok(true)`. `Ok(false)`, with nothing written or created, when `id` holds no such record:
    /// no live record at all, another claim's, or a completed one (a completion is final, even to
    /// the claim that wrote it).
    fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Called for a claimed request before its work runs, with the request's extensions: a store
    /// whose records live beside the work's own data puts there what lets the work join the
    /// completion's transaction, so that the work's writes and its record commit together (or
    /// not at all). The default does nothing.
    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        let _ = (id, token, extensions);
    }

    /// Deletes the in-flight record claimed with `token`, so the key is free again; `Ok(true)`.
    /// `Ok(false)`, with nothing deleted, when `id` holds no such record: no live record at all,
    /// another claim's, or a completed one (a completion is final, even to the claim that wrote
    /// it). Once released, the token is spent: its release and renewal answer `Ok(false)`, and so
    /// does its completion once another claim holds the key.
    fn release(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// A signal that the record under `id` may have changed (completed or released, by any
    /// instance), for the requests that wait on it
    /// ([`IdempotencyLayer::wait_for_in_flight`](crate::IdempotencyLayer::wait_for_in_flight)):
    /// they ask the store again when it resolves. It must watch from the moment it is called, so
    /// that a change before its first poll is not missed. It may resolve without a change (the
    /// waiters then ask once more for nothing), and may miss one (they also ask on a backoff).
    /// The default, `None`, says the store cannot tell, and the waiters ask on the backoff alone.
    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        let _ = id;
        None::<std::future::Ready<()>>
    }
}

/// A store whose records an operator can read and forget one key at a time
/// (`docs/PROTOCOL.md` §10.9): what the [`operator`](crate::operator) module, the
/// `idempotency-keys` tool and `ScopeQuota` (feature `scope-quota`)
/// need of a store, beside the claims. A capability of its own, as tower-sessions'
/// `ExpiredDeletion` is: a store without it is a compile error where it is needed, never a
/// failure at run time. Every store of the workspace has it, and the contract suite checks it.
///
/// ```
/// use tower_idempotency::operator;
/// use tower_idempotency::store::{MemoryStore, OperatorStore};
///
/// /// What the operator's tool asks of a store: this bound.
/// async fn state_of(store: &impl OperatorStore) -> &'static str {
///     match operator::lookup(store, b"acct_1", "order-42").await {
///         Ok(Some(record)) => record.state(),
///         Ok(None) => "absent",
///         Err(_) => "unknown",
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// assert_eq!(state_of(&MemoryStore::new()).await, "absent");
/// # }
/// ```
pub trait OperatorStore: Store {
    /// Reads the live record under `id` for an operator, writing nothing: `None` when there is
    /// none (never claimed, released, forgotten, or past its expiry), else the record with its
    /// fence and the end of its lease or window on the store's clock (`docs/PROTOCOL.md` §10.9).
    /// A completed record comes back as the store keeps it (a sealed response stays sealed
    /// unless a `SealedStore` opens it). The [`operator`](crate::operator) module reads a key
    /// through it.
    fn inspect(
        &self,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<Inspected>, StoreError>> + Send;

    /// Forgets the live record under `id`, in one atomic step, so that the key is new to the
    /// next claim: a completed record or tombstone always; an in-flight record only when `force`
    /// is set (its handler may still be running: its completion is then written if nobody
    /// claimed the key since, §10.1), else [`ForgetOutcome::Refused`] and nothing written.
    /// [`ForgetOutcome::Absent`] when there is no live record. The next claim of `id` still gets
    /// a fence larger than every earlier claim's (§5.3, §10.9).
    ///
    /// Logs nothing: [`operator::forget`](crate::operator::forget) is the operator's way in,
    /// and logs the reason.
    fn forget(
        &self,
        id: &RecordId,
        force: bool,
    ) -> impl Future<Output = Result<ForgetOutcome, StoreError>> + Send;
}
