//! The events the API publishes (every charge that succeeds, every capture, every refund), and
//! their publisher.
//!
//! An event's id is derived from the effect it reports as the provider knows it (the payment or
//! refund id, and the type): whatever publishes it for one payment (a handler that ran again, the
//! reconciler) publishes the same id, and the ledger consumer applies it once.
//!
//! [`Publisher`] is a small outbox in memory: an event the queue refuses waits there and is sent
//! again by the relay, so an unreachable queue delays an event rather than losing it or failing a
//! request whose money already moved. No lock is held across a call to the queue: a stalled Redis
//! costs each request at most one publish timeout, side by side. (On PostgreSQL the events go to
//! an outbox table in the charge's transaction instead: `outbox.rs`.)

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::ledger::Charge;
use super::queue::{Queue, QueueError};

/// How often [`Publisher::relay`] retries events the queue refused.
const RELAY_EVERY: Duration = Duration::from_secs(1);

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    /// A charge was authorized, and captured too unless it was created with `"capture": false`.
    #[serde(rename = "charge.succeeded")]
    Succeeded,
    /// An authorized charge was captured.
    #[serde(rename = "charge.captured")]
    Captured,
    /// A captured charge was refunded, in part or in full: `amount` is this refund's.
    #[serde(rename = "charge.refunded")]
    Refunded,
}

/// One event, as it travels through the queue:
/// `{"id": "evt_...", "type": "charge.succeeded", "account": ..., "amount": ..., "currency": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentEvent {
    /// Derived from the effect: the same effect always has the same id.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: EventType,
    pub account: String,
    /// In minor units; a refund's amount is positive too.
    pub amount: i64,
    pub currency: String,
    /// The charge the event is about.
    pub charge: String,
    /// Whether the money was taken (`false` for a charge that is authorized only).
    pub captured: bool,
}

impl PaymentEvent {
    /// `charge.succeeded` for a charge the provider approved: captured, or authorized only. Its
    /// id is the provider payment's.
    pub fn succeeded(charge: &Charge, captured: bool) -> Self {
        Self::about(
            charge,
            EventType::Succeeded,
            &charge.payment,
            charge.amount,
            captured,
        )
    }

    /// `charge.captured` for an authorized charge that was captured. Its id is the provider
    /// payment's.
    pub fn captured(charge: &Charge) -> Self {
        Self::about(
            charge,
            EventType::Captured,
            &charge.payment,
            charge.amount,
            true,
        )
    }

    /// `charge.refunded` for the refund `refund_id` (the provider's id) of `amount`.
    pub fn refunded(charge: &Charge, refund_id: &str, amount: i64) -> Self {
        Self::about(charge, EventType::Refunded, refund_id, amount, true)
    }

    fn about(charge: &Charge, kind: EventType, object: &str, amount: i64, captured: bool) -> Self {
        Self {
            id: event_id(kind, object),
            kind,
            account: charge.account.id().to_owned(),
            amount,
            currency: charge.currency.clone(),
            charge: charge.id.clone(),
            captured,
        }
    }

    /// What the event does to the account's available balance: `(currency, change)`, or `None`.
    ///
    /// Only captured money is available: `charge.succeeded` adds the amount when the charge was
    /// captured at once and nothing when it was authorized only (its `charge.captured` adds it
    /// later); `charge.refunded` subtracts the refund. (An amount is positive, and
    /// [`Balances::apply`](super::balance::Balances::apply) refuses any other, so the negation is exact.)
    pub fn balance_change(&self) -> Option<(&str, i64)> {
        match self.kind {
            EventType::Succeeded if !self.captured => None,
            EventType::Succeeded | EventType::Captured => Some((&self.currency, self.amount)),
            EventType::Refunded => Some((&self.currency, self.amount.saturating_neg())),
        }
    }

    /// The event as the queue carries it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// `evt_<what>_<object id>`: `evt_succeeded_py_...`, `evt_captured_py_...`, `evt_refunded_re_...`.
fn event_id(kind: EventType, object: &str) -> String {
    let what = match kind {
        EventType::Succeeded => "succeeded",
        EventType::Captured => "captured",
        EventType::Refunded => "refunded",
    };
    format!("evt_{what}_{object}")
}

/// Publishes events to the queue through an in-memory outbox, in order; clones share it.
#[derive(Clone)]
pub struct Publisher {
    queue: Arc<dyn Queue>,
    /// The events the queue refused, oldest first. Locked only to look or change, never across a
    /// call to the queue.
    outbox: Arc<Mutex<VecDeque<PaymentEvent>>>,
    /// Held by the one flush that sends the outbox; another flush returns at once instead of
    /// waiting for it (and sending the same event twice).
    sending: Arc<tokio::sync::Mutex<()>>,
}

impl Publisher {
    /// A publisher to `queue`, with an empty outbox.
    pub fn new(queue: Arc<dyn Queue>) -> Self {
        Self {
            queue,
            outbox: Arc::default(),
            sending: Arc::default(),
        }
    }

    /// Sends `event` to the queue, or leaves it in the outbox for [`Publisher::relay`]: behind
    /// events that are waiting already, or when the queue refuses it. It is never dropped.
    pub async fn publish(&self, event: PaymentEvent) {
        {
            let mut outbox = self.outbox();
            if !outbox.is_empty() {
                outbox.push_back(event);
                return;
            }
        }
        if let Err(err) = send(&*self.queue, &event).await {
            let mut outbox = self.outbox();
            refused(&event, outbox.len() + 1, &err);
            outbox.push_back(event);
        }
    }

    /// Sends what the outbox holds, in order, up to the first event the queue refuses; returns how
    /// many events are still waiting. While another flush is sending, returns at once.
    pub async fn flush(&self) -> usize {
        let Ok(_sending) = self.sending.try_lock() else {
            return self.outbox().len();
        };
        loop {
            // Only the flush holding `sending` removes events, so the front stays this event.
            let Some(event) = self.outbox().front().cloned() else {
                return 0;
            };
            if let Err(err) = send(&*self.queue, &event).await {
                let waiting = self.outbox().len();
                refused(&event, waiting, &err);
                return waiting;
            }
            self.outbox().pop_front();
        }
    }

    /// Retries the outbox every second until `stop`, then one last time.
    pub async fn relay(self, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(RELAY_EVERY) => {}
            }
            self.flush().await;
        }
        let left = self.flush().await;
        if left > 0 {
            tracing::error!(left, "stopping with events the queue did not take");
        }
    }

    fn outbox(&self) -> MutexGuard<'_, VecDeque<PaymentEvent>> {
        self.outbox.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Sends one event to the queue.
async fn send(queue: &dyn Queue, event: &PaymentEvent) -> Result<(), QueueError> {
    let message = queue.publish(&event.to_json()).await?;
    tracing::debug!(event = %event.id, %message, "event published");
    Ok(())
}

/// Logs that the queue refused `event`, which waits in the outbox with `waiting - 1` others.
fn refused(event: &PaymentEvent, waiting: usize, err: &QueueError) {
    tracing::warn!(
        event = %event.id,
        waiting,
        error = %super::report(err),
        "the queue refused an event; it stays in the outbox"
    );
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}
