//! The ledger consumer: every event applied to its account's balance once, from a queue that
//! delivers at least once (on PostgreSQL, the outbox's consumer: `outbox.rs`). Each delivery goes
//! through the crate's [`Deduplicator`], keyed by the *event* id (a republished event is
//! recognised as well as a redelivered message), into [`Balances::apply`], whose own atomic
//! record of the event id closes the gap the Deduplicator leaves (a crash after the effect,
//! before its record); the Deduplicator adds the cheap skip and keeps two consumers off one event.
//!
//! | the delivery | what happens | ack? |
//! |---|---|---|
//! | first of its event | claimed and applied: [`Handled::Applied`] | yes |
//! | again, after it was done | skipped: [`Handled::Duplicate`] | yes |
//! | again, while another consumer runs it | waits for it (up to `max_wait`): [`Handled::Duplicate`], or [`Handled::InProgress`] | not on `InProgress` |
//! | applied, though the Deduplicator has no record | the ledger skips it: [`Handled::AlreadyApplied`] | yes |
//! | the apply failed | the claim is released: [`Handled::Failed`] | no: it comes back after `min_idle` |
//! | the apply can never succeed (overflow, an amount not positive) | logged as an error: [`Handled::Rejected`] | yes |
//! | not an event | logged: [`Handled::Unreadable`] | yes |

use std::fmt;
use std::ops::Add;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tower_idempotency::Store;
use tower_idempotency::consumer::{DedupError, Deduplicator, Processed};

use super::balance::{Applied, Balances};
use super::events::PaymentEvent;
use super::queue::{Delivery, QueueConsumer};

/// The Deduplicator's scope: the consumer group's name.
pub const SCOPE: &str = "ledger";

/// The prefix of the Deduplicator's records in the stream's Redis: a namespace apart from the
/// HTTP layer's records, which may be flushed on their own.
pub const RECORDS_PREFIX: &str = "payments:consumer:";

/// The longest pause after a failed receive.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The ledger's [`Deduplicator`] on `store`: a lease of `min_idle` (the queue's: a consumer that
/// dies mid-event frees the id by the time its message is taken over), and at most 1 s of waiting
/// for another consumer on the same event (then the message is left pending).
pub fn deduplicator<St>(store: St, min_idle: Duration) -> Deduplicator<St> {
    Deduplicator::new(store, SCOPE)
        .lease(min_idle.max(Duration::from_millis(100)))
        .max_wait(Duration::from_secs(1))
}

/// What the consumer did with one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Applied now. Acked.
    Applied,
    /// The ledger had applied it (the Deduplicator had no record of it, or there is none: the
    /// outbox): nothing changed. Acked.
    AlreadyApplied,
    /// The Deduplicator knew it as done. Acked.
    Duplicate,
    /// Another consumer is still on it. Not acked: it comes back.
    InProgress,
    /// The apply failed, or the idempotency store did. Not acked: it comes back.
    Failed,
    /// The apply can never succeed. Logged, acked, dropped.
    Rejected,
    /// Not an event (or deleted from the stream). Acked, dropped.
    Unreadable,
}

impl Handled {
    /// Whether the message is done with.
    pub fn acks(self) -> bool {
        !matches!(self, Handled::InProgress | Handled::Failed)
    }
}

/// What a consumer did so far, per [`Handled`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub applied: usize,
    pub already_applied: usize,
    pub duplicates: usize,
    pub in_progress: usize,
    pub failed: usize,
    pub rejected: usize,
    pub unreadable: usize,
}

impl Counts {
    /// Counts one delivery.
    pub fn record(&mut self, handled: Handled) {
        *match handled {
            Handled::Applied => &mut self.applied,
            Handled::AlreadyApplied => &mut self.already_applied,
            Handled::Duplicate => &mut self.duplicates,
            Handled::InProgress => &mut self.in_progress,
            Handled::Failed => &mut self.failed,
            Handled::Rejected => &mut self.rejected,
            Handled::Unreadable => &mut self.unreadable,
        } += 1;
    }
}

impl Add for Counts {
    type Output = Counts;

