//! The simulated payment provider, shaped like a real one: payments, idempotency keys each bound
//! to its request for [`WINDOW`], a refund bound (`amount_too_large`), payments listed by
//! creation time and found by their metadata. Its state is in memory: it is a program of its own
//! (`src/bin/provider.rs`, `PROVIDER_URL`), which every instance of the example calls over HTTP
//! (`api.rs`) through its client (`client.rs`); without one, the example serves it in process.
//! Each call runs in a task of its own, as on a provider's server: a caller that stops waiting
//! does not stop it. Test tokens: `tok_visa` is approved, `tok_chargeDeclined` declined,
//! `tok_pspUnavailable` finds the provider down.

pub mod api;
mod client;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

pub use client::ProviderClient;

use super::now_ms;

/// How long the provider remembers a key: 24 hours, as Stripe does.
pub const WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// A card token of the test mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Source {
    /// Approved.
    #[serde(rename = "tok_visa")]
    Visa,
    /// Declined by the issuer.
    #[serde(rename = "tok_chargeDeclined")]
    ChargeDeclined,
    /// The provider is down for this call.
    #[serde(rename = "tok_pspUnavailable")]
    ProviderUnavailable,
}

impl Source {
    const ALL: [Source; 3] = [
        Source::Visa,
        Source::ChargeDeclined,
        Source::ProviderUnavailable,
    ];

    /// The test token's source, or `None` for a token the provider does not know.
    pub fn parse(token: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|source| source.token() == token)
    }

    /// The test token.
    pub fn token(self) -> &'static str {
        match self {
            Source::Visa => "tok_visa",
            Source::ChargeDeclined => "tok_chargeDeclined",
            Source::ProviderUnavailable => "tok_pspUnavailable",
        }
    }
}

/// A new payment, as the provider answers it; a repeated call with the same key gets the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    pub id: String,
    pub outcome: Outcome,
}

/// What the provider did with a new payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The money is held, not yet taken.
    Authorized,
    /// The money is taken.
    Captured,
    /// The issuer declined the card: a decided outcome.
    Declined,
}

impl Outcome {
    /// What a new payment from `source` comes to: the simulated issuer decides from the token.
    pub fn of(source: Source, capture: bool) -> Self {
        match (source, capture) {
            (Source::ChargeDeclined, _) => Outcome::Declined,
            (_, false) => Outcome::Authorized,
            (_, true) => Outcome::Captured,
        }
    }
}

/// A call that did not get the provider's answer. Every refusal means nothing happened;
/// [`ProviderError::Unknown`] alone means the call may have taken effect.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ProviderError {
    /// The provider said it was down, or could not be reached, before doing anything: retry
    /// with the same key.
    #[error("the payment provider is unavailable")]
    Unavailable,
    /// No usable answer (a timeout, a connection lost after the call was sent, a failure
    /// midway): whether it took effect is not known; a call with the same key finds out.
    #[error("the payment provider's answer was lost: the outcome is unknown")]
    Unknown,
    /// A refund of more than what is left of its payment (Stripe's `amount_too_large`).
    #[error("a refund of {amount} is more than the {refundable} left of the payment")]
    AmountTooLarge { amount: i64, refundable: i64 },
    /// A refund of a payment the provider never made.
    #[error("no such payment")]
    NoSuchPayment,
    /// The key was used, within the window, for another request.
    #[error("the idempotency key was used for another request")]
    KeyReused,
}

/// A payment as the provider keeps it (for good, not for a key's window): what its report
/// lists, its search finds, and what bounds its refunds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// One call, as its key is bound to it.
#[derive(Debug, Clone, Copy)]
pub enum Request<'a> {
    CreatePayment {
        source: Source,
        amount: i64,
        capture: bool,
    },
    Capture {
        payment: &'a str,
    },
    Refund {
        payment: &'a str,
        amount: i64,
    },
    Cancel {
        payment: &'a str,
    },
}

impl Request<'_> {
    /// The operation and all its parameters: what a key is bound to.
    fn describe(self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = match self {
            Request::CreatePayment {
                source,
                amount,
                capture,
            } => write!(
                text,
                "create_payment source={} amount={amount} capture={capture}",
                source.token()
            ),
            Request::Capture { payment } => write!(text, "capture payment={payment}"),
            Request::Refund { payment, amount } => {
                write!(text, "refund payment={payment} amount={amount}")
            }
            Request::Cancel { payment } => write!(text, "cancel payment={payment}"),
        };
        text
    }
}

/// What a call does besides answering, in the same step as its key's claim.
enum Effect {
    /// Nothing but the key (a capture, a cancellation).
    None,
    /// A new payment is recorded.
    Payment(PaymentRecord),
    /// `amount` of `payment` is refunded, unless that is more than is left of it.
    Refund { payment: String, amount: i64 },
}

/// The simulated provider; clones share it.
#[derive(Debug, Clone)]
pub struct Provider {
    book: Arc<Mutex<Book>>,
    /// How long each call takes (`PSP_LATENCY_MS`).
    latency: Duration,
    window: Duration,
}

