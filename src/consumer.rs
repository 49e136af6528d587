//! The idempotent consumer: exactly-once effects from at-least-once delivery.
//!
//! A queue delivers a message again when its ack is lost (the consumer crashed after the work,
//! before the ack). A [`Deduplicator`] recognises the redelivery: it claims the message id in the
//! same stores the HTTP layer uses, runs the work once, and marks the id done for the dedup window.
//!
//! | delivery | [`Deduplicator::process`] | ack? |
//! |---|---|---|
//! | first | runs the work: [`Processed::Done`] | yes |
//! | again, after the work succeeded | skips it: [`Processed::Duplicate`] | yes |
//! | again, while another consumer runs it | waits for that one (up to `max_wait`), then `Duplicate`, or runs it if that one failed; else [`Processed::InProgress`] | not on `InProgress` |
//! | the work failed or panicked | releases the claim: [`DedupError::Failed`] / [`DedupError::Panicked`] | no: the redelivery retries |
//! | the store is unreachable | [`DedupError::Store`] | no |
//!
//! # Settings for a queue consumer
//! Keep the lease no longer than the queue's redelivery delay (a Redis Stream's `XAUTOCLAIM`
//! min-idle time, a visibility timeout): a consumer that dies holds its ids for one lease, and a
//! takeover before that finds them in progress. A consumer that handles one message at a time
//! wants a short `max_wait` (or zero), so that it does not stall behind another consumer's run.
//!
//! # What is guaranteed, and the remaining gap
//! The work runs at most once per id within the dedup window as long as its completion is
//! recorded, and a failed attempt never blocks a retry. One gap remains, as in every deduplicator
//! that keeps its records apart from the effects: a process that dies *after* the work's effect but
//! *before* the completion is recorded leaves only an expiring claim, and the redelivery after the
//! lease runs the work again. Close it where the effect lives: make the effect itself conditional on
//! the message id in the same transaction (a unique "applied events" row beside the balance update,
//! an upsert keyed by the id), and use the deduplicator to skip the work cheaply and to keep two
//! consumers from running one message side by side.
//!
//! ```
//! use tower_idempotency::consumer::{Deduplicator, Processed};
//! use tower_idempotency::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let dedup = Deduplicator::new(MemoryStore::new(), "ledger");
//! let mut balance = 0;
//! for _delivery in 0..3 {
//!     // The queue delivers "evt_1" three times.
//!     let outcome = dedup
//!         .process("evt_1", || async {
//!             balance += 100;
//!             Ok::<_, std::convert::Infallible>(())
//!         })
//!         .await
//!         .unwrap();
//!     assert!(matches!(outcome, Processed::Done(()) | Processed::Duplicate));
//! }
//! assert_eq!(balance, 100);
//! # }
//! ```

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use tracing::Instrument;

use crate::error_chain::panic_message;
use crate::fingerprint::Fingerprint;
use crate::layer_metrics::Metered;
use crate::lease::Held;
use crate::record::{Completed, Record, RecordId};
use crate::scope::Scope;
use crate::store::{Claim, Store, StoreError};

/// Runs a message's work once per message id, on any [`Store`].
#[derive(Clone)]
pub struct Deduplicator<St> {
    /// The store, its calls timed (`layer_metrics`).
    store: Metered<St>,
    scope: Scope,
    window: Duration,
    lease: Duration,
    max_wait: Duration,
}

/// What [`Deduplicator::process`] did with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The work ran, with this result; ack the message.
    Done(T),
    /// The work already ran for this id; ack the message and do nothing.
    Duplicate,
    /// Another consumer is still running this id after `max_wait`; do not ack: the message will be
    /// delivered again, and then found done (or run, if that consumer failed).
    InProgress,
}

impl<T> Processed<T> {
    /// Whether to acknowledge the message: after `Done` and `Duplicate`, not after `InProgress`.
    pub fn should_ack(&self) -> bool {
        !matches!(self, Processed::InProgress)
    }
}

