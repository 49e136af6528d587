//! The ledger of charges: the [`Ledger`] trait, one implementation per backend. A charge moves
//! only through [`Charge::apply`]. No lock is held across a provider call: the `-ing` state is
//! committed before it, so an unknown outcome leaves the charge where a retry or the reconciler
//! finds it.

mod memory;
mod postgres;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use serde::{Deserialize, Serialize};

pub use memory::MemoryLedger;
pub use postgres::PgLedger;

use super::auth::Account;
use super::error::ApiError;
use super::events::PaymentEvent;
use super::now_ms;
use super::provider::{ProviderError, Source};
use super::state_machine::{Event, Status, next};

/// What the ledger answers.
type Result<T, E = ApiError> = std::result::Result<T, E>;

/// A change to a charge: refused (nothing written) with the error it returns.
pub type Change<'a> = &'a mut (dyn FnMut(&mut Charge) -> Result<()> + Send);

/// The event a write publishes, from the charge as written.
pub type EventOf<'a> = &'a (dyn Fn(&Charge) -> Option<PaymentEvent> + Sync);

/// Every account's charges.
#[async_trait]
pub trait Ledger: fmt::Debug + Send + Sync {
    /// The charge holding the account's operation `provider_key`, within the provider's window.
    async fn find(&self, account: &Account, provider_key: &str) -> Result<Option<Charge>>;

    /// Stores the new `charge` with its `seq`, or nothing (`None`) while its operation has one
    /// within the window: the last line of defence, one charge per operation whatever ran twice.
    async fn insert(&self, charge: Charge) -> Result<Option<Charge>>;

    /// Removes an `authorizing` charge whose create the provider refused; `false` when it is kept
    /// (the reconciler took it over meanwhile, or the ledger failed: the reconciler settles it).
    /// Never for a call whose outcome is unknown.
    async fn abandon(&self, charge: &Charge) -> bool;

    /// The account's charge `id`; another account's is not found either.
    async fn get(&self, account: &Account, id: &str) -> Result<Charge>;

    /// The account's charges, newest first.
    async fn list(&self, account: &Account) -> Result<Vec<Charge>>;

    /// Changes the account's charge `id`, with its event, all or nothing, in `request`'s work (in
    /// PostgreSQL, the transaction that commits with its idempotency record) or at once.
    async fn settle(
        &self,
        request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge>;

    /// Up to `limit` charges in an `-ing` state unchanged for `after`, oldest first.
    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>>;

    /// Moves `found` to `settled`, with `event`, unless it changed since (in PostgreSQL: left
    /// its state or call, or changed within `unchanged_for`); says whether it did.
    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        unchanged_for: Duration,
    ) -> Result<bool>;

    /// Changes the account's charge `id`, all or nothing, committed at once.
    async fn update(&self, account: &Account, id: &str, change: Change<'_>) -> Result<Charge> {
        (self.settle(&Extensions::new(), account, id, change, &|_| None)).await
    }

    /// A charge for `request` under `provider_key`, committed `authorizing` before the call. An
    /// earlier attempt's is resumed (touched: the reconciler leaves it alone) or, settled,
    /// answered; another request's is `idempotency_key_reused`; the reconciler's is `504`.
    async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened> {
        // A charge found may be abandoned before it is touched, or one inserted after the look.
        for _ in 0..3 {
            let Some(earlier) = self.find(account, provider_key).await? else {
                let mut charge = Charge::new(account.clone(), request, provider_key);
                charge.apply(Event::Authorize)?;
                match self.insert(charge).await? {
                    Some(charge) => return Ok(Opened::Authorizing(charge)),
                    None => continue,
                }
            };
            if !earlier.is_for(request) {
                return Err(ApiError::idempotency_key_reused());
            }
            if earlier.status != Status::Authorizing {
                return Ok(Opened::Settled(earlier));
            }
            if earlier.reconciling {
                // The reconciler sends its create again: the outcome is its to learn.
                return Err(ProviderError::Unknown.into());
            }
            // Touched, so that the reconciler leaves it alone while this attempt runs, unless it
            // marked it meanwhile.
            let mut marked = false;
            let touched = (self.update(account, &earlier.id, &mut |c| {
                marked = c.reconciling;
                match marked {
                    true => Err(ProviderError::Unknown.into()),
                    false => Ok(()),
                }
            }))
            .await;
            match touched {
                Ok(c) if c.status == Status::Authorizing => return Ok(Opened::Resumed(c)),
                Ok(settled) => return Ok(Opened::Settled(settled)),
                Err(err) if marked => return Err(err),
                // Gone meanwhile (abandoned), or the ledger failed: looked at again.
                Err(_) => continue,
            }
        }
        tracing::warn!("the charge's operation changed hands too often; giving up for now");
        Err(ApiError::storage_unavailable())
    }

    /// Writes the provider's answer (status, payment) over an `authorizing` charge, with its
    /// event, as [`Ledger::settle`]. One settled meanwhile (by the reconciler) is kept as it is.
    async fn record(
        &self,
        request: &Extensions,
        charge: Charge,
        event: EventOf<'_>,
    ) -> Result<Charge> {
        let answer = &mut |c: &mut Charge| {
            if c.status == Status::Authorizing {
                c.status = charge.status;
                c.payment.clone_from(&charge.payment);
                c.reconciling = false;
            }
            Ok(())
        };
        (self.settle(request, &charge.account, &charge.id, answer, event)).await
    }
}

/// What `POST /v1/charges` asks for, once validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCharge {
    pub amount: i64,
    /// Lowercase.
    pub currency: String,
    pub source: Source,
    /// Whether to capture at once, or only authorize.
    pub capture: bool,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
}

