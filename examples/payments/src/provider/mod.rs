//! A simulated payment service provider (PSP), deduplicating on its own idempotency key.
//!
//! Like a real PSP, every call carries an idempotency key, and a second call with the same key
//! returns the first call's reply without doing anything again. The example derives that key from
//! the client's `Idempotency-Key` and the account, so even a request whose idempotency record was
//! lost (a flushed Redis, a dedup window that ran out) cannot move money twice.
//!
//! A key is bound to the request it was first used for: the operation and every parameter
//! (amount, source, capture flag, payment). The same key with another request is refused with
//! [`ProviderError::KeyReused`], and nothing happens: a reused key never returns another
//! request's payment or refund. A key is remembered for the provider's dedup window ([`WINDOW`],
//! 24 h, as the idempotency layer's), then it is new again. The keys live in a [`KeyTable`]: in
//! memory, or in Redis or PostgreSQL, where every instance of the service shares them, as they
//! would share one real provider.
//!
//! Every call also carries the caller's fence: the number of the idempotency layer's claim it
//! runs under ([`tower_idempotency::HeldClaim::fence`]), larger for every later claim of the
//! client's key. The key table keeps the largest fence each key has seen, in the same atomic step
//! as the key's claim, and refuses a call with a smaller one ([`ProviderError::Superseded`]):
//! a run whose lease ran out while it was stalled, and whose key a retry took over, cannot act
//! after the newer run did. An equal fence is the same claim (the client's own resend), and gets
//! the first reply.
//!
//! [`Provider::find_payment`] and [`Provider::find_call`] look a call up by its key, as a real
//! provider's API lets a reconciler find out what became of a call whose answer was lost.
//!
//! The example calls it over HTTP, as a service calls a real provider: [`api::router`] is its API
//! (an axum `Router`, served in process), and [`ProviderClient`] calls that API through the
//! crate's client layer, `IdempotentRetryLayer`, with the derived key as the `Idempotency-Key`.
//! The provider's key table is the server half of that exchange.
//!
//! Test tokens: `tok_visa` is approved, `tok_chargeDeclined` is declined, and
//! `tok_pspUnavailable` finds the provider down (a transient failure: nothing happened, retry).
//! The simulated issuer decides from the token alone, so a payment's outcome follows from its
//! request, and a key only needs to remember the id it answered with.

pub mod api;
mod client;
mod keys;

use std::fmt::Write as _;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

pub use client::ProviderClient;
pub use keys::{KeyTable, KeyTableError, Used, now_ms};

/// How long the provider remembers a key: 24 hours.
pub const WINDOW: Duration = Duration::from_secs(24 * 60 * 60);

/// How often the expired keys are swept where the key table does not drop them by itself.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// A card token of the test mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Source {
    /// `tok_visa`: approved.
    #[serde(rename = "tok_visa")]
    Visa,
    /// `tok_chargeDeclined`: declined by the issuer.
    #[serde(rename = "tok_chargeDeclined")]
    ChargeDeclined,
    /// `tok_pspUnavailable`: the provider is down for this call.
    #[serde(rename = "tok_pspUnavailable")]
    ProviderUnavailable,
}

impl Source {
    /// The test token's source, or `None` for a token the provider does not know.
    pub fn parse(token: &str) -> Option<Self> {
        match token {
            "tok_visa" => Some(Source::Visa),
            "tok_chargeDeclined" => Some(Source::ChargeDeclined),
            "tok_pspUnavailable" => Some(Source::ProviderUnavailable),
            _ => None,
        }
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

/// A new payment, as the provider answers it; a repeated call with the same key gets the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// The provider's id of the payment.
    pub id: String,
    pub outcome: Outcome,
}

/// What the provider did with a new payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The payment is authorized: the money is held, not yet taken.
    Authorized,
    /// The payment is captured: the money is taken.
    Captured,
    /// The issuer declined the card: a decided outcome, nothing is held.
    Declined,
}