/// Keys and payments, under one lock: a key's check, its claim and its call's effect are one step.
#[derive(Debug, Default)]
struct Book {
    /// Each key's request and answer (the payment's or refund's id), until its deadline.
    keys: HashMap<String, (Instant, String, String)>,
    /// Each key with its deadline, first used first: the order in which they expire.
    order: VecDeque<(Instant, String)>,
    payments: HashMap<String, PaymentRecord>,
}

impl Book {
    fn forget_expired(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.order.front()
            && *deadline <= now
        {
            let Some((deadline, key)) = self.order.pop_front() else {
                break;
            };
            // The key may have been used again since, with a later deadline: keep that one.
            if self.keys.get(&key).is_some_and(|(at, ..)| *at == deadline) {
                self.keys.remove(&key);
            }
        }
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

    /// Creates a payment of `amount` from `source`, authorized only or also captured; `metadata`
    /// is kept with it, as given.
    pub async fn create_payment(
        &self,
        key: &str,
        (source, amount, capture): (Source, i64, bool),
        metadata: BTreeMap<String, String>,
    ) -> Result<Payment, ProviderError> {
        let request = Request::CreatePayment {
            source,
            amount,
            capture,
        };
        let outcome = Outcome::of(source, capture);
        let record = PaymentRecord {
            id: crate::ledger::new_id("py"),
            amount,
            refunded: 0,
            source,
            capture,
            outcome,
            created: 0,
            metadata,
        };
        let unavailable = source == Source::ProviderUnavailable;
        let (id, effect) = (record.id.clone(), Effect::Payment(record));
        let id = self.call(key, request, unavailable, id, effect).await?;
        Ok(Payment { id, outcome })
    }

    /// Captures an authorized payment.
    pub async fn capture(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Capture { payment };
        (self
            .call(key, request, false, payment.to_owned(), Effect::None)
            .await)
            .map(drop)
    }

    /// Refunds `amount` of a captured payment; answers the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        let effect = Effect::Refund {
            payment: payment.to_owned(),
            amount,
        };
        let request = Request::Refund { payment, amount };
        let id = crate::ledger::new_id("re");
        self.call(key, request, false, id, effect).await
    }

    /// Releases an authorized payment.
    pub async fn cancel(&self, key: &str, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Cancel { payment };
        (self
            .call(key, request, false, payment.to_owned(), Effect::None)
            .await)
            .map(drop)
    }

    /// Up to `limit` payments made since `since` (ms since the Unix epoch), oldest first.
    pub async fn payments_since(&self, since: u64, limit: usize) -> Vec<PaymentRecord> {
        self.wait().await;
        let mut listed: Vec<PaymentRecord> = (self.lock().payments.values())
            .filter(|payment| payment.created >= since)
            .cloned()
            .collect();
        listed.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
        listed.truncate(limit);
        listed
    }

    /// The payments whose metadata has `value` under `field`, oldest first.
    pub async fn search(&self, field: &str, value: &str) -> Vec<PaymentRecord> {
        self.wait().await;
        let mut found: Vec<PaymentRecord> = (self.lock().payments.values())
            .filter(|payment| payment.metadata.get(field).is_some_and(|v| v == value))
            .cloned()
            .collect();
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

    /// One call, in a task of its own: the id answered before for a key used for the same
    /// request, a refusal for a key used for another one, or else `effect` made once, answered
    /// `id`.
    async fn call(
        &self,
        key: &str,
        request: Request<'_>,
        unavailable: bool,
        id: String,
        effect: Effect,
    ) -> Result<String, ProviderError> {
        let (this, key, request) = (self.clone(), key.to_owned(), request.describe());
        let call = async move {
            this.wait().await;
            let now = Instant::now();
            let mut book = this.lock();
            book.forget_expired(now);
            if let Some((_, used_for, answered)) = book.keys.get(&key) {
                if *used_for != request {
                    tracing::info!(used_for = %used_for, %request, "provider: a key reused for another request");
                    return Err(ProviderError::KeyReused);
                }
                return Ok(answered.clone());
            }
            // A provider that is down does nothing new, but still answers a key it knows.
            if unavailable {
                return Err(ProviderError::Unavailable);
            }
            match effect {
                Effect::None => {}
                Effect::Payment(mut payment) => {
                    payment.created = now_ms();
                    book.payments.insert(payment.id.clone(), payment);
                }
                Effect::Refund { payment, amount } => {
                    let payment =
                        (book.payments.get_mut(&payment)).ok_or(ProviderError::NoSuchPayment)?;
                    let refundable = payment.amount - payment.refunded;
                    if amount > refundable {
                        return Err(ProviderError::AmountTooLarge { amount, refundable });
                    }
                    payment.refunded += amount;
                }
            }
            let deadline = now + this.window;
            book.keys
                .insert(key.clone(), (deadline, request, id.clone()));
            book.order.push_back((deadline, key));
            Ok(id)
        };
        // A call that panicked ended without an answer: its outcome is unknown.
        (tokio::spawn(call).await).unwrap_or(Err(ProviderError::Unknown))
    }
}
