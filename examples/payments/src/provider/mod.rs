//! The simulated payment provider, shaped like a real one: payments, idempotency keys bound to
//! their request for [`WINDOW`], refunds bounded by what a captured payment took, payments listed
//! by creation and found by metadata. In memory, it is a program of its own (`src/bin/provider.rs`,
//! `PROVIDER_URL`) that every instance calls over HTTP (`api.rs`, `client.rs`), or else served in
//! process. Each call runs in a task of its own: a caller that stops waiting does not stop it.

pub mod api;
mod client;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

pub use client::ProviderClient;

use crate::{ledger::new_id, now_ms};

/// How long the provider remembers a key: 24 hours, as Stripe does.
pub const WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// A card token of the test mode: `tok_visa` is approved, `tok_chargeDeclined` declined by the
/// issuer, `tok_pspUnavailable` finds the provider down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    #[serde(rename = "tok_visa")]
    Visa,
    #[serde(rename = "tok_chargeDeclined")]
    ChargeDeclined,
    #[serde(rename = "tok_pspUnavailable")]
    ProviderUnavailable,
}

impl Source {
    /// The test token's source, or `None` for a token the provider does not know.
    pub fn parse(token: &str) -> Option<Self> {
        Self::deserialize(serde_json::Value::from(token)).ok()
    }
}

/// A new payment, as the provider answers it; a repeated call with the same key gets the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    pub id: String,
    pub outcome: Outcome,
}

/// Where a payment is: a create answers one of the first three.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The money is held, not yet taken.
    Authorized,
    /// The money is taken.
    Captured,
    /// The issuer declined the card: a decided outcome.
    Declined,
    /// The hold was released: nothing taken.
    Canceled,
}

/// A call that did not get the provider's answer. Every refusal means nothing happened;
/// [`ProviderError::Unknown`] alone means the call may have taken effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ProviderError {
    /// Down, or unreachable, before doing anything: retry with the same key.
    #[error("the payment provider is unavailable")]
    Unavailable,
    /// No usable answer: the call may have taken effect, and the same key finds out.
    #[error("the payment provider's answer was lost: the outcome is unknown")]
    Unknown,
    /// A refund of more than its payment has left (nothing until captured): `amount_too_large`.
    #[error("a refund of {amount} is more than the {refundable} left of the payment")]
    AmountTooLarge { amount: i64, refundable: i64 },
    /// A call on a payment the provider never made.
    #[error("no such payment")]
    NoSuchPayment,
    /// A capture or cancellation of a payment that is not authorized (captured, canceled,
    /// declined already): Stripe's `payment_intent_unexpected_state`.
    #[error("the payment cannot be captured or canceled in its state")]
    UnexpectedState,
    /// The key was used, within the window, for another request.
    #[error("the idempotency key was used for another request")]
    KeyReused,
}

/// A payment as the provider keeps it, for good: what it lists, finds and bounds refunds by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRecord {
    pub id: String,
    pub amount: i64,
    /// How much of it was refunded.
    pub refunded: i64,
    pub source: Source,
    pub capture: bool,
    pub outcome: Outcome,
    /// When it was made, in ms since the Unix epoch.
    pub created: u64,
    /// The caller's own key-value pairs, kept as given and searchable.
    pub metadata: BTreeMap<String, String>,
}

/// One call: the operation and every parameter, what its key is bound to (a create's metadata is
/// not). A capture and a cancellation each move an authorized payment to their outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Request {
    Create(Source, i64, bool),
    Settle(String, Outcome),
    Refund(String, i64),
}

/// The simulated provider; clones share it.
#[derive(Debug, Clone)]
pub struct Provider {
    book: Arc<Mutex<Book>>,
    /// How long each call takes (`PSP_LATENCY_MS`).
    latency: Duration,
    window: Duration,
}

/// Keys and payments under one lock, so that a call's key check and its effect are one step.
#[derive(Debug, Default)]
struct Book {
    /// Each key's request and answer (the payment's or refund's id), until its deadline.
    keys: HashMap<String, (Instant, Request, String)>,
    /// Each key with its deadline, in the order they expire.
    order: VecDeque<(Instant, String)>,
    payments: HashMap<String, PaymentRecord>,
}

impl Book {
    fn forget_expired(&mut self, now: Instant) {
        while (self.order.front()).is_some_and(|(deadline, _)| *deadline <= now) {
            // The key may have been used again since, with a later deadline: keep that one.
            if let Some((deadline, key)) = self.order.pop_front()
                && self.keys.get(&key).is_some_and(|(at, ..)| *at == deadline)
            {
                self.keys.remove(&key);
            }
        }
    }

