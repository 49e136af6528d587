//! The charges in memory (one process): a map under one lock, every write all or nothing, and
//! its event added to the outbox under the same lock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use tokio::time::Instant;

use super::{Change, Charge, EventOf, Ledger, Result, millis};
use crate::auth::Account;
use crate::consumer::MemoryOutbox;
use crate::error::ApiError;
use crate::events::PaymentEvent;
use crate::now_ms;
use crate::state_machine::Status;

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
}

#[async_trait]
impl Ledger for MemoryLedger {
    async fn find(&self, account: &Account, provider_key: &str) -> Result<Option<Charge>> {
        Ok(self.lock().operation(account.id(), provider_key).cloned())
    }

    async fn insert(&self, mut charge: Charge) -> Result<Option<Charge>> {
        let mut charges = self.lock();
        if charges
            .operation(charge.account.id(), &charge.provider_key)
            .is_some()
        {
            return Ok(None);
        }
        let operation = (charge.account.id().to_owned(), charge.provider_key.clone());
        (charges.operations).insert(operation, (Instant::now() + self.window, charge.id.clone()));
        charges.next_seq += 1;
        charge.seq = charges.next_seq;
        charges.by_id.insert(charge.id.clone(), charge.clone());
        Ok(Some(charge))
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

    async fn get(&self, account: &Account, id: &str) -> Result<Charge> {
        (self.lock().by_id.get(id))
            .filter(|charge| &charge.account == account)
            .cloned()
            .ok_or_else(|| ApiError::no_such_charge(id))
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>> {
        let mut list: Vec<Charge> = (self.lock().by_id.values())
            .filter(|charge| &charge.account == account)
            .cloned()
            .collect();
        list.sort_by_key(|charge| std::cmp::Reverse(charge.seq));
        Ok(list)
    }

    async fn settle(
        &self,
        _request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge> {
        let mut charges = self.lock();
        let charge = (charges.by_id.get_mut(id))
            .filter(|charge| &charge.account == account)
            .ok_or_else(|| ApiError::no_such_charge(id))?;
        let mut changed = charge.clone();
        change(&mut changed)?;
        changed.updated = now_ms();
        *charge = changed.clone();
        if let Some(event) = event(&changed) {
            self.outbox.push(event);
        }
        Ok(changed)
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>> {
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
    ) -> Result<bool> {
        let mut charges = self.lock();
        let Some(now) =
            (charges.by_id.get_mut(&found.id)).filter(|now| now.updated == found.updated)
        else {
            return Ok(false);
        };
        *now = settled.clone();
        now.updated = now_ms();
        if let Some(event) = event {
            self.outbox.push(event);
        }
        Ok(true)
    }
}
