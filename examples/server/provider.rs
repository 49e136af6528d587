//! A simulated payment service provider (PSP), deduplicating on its own idempotency key.
//!
//! Like a real PSP, every call carries an idempotency key, and a second call with the same key
//! returns the first call's reply without doing anything again. The example derives that key from
//! the client's `Idempotency-Key` and the account, so even a request whose idempotency record was
//! lost (a flushed Redis, a dedup window that ran out) cannot move money twice.
//!
//! Test tokens: `tok_visa` is approved, `tok_chargeDeclined` is declined, and
//! `tok_pspUnavailable` finds the provider down (a transient failure: nothing happened, retry).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// A card token of the test mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `tok_visa`: approved.
    Visa,
    /// `tok_chargeDeclined`: declined by the issuer.
    ChargeDeclined,
    /// `tok_pspUnavailable`: the provider is down for this call.
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
}

/// The provider's answer to a call; a repeated call with the same key gets the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The provider's id of the payment, or of the refund.
    pub id: String,
    pub outcome: Outcome,
}

/// What the provider did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The payment is authorized: the money is held, not yet taken.
    Authorized,
    /// The payment is captured: the money is taken.
    Captured,
    /// The issuer declined the card: a decided outcome, nothing is held.
    Declined,
    /// The money (or part of it) went back.
    Refunded,
    /// The authorization is released.
    Canceled,
}

/// The provider could not be reached: nothing happened, and a retry with the same key is safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unavailable;

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the payment provider is unavailable")
    }
}

/// A handle on the simulated provider; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Provider {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    latency: Duration,
    /// Every call, including the ones answered from the dedup table and the failed ones.
    calls: AtomicUsize,
    /// Every call that did something: the ones not answered from the dedup table, nor failed.
    effects: AtomicUsize,
    /// The provider is down for every call (tests switch it on and off).
    outage: AtomicBool,
    /// The reply to each idempotency key seen.
    replies: Mutex<HashMap<String, Reply>>,
    ids: RandomState,
    next_id: AtomicUsize,
}

impl Provider {
    /// A provider that takes `latency` to answer each call.
    pub fn new(latency: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                latency,
                ..Inner::default()
            }),
        }
    }

    /// Creates a payment of `amount` from `source`, authorized only or also captured.
    pub async fn create_payment(
        &self,
        key: &str,
        source: Source,
        amount: i64,
        capture: bool,
    ) -> Result<Reply, Unavailable> {
        tracing::debug!(amount, ?source, capture, "provider: create payment");
        self.call(key, source == Source::ProviderUnavailable, || {
            let outcome = match (source, capture) {
                (Source::ChargeDeclined, _) => Outcome::Declined,
                (_, false) => Outcome::Authorized,
                (_, true) => Outcome::Captured,
            };
            (self.new_id("py"), outcome)
        })
        .await
    }

    /// Captures an authorized payment.
    pub async fn capture(&self, key: &str, payment: &str) -> Result<Reply, Unavailable> {
        self.call(key, false, || (payment.to_owned(), Outcome::Captured))
            .await
    }

    /// Refunds `amount` of a captured payment.
    pub async fn refund(
        &self,
        key: &str,
        payment: &str,
        amount: i64,
    ) -> Result<Reply, Unavailable> {
        tracing::debug!(payment, amount, "provider: refund");
        self.call(key, false, || (self.new_id("re"), Outcome::Refunded))
            .await
    }

    /// Releases an authorized payment.
    pub async fn cancel(&self, key: &str, payment: &str) -> Result<Reply, Unavailable> {
        self.call(key, false, || (payment.to_owned(), Outcome::Canceled))
            .await
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

    /// Makes every call fail as [`Unavailable`] until switched off.
    #[allow(dead_code)] // for tests
    pub fn set_outage(&self, down: bool) {
        self.inner.outage.store(down, Ordering::SeqCst);
    }

    /// One call: the stored reply for a key seen before, or else `effect` run once and remembered.
    async fn call(
        &self,
        key: &str,
        unavailable: bool,
        effect: impl FnOnce() -> (String, Outcome),
    ) -> Result<Reply, Unavailable> {
        let inner = &self.inner;
        inner.calls.fetch_add(1, Ordering::SeqCst);
        if !inner.latency.is_zero() {
            tokio::time::sleep(inner.latency).await;
        }
        let mut replies = inner.replies.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(reply) = replies.get(key) {
            return Ok(reply.clone());
        }
        if unavailable || inner.outage.load(Ordering::SeqCst) {
            return Err(Unavailable);
        }
        let (id, outcome) = effect();
        let reply = Reply { id, outcome };
        replies.insert(key.to_owned(), reply.clone());
        inner.effects.fetch_add(1, Ordering::SeqCst);
        Ok(reply)
    }

    /// A fresh, unguessable id such as `py_3f9a0c1b7e2d4a68`.
    fn new_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::SeqCst);
        format!("{prefix}_{:016x}", self.inner.ids.hash_one(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_repeated_key_gets_the_first_reply_without_a_second_effect() {
        let provider = Provider::default();
        let first = provider
            .create_payment("k1", Source::Visa, 100, true)
            .await
            .unwrap();
        let again = provider
            .create_payment("k1", Source::Visa, 100, true)
            .await
            .unwrap();
        assert_eq!(first, again);
        assert_eq!(first.outcome, Outcome::Captured);
        assert_eq!((provider.calls(), provider.effects()), (2, 1));

        let other = provider
            .create_payment("k2", Source::Visa, 100, false)
            .await
            .unwrap();
        assert_ne!(other.id, first.id);
        assert_eq!(other.outcome, Outcome::Authorized);
        assert_eq!((provider.calls(), provider.effects()), (3, 2));
    }

    #[tokio::test]
    async fn a_decline_is_a_decided_outcome() {
        let provider = Provider::default();
        for _ in 0..2 {
            let reply = provider
                .create_payment("k", Source::ChargeDeclined, 100, true)
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
                .create_payment("k", Source::ProviderUnavailable, 100, true)
                .await;
            assert_eq!(reply, Err(Unavailable));
        }
        assert_eq!((provider.calls(), provider.effects()), (2, 0));

        provider.set_outage(true);
        assert_eq!(provider.capture("c", "py_1").await, Err(Unavailable));
        provider.set_outage(false);
        assert_eq!(
            provider.capture("c", "py_1").await.map(|r| r.outcome),
            Ok(Outcome::Captured)
        );
        assert_eq!((provider.calls(), provider.effects()), (4, 1));
    }
}