    /// Makes `request`'s effect: the id it answers, or a refusal (nothing done).
    fn make(
        &mut self,
        request: &Request,
        metadata: BTreeMap<String, String>,
    ) -> Result<String, ProviderError> {
        match *request {
            Request::Create(Source::ProviderUnavailable, ..) => Err(ProviderError::Unavailable),
            Request::Create(source, amount, capture) => {
                let (id, outcome) = (new_id("py"), outcome(source, capture));
                let record = PaymentRecord {
                    id: id.clone(),
                    amount,
                    refunded: 0,
                    source,
                    capture,
                    outcome,
                    created: now_ms(),
                    metadata,
                };
                self.payments.insert(id.clone(), record);
                Ok(id)
            }
            Request::Settle(ref payment, to) => {
                let record = self.payments.get_mut(payment);
                let record = record.ok_or(ProviderError::NoSuchPayment)?;
                if record.outcome != Outcome::Authorized {
                    return Err(ProviderError::UnexpectedState);
                }
                record.outcome = to;
                Ok(payment.clone())
            }
            Request::Refund(ref payment, amount) => {
                let payment =
                    (self.payments.get_mut(payment)).ok_or(ProviderError::NoSuchPayment)?;
                // Only a captured payment took money to give back.
                let left = payment.amount - payment.refunded;
                let captured = payment.outcome == Outcome::Captured;
                let refundable = if captured { left } else { 0 };
                if amount > refundable {
                    return Err(ProviderError::AmountTooLarge { amount, refundable });
                }
                payment.refunded += amount;
                Ok(new_id("re"))
            }
        }
    }
}

/// What a new payment from `source` comes to: the simulated issuer decides from the token.
fn outcome(source: Source, capture: bool) -> Outcome {
    match (source, capture) {
        (Source::ChargeDeclined, _) => Outcome::Declined,
        (_, false) => Outcome::Authorized,
        (_, true) => Outcome::Captured,
    }
}

impl Provider {
    /// A provider with no payments, taking `latency` to answer each call, remembering each key
    /// for `window`.
    pub fn new(latency: Duration, window: Duration) -> Self {
        Self {
            book: Arc::default(),
            latency,
            window,
        }
    }

    /// Its HTTP API.
    pub fn router(&self) -> axum::Router {
        api::router(self.clone())
    }

    /// Creates a payment of `amount` from `source`, authorized only or also captured, with
    /// `metadata` kept as given.
    pub async fn create_payment(
        &self,
        key: &str,
        (source, amount, capture): (Source, i64, bool),
        metadata: BTreeMap<String, String>,
    ) -> Result<Payment, ProviderError> {
        let id = (self.call(key, Request::Create(source, amount, capture), metadata)).await?;
        // What the create did, even when answered again after a capture or a cancellation.
        let outcome = outcome(source, capture);
        Ok(Payment { id, outcome })
    }

    /// Captures an authorized payment.
    pub async fn capture(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Settle(payment.to_owned(), Outcome::Captured);
        self.call(key, request, BTreeMap::new()).await.map(drop)
    }

    /// Refunds `amount` of a captured payment; answers the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        let request = Request::Refund(payment.to_owned(), amount);
        self.call(key, request, BTreeMap::new()).await
    }

    /// Releases an authorized payment.
    pub async fn cancel(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Settle(payment.to_owned(), Outcome::Canceled);
        self.call(key, request, BTreeMap::new()).await.map(drop)
    }

    /// Up to `limit` payments made since `since` (ms since the Unix epoch), oldest first.
    pub async fn payments_since(&self, since: u64, limit: usize) -> Vec<PaymentRecord> {
        let mut listed = self.find(|payment| payment.created >= since).await;
        listed.truncate(limit);
        listed
    }

    /// The payments whose metadata has `value` under `field`, oldest first.
    pub async fn search(&self, field: &str, value: &str) -> Vec<PaymentRecord> {
        self.find(|p| p.metadata.get(field).is_some_and(|v| v == value))
            .await
    }

    async fn find(&self, keep: impl Fn(&PaymentRecord) -> bool) -> Vec<PaymentRecord> {
        self.wait().await;
        let mut found: Vec<_> = self.lock().payments.values().cloned().collect();
        found.retain(keep);
        found.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
        found
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The provider's latency, if any.
    async fn wait(&self) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }

    /// One call, in a task of its own: the first answer again for a key used for the same
    /// request, a refusal for a key used for another, or else the effect made once.
    async fn call(
        &self,
        key: &str,
        request: Request,
        metadata: BTreeMap<String, String>,
    ) -> Result<String, ProviderError> {
        let (this, key) = (self.clone(), key.to_owned());
        let call = async move {
            this.wait().await;
            let now = Instant::now();
            let mut book = this.lock();
            book.forget_expired(now);
            if let Some((_, used_for, answered)) = book.keys.get(&key) {
                if *used_for != request {
                    tracing::info!(?used_for, ?request, "provider: a key reused");
                    return Err(ProviderError::KeyReused);
                }
                return Ok(answered.clone());
            }
            // A refusal binds no key: a provider that is down does nothing new, but still
            // answers a key it knows.
            let id = book.make(&request, metadata)?;
            let deadline = now + this.window;
            book.order.push_back((deadline, key.clone()));
            book.keys.insert(key, (deadline, request, id.clone()));
            Ok(id)
        };
        // A call that panicked ended without an answer: its outcome is unknown.
        (tokio::spawn(call).await).unwrap_or(Err(ProviderError::Unknown))
    }
}
