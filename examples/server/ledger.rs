//! The charges of every account, in memory.
//!
//! A charge changes state only through [`Charge::apply`], which asks the state machine; the
//! ledger's lock is never held across a call to the provider.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::auth::Account;
use super::error::ApiError;
use super::state_machine::{Event, Status, next};

/// One charge.
#[derive(Debug, Clone)]
pub struct Charge {
    pub id: String,
    pub account: Account,
    pub amount: i64,
    pub currency: String,
    pub description: Option<String>,
    /// The client's own key-value pairs, as Stripe keeps them (`metadata[key]=value`).
    pub metadata: BTreeMap<String, String>,
    pub status: Status,
    pub amount_refunded: i64,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// The provider's payment id.
    pub payment: String,
    /// Orders the charges of the ledger (several may share a `created` second).
    seq: u64,
}

impl Charge {
    /// A new charge, in state `created`.
    pub fn new(
        account: Account,
        amount: i64,
        currency: String,
        description: Option<String>,
        metadata: BTreeMap<String, String>,
    ) -> Self {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        Self {
            id: String::new(),
            account,
            amount,
            currency,
            description,
            metadata,
            status: Status::Created,
            amount_refunded: 0,
            created,
            payment: String::new(),
            seq: 0,
        }
    }

    /// Moves the charge along `event`, or refuses with `invalid_state` (nothing changes).
    pub fn apply(&mut self, event: Event) -> Result<(), ApiError> {
        match next(self.status, event) {
            Some(status) => {
                self.status = status;
                Ok(())
            }
            None => Err(ApiError::invalid_state(self.status, event.operation())),
        }
    }

    /// What is left to refund.
    pub fn refundable(&self) -> i64 {
        self.amount - self.amount_refunded
    }

    /// The charge as the API shows it.
    pub fn to_json(&self) -> ChargeJson {
        ChargeJson {
            id: self.id.clone(),
            object: "charge",
            amount: self.amount,
            currency: self.currency.clone(),
            description: self.description.clone(),
            metadata: self.metadata.clone(),
            status: self.status.as_str(),
            captured: matches!(
                self.status,
                Status::Captured | Status::Refunding | Status::Refunded
            ),
            amount_refunded: self.amount_refunded,
            created: self.created,
        }
    }
}

/// A charge, as the API shows it.
#[derive(Debug, Serialize)]
pub struct ChargeJson {
    id: String,
    object: &'static str,
    amount: i64,
    currency: String,
    description: Option<String>,
    metadata: BTreeMap<String, String>,
    status: &'static str,
    captured: bool,
    amount_refunded: i64,
    /// Seconds since the Unix epoch.
    created: u64,
}

/// Every account's charges.
#[derive(Debug, Default)]
pub struct Ledger {
    inner: Mutex<Charges>,
}

#[derive(Debug, Default)]
struct Charges {
    by_id: HashMap<String, Charge>,
    next_seq: u64,
}

impl Ledger {
    /// Records a new charge. A charge with the same id is already there when a request ran twice
    /// (its idempotency record was lost) and the provider answered the repeated call with the
    /// same payment: that charge is kept and returned.
    pub fn insert(&self, mut charge: Charge) -> Charge {
        let mut charges = self.lock();
        charges.next_seq += 1;
        charge.seq = charges.next_seq;
        charges
            .by_id
            .entry(charge.id.clone())
            .or_insert(charge)
            .clone()
    }

    /// The account's charge `id`; another account's charge is not found either.
    pub fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        self.update(account, id, |_| Ok(()))
    }

    /// The account's charges, newest first.
    pub fn list(&self, account: &Account) -> Vec<Charge> {
        let charges = self.lock();
        let mut list: Vec<Charge> = charges
            .by_id
            .values()
            .filter(|charge| &charge.account == account)
            .cloned()
            .collect();
        list.sort_by_key(|charge| std::cmp::Reverse(charge.seq));
        list
    }

    /// Changes the account's charge `id` with `change`, all or nothing, and returns the result.
    pub fn update(
        &self,
        account: &Account,
        id: &str,
        change: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        let mut charges = self.lock();
        let charge = charges
            .by_id
            .get_mut(id)
            .filter(|charge| &charge.account == account)
            .ok_or_else(|| ApiError::no_such_charge(id))?;
        let mut changed = charge.clone();
        change(&mut changed)?;
        *charge = changed.clone();
        Ok(changed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Charges> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