    fn add(self, other: Counts) -> Counts {
        Counts {
            applied: self.applied + other.applied,
            already_applied: self.already_applied + other.already_applied,
            duplicates: self.duplicates + other.duplicates,
            in_progress: self.in_progress + other.in_progress,
            failed: self.failed + other.failed,
            rejected: self.rejected + other.rejected,
            unreadable: self.unreadable + other.unreadable,
        }
    }
}

/// One consumer of the ledger's group: what it applies events to, and through which
/// Deduplicator.
pub struct LedgerConsumer<St> {
    balances: Arc<dyn Balances>,
    dedup: Deduplicator<St>,
    counts: Mutex<Counts>,
}

impl<St: Store> LedgerConsumer<St> {
    /// A consumer that applies to `balances` through `dedup` (see [`deduplicator`]).
    pub fn new(balances: Arc<dyn Balances>, dedup: Deduplicator<St>) -> Self {
        Self {
            balances,
            dedup,
            counts: Mutex::default(),
        }
    }

    /// Receives from `queue` and handles messages until `stop`; then finishes the message at
    /// hand, leaves the group, and returns what it did.
    pub async fn run(self, mut queue: Box<dyn QueueConsumer>, stop: CancellationToken) -> Counts {
        tracing::info!("ledger consumer started");
        let mut backoff = Duration::from_millis(100);
        'receiving: while !stop.is_cancelled() {
            let received = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                received = queue.receive() => received,
            };
            let batch = match received {
                Ok(batch) => {
                    backoff = Duration::from_millis(100);
                    batch
                }
                Err(err) => {
                    tracing::warn!(error = %super::report(&err), ?backoff, "cannot receive events");
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            for delivery in batch {
                if stop.is_cancelled() {
                    break 'receiving;
                }
                self.finish(&mut *queue, &delivery).await;
            }
        }
        queue.close().await;
        let counts = self.counts();
        tracing::info!(?counts, "ledger consumer stopped");
        counts
    }

    /// What it did so far.
    pub fn counts(&self) -> Counts {
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Handles `delivery` and acks it on `queue` when it is done with.
    pub async fn finish(&self, queue: &mut dyn QueueConsumer, delivery: &Delivery) -> Handled {
        let handled = self.handle(delivery).await;
        if handled.acks()
            && let Err(err) = queue.ack(&delivery.id).await
        {
            // The message comes back, and is then found done.
            tracing::warn!(message = %delivery.id, error = %super::report(&err), "ack failed");
        }
        handled
    }

    /// Applies the event `delivery` carries, at most once per event id; does not ack.
    pub async fn handle(&self, delivery: &Delivery) -> Handled {
        let handled = self.apply(delivery).await;
        (self.counts.lock().unwrap_or_else(PoisonError::into_inner)).record(handled);
        handled
    }

    async fn apply(&self, delivery: &Delivery) -> Handled {
        let event = match delivery
            .payload
            .as_deref()
            .map(serde_json::from_str::<PaymentEvent>)
        {
            Some(Ok(event)) => event,
            Some(Err(err)) => {
                tracing::error!(message = %delivery.id, %err, "dropping a message that is not an event");
                return Handled::Unreadable;
            }
            None => {
                tracing::warn!(message = %delivery.id, "the message was deleted before it was handled");
                return Handled::Unreadable;
            }
        };
        let outcome = (self.dedup)
            .process(&event.id, || self.balances.apply(&event))
            .await;
        let handled = match outcome {
            Ok(Processed::Done(Applied::New)) => Handled::Applied,
            Ok(Processed::Done(Applied::Already)) => Handled::AlreadyApplied,
            Ok(Processed::Duplicate) => Handled::Duplicate,
            Ok(Processed::InProgress) => Handled::InProgress,
            Err(DedupError::Failed(err)) if err.is_permanent() => {
                tracing::error!(event = %event.id, account = %event.account, error = %super::report(&err), "dropping an event the ledger refuses for good");
                Handled::Rejected
            }
            Err(err) => {
                tracing::warn!(event = %event.id, error = %super::report(&err), "applying the event failed; it will be retried");
                Handled::Failed
            }
        };
        tracing::debug!(event = %event.id, message = %delivery.id, ?handled, "event handled");
        handled
    }
}

impl<St: fmt::Debug> fmt::Debug for LedgerConsumer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LedgerConsumer")
            .field("dedup", &self.dedup)
            .finish_non_exhaustive()
    }
}
