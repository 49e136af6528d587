//! The ledger consumer: every event applied to its account's balance once, from a queue that
//! delivers at least once.
//!
//! For each delivery: decode the event, run [`Balances::apply`] for it through the crate's
//! [`Deduplicator`] (scope `ledger`, keyed by the *event* id, so a republished event is recognised
//! as well as a redelivered message), then ack the message unless the attempt failed or another
//! consumer is still on it.
//!
//! | the delivery | what happens | ack? |
//! |---|---|---|
//! | first of its event | the Deduplicator claims the id, the ledger applies it: [`Handled::Applied`] | yes |
//! | again, after it was done | the Deduplicator skips it: [`Handled::Duplicate`] | yes |
//! | again, while another consumer runs it | waits for that one (up to `max_wait`), then [`Handled::Duplicate`], or [`Handled::InProgress`] | not on `InProgress` |
//! | the ledger already has it, though the Deduplicator has no record | the ledger skips it: [`Handled::AlreadyApplied`] | yes |
//! | the apply failed | the claim is released: [`Handled::Failed`] | no: it comes back after `min_idle` |
//! | the apply can never succeed (the balance would overflow, the amount is not positive) | logged as an error and dropped: [`Handled::Rejected`] | yes: it would fail every time |
//! | not an event | logged and dropped: [`Handled::Unreadable`] | yes |
//!
//! # What is guaranteed, and where the remaining gap is closed
//! The queue delivers every message at least once: a message that is not acked (its consumer
//! crashed, or failed) is taken over by another consumer of the group after `min_idle`. The
//! Deduplicator turns that into "at most once per event id" only as long as it recorded the
//! completion, and that record is written *after* the work, in another store. Two windows remain:
//!
//! 1. **Crash between applying and acking**, after the Deduplicator recorded the completion: the
//!    message is taken over, the Deduplicator finds the id done and skips it. Closed by the
//!    Deduplicator alone.
//! 2. **Crash between applying and recording**, or a completion write that failed or was lost
//!    (a Redis restart, a flushed store, a dedup window that ran out, an apply whose reply was
//!    lost after its effect): the Deduplicator's claim expires after its lease or is released,
//!    the redelivery runs the work again. The Deduplicator cannot close this gap; the ledger does:
//!    [`Balances::apply`] checks and records the event id in the same atomic step as the balance
//!    change (one lock in memory; one Lua script in Redis, `ZADD NX` on the account's
//!    applied-events set, then `HINCRBY`), so the second run changes nothing and reports
//!    [`Handled::AlreadyApplied`].
//!
//! So each event changes its balance exactly once, for as long as the ledger remembers its id
//! (`balance::RETENTION`, 7 days). What the Deduplicator adds is the cheap skip (one `SET NX` in the
//! idempotency store instead of a script on the ledger) and mutual exclusion: two consumers that
//! got the same event (a redelivery taken over while the first consumer is still slow, or a
//! republished copy) do not run it side by side while the first holds its lease; the second waits
//! for the first. Should a stalled consumer lose its lease anyway, the ledger still applies the
//! event once.
//!
//! Not covered: an event the ledger forgot (older than the retention) and delivered again is
//! applied again; a message whose apply fails for a transient reason every time (a ledger that
//! stays unreachable) is retried every `min_idle` until it succeeds, and one refused for good is
//! only logged (no dead-letter stream here); an event that never reached the queue (the
//! publisher's outbox is in memory, like the charges; on PostgreSQL it is a table, read by a
//! consumer of its own: `pg/outbox.rs`) is never applied; with the in-memory queue, everything is
//! lost with the process.
//!
//! # Stopping
//! [`LedgerConsumer::run`] stops when its token is cancelled (SIGTERM in `main`), after finishing
//! and acking the message at hand. Messages received with it and not yet handled stay pending, and
//! another consumer (or this service, restarted) takes them over after `min_idle`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tower_idempotency::Store;
use tower_idempotency::consumer::{DedupError, Deduplicator, Processed};

use super::balance::{Applied, Balances};
use super::events::PaymentEvent;
use super::queue::{Delivery, QueueConsumer};

/// The Deduplicator's scope: the consumer group's name.
pub const SCOPE: &str = "ledger";

/// The longest pause after a failed receive.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The ledger's [`Deduplicator`] on `store`: scope [`SCOPE`], a lease of `min_idle` (the queue's;
/// a consumer that dies mid-event frees the id by the time its message is taken over), and at
/// most 1 s of waiting for another consumer on the same event (then the message is left pending).
///
/// Its records sit beside the ledger's data (the ledger's Redis, under a prefix of their own),
/// apart from the HTTP layer's records, which may be flushed independently.
pub fn deduplicator<St>(store: St, min_idle: Duration) -> Deduplicator<St> {
    Deduplicator::new(store, SCOPE)
        .lease(min_idle.max(Duration::from_millis(100)))
        .max_wait(Duration::from_secs(1))
}