/// Why [`Deduplicator::process`] did not finish a delivery. Do not ack: the redelivery retries.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DedupError<E> {
    /// The work returned an error; the claim was released.
    #[error("the work failed")]
    Failed(#[source] E),
    /// The work panicked; the claim was released.
    #[error("the work panicked: {0}")]
    Panicked(String),
    /// The store failed, or refused the claim (a `CircuitOpen` or `QuotaExceeded` of a wrapper,
    /// with its `retry_after`); the work did not run.
    #[error("the deduplication store failed")]
    Store(#[source] StoreError),
}

impl<St> Deduplicator<St> {
    /// A deduplicator over `store`, whose ids live in their own `scope` (a consumer group's or a
    /// queue's name): ids of other scopes, and the HTTP layer's keys (even in a scope of the same
    /// name), never collide with them.
    /// Defaults: a 24 h dedup window, a 30 s lease renewed while the work runs, and up to 30 s of
    /// waiting for another consumer's run of the same id. Each store call is bounded by the store
    /// itself (`RedisStore::with_timeout`).
    pub fn new(store: St, scope: impl Into<Scope>) -> Self {
        crate::layer_metrics::describe();
        Self {
            store: Metered(store),
            scope: scope.into(),
            window: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            max_wait: Duration::from_secs(30),
        }
    }

    /// How long a processed id is remembered. Default: 24 hours.
    pub fn dedup_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How long a claim lives without renewal; renewed every third of it while the work runs, so a
    /// consumer that dies frees its ids within one lease. Default: 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(3));
        self
    }

    /// How long a delivery waits for another consumer that is running the same id before it gives
    /// up with [`Processed::InProgress`]. Zero skips at once. Default: 30 seconds.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }
}

impl<St: Store> Deduplicator<St> {
    /// Runs `work` for `message_id` unless it already ran (see the [module docs](self)).
    ///
    /// # Errors
    /// [`DedupError`] when the work failed or panicked (the claim is released) or the store failed:
    /// leave the message unacked, so that it is delivered again.
    pub async fn process<T, E, F, Fut>(
        &self,
        message_id: &str,
        work: F,
    ) -> Result<Processed<T>, DedupError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let id = RecordId::for_message(self.scope.as_bytes(), message_id);
        let span = tracing::info_span!(target: "tower_idempotency", "idempotent_consumer", key = %id.tag());
        self.process_as(id, work).instrument(span).await
    }

    async fn process_as<T, E, F, Fut>(
        &self,
        id: RecordId,
        work: F,
    ) -> Result<Processed<T>, DedupError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // A message id names one message, so every delivery of it has the same fingerprint.
        let fingerprint = Fingerprint::from_bytes([0; 32]);
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(10);
        let token = loop {
            let claim = self.store.claim(&id, &fingerprint, self.lease).await;
            match claim.map_err(DedupError::Store)? {
                Claim::Claimed(token) => break token,
                Claim::Existing(Record::Completed(_)) => return Ok(Processed::Duplicate),
                Claim::Existing(Record::InFlight(in_flight)) => {
                    let waited = started.elapsed();
                    if waited >= self.max_wait {
                        return Ok(Processed::InProgress);
                    }
                    let remaining = self.max_wait - waited;
                    tokio::time::sleep(pause.min(in_flight.lease_remaining).min(remaining)).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        };

        let held = Held {
            store: &self.store,
            id: &id,
            token: &token,
            lease: self.lease,
        };
        let result = held.renewing(AssertUnwindSafe(work()).catch_unwind()).await;
        match result {
            Ok(Ok(value)) => {
                let done = Completed::tombstone(fingerprint);
                let window = self.window;
                // Bounded by a lease, not the window: the caller is waiting to ack the message, and
                // the effect is done whether or not the record lands.
                held.complete_with(self.lease, 0, || {
                    self.store.complete(&id, &token, &done, window)
                })
                .await;
                Ok(Processed::Done(value))
            }
            Ok(Err(err)) => {
                held.release_with(0, || self.store.release(&id, &token))
                    .await;
                Err(DedupError::Failed(err))
            }
            Err(panic) => {
                held.release_with(0, || self.store.release(&id, &token))
                    .await;
                Err(DedupError::Panicked(panic_message(&*panic).to_owned()))
            }
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for Deduplicator<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deduplicator")
            .field("store", &self.store)
            .field("scope", &self.scope)
            .field("window", &self.window)
            .field("lease", &self.lease)
            .field("max_wait", &self.max_wait)
            .finish()
    }
}