/// A call that did not get the provider's answer. Every refusal means nothing happened;
/// [`ProviderError::Unknown`] alone means the call may have taken effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// The provider said it was down, before doing anything: nothing happened, and a retry with
    /// the same key is safe.
    #[error("the payment provider is unavailable")]
    Unavailable,
    /// No usable answer: the call timed out, its connection was lost after it was sent, or the
    /// provider failed midway. Whether it took effect is not known; a call with the same key, or
    /// a look-up by it, finds out.
    #[error("the payment provider's answer was lost: the outcome is unknown")]
    Unknown,
    /// A refund of more than what is left of its payment (Stripe's `amount_too_large`).
    #[error("a refund of {amount} is more than the {refundable} left of the payment")]
    AmountTooLarge { amount: i64, refundable: i64 },
    /// A refund of a payment the provider never made.
    #[error("no such payment")]
    NoSuchPayment,
    /// The key was used, within the provider's window, for another request.
    #[error("the idempotency key was used for another request")]
    KeyReused,
    /// A call with the key carried a larger fence: this one comes from a run that a later claim
    /// of the client's key took over.
    #[error("a later run of this operation called the provider: this run was superseded")]
    Superseded,
}

/// A payment as the provider keeps it, for as long as a real one would (not for a key's window):
/// what [`Provider::payments_since`] lists, and what bounds its refunds.
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
    /// When it was made, in milliseconds since the Unix epoch.
    pub created: u64,
    /// The caller's own reference, kept as given (the example's: the account and the charge's
    /// details, so that a payment no charge names can be matched to its operation).
    pub reference: String,
}

/// What a call does besides answering, in the same atomic step as its key's claim.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Nothing besides the key (a capture, a cancellation).
    None,
    /// A new payment is recorded.
    Payment(PaymentRecord),
    /// `amount` of `payment` is refunded, unless that is more than is left of it.
    Refund { payment: String, amount: i64 },
}

/// Where every call stops for good, as a process that dies there would ([`Provider::hang`],
/// for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // for tests
pub enum Hang {
    /// Before the provider does anything.
    BeforeEffect,
    /// Once the provider did it (money moved, the key recorded), before it answers.
    AfterEffect,
}

impl Hang {
    fn code(at: Option<Hang>) -> u8 {
        match at {
            None => 0,
            Some(Hang::BeforeEffect) => 1,
            Some(Hang::AfterEffect) => 2,
        }
    }
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

/// A handle on the simulated provider; clones share it.
#[derive(Debug, Clone)]
pub struct Provider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    latency: Duration,
    /// Every call, including the ones answered from the key table and the failed ones.
    calls: AtomicUsize,
    /// Every call that did something: the ones not answered from the key table, nor failed.
    effects: AtomicUsize,
    /// The provider is down for every call (tests switch it on and off).
    outage: AtomicBool,
    /// The provider is down for this many more calls (tests).
    down_for: AtomicUsize,
    /// Where every call hangs ([`Hang::code`]; tests).
    hang: AtomicU8,
    /// Holds every call before its effect while a test holds it for writing, as a locked key
    /// table would ([`Provider::stall`]); and how many calls wait there.
    gate: Arc<tokio::sync::RwLock<()>>,
    stalled: AtomicUsize,
    keys: KeyTable,
    ids: RandomState,
    next_id: AtomicUsize,
}

impl Default for Provider {
    fn default() -> Self {
        Self::new(Duration::ZERO)
    }
}

impl Provider {
    /// A provider that takes `latency` to answer each call, with its keys in memory for
    /// [`WINDOW`].
    pub fn new(latency: Duration) -> Self {
        Self::with_keys(latency, KeyTable::memory(WINDOW))
    }