/// What the consumer did with one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The event was applied now. Acked.
    Applied,
    /// The Deduplicator had no record, but the ledger had applied the event: nothing changed. Acked.
    AlreadyApplied,
    /// The Deduplicator knew the event as done. Acked.
    Duplicate,
    /// Another consumer is still on this event. Not acked: it comes back.
    InProgress,
    /// The apply failed, or the idempotency store did. Not acked: it comes back.
    Failed,
    /// The apply can never succeed (see [`BalanceError::is_permanent`]). Logged, acked, and
    /// dropped: a retry would fail the same way, forever.
    ///
    /// [`BalanceError::is_permanent`]: super::balance::BalanceError::is_permanent
    Rejected,
    /// The message is not an event (or was deleted from the stream). Acked, and dropped.
    Unreadable,
}

impl Handled {
    /// Whether the message is done with.
    pub fn acks(self) -> bool {
        !matches!(self, Handled::InProgress | Handled::Failed)
    }
}

/// What a consumer did so far.
#[derive(Debug, Default)]
pub struct Stats {
    applied: AtomicUsize,
    already_applied: AtomicUsize,
    duplicates: AtomicUsize,
    in_progress: AtomicUsize,
    failed: AtomicUsize,
    rejected: AtomicUsize,
    unreadable: AtomicUsize,
}

/// A snapshot of [`Stats`].
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

impl Stats {
    /// Counts one delivery.
    pub fn record(&self, handled: Handled) {
        let counter = match handled {
            Handled::Applied => &self.applied,
            Handled::AlreadyApplied => &self.already_applied,
            Handled::Duplicate => &self.duplicates,
            Handled::InProgress => &self.in_progress,
            Handled::Failed => &self.failed,
            Handled::Rejected => &self.rejected,
            Handled::Unreadable => &self.unreadable,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }

    /// The counts now.
    pub fn counts(&self) -> Counts {
        let load = |counter: &AtomicUsize| counter.load(Ordering::SeqCst);
        Counts {
            applied: load(&self.applied),
            already_applied: load(&self.already_applied),
            duplicates: load(&self.duplicates),
            in_progress: load(&self.in_progress),
            failed: load(&self.failed),
            rejected: load(&self.rejected),
            unreadable: load(&self.unreadable),
        }
    }
}

impl std::ops::Add for Counts {
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

/// One consumer of the ledger's group.
pub struct LedgerConsumer<St> {
    queue: QueueConsumer,
    balances: Balances,
    dedup: Deduplicator<St>,
    stats: Arc<Stats>,
}

impl<St: Store> LedgerConsumer<St> {
    /// A consumer that receives from `queue` and applies to `balances` through `dedup` (see
    /// [`deduplicator`]).
    pub fn new(queue: QueueConsumer, balances: Balances, dedup: Deduplicator<St>) -> Self {
        Self {
            queue,
            balances,
            dedup,
            stats: Arc::default(),
        }
    }

    /// The consumer's end of the queue, to receive and ack by hand (tests).
    #[allow(dead_code)] // for tests
    pub fn queue(&mut self) -> &mut QueueConsumer {
        &mut self.queue
    }

    /// Receives and handles messages until `stop` is cancelled; then finishes the message at hand,
    /// leaves the group, and returns what it did.
    pub async fn run(mut self, stop: CancellationToken) -> Counts {
        tracing::info!("ledger consumer started");
        let mut backoff = Duration::from_millis(100);
        'receiving: while !stop.is_cancelled() {
            let received = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                received = self.queue.receive() => received,
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
                self.finish(&delivery).await;
            }
        }
        let counts = self.stats.counts();
        self.queue.close().await;
        tracing::info!(?counts, "ledger consumer stopped");
        counts
    }

    /// Handles `delivery` and acks it when it is done with.
    pub async fn finish(&mut self, delivery: &Delivery) -> Handled {
        let handled = self.handle(delivery).await;
        if handled.acks()
            && let Err(err) = self.queue.ack(&delivery.id).await
        {
            // The message comes back, and is then found done.
            tracing::warn!(message = %delivery.id, error = %super::report(&err), "ack failed");
        }
        handled
    }

    /// Applies the event `delivery` carries, at most once per event id; does not ack.
    pub async fn handle(&self, delivery: &Delivery) -> Handled {
        let handled = self.apply(delivery).await;
        self.stats.record(handled);
        handled
    }

    async fn apply(&self, delivery: &Delivery) -> Handled {
        let event = delivery
            .payload
            .as_deref()
            .map(serde_json::from_str::<PaymentEvent>);
        let event = match event {
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
        let outcome = self
            .dedup
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
            Err(DedupError::Failed(err)) => {
                tracing::warn!(event = %event.id, error = %super::report(&err), "applying the event failed; it will be retried");
                Handled::Failed
            }
            Err(err) => {
                tracing::warn!(event = %event.id, error = %super::report(&err), "the event will be retried");
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
            .field("queue", &self.queue)
            .field("dedup", &self.dedup)
            .field("stats", &self.stats.counts())
            .finish_non_exhaustive()
    }
}
