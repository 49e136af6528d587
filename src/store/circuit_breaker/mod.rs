//! The circuit breaker: a store wrapper that stops sending claims to a store that keeps failing,
//! so that each request is answered at once instead of waiting for the store's timeout
//! ([`CircuitBreaker`], `docs/PROTOCOL.md` §9.11).

mod state;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use self::state::{Admission, Breaker, Settings};
use super::{Claim, Inspected, OperatorStore, Store, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::RecordId;

pub(crate) use self::state::Entered;

/// A store with a circuit breaker in front of its claims (`docs/PROTOCOL.md` §9.11).
///
/// - **Closed** (the start): every claim goes to the store. A claim that fails because the store
///   is unreachable or timed out ([`StoreError::Timeout`], [`StoreError::Unavailable`]) counts; a
///   claim the store answers (a claim, a record, or a refusal such as [`StoreError::Full`]) ends
///   the run. [`failure_threshold`](Self::failure_threshold) failures in a row, all within the
///   [`window`](Self::window) of the first, open the breaker.
/// - **Open**: for the [`cool_down`](Self::cool_down), no claim reaches the store: each answers
///   [`StoreError::CircuitOpen`] at once, with the cool-down left. The layer answers it `503`
///   `store-unavailable` with that `Retry-After` (rounded up), or, when it
///   [fails open](crate::IdempotencyLayer::fail_open), runs the request unprotected, as on any
///   store failure.
/// - **Half-open**: once the cool-down is over, the next claim goes to the store (the probe); the
///   others are refused as while open, with a `Retry-After` of 1 s. The probe's answer closes the
///   breaker; its failure opens it for another cool-down. A probe whose caller went away
///   unanswered lets the next claim probe instead.
///
/// Only claims are gated: a completion, renewal or release of a request already running goes to
/// the store whatever the breaker's state, so that its work is not lost. Changes of state are
/// logged (WARN when it opens, INFO otherwise) and counted
/// (`idempotency_circuit_breaker_transitions_total`). Clones share one breaker.
///
/// Defaults: 5 failures within 10 s open it for 5 s. Under a `ScopeQuota` (feature `scope-quota`),
/// not over it: a scope past its quota is then refused `429` even while the breaker is open,
/// rather than run unprotected on a fail-open layer.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::store::{CircuitBreaker, MemoryStore};
/// use tower_idempotency::IdempotencyLayer;
///
/// let store = CircuitBreaker::new(MemoryStore::new())
///     .with_failure_threshold(3)
///     .with_window(Duration::from_secs(5))
///     .with_cool_down(Duration::from_secs(2));
/// assert_eq!(store.failure_threshold(), 3);
/// assert_eq!(store.cool_down(), Duration::from_secs(2));
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct CircuitBreaker<St> {
    store: St,
    breaker: Arc<Breaker>,
}

impl<St> CircuitBreaker<St> {
    /// `store` behind a breaker with the defaults: 5 failures within 10 s open it for 5 s.
    pub fn new(store: St) -> Self {
        Self {
            store,
            breaker: Arc::new(Breaker::new(Settings::default())),
        }
    }

    /// A breaker of new settings: its state starts anew (closed), shared by the clones made
    /// after this call.
    fn with_settings(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = self.breaker.settings;
        change(&mut settings);
        self.breaker = Arc::new(Breaker::new(settings));
        self
    }

    /// How many store failures in a row open the breaker, none of the store's answers between
    /// them. Default: 5; at least 1.
    ///
    /// ```
    /// use tower_idempotency::store::{CircuitBreaker, MemoryStore};
    ///
    /// let store = CircuitBreaker::new(MemoryStore::new()).with_failure_threshold(0);
    /// assert_eq!(store.failure_threshold(), 1);
    /// ```
    pub fn with_failure_threshold(self, failures: u32) -> Self {
        self.with_settings(|settings| settings.failures = failures.max(1))
    }

    /// How close together the failures must come: a failure later than this after the first of
    /// its run starts a new run. Default: 10 s; at least 1 ms.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::{CircuitBreaker, MemoryStore};
    ///
    /// let store = CircuitBreaker::new(MemoryStore::new()).with_window(Duration::from_secs(30));
    /// assert_eq!(store.window(), Duration::from_secs(30));
    /// ```
    pub fn with_window(self, window: Duration) -> Self {
        self.with_settings(|settings| settings.within = window.max(Duration::from_millis(1)))
    }

    /// How long an open breaker refuses claims before it lets a probe through. Default: 5 s; at
    /// least 1 ms. Choose it longer than the store's own timeout (1 s for `RedisStore`), so that
    /// a probe ends before the next one could start.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::{CircuitBreaker, MemoryStore};
    ///
    /// let store = CircuitBreaker::new(MemoryStore::new()).with_cool_down(Duration::ZERO);
    /// assert_eq!(store.cool_down(), Duration::from_millis(1));
    /// ```
    pub fn with_cool_down(self, cool_down: Duration) -> Self {
        self.with_settings(|settings| {
            settings.cool_down = cool_down.max(Duration::from_millis(1));
        })
    }

    /// The number of failures in a row that opens the breaker
    /// ([`with_failure_threshold`](Self::with_failure_threshold)).
    pub fn failure_threshold(&self) -> u32 {
        self.breaker.settings.failures
    }

    /// The time within which those failures must come ([`with_window`](Self::with_window)).
    pub fn window(&self) -> Duration {
        self.breaker.settings.within
    }

    /// How long the breaker stays open ([`with_cool_down`](Self::with_cool_down)).
    pub fn cool_down(&self) -> Duration {
        self.breaker.settings.cool_down
    }

    /// The store behind the breaker.
    pub fn inner(&self) -> &St {
        &self.store
    }
}

impl<St: fmt::Debug> fmt::Debug for CircuitBreaker<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("store", &self.store)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl<St> CircuitBreaker<St> {
    /// Makes `call` if the breaker lets it through, and tells the breaker its answer; at once
    /// [`StoreError::CircuitOpen`] if not.
    async fn gated<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let ticket = match self.breaker.admit(Instant::now()) {
            Admission::Pass(ticket) => ticket,
            Admission::Refuse(left) => return Err(StoreError::CircuitOpen { retry_after: left }),
        };
        let answer = call.await;
        match &answer {
            // Another wrapper's refusal under this one (a quota, a breaker) says nothing of the
            // store: the ticket goes unanswered, and a probe's turn passes to the next claim.
            Err(StoreError::QuotaExceeded { .. } | StoreError::CircuitOpen { .. }) => drop(ticket),
            _ => ticket.answered(&answer),
        }
        answer
    }
}

