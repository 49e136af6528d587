//! What an operator reads of one record ([`OperatorStore::inspect`](super::OperatorStore::inspect))
//! and what forgetting it did ([`OperatorStore::forget`](super::OperatorStore::forget)).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::fingerprint::Fingerprint;
use crate::record::{Completed, Fence, Payload};

/// A live record as [`OperatorStore::inspect`](super::OperatorStore::inspect) reads it, with what
/// the store knows of its claim and its lifetime: not what a claim answers (a claim sees neither
/// fence nor expiry), but what an operator needs to say what happened to a key.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_idempotency::store::{InFlightView, Inspected};
/// use tower_idempotency::record::{Fence, Fingerprint};
///
/// let view = Inspected::InFlight(InFlightView {
///     fingerprint: Fingerprint::from_bytes([1; 32]),
///     fence: Fence::new(1_700_000_000_000_000),
///     lease_ends: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_030),
/// });
/// assert_eq!(view.state(), "in_flight");
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Inspected {
    /// Claimed; its handler is running (or its owner stalled and the lease has not run out yet).
    InFlight(InFlightView),
    /// Its handler finished: a response, or a tombstone.
    Completed(CompletedView),
}

impl Inspected {
    /// The record's state in one word, as logs and the command-line tool print it: `in_flight`,
    /// `completed`, or `tombstone` (a completed record without a response, §8.4).
    ///
    /// ```
    /// use std::time::SystemTime;
    /// use tower_idempotency::store::{CompletedView, Inspected};
    /// use tower_idempotency::record::{Completed, Fingerprint};
    ///
    /// let tombstone = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
    /// let view = CompletedView { completed: tombstone, fence: None, expires: SystemTime::now() };
    /// assert_eq!(Inspected::Completed(view).state(), "tombstone");
    /// ```
    pub fn state(&self) -> &'static str {
        match self {
            Inspected::InFlight(_) => "in_flight",
            Inspected::Completed(view) if view.completed.response.is_none() => "tombstone",
            Inspected::Completed(_) => "completed",
        }
    }

    /// The fingerprint of the request that made the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Inspected::InFlight(view) => &view.fingerprint,
            Inspected::Completed(view) => &view.completed.fingerprint,
        }
    }

    /// The fence of the claim that made the record, where the store still knows it: always in
    /// flight; once completed, only where the store keeps it (§10.9).
    pub fn fence(&self) -> Option<Fence> {
        match self {
            Inspected::InFlight(view) => Some(view.fence),
            Inspected::Completed(view) => view.fence,
        }
    }
}

/// An in-flight record, read by an operator.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_idempotency::store::InFlightView;
/// use tower_idempotency::record::{Fence, Fingerprint};
///
/// let view = InFlightView {
///     fingerprint: Fingerprint::from_bytes([1; 32]),
///     fence: Fence::new(1_700_000_000_000_000),
///     lease_ends: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_030),
/// };
/// assert_eq!(view.claimed_at(), SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct InFlightView {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The claim's fence (§5.3).
    pub fence: Fence,
    /// When the lease ends, on the store's clock, unless its owner renews it first (§9.2).
    pub lease_ends: SystemTime,
}

impl InFlightView {
    /// When the key was claimed, read from the fence: the store's clock in microseconds at the
    /// claim (§5.3). Exact unless the claim took over a record whose fence was ahead of that
    /// clock (one past it, then), which makes it a little late at most.
    pub fn claimed_at(&self) -> SystemTime {
        fence_time(self.fence)
    }
}

/// A completed record (or tombstone), read by an operator.
///
/// ```
/// use std::time::SystemTime;
/// use tower_idempotency::store::CompletedView;
/// use tower_idempotency::record::{Completed, Fingerprint};
///
/// let tombstone = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
/// let view = CompletedView { completed: tombstone, fence: None, expires: SystemTime::now() };
/// assert_eq!(view.status(), None);
/// assert_eq!(view.body_len(), None);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CompletedView {
    /// The record as the store keeps it: its response in clear, sealed (read through a
    /// `SealedStore` with its keys to see it opened), or none (a tombstone).
    pub completed: Completed,
    /// The fence of the claim that completed it, where the store keeps it once completed
    /// (`MemoryStore` and `PgStore` do; `RedisStore` keeps only the record's bytes, §10.9).
    pub fence: Option<Fence>,
    /// When the record expires (the end of its dedup window), on the store's clock.
    pub expires: SystemTime,
}

impl CompletedView {
    /// The stored response's status; `None` for a tombstone or a sealed response.
    pub fn status(&self) -> Option<http::StatusCode> {
        self.completed.plain().map(|response| response.status)
    }

    /// The stored response's body length in bytes; `None` for a tombstone or a sealed response.
    pub fn body_len(&self) -> Option<usize> {
        self.completed.plain().map(|response| response.body.len())
    }

    /// The id of the key a sealed response was sealed under; `None` otherwise.
    pub fn sealed_under(&self) -> Option<&str> {
        match &self.completed.response {
            Some(Payload::Sealed(sealed)) => Some(&sealed.key_id),
            _ => None,
        }
    }

    /// When the completed claim was made, read from its fence (see
    /// [`InFlightView::claimed_at`]), where the store keeps the fence.
    pub fn claimed_at(&self) -> Option<SystemTime> {
        self.fence.map(fence_time)
    }
}

/// What [`OperatorStore::forget`](super::OperatorStore::forget) did.
///
/// ```
/// use tower_idempotency::store::ForgetOutcome;
///
/// assert!(!ForgetOutcome::Absent.forgotten());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ForgetOutcome {
    /// The key holds no live record: nothing to forget, nothing written.
    Absent,
    /// The key is in flight and the call was not forced: nothing written. The record as it is.
    Refused(InFlightView),
    /// The record is forgotten: the key is new to the next claim. The record as it was.
    Forgotten(Inspected),
}

impl ForgetOutcome {
    /// Whether a record was forgotten.
    pub fn forgotten(&self) -> bool {
        matches!(self, ForgetOutcome::Forgotten(_))
    }
}

/// The time a fence stands for: microseconds since the Unix epoch.
fn fence_time(fence: Fence) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(fence.get())
}
