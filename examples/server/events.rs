//! The events the API publishes: every charge that succeeds, every capture and every refund.
//!
//! An event's id is derived from the effect it reports (the charge or refund id, and the type), not
//! drawn at random: a handler that runs again for the same effect (its idempotency record lost, the
//! provider answering the repeated call with the same payment) publishes the same event id again,
//! and the ledger consumer recognises it.
//!
//! Publishing goes through a small outbox ([`Publisher`]): the event is queued in memory first and
//! sent from there, so an unreachable queue delays an event instead of losing it or failing a
//! request whose money already moved. (The outbox lives in memory, like the charges; a real service
//! writes it in the same database transaction as the charge.)

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::ledger::Charge;
use super::queue::Queue;

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
    /// `charge.succeeded` for a charge the provider approved: captured, or authorized only.
    pub fn succeeded(charge: &Charge, captured: bool) -> Self {
        Self::about(
            charge,
            EventType::Succeeded,
            &charge.id,
            charge.amount,
            captured,
        )
    }

    /// `charge.captured` for an authorized charge that was captured.
    pub fn captured(charge: &Charge) -> Self {
        Self::about(charge, EventType::Captured, &charge.id, charge.amount, true)
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
    /// later); `charge.refunded` subtracts the refund.
    pub fn balance_change(&self) -> Option<(&str, i64)> {
        match self.kind {
            EventType::Succeeded if !self.captured => None,
            EventType::Succeeded | EventType::Captured => Some((&self.currency, self.amount)),
            EventType::Refunded => Some((&self.currency, -self.amount)),
        }
    }

    /// The event as the queue carries it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// `evt_<what>_<object id>`: `evt_succeeded_ch_...`, `evt_captured_ch_...`, `evt_refunded_re_...`.
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
    queue: Queue,
    outbox: Arc<tokio::sync::Mutex<VecDeque<PaymentEvent>>>,
}

impl Publisher {
    /// A publisher to `queue`, with an empty outbox.
    pub fn new(queue: Queue) -> Self {
        Self {
            queue,
            outbox: Arc::default(),
        }
    }

    /// The queue the events go to.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Puts `event` in the outbox and sends the outbox to the queue. An event the queue refuses
    /// stays in the outbox for the next publish or [`Publisher::relay`]: it is never dropped.
    pub async fn publish(&self, event: PaymentEvent) {
        let mut outbox = self.outbox.lock().await;
        outbox.push_back(event);
        send(&self.queue, &mut outbox).await;
    }

    /// Sends what the outbox holds; returns how many events are still waiting.
    pub async fn flush(&self) -> usize {
        let mut outbox = self.outbox.lock().await;
        send(&self.queue, &mut outbox).await;
        outbox.len()
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
}

/// Sends the outbox to the queue in order, up to the first event the queue refuses.
async fn send(queue: &Queue, outbox: &mut VecDeque<PaymentEvent>) {
    while let Some(event) = outbox.front() {
        match queue.publish(&event.to_json()).await {
            Ok(message) => {
                tracing::debug!(event = %event.id, %message, "event published");
                outbox.pop_front();
            }
            Err(err) => {
                tracing::warn!(
                    event = %event.id,
                    waiting = outbox.len(),
                    error = %super::report(&err),
                    "the queue refused an event; it stays in the outbox"
                );
                return;
            }
        }
    }
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}
