//! The simulated payment provider: payments, its idempotency keys (each bound to its request for
//! [`WINDOW`]), its fences (the largest per key, a smaller one refused), its refund bound
//! (`amount_too_large`) and its payments report; the keys in a [`KeyTable`] (`keys/`). The README
//! says why each exists. The example calls it over HTTP (`api.rs`) through its client
//! (`client.rs`), as it would call a real one. Each call runs in a task of its own, as on a
//! provider's server: a caller that stops waiting does not stop it. Test tokens: `tok_visa` is
//! approved, `tok_chargeDeclined` declined, `tok_pspUnavailable` finds the provider down.

pub mod api;
mod client;
pub mod keys;

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use client::ProviderClient;
pub use keys::{KeyTable, KeyTableError, MemoryKeys, PgKeys, RedisKeys, Used, now_ms};

/// How long the provider remembers a key: 24 hours.
pub const WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// How often the expired keys are swept where the key table does not drop them by itself.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

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
    const ALL: [Outcome; 3] = [Outcome::Authorized, Outcome::Captured, Outcome::Declined];

    /// What a new payment from `source` comes to: the simulated issuer decides from the token.
    pub fn of(source: Source, capture: bool) -> Self {
        match (source, capture) {
            (Source::ChargeDeclined, _) => Outcome::Declined,
            (_, false) => Outcome::Authorized,
            (_, true) => Outcome::Captured,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Authorized => "authorized",
            Outcome::Captured => "captured",
            Outcome::Declined => "declined",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|outcome| outcome.as_str() == text)
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
    /// The provider said it was down, before doing anything: retry with the same key.
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
    /// A call with the key carried a larger fence: this one comes from a run taken over.
    #[error("a later run of this operation called the provider: this run was superseded")]
    Superseded,
}

/// A payment as the provider keeps it (for good, not for a key's window): what its report
/// lists, and what bounds its refunds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PaymentRecord {
    pub id: String,
    /// The idempotency key it was made under.
    pub key: String,
    pub amount: i64,
    /// How much of it was refunded.
    pub refunded: i64,
    pub source: Source,
    pub capture: bool,
    pub outcome: Outcome,
    /// When it was made, in ms since the Unix epoch (stamped by the key table).
    pub created: u64,
    /// The caller's own reference, kept as given.
    pub reference: String,
}

