//! The provider's keys in memory: a map under one lock, and the keys in the order they were first
//! used, so that the expired ones are dropped from the front.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{KeyTable, KeyTableError, Used, now_ms};
use crate::provider::{Effect, PaymentRecord, ProviderError};

/// The keys and payments in memory, each key remembered for `window`.
#[derive(Debug)]
pub struct MemoryKeys {
    window: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    used: HashMap<String, (Instant, Used)>,
    /// Every payment, by id (kept for good, as a provider keeps them).
    payments: HashMap<String, PaymentRecord>,
    /// Each key with its deadline, first used first: with one window for every key, that is the
    /// order in which they expire.
    order: VecDeque<(Instant, String)>,
}

impl MemoryKeys {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Inner {
    fn forget_expired(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.order.front()
            && *deadline <= now
        {
            let Some((deadline, key)) = self.order.pop_front() else {
                break;
            };
            // The key may have been used again since, with a later deadline: keep that one.
            if self.used.get(&key).is_some_and(|(at, _)| *at == deadline) {
                self.used.remove(&key);
            }
        }
    }
}

#[async_trait]
impl KeyTable for MemoryKeys {
    async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError> {
        let inner = self.lock();
        let live = inner.used.get(key).filter(|(at, _)| *at > Instant::now());
        Ok(live.map(|(_, used)| used.clone()))
    }

    async fn insert(
        &self,
        key: &str,
        used: &Used,
        effect: Effect,
    ) -> Result<Result<Option<Used>, ProviderError>, KeyTableError> {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.forget_expired(now);
        if let Some((_, earlier)) = inner.used.get_mut(key).filter(|(at, _)| *at > now) {
            let before = earlier.clone();
            if earlier.request == used.request {
                earlier.fence = earlier.fence.max(used.fence);
            }
            return Ok(Ok(Some(before)));
        }
        match effect {
            Effect::None => {}
            Effect::Payment(mut payment) => {
                payment.created = now_ms();
                inner.payments.insert(payment.id.clone(), payment);
            }
            Effect::Refund { payment, amount } => {
                let Some(payment) = inner.payments.get_mut(&payment) else {
                    return Ok(Err(ProviderError::NoSuchPayment));
                };
                let refundable = payment.amount - payment.refunded;
                if amount > refundable {
                    return Ok(Err(ProviderError::AmountTooLarge { amount, refundable }));
                }
                payment.refunded += amount;
            }
        }
        let deadline = now + self.window;
        inner.used.insert(key.to_owned(), (deadline, used.clone()));
        inner.order.push_back((deadline, key.to_owned()));
        Ok(Ok(None))
    }

    async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, KeyTableError> {
        let mut listed: Vec<PaymentRecord> = (self.lock().payments.values())
            .filter(|payment| payment.created >= since)
            .cloned()
            .collect();
        listed.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
        listed.truncate(limit);
        Ok(listed)
    }

    async fn sweep(&self) -> Result<u64, KeyTableError> {
        let mut inner = self.lock();
        let before = inner.used.len();
        inner.forget_expired(Instant::now());
        Ok((before - inner.used.len()) as u64)
    }
}
