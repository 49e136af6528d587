//! The ledger consumer: each event applied to its balance once, from an outbox written with the
//! charge (under one lock in memory, in its transaction in PostgreSQL: `outbox.rs`) that hands it
//! out at least once. [`Balances`] records the event id with the balance change in one atomic step,
//! so an event handed out again (its consumer died before taking it off, a retry or the reconciler
//! published it again) changes nothing.
//!
//! | the event | what happens | taken off the outbox? |
//! |---|---|---|
//! | not applied before | applied: [`Handled::Applied`] | yes |
//! | its id applied before | nothing: [`Handled::AlreadyApplied`] | yes |
//! | another consumer holds it | left to it: [`Handled::InProgress`] | by the other |
//! | the apply failed (the database, say) | [`Handled::Failed`] | no: taken again |
//! | the apply can never succeed (the balance would overflow) | logged as an error: [`Handled::Rejected`] | yes |
//! | not an event | logged: [`Handled::Unreadable`] | yes |

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::balance::{Applied, BalanceError, Balances};
use super::events::PaymentEvent;

/// The scope of the ledger's processed event ids, among the idempotency records.
pub const SCOPE: &str = "ledger";

/// The longest pause after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What the consumer did with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    Applied,
    AlreadyApplied,
    InProgress,
    Failed,
    Rejected,
    Unreadable,
}

/// What a consumer did so far, per [`Handled`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub applied: usize,
    pub already_applied: usize,
    pub in_progress: usize,
    pub failed: usize,
    pub rejected: usize,
    pub unreadable: usize,
}

impl Counts {
    /// Counts one event.
    pub fn record(&mut self, handled: Handled) {
        *match handled {
            Handled::Applied => &mut self.applied,
            Handled::AlreadyApplied => &mut self.already_applied,
            Handled::InProgress => &mut self.in_progress,
            Handled::Failed => &mut self.failed,
            Handled::Rejected => &mut self.rejected,
            Handled::Unreadable => &mut self.unreadable,
        } += 1;
    }
}

/// A failure to read or change the outbox.
pub type OutboxError = Box<dyn std::error::Error + Send + Sync>;

/// Where events wait until the ledger consumer has applied them.
#[async_trait]
pub trait Outbox: fmt::Debug + Send + Sync {
    /// Applies the oldest event no other consumer holds, and takes it off once applied (or once
    /// it can never be); `None` when there is none.
    async fn next(&self) -> Result<Option<Handled>, OutboxError>;
}

/// What applying `event` came to, as [`Handled`]: `Failed` for a failure worth retrying.
pub fn handled(event: &PaymentEvent, applied: Result<Applied, BalanceError>) -> Handled {
    match applied {
        Ok(Applied::New) => Handled::Applied,
        Ok(Applied::Already) => Handled::AlreadyApplied,
        Err(err) if err.is_permanent() => {
            tracing::error!(event = %event.id, account = %event.account, error = %super::report(&err), "dropping an event the ledger refuses for good");
            Handled::Rejected
        }
        Err(err) => {
            tracing::warn!(event = %event.id, error = %super::report(&err), "applying the event failed; it will be retried");
            Handled::Failed
        }
    }
}

/// Takes events off `outbox` until `stop`, looking again every `poll` while it is empty; then
/// finishes the event at hand and returns what it did.
pub async fn run(outbox: Arc<dyn Outbox>, poll: Duration, stop: CancellationToken) -> Counts {
    tracing::info!("ledger consumer started");
    let mut backoff = Duration::from_millis(100);
    let mut counts = Counts::default();
    while !stop.is_cancelled() {
        let pause = match outbox.next().await {
            Ok(Some(Handled::Failed)) => {
                counts.record(Handled::Failed);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                backoff
            }
            Ok(Some(handled)) => {
                counts.record(handled);
                backoff = Duration::from_millis(100);
                continue;
            }
            Ok(None) => poll,
            Err(err) => {
                tracing::warn!(error = %super::report(&*err), ?backoff, "cannot take events off the outbox");
                backoff = (backoff * 2).min(MAX_BACKOFF);
                backoff
            }
        };
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
    tracing::info!(?counts, "ledger consumer stopped");
    counts
}

/// The outbox in memory, for one process: the memory ledger adds events under its own lock, with
/// the charge they report; one consumer applies them to `balances`.
#[derive(Debug)]
pub struct MemoryOutbox {
    events: Mutex<VecDeque<PaymentEvent>>,
    balances: Arc<dyn Balances>,
}

impl MemoryOutbox {
    /// An empty outbox whose events go to `balances`.
    pub fn new(balances: Arc<dyn Balances>) -> Self {
        Self {
            events: Mutex::default(),
            balances,
        }
    }

    /// Adds `event` at the back.
    pub fn push(&self, event: PaymentEvent) {
        self.lock().push_back(event);
    }

    /// How many events wait.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no event waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<PaymentEvent>> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl Outbox for MemoryOutbox {
    async fn next(&self) -> Result<Option<Handled>, OutboxError> {
        // One consumer per process: the front stays this event until it is taken off below.
        let Some(event) = self.lock().front().cloned() else {
            return Ok(None);
        };
        let handled = handled(&event, self.balances.apply(&event).await);
        if handled != Handled::Failed {
            self.lock().pop_front();
        }
        Ok(Some(handled))
    }
}