impl<St: Store> Store for CircuitBreaker<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.gated(self.store.claim(id, fingerprint, lease)).await
    }

    crate::forward_store!(store => complete, renew, prepare, release, changed);
}

/// A read is gated as a claim is: a `ScopeQuota`'s read of a key,
/// which stands for its claim, is refused at once while the breaker is open. A forget is not: an
/// operator who forgets a key asks the store itself, and sees it fail.
impl<St: OperatorStore> OperatorStore for CircuitBreaker<St> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        self.gated(self.store.inspect(id)).await
    }

    crate::forward_store!(store => forget);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn the_settings_read_back_as_set_and_are_bounded() {
        let store = CircuitBreaker::new(MemoryStore::new())
            .with_failure_threshold(3)
            .with_window(Duration::from_secs(7))
            .with_cool_down(Duration::from_secs(2));
        assert_eq!(store.failure_threshold(), 3);
        assert_eq!(store.window(), Duration::from_secs(7));
        assert_eq!(store.cool_down(), Duration::from_secs(2));
        let least = CircuitBreaker::new(MemoryStore::new())
            .with_failure_threshold(0)
            .with_window(Duration::ZERO)
            .with_cool_down(Duration::ZERO);
        assert_eq!(least.failure_threshold(), 1);
        assert_eq!(least.window(), Duration::from_millis(1));
        assert_eq!(least.cool_down(), Duration::from_millis(1));
        let defaults = CircuitBreaker::new(MemoryStore::new());
        assert_eq!(
            (
                defaults.failure_threshold(),
                defaults.window(),
                defaults.cool_down()
            ),
            (5, Duration::from_secs(10), Duration::from_secs(5))
        );
    }
}