    /// A provider that takes `latency` to answer each call, with its keys in `keys`.
    pub fn with_keys(latency: Duration, keys: KeyTable) -> Self {
        Self {
            inner: Arc::new(Inner {
                latency,
                calls: AtomicUsize::new(0),
                effects: AtomicUsize::new(0),
                outage: AtomicBool::new(false),
                down_for: AtomicUsize::new(0),
                hang: AtomicU8::new(0),
                gate: Arc::default(),
                stalled: AtomicUsize::new(0),
                keys,
                ids: RandomState::new(),
                next_id: AtomicUsize::new(0),
            }),
        }
    }

    /// Creates a payment of `amount` from `source`, authorized only or also captured, under a
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
        let unavailable = source == Source::ProviderUnavailable;
        let record = PaymentRecord {
            id: self.new_id("py"),
            key: key.to_owned(),
            amount,
            refunded: 0,
            source,
            capture,
            outcome: outcome(source, capture),
            created: 0,
            reference: reference.to_owned(),
        };
        let id = record.id.clone();
        let id = self
            .call(
                key,
                fence,
                request,
                unavailable,
                id,
                Effect::Payment(record),
            )
            .await?;
        Ok(Payment {
            id,
            outcome: outcome(source, capture),
        })
    }

    /// Up to `limit` payments made since `since` (milliseconds since the Unix epoch), oldest
    /// first: the provider's side of a reconciliation, as a real provider's payments report.
    pub async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, ProviderError> {
        let inner = &self.inner;
        inner.calls.fetch_add(1, Ordering::SeqCst);
        if self.is_down() {
            return Err(ProviderError::Unavailable);
        }
        inner
            .keys
            .payments_since(since, limit)
            .await
            .map_err(table_unavailable)
    }

    /// The payment a [`Provider::create_payment`] call with `key` made for this request (`source`,
    /// `amount`, `capture`), within the provider's window; `None` when there is none: no such
    /// call reached the provider, or it failed, or the key was used for another request. Moves no
    /// money.
    pub async fn find_payment(
        &self,
        key: &str,
        source: Source,
        amount: i64,
        capture: bool,
    ) -> Result<Option<Payment>, ProviderError> {
        let inner = &self.inner;
        inner.calls.fetch_add(1, Ordering::SeqCst);
        if !inner.latency.is_zero() {
            tokio::time::sleep(inner.latency).await;
        }
        if self.is_down() {
            return Err(ProviderError::Unavailable);
        }
        let request = Request::CreatePayment {
            source,
            amount,
            capture,
        }
        .describe();
        let used = inner.keys.get(key).await.map_err(table_unavailable)?;
        Ok(used
            .filter(|used| used.request == request)
            .map(|used| Payment {
                id: used.id,
                outcome: outcome(source, capture),
            }))
    }

    /// The id a call with `key` answered for `request`, within the provider's window; `None` when
    /// there is none (no such call reached the provider, or it failed, or the key was used for
    /// another request). Changes nothing.
    #[allow(dead_code)] // for tests
    pub async fn find_call(
        &self,
        key: &str,
        request: Request<'_>,
    ) -> Result<Option<String>, ProviderError> {
        self.find_call_described(key, &request.describe()).await
    }

    /// [`Provider::find_call`] for a request as [`Request::describe`] wrote it.
    pub async fn find_call_described(
        &self,
        key: &str,
        request: &str,
    ) -> Result<Option<String>, ProviderError> {
        let inner = &self.inner;
        inner.calls.fetch_add(1, Ordering::SeqCst);
        if !inner.latency.is_zero() {
            tokio::time::sleep(inner.latency).await;
        }
        if self.is_down() {
            return Err(ProviderError::Unavailable);
        }
        let used = inner.keys.get(key).await.map_err(table_unavailable)?;
        Ok(used
            .filter(|used| used.request == request)
            .map(|used| used.id))
    }

    /// Deletes the keys whose window ended, where the key table does not do it by itself
    /// (PostgreSQL); returns how many went.
    pub async fn sweep_keys(&self) -> Result<u64, KeyTableError> {
        self.inner.keys.sweep().await
    }

    /// Sweeps the expired keys ([`Provider::sweep_keys`]) every `every` until `stop`, so that the
    /// key table holds no more than a window's keys.
    pub async fn sweep_keys_every(
        self,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            match self.sweep_keys().await {
                Ok(0) => {}
                Ok(swept) => tracing::debug!(swept, "provider: swept expired keys"),
                Err(err) => {
                    tracing::warn!(error = %super::report(&err), "provider: cannot sweep expired keys");
                }
            }
        }
    }

    /// Captures an authorized payment.
    pub async fn capture(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Capture { payment };
        self.call(key, fence, request, false, payment.to_owned(), Effect::None)
            .await
            .map(drop)
    }

    /// Refunds `amount` of a captured payment; answers the refund's id. Refused, and nothing
    /// happens, when that is more than is left of the payment ([`ProviderError::AmountTooLarge`]):
    /// checked in the same atomic step as the key's claim, so two refunds under two keys never
    /// both pass.
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
        self.call(key, fence, request, false, self.new_id("re"), effect)
            .await
    }

    /// Releases an authorized payment.
    pub async fn cancel(&self, key: &str, fence: u64, payment: &str) -> Result<(), ProviderError> {
        let request = Request::Cancel { payment };
        self.call(key, fence, request, false, payment.to_owned(), Effect::None)
            .await
            .map(drop)
    }

    /// How many calls reached the provider, repeated and failed ones included.
    #[allow(dead_code)] // for tests
    pub fn calls(&self) -> usize {
        self.inner.calls.load(Ordering::SeqCst)
    }

    /// How many calls did something (moved or held money, or recorded a decline): a call repeated
    /// with the same idempotency key is not counted again.
    #[allow(dead_code)] // for tests
    pub fn effects(&self) -> usize {
        self.inner.effects.load(Ordering::SeqCst)
    }

    /// Makes every call fail as [`ProviderError::Unavailable`] until switched off.
    #[allow(dead_code)] // for tests
    pub fn set_outage(&self, down: bool) {
        self.inner.outage.store(down, Ordering::SeqCst);
    }

    /// Makes the next `calls` calls fail as [`ProviderError::Unavailable`]: a provider down for a
    /// moment.
    #[allow(dead_code)] // for tests
    pub fn set_down_for(&self, calls: usize) {
        self.inner.down_for.store(calls, Ordering::SeqCst);
    }

    /// Whether this call finds the provider down: an outage, or one of the calls
    /// [`Provider::set_down_for`] counts down.
    fn is_down(&self) -> bool {
        let inner = &self.inner;
        inner.outage.load(Ordering::SeqCst)
            || inner
                .down_for
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    }

    /// Holds every call before its effect until the guard is dropped, as a locked key table
    /// would: a caller that gives up meanwhile does not stop it, and the held calls take effect
    /// once let go (tests).
    #[allow(dead_code)] // for tests
    pub async fn stall(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.inner.gate.clone().write_owned().await
    }

    /// How many calls [`Provider::stall`] holds now (tests).
    #[allow(dead_code)] // for tests
    pub fn stalled(&self) -> usize {
        self.inner.stalled.load(Ordering::SeqCst)
    }

    /// Makes every call from now on stop for good `at` that point (`None`: none does), as a
    /// process that dies there would.
    #[allow(dead_code)] // for tests
    pub fn hang(&self, at: Option<Hang>) {
        self.inner.hang.store(Hang::code(at), Ordering::SeqCst);
    }

    /// How long the provider takes to answer each call.
    #[allow(dead_code)] // with the postgres feature
    pub fn latency(&self) -> Duration {
        self.inner.latency
    }

    /// How long the provider remembers a key.
    #[allow(dead_code)] // for tests, and with the postgres feature
    pub fn window(&self) -> Duration {
        self.inner.keys.window()
    }

    /// One call: the id answered before for a key used for the same request, a refusal for a key
    /// used for another one or with a larger fence, or else `effect` made once, answered `id`.
    /// The call runs in a task of its own, as on a provider's server: a caller that stops waiting
    /// (its timeout, a lost connection) does not stop it.
    async fn call(
        &self,
        key: &str,
        fence: u64,
        request: Request<'_>,
        unavailable: bool,
        id: String,
        effect: Effect,
    ) -> Result<String, ProviderError> {
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        let (key, request) = (key.to_owned(), request.describe());
        let call = async move {
            this.run(&key, fence, request, unavailable, id, effect)
                .await
        };
        // A call that panicked ended without an answer: its outcome is unknown.
        tokio::spawn(call)
            .await
            .unwrap_or(Err(ProviderError::Unknown))
    }

    async fn run(
        &self,
        key: &str,
        fence: u64,
        request: String,
        unavailable: bool,
        id: String,
        effect: Effect,
    ) -> Result<String, ProviderError> {
        let inner = &self.inner;
        if !inner.latency.is_zero() {
            tokio::time::sleep(inner.latency).await;
        }
        self.hang_at(Hang::BeforeEffect).await;
        inner.stalled.fetch_add(1, Ordering::SeqCst);
        drop(inner.gate.read().await);
        inner.stalled.fetch_sub(1, Ordering::SeqCst);
        // A provider that is down does nothing new, but still answers a key it knows.
        let earlier = if unavailable || self.is_down() {
            let known = inner.keys.get(key).await.map_err(table_failed)?;
            known.ok_or(ProviderError::Unavailable)?
        } else {
            let used = Used {
                request: request.clone(),
                id,
                fence,
            };
            let inserted = inner.keys.insert(key, &used, effect).await;
            let Some(earlier) = inserted.map_err(table_failed)?? else {
                inner.effects.fetch_add(1, Ordering::SeqCst);
                self.hang_at(Hang::AfterEffect).await;
                return Ok(used.id);
            };
            earlier
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
    }

    /// Never returns when calls hang `at` this point.
    async fn hang_at(&self, at: Hang) {
        if self.inner.hang.load(Ordering::SeqCst) == Hang::code(Some(at)) {
            tracing::debug!(?at, "provider: hanging");
            std::future::pending::<()>().await;
        }
    }

    /// A fresh, unguessable id such as `py_3f9a0c1b7e2d4a68`.
    fn new_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::SeqCst);
        format!("{prefix}_{:016x}", self.inner.ids.hash_one(n))
    }
}