/// One charge.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charge {
    pub id: String,
    pub account: Account,
    pub amount: i64,
    pub currency: String,
    pub description: Option<String>,
    pub source: Source,
    pub capture: bool,
    pub metadata: BTreeMap<String, String>,
    pub status: Status,
    pub amount_refunded: i64,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// The provider's idempotency key of the create call: the operation.
    pub provider_key: String,
    /// The provider's payment id.
    pub payment: String,
    /// The key of the capture, refund or cancellation in flight, kept through its `-ing` state:
    /// a retry resumes the call, the reconciler sends it again.
    pub call_key: String,
    /// That call's amount, for a refund.
    pub call_amount: i64,
    /// When that call began (ms since the epoch): the provider's key window counts from it.
    pub call_started: u64,
    /// The refunds made, by key: a retry after later calls is answered here, never counted twice.
    pub refunds: Vec<Refund>,
    /// The key of the capture made: a retry of it after later calls gets the charge.
    pub capture_key: String,
    /// The reconciler took the call in flight over: a run whose own call is refused leaves the
    /// charge to it, as the reconciler's call may be made.
    pub reconciling: bool,
    /// Orders the charges (several may share a `created` second).
    pub seq: u64,
    /// When it last changed (ms since the epoch; in PostgreSQL, `updated_at` counts): what a
    /// compare-and-set compares; the reconciler leaves a recent charge alone.
    pub updated: u64,
}

impl Charge {
    /// A new charge for `request`, `created`, with a fresh id; its create call begins now.
    pub fn new(account: Account, request: &NewCharge, provider_key: &str) -> Self {
        let now = now_ms();
        Self {
            id: new_id("ch"),
            account,
            amount: request.amount,
            currency: request.currency.clone(),
            description: request.description.clone(),
            source: request.source,
            capture: request.capture,
            metadata: request.metadata.clone(),
            status: Status::Created,
            amount_refunded: 0,
            created: now / 1000,
            provider_key: provider_key.to_owned(),
            payment: String::new(),
            call_key: String::new(),
            call_amount: 0,
            call_started: now,
            refunds: Vec::new(),
            capture_key: String::new(),
            reconciling: false,
            seq: 0,
            updated: now,
        }
    }

    /// Whether the charge waits on a provider call (an `-ing` state).
    pub fn is_busy(&self) -> bool {
        matches!(
            self.status,
            Status::Authorizing | Status::Capturing | Status::Refunding | Status::Canceling
        )
    }

    /// Whether the charge was made for `request`.
    pub fn is_for(&self, request: &NewCharge) -> bool {
        self.amount == request.amount
            && self.currency == request.currency
            && self.source == request.source
            && self.capture == request.capture
            && self.description == request.description
            && self.metadata == request.metadata
    }

    /// Moves the charge along `event`, or refuses with `invalid_state` (nothing changes).
    pub fn apply(&mut self, event: Event) -> Result<()> {
        self.status = next(self.status, event)
            .ok_or_else(|| ApiError::invalid_state(self.status, event.operation()))?;
        // The reconciler's mark is on the call in flight: it ends with it.
        if !self.is_busy() {
            self.reconciling = false;
        }
        Ok(())
    }

    /// Records the refund `id` of `amount` under `call_key`, and moves the charge out of
    /// `refunding`: refunded, or captured with the rest left.
    pub fn record_refund(&mut self, call_key: &str, id: &str, amount: i64) -> Result<()> {
        self.amount_refunded += amount;
        self.refunds.push(Refund {
            call_key: call_key.to_owned(),
            id: id.to_owned(),
            amount,
        });
        self.apply(if self.refundable() == 0 {
            Event::Refunded
        } else {
            Event::PartiallyRefunded
        })
    }

    /// The refund made under the provider key `call_key`, if one was.
    pub fn refund_under(&self, call_key: &str) -> Option<&Refund> {
        self.refunds.iter().find(|r| r.call_key == call_key)
    }

    /// What is left to refund.
    pub fn refundable(&self) -> i64 {
        self.amount - self.amount_refunded
    }

    /// The charge as the API shows it.
    pub fn to_json(&self) -> ChargeJson {
        let captured =
            [Status::Captured, Status::Refunding, Status::Refunded].contains(&self.status);
        ChargeJson {
            id: self.id.clone(),
            object: "charge",
            amount: self.amount,
            currency: self.currency.clone(),
            description: self.description.clone(),
            metadata: self.metadata.clone(),
            status: self.status,
            captured,
            amount_refunded: self.amount_refunded,
            created: self.created,
        }
    }
}

/// A refund of a charge, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    /// The provider's key of the refund call.
    pub call_key: String,
    /// The provider's refund id.
    pub id: String,
    pub amount: i64,
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
    status: Status,
    captured: bool,
    amount_refunded: i64,
    created: u64,
}

/// What [`Ledger::open`] found for a new charge's key.
#[derive(Debug)]
pub enum Opened {
    /// New, `authorizing`: call the provider.
    Authorizing(Charge),
    /// An earlier attempt's, still `authorizing`: call the provider again under its key. Its
    /// refusal says nothing of the earlier attempt's call, which may still land.
    Resumed(Charge),
    /// An earlier attempt's, settled (its record lost, or by the reconciler): the answer.
    Settled(Charge),
}

/// A fresh, unguessable id such as `ch_3f9a0c1b7e2d4a68`.
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{:016x}", RandomState::new().hash_one(n))
}

/// A duration in milliseconds, saturated.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
