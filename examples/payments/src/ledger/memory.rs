//! The charges in memory (one process): a map under one lock, every write all or nothing, and
//! its event added to the outbox under the same lock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use tokio::time::Instant;

use super::{Change, Charge, EventOf, Ledger, NewCharge, Opened, millis, reopen};
use crate::auth::Account;
use crate::consumer::MemoryOutbox;
use crate::error::ApiError;
use crate::events::PaymentEvent;
use crate::now_ms;
use crate::state_machine::{Event, Status};

/// The charges in memory; events go to `outbox` with the charge they report.
#[derive(Debug)]
pub struct MemoryLedger {
    charges: Mutex<Charges>,
    outbox: Arc<MemoryOutbox>,
    /// How long a charge holds its operation: the provider's key window.
    window: Duration,
}

#[derive(Debug, Default)]
struct Charges {
    by_id: HashMap<String, Charge>,
    /// Each operation, `(account, provider key)`: its charge's id, and until when it holds it.
    operations: HashMap<(String, String), (Instant, String)>,
    next_seq: u64,
}

impl MemoryLedger {
    /// An empty ledger whose charges hold their operation for `window`.
    pub fn new(outbox: Arc<MemoryOutbox>, window: Duration) -> Self {
        Self {
            charges: Mutex::default(),
            outbox,
            window,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Charges> {
        self.charges.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes the account's charge `id`, all or nothing, and adds its event.
    fn change(
        &self,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let mut charges = self.lock();
        let charge = charges
            .by_id
            .get_mut(id)
            .filter(|charge| &charge.account == account)
            .ok_or_else(|| ApiError::no_such_charge(id))?;
        let mut changed = charge.clone();
        change(&mut changed)?;
        changed.updated = now_ms();
        *charge = changed.clone();
        self.publish(event(&changed));
        Ok(changed)
    }

    /// Adds `event` to the outbox: called under the charges' lock, with the write it reports.
    fn publish(&self, event: Option<PaymentEvent>) {
        if let Some(event) = event {
            self.outbox.push(event);
        }
    }
}

impl Charges {
    /// The charge that holds the operation, within its window.
    fn operation(&self, account: &str, provider_key: &str) -> Option<&Charge> {
        let key = (account.to_owned(), provider_key.to_owned());
        let (until, id) = self.operations.get(&key)?;
        (*until > Instant::now())
            .then(|| self.by_id.get(id))
            .flatten()
    }

    /// Stores `charge` as its operation's, for `window`, with the next `seq`.
    fn insert(&mut self, charge: &mut Charge, window: Duration) {
        let operation = (charge.account.id().to_owned(), charge.provider_key.clone());
        self.operations
            .insert(operation, (Instant::now() + window, charge.id.clone()));
        self.next_seq += 1;
        charge.seq = self.next_seq;
        self.by_id.insert(charge.id.clone(), charge.clone());
    }
}

#[async_trait]
impl Ledger for MemoryLedger {
    async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened, ApiError> {
        let mut charge = Charge::new(account.clone(), request, provider_key);
        charge.apply(Event::Authorize)?;
        let earlier = {
            let mut charges = self.lock();
            match charges.operation(account.id(), provider_key) {
                Some(earlier) => earlier.clone(),
                None => {
                    charges.insert(&mut charge, self.window);
                    return Ok(Opened::Authorizing(charge));
                }
            }
        };
        reopen(self, request, earlier).await
    }

    async fn abandon(&self, charge: &Charge) -> bool {
        let mut charges = self.lock();
        let abandoned = (charges.by_id.get(&charge.id)).is_some_and(|c| {
            c.status == Status::Authorizing && c.reconciling == charge.reconciling
        });
        if abandoned {
            charges.by_id.remove(&charge.id);
        }
        abandoned
    }

    async fn record(
        &self,
        _request: &Extensions,
        charge: Charge,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let recorded = {
            let mut charges = self.lock();
            // Under the one lock: the reconciler cannot remove it between the look and the write.
            // Gone only if the provider refused its create: no answer to record.
            let stored = (charges.by_id.get_mut(&charge.id))
                .ok_or_else(|| ApiError::no_such_charge(&charge.id))?;
            if stored.status == Status::Authorizing {
                stored.status = charge.status;
                stored.payment.clone_from(&charge.payment);
                stored.updated = now_ms();
            }
            let recorded = stored.clone();
            self.publish(event(&recorded));
            recorded
        };
        Ok(recorded)
    }

    async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        let charges = self.lock();
        charges
            .by_id
            .get(id)
            .filter(|charge| &charge.account == account)
            .cloned()
            .ok_or_else(|| ApiError::no_such_charge(id))
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        let mut list: Vec<Charge> = (self.lock().by_id.values())
            .filter(|charge| &charge.account == account)
            .cloned()
            .collect();
        list.sort_by_key(|charge| std::cmp::Reverse(charge.seq));
        Ok(list)
    }

    async fn update(
        &self,
        account: &Account,
        id: &str,
        change: Change<'_>,
    ) -> Result<Charge, ApiError> {
        self.change(account, id, change, &|_| None)
    }

    async fn settle(
        &self,
        _request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        self.change(account, id, change, event)
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let before = now_ms().saturating_sub(millis(after));
        let mut found: Vec<Charge> = (self.lock().by_id.values())
            .filter(|c| c.is_busy() && c.updated <= before)
            .cloned()
            .collect();
        found.sort_by_key(|c| c.updated);
        found.truncate(limit);
        Ok(found)
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        _unchanged_for: Duration,
    ) -> Result<bool, ApiError> {
        {
            let mut charges = self.lock();
            match charges.by_id.get_mut(&found.id) {
                Some(now) if now.updated == found.updated => {
                    *now = settled.clone();
                    now.updated = now_ms();
                }
                _ => return Ok(false),
            }
            self.publish(event);
        }
        Ok(true)
    }
}