/// What a call does besides answering, in the same atomic step as its key's claim.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Nothing but the key (a capture, a cancellation).
    None,
    /// A new payment is recorded.
    Payment(PaymentRecord),
    /// `amount` of `payment` is refunded, unless that is more than is left of it.
    Refund { payment: String, amount: i64 },
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
    /// The operation and all its parameters, as the key table stores them.
    pub fn describe(self) -> String {
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

/// The simulated provider; clones share it.
#[derive(Debug, Clone)]
pub struct Provider {
    keys: Arc<dyn KeyTable>,
    /// How long each call takes (`PSP_LATENCY_MS`).
    latency: Duration,
}

impl Provider {
    /// A provider whose keys and payments are in `keys`, taking `latency` to answer each call.
    pub fn new(keys: Arc<dyn KeyTable>, latency: Duration) -> Self {
        Self { keys, latency }
    }

    /// Its HTTP API.
    pub fn router(&self) -> axum::Router {
        api::router(self.clone())
    }

    /// Creates a payment of `amount` from `source`, authorized only or also captured, under the
    /// claim numbered `fence`; `reference` is kept with it, as given.
    pub async fn create_payment(
        &self,
        key: &str,
        fence: u64,
        source: Source,
        amount: i64,
        capture: bool,
        reference: &str,
    ) -> Result<Payment, ProviderError> {
        tracing::debug!(amount, ?source, capture, "provider: create payment");
        let request = Request::CreatePayment {
            source,
            amount,
            capture,
        };
        let outcome = Outcome::of(source, capture);
        let record = PaymentRecord {
            id: crate::ledger::new_id("py"),
            key: key.to_owned(),
            amount,
            refunded: 0,
            source,
            capture,
            outcome,
            created: 0,
            reference: reference.to_owned(),
        };
        let unavailable = source == Source::ProviderUnavailable;
        let (id, effect) = (record.id.clone(), Effect::Payment(record));
        let id = self
            .call(key, fence, request, unavailable, id, effect)
            .await?;
        Ok(Payment { id, outcome })
    }

    /// Captures an authorized payment.
    pub async fn capture(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Capture { payment };
        self.call(key, fence, request, false, payment.to_owned(), Effect::None)
            .await
            .map(drop)
    }

    /// Refunds `amount` of a captured payment; answers the refund's id.
    pub async fn refund(
        &self,
        key: &str,
        fence: u64,
        payment: &str,
        amount: i64,
    ) -> Result<String, ProviderError> {
        tracing::debug!(payment, amount, "provider: refund");
        let effect = Effect::Refund {
            payment: payment.to_owned(),
            amount,
        };
        let request = Request::Refund { payment, amount };
        let id = crate::ledger::new_id("re");
        self.call(key, fence, request, false, id, effect).await
    }

    /// Releases an authorized payment.
    pub async fn cancel(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Cancel { payment };
        self.call(key, fence, request, false, payment.to_owned(), Effect::None)
            .await
            .map(drop)
    }

    /// The id a call with `key` answered for `request` (as [`Request::describe`] writes it),
    /// within the window; `None` when there is none: no such call reached the provider, it
    /// failed, or the key was used for another request. Changes nothing.
    pub async fn find_call(
        &self,
        key: &str,
        request: &str,
    ) -> Result<Option<String>, ProviderError> {
        self.wait().await;
        let used = self.keys.get(key).await.map_err(table_unavailable)?;
        Ok(used
            .filter(|used| used.request == request)
            .map(|used| used.id))
    }

    /// Up to `limit` payments made since `since` (ms since the Unix epoch), oldest first.
    pub async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, ProviderError> {
        (self.keys.payments_since(since, limit).await).map_err(table_unavailable)
    }

    /// Sweeps the expired keys every `every` until `stop`, where the key table does not drop
    /// them by itself, so that it holds no more than a window's keys.
    pub async fn sweep_keys_every(self, every: Duration, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            match self.keys.sweep().await {
                Ok(0) => {}
                Ok(swept) => tracing::debug!(swept, "provider: swept expired keys"),
                Err(err) => {
                    tracing::warn!(error = %crate::report(&err), "provider: cannot sweep expired keys");
                }
            }
        }
    }

    /// The provider's latency, if any.
    async fn wait(&self) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }

    /// One call, in a task of its own: the id answered before for a key used for the same
    /// request, a refusal for a key used for another one or with a larger fence, or else
    /// `effect` made once, answered `id`.
    async fn call(
        &self,
        key: &str,
        fence: u64,
        request: Request<'_>,
        unavailable: bool,
        id: String,
        effect: Effect,
    ) -> Result<String, ProviderError> {
        let (this, key, request) = (self.clone(), key.to_owned(), request.describe());
        let call = async move {
            this.wait().await;
            // A provider that is down does nothing new, but still answers a key it knows.
            let earlier = if unavailable {
                let known = this.keys.get(&key).await.map_err(table_failed)?;
                known.ok_or(ProviderError::Unavailable)?
            } else {
                let used = Used {
                    request: request.clone(),
                    id,
                    fence,
                };
                match this
                    .keys
                    .insert(&key, &used, effect)
                    .await
                    .map_err(table_failed)??
                {
                    None => return Ok(used.id),
                    Some(earlier) => earlier,
                }
            };
            if earlier.request != request {
                tracing::info!(used_for = %earlier.request, %request, "provider: a key reused for another request");
                return Err(ProviderError::KeyReused);
            }
            if fence < earlier.fence {
                tracing::info!(fence, seen = earlier.fence, %request, "provider: a call from a superseded run");
                return Err(ProviderError::Superseded);
            }
            Ok(earlier.id)
        };
        // A call that panicked ended without an answer: its outcome is unknown.
        (tokio::spawn(call).await).unwrap_or(Err(ProviderError::Unknown))
    }
}

/// A key table that failed during a look-up: the provider cannot answer now.
fn table_unavailable(err: KeyTableError) -> ProviderError {
    tracing::warn!(error = %crate::report(&err), "provider: the key table failed");
    ProviderError::Unavailable
}

/// A key table that failed during a call: its write may have happened (a commit whose answer was
/// lost), so the outcome is unknown, and a retry with the same key finds out.
fn table_failed(err: KeyTableError) -> ProviderError {
    tracing::warn!(error = %crate::report(&err), "provider: the key table failed during a call");
    ProviderError::Unknown
}
