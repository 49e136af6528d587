//! The events the API publishes: every charge that succeeds, every capture, every refund. An
//! event's id comes from the effect it reports as the provider knows it (the payment or refund id,
//! and the type), so whatever publishes it again (a handler run again, the reconciler) publishes
//! the same id, and the ledger consumer applies it once. They leave through the outbox, written
//! with the charge they report (`consumer.rs`, `outbox.rs`).

use serde::{Deserialize, Serialize};

use super::ledger::Charge;

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

/// One event, as the outbox holds it:
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
    /// `charge.succeeded` for a charge the provider approved, captured or authorized only.
    pub fn succeeded(charge: &Charge, captured: bool) -> Self {
        Self::about(charge, EventType::Succeeded, &charge.payment, captured)
    }

    /// `charge.captured` for an authorized charge that was captured.
    pub fn captured(charge: &Charge) -> Self {
        Self::about(charge, EventType::Captured, &charge.payment, true)
    }

    /// `charge.refunded` for the refund `refund_id` (the provider's id) of `amount`.
    pub fn refunded(charge: &Charge, refund_id: &str, amount: i64) -> Self {
        let event = Self::about(charge, EventType::Refunded, refund_id, true);
        Self { amount, ..event }
    }

    /// The event about `object`, the provider's payment or refund, whose id it derives:
    /// `evt_succeeded_py_...`, `evt_captured_py_...`, `evt_refunded_re_...`.
    fn about(charge: &Charge, kind: EventType, object: &str, captured: bool) -> Self {
        let what = match kind {
            EventType::Succeeded => "succeeded",
            EventType::Captured => "captured",
            EventType::Refunded => "refunded",
        };
        Self {
            id: format!("evt_{what}_{object}"),
            kind,
            account: charge.account.id().to_owned(),
            amount: charge.amount,
            currency: charge.currency.clone(),
            charge: charge.id.clone(),
            captured,
        }
    }

    /// What the event does to the account's available balance: `(currency, change)`, or `None`.
    /// Only captured money is available: a `charge.succeeded` authorized only adds nothing (its
    /// `charge.captured` adds it later); `charge.refunded` subtracts the refund. (An amount is
    /// positive, and [`Balances::apply`](super::balance::Balances::apply) refuses any other, so
    /// the negation is exact.)
    pub fn balance_change(&self) -> Option<(&str, i64)> {
        match self.kind {
            EventType::Succeeded if !self.captured => None,
            EventType::Succeeded | EventType::Captured => Some((&self.currency, self.amount)),
            EventType::Refunded => Some((&self.currency, self.amount.saturating_neg())),
        }
    }

    /// The event as the outbox holds it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}