/// What a new payment from `source` comes to: the simulated issuer decides from the token alone.
fn outcome(source: Source, capture: bool) -> Outcome {
    match (source, capture) {
        (Source::ChargeDeclined, _) => Outcome::Declined,
        (_, false) => Outcome::Authorized,
        (_, true) => Outcome::Captured,
    }
}

/// A key table that failed during a look-up: the provider cannot answer now.
fn table_unavailable(err: KeyTableError) -> ProviderError {
    tracing::warn!(error = %super::report(&err), "provider: the key table failed");
    ProviderError::Unavailable
}

/// A key table that failed during a call: its write may have happened (a commit whose answer was
/// lost), so the outcome is unknown, and a retry with the same key finds out.
fn table_failed(err: KeyTableError) -> ProviderError {
    tracing::warn!(error = %super::report(&err), "provider: the key table failed during a call");
    ProviderError::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_repeated_key_gets_the_first_reply_without_a_second_effect() {
        let provider = Provider::default();
        let first = provider
            .create_payment("k1", 0, Source::Visa, 100, true, "")
            .await
            .unwrap();
        let again = provider
            .create_payment("k1", 0, Source::Visa, 100, true, "")
            .await
            .unwrap();
        assert_eq!(first, again);
        assert_eq!(first.outcome, Outcome::Captured);
        assert_eq!((provider.calls(), provider.effects()), (2, 1));

        let other = provider
            .create_payment("k2", 0, Source::Visa, 100, false, "")
            .await
            .unwrap();
        assert_ne!(other.id, first.id);
        assert_eq!(other.outcome, Outcome::Authorized);
        assert_eq!((provider.calls(), provider.effects()), (3, 2));
    }

    #[tokio::test]
    async fn a_smaller_fence_is_refused_and_an_equal_or_larger_one_resends() {
        let provider = Provider::default();
        let payment = provider
            .create_payment("k", 20, Source::Visa, 100, true, "")
            .await
            .unwrap();
        assert_eq!(
            provider
                .create_payment("k", 10, Source::Visa, 100, true, "")
                .await,
            Err(ProviderError::Superseded),
            "a run taken over acts no more"
        );
        assert_eq!(
            provider
                .create_payment("k", 20, Source::Visa, 100, true, "")
                .await,
            Ok(payment.clone()),
            "the same claim's resend"
        );
        assert_eq!(
            provider
                .create_payment("k", 30, Source::Visa, 100, true, "")
                .await,
            Ok(payment.clone()),
            "a later claim of the same request gets the same payment"
        );
        assert_eq!(
            provider
                .create_payment("k", 20, Source::Visa, 100, true, "")
                .await,
            Err(ProviderError::Superseded),
            "the key keeps the largest fence"
        );
        assert_eq!(
            provider
                .create_payment("k", 40, Source::Visa, 101, true, "")
                .await,
            Err(ProviderError::KeyReused),
            "another request is refused whatever its fence"
        );
        assert_eq!(provider.capture("c", 5, &payment.id).await, Ok(()));
        assert_eq!(
            provider.capture("c", 4, &payment.id).await,
            Err(ProviderError::Superseded)
        );
        assert_eq!(provider.effects(), 2, "one payment, one capture");
    }

    #[tokio::test]
    async fn a_decline_is_a_decided_outcome() {
        let provider = Provider::default();
        for _ in 0..2 {
            let reply = provider
                .create_payment("k", 0, Source::ChargeDeclined, 100, true, "")
                .await
                .unwrap();
            assert_eq!(reply.outcome, Outcome::Declined);
        }
        assert_eq!((provider.calls(), provider.effects()), (2, 1));
    }

    #[tokio::test]
    async fn an_unavailable_call_does_nothing_and_is_not_remembered() {
        let provider = Provider::default();
        for _ in 0..2 {
            let reply = provider
                .create_payment("k", 0, Source::ProviderUnavailable, 100, true, "")
                .await;
            assert_eq!(reply, Err(ProviderError::Unavailable));
        }
        assert_eq!((provider.calls(), provider.effects()), (2, 0));

        provider.set_outage(true);
        assert_eq!(
            provider.capture("c", 0, "py_1").await,
            Err(ProviderError::Unavailable)
        );
        provider.set_outage(false);
        assert_eq!(provider.capture("c", 0, "py_1").await, Ok(()));
        assert_eq!((provider.calls(), provider.effects()), (4, 1));
    }

    #[tokio::test]
    async fn a_key_is_bound_to_its_operation_and_parameters() {
        let provider = Provider::default();
        let payment = provider
            .create_payment("k", 0, Source::Visa, 100, true, "")
            .await
            .unwrap();
        let reused = [
            provider
                .create_payment("k", 0, Source::Visa, 101, true, "")
                .await,
            provider
                .create_payment("k", 0, Source::Visa, 100, false, "")
                .await,
            provider
                .create_payment("k", 0, Source::ChargeDeclined, 100, true, "")
                .await,
        ];
        for reply in reused {
            assert_eq!(reply, Err(ProviderError::KeyReused));
        }
        assert_eq!(
            provider.refund("k", 0, &payment.id, 100).await,
            Err(ProviderError::KeyReused)
        );
        assert_eq!(
            provider.capture("k", 0, &payment.id).await,
            Err(ProviderError::KeyReused)
        );
        assert_eq!(
            provider.cancel("k", 0, &payment.id).await,
            Err(ProviderError::KeyReused)
        );

        let refund = provider.refund("r", 0, &payment.id, 40).await.unwrap();
        assert_eq!(provider.refund("r", 0, &payment.id, 40).await, Ok(refund));
        assert_eq!(
            provider.refund("r", 0, &payment.id, 60).await,
            Err(ProviderError::KeyReused)
        );
        assert_eq!(
            provider.refund("r", 0, "py_other", 40).await,
            Err(ProviderError::KeyReused)
        );
        assert_eq!((provider.calls(), provider.effects()), (11, 2));
    }

    #[tokio::test]
    async fn a_payment_is_found_by_its_key_and_request_only() {
        let provider = Provider::default();
        assert_eq!(
            provider.find_payment("k", Source::Visa, 100, false).await,
            Ok(None)
        );
        let payment = provider
            .create_payment("k", 0, Source::Visa, 100, false, "")
            .await
            .unwrap();
        let payment_id = payment.id.clone();
        assert_eq!(
            provider.find_payment("k", Source::Visa, 100, false).await,
            Ok(Some(payment))
        );
        assert_eq!(
            provider.find_payment("k", Source::Visa, 101, false).await,
            Ok(None),
            "the key was used for another request"
        );
        provider.refund("r", 0, &payment_id, 100).await.unwrap();
        assert_eq!(
            provider.find_payment("r", Source::Visa, 100, true).await,
            Ok(None)
        );
        assert_eq!(provider.effects(), 2, "a lookup moves no money");
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_is_new_again_after_the_window() {
        let window = Duration::from_secs(60);
        let provider = Provider::with_keys(Duration::ZERO, KeyTable::memory(window));
        let paid = provider
            .create_payment("paid", 0, Source::Visa, 100, true, "")
            .await
            .unwrap();
        let refund = provider.refund("k", 0, &paid.id, 100).await.unwrap();

        tokio::time::advance(window - Duration::from_millis(1)).await;
        assert_eq!(
            provider
                .create_payment("k", 0, Source::Visa, 100, true, "")
                .await,
            Err(ProviderError::KeyReused)
        );

        tokio::time::advance(Duration::from_millis(1)).await;
        let payment = provider
            .create_payment("k", 0, Source::Visa, 100, true, "")
            .await
            .unwrap();
        assert_ne!(payment.id, refund);
        assert_eq!(payment.outcome, Outcome::Captured);
        assert_eq!(
            provider
                .create_payment("k", 0, Source::Visa, 100, true, "")
                .await,
            Ok(payment)
        );
        assert_eq!((provider.calls(), provider.effects()), (5, 3));
    }

    #[tokio::test]
    async fn a_refund_beyond_what_is_left_of_its_payment_is_refused() {
        let provider = Provider::default();
        let payment = provider
            .create_payment("pay", 0, Source::Visa, 1000, true, "")
            .await
            .unwrap();
        provider.refund("r1", 0, &payment.id, 600).await.unwrap();
        assert_eq!(
            provider.refund("r2", 0, &payment.id, 600).await,
            Err(ProviderError::AmountTooLarge {
                amount: 600,
                refundable: 400
            })
        );
        provider.refund("r3", 0, &payment.id, 400).await.unwrap();
        assert_eq!(
            provider.refund("r1", 0, &payment.id, 600).await.map(drop),
            Ok(()),
            "a resend gets its first reply"
        );
        assert_eq!(
            provider.refund("r4", 0, "py_none", 1).await,
            Err(ProviderError::NoSuchPayment)
        );
        assert_eq!(provider.effects(), 3, "one payment, two refunds");
        let listed = provider.payments_since(0, 10).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].id.as_str(), listed[0].refunded),
            (payment.id.as_str(), 1000)
        );
    }
}
