//! The charges of every account: in memory, or in PostgreSQL (`pg/charges.rs`).
//!
//! A charge changes state only through [`Charge::apply`], which asks the state machine; no lock
//! and no transaction is held across a call to the provider. A handler writes in two kinds of
//! steps:
//!
//! - before the provider call, the `-ing` state that holds the charge ([`Ledger::open`],
//!   [`Ledger::update`]): committed at once, so that a crash during the call leaves the charge
//!   where a retry, or the reconciler, finds it;
//! - after it, the provider's answer ([`Ledger::record`], [`Ledger::settle`]) through the
//!   request's [`Work`]: in PostgreSQL, the transaction that commits with the request's
//!   idempotency record and its event, or not at all.
//!
//! In memory, a new charge is stored only once the provider answered (a crash loses everything
//! anyway), and its id is the provider's payment id.
//!
//! **One charge per operation.** An operation is the account and the provider's key of its
//! create call (derived from the client's `Idempotency-Key`); the store itself refuses a second
//! charge for one, whatever ran twice in front of it (two runs of one request, after a lease ran
//! out under a stalled handler, each believing it holds the key):
//!
//! - in memory: a map from the operation to its charge, under the charges' lock, taken with the
//!   charge's insert (the entry API): the second run inserts nothing and gets the first charge;
//! - with `REDIS_URL` or `REDIS_CLUSTER_URLS`, the operations are claimed in Redis too, with
//!   `SET NX PX <window> GET` of one key per operation (`payments:operation:<account>:<key>`, one
//!   key per command, so any slot of a cluster), so that every instance agrees on the charge of
//!   an operation;
//! - in PostgreSQL: a `UNIQUE` index on `charges (account, operation)` (`pg/charges.rs`).
//!
//! Each holds the operation for the provider's window, after which the key is new again, as at
//! the provider.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_redis::redis;
use serde::Serialize;
use tokio::time::Instant;

use super::auth::Account;
use super::error::ApiError;
use super::pg::PgCharges;
use super::provider::Source;
use super::redis_conn::RedisConn;
use super::state_machine::{Event, Status, next};
use super::work::Work;

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
    /// The client's own key-value pairs (`metadata[key]=value`).
    pub metadata: BTreeMap<String, String>,
}

/// One charge.
#[derive(Debug, Clone)]
pub struct Charge {
    pub id: String,
    pub account: Account,
    pub amount: i64,
    pub currency: String,
    pub description: Option<String>,
    /// The card token it was made from.
    pub source: Source,
    /// Whether it was to be captured at once.
    pub capture: bool,
    /// The client's own key-value pairs, as Stripe keeps them (`metadata[key]=value`).
    pub metadata: BTreeMap<String, String>,
    pub status: Status,
    pub amount_refunded: i64,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// The provider's idempotency key for creating it.
    pub provider_key: String,
    /// The provider's payment id.
    pub payment: String,
    /// The provider's key of the last capture, refund or cancellation call on the charge (empty
    /// before one): held while the charge is in the `-ing` state of that call, so that a retry of
    /// the same request resumes it and a reconciler can ask the provider what became of it.
    pub call_key: String,
    /// The amount of that call, for a refund.
    pub call_amount: i64,
    /// Orders the charges of the ledger (several may share a `created` second).
    pub seq: u64,
}

impl Charge {
    /// A new charge for `request`, in state `created`, without an id yet.
    pub fn new(account: Account, request: &NewCharge, provider_key: &str) -> Self {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        Self {
            id: String::new(),
            account,
            amount: request.amount,
            currency: request.currency.clone(),
            description: request.description.clone(),
            source: request.source,
            capture: request.capture,
            metadata: request.metadata.clone(),
            status: Status::Created,
            amount_refunded: 0,
            created,
            provider_key: provider_key.to_owned(),
            payment: String::new(),
            call_key: String::new(),
            call_amount: 0,
            seq: 0,
        }
    }

    /// Whether the charge was made for `request`.
    pub fn is_for(&self, request: &NewCharge) -> bool {
        self.amount == request.amount
            && self.currency == request.currency
            && self.source == request.source
            && self.capture == request.capture
            && self.description == request.description
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

/// What [`Ledger::open`] found for a new charge's key.
#[derive(Debug)]
pub enum Opened {
    /// The charge is `authorizing`: call the provider. A new one, or (in PostgreSQL) the one an
    /// earlier attempt with the same key left there when it crashed.
    Authorizing(Charge),
    /// An earlier attempt's charge, past `authorizing` (the reconciler settled it): the answer.
    Settled(Charge),
}

/// Every account's charges.
#[derive(Debug)]
pub struct Ledger {
    backend: Backend,
    /// Holds every [`Ledger::open`] at its start while a test holds it for writing, as a locked
    /// charges table would ([`Ledger::hold_opens`]).
    gate: Arc<tokio::sync::RwLock<()>>,
    /// How many opens wait at the gate.
    held: AtomicUsize,
}

#[derive(Debug)]
enum Backend {
    /// The charges in memory; their operations also claimed in Redis when it is set.
    Memory(Box<Mutex<Charges>>, Option<RedisOperations>),
    Postgres(PgCharges),
}

#[derive(Debug, Default)]
struct Charges {
    by_id: HashMap<String, Charge>,
    /// Each operation, `(account, provider key)`, with its charge's id and when it stops holding
    /// the operation.
    operations: HashMap<(String, String), (Instant, String)>,
    next_seq: u64,
}

/// The operations claimed in Redis: one key per operation, holding its charge's id.
#[derive(Debug, Clone)]
struct RedisOperations {
    conn: RedisConn,
    prefix: Arc<str>,
}

/// The prefix of the operation keys in Redis.
pub const OPERATIONS_PREFIX: &str = "payments:operation:";

impl Default for Ledger {
    fn default() -> Self {
        Self::on(Backend::Memory(Box::default(), None))
    }
}

impl Ledger {
    /// The charges in PostgreSQL.
    pub fn postgres(charges: PgCharges) -> Self {
        Self::on(Backend::Postgres(charges))
    }

    /// The charges in memory, their operations claimed in the Redis of `conn` too (under
    /// `OPERATIONS_PREFIX`), so that every instance on that Redis agrees on an operation's
    /// charge.
    pub fn with_redis_operations(conn: RedisConn) -> Self {
        let operations = RedisOperations {
            conn,
            prefix: OPERATIONS_PREFIX.into(),
        };
        Self::on(Backend::Memory(Box::default(), Some(operations)))
    }

    fn on(backend: Backend) -> Self {
        Self {
            backend,
            gate: Arc::default(),
            held: AtomicUsize::new(0),
        }
    }

    /// Holds every [`Ledger::open`] at its start, right after the request's claim, until the
    /// guard is dropped: a handler stalled as behind a locked table (tests).
    #[allow(dead_code)] // for tests
    pub async fn hold_opens(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.gate.clone().write_owned().await
    }

    /// How many [`Ledger::open`] calls wait behind [`Ledger::hold_opens`] now (tests).
    #[allow(dead_code)] // for tests
    pub fn held_opens(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Whether the charges are in PostgreSQL: the handlers then write through the request's
    /// transaction.
    pub fn is_postgres(&self) -> bool {
        match &self.backend {
            Backend::Memory(..) => false,
            Backend::Postgres(_) => true,
        }
    }

    /// A charge for `request`, made with the provider's key `provider_key`, moved to
    /// `authorizing`. In PostgreSQL that state is committed now, before the provider is called;
    /// a charge an earlier attempt with the same key left is resumed (or answered, once settled),
    /// and one made for another request is refused (`idempotency_key_reused`).
    pub async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened, ApiError> {
        self.held.fetch_add(1, Ordering::SeqCst);
        drop(self.gate.read().await);
        self.held.fetch_sub(1, Ordering::SeqCst);
        match &self.backend {
            Backend::Memory(..) => {
                let mut charge = Charge::new(account.clone(), request, provider_key);
                charge.apply(Event::Authorize)?;
                Ok(Opened::Authorizing(charge))
            }
            Backend::Postgres(pg) => pg.open(account, provider_key, request).await,
        }
    }

    /// The provider did nothing for the `authorizing` charge (it was unavailable, or knew the
    /// key from another request): the charge was never made, and goes.
    pub async fn abandon(&self, charge: &Charge) {
        match &self.backend {
            Backend::Memory(..) => {
                let _ = charge;
            }
            Backend::Postgres(pg) => pg.abandon(charge).await,
        }
    }

    /// Records the provider's answer for an `authorizing` charge (its state and payment set), in
    /// `work`, and returns the charge as recorded. The operation already has a charge when a
    /// request ran twice (its idempotency record was lost, or a retry took over a stalled run; in
    /// PostgreSQL also when the reconciler settled it first): that charge is kept and returned,
    /// and nothing is inserted. In memory the operation is held for `window`.
    pub async fn record(
        &self,
        work: &mut Work,
        charge: Charge,
        window: Duration,
    ) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges, redis) => {
                let _ = work;
                let mut charge = charge;
                if charge.id.is_empty() {
                    charge.id = format!("ch_{}", charge.payment.trim_start_matches("py_"));
                }
                if let Some(redis) = redis {
                    let holder = redis.claim(&charge, window).await?;
                    if let Some(holder) = holder.filter(|holder| *holder != charge.id) {
                        // Another charge holds the operation: that one is the answer.
                        return match lock(charges).by_id.get(&holder) {
                            Some(earlier) => Ok(earlier.clone()),
                            None => Err(ApiError::superseded()),
                        };
                    }
                }
                Ok(insert(charges, charge, window))
            }
            Backend::Postgres(_) => PgCharges::record(work.connection()?, charge).await,
        }
    }

    /// The account's charge `id`; another account's charge is not found either.
    pub async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges, _) => change(charges, account, id, |_| Ok(())),
            Backend::Postgres(pg) => pg.get(account, id).await,
        }
    }

    /// The account's charges, newest first.
    pub async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        match &self.backend {
            Backend::Memory(charges, _) => {
                let charges = lock(charges);
                let mut list: Vec<Charge> = charges
                    .by_id
                    .values()
                    .filter(|charge| &charge.account == account)
                    .cloned()
                    .collect();
                list.sort_by_key(|charge| std::cmp::Reverse(charge.seq));
                Ok(list)
            }
            Backend::Postgres(pg) => pg.list(account).await,
        }
    }

    /// Changes the account's charge `id` with `change`, all or nothing, committed at once, and
    /// returns the result.
    pub async fn update(
        &self,
        account: &Account,
        id: &str,
        change_with: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges, _) => change(charges, account, id, change_with),
            Backend::Postgres(pg) => pg.update(account, id, change_with).await,
        }
    }

    /// Changes the account's charge `id` with `change`, all or nothing, in `work`, and returns
    /// the result: the provider's answer, written with the request's record.
    pub async fn settle(
        &self,
        work: &mut Work,
        account: &Account,
        id: &str,
        change_with: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges, _) => {
                let _ = work;
                change(charges, account, id, change_with)
            }
            Backend::Postgres(_) => {
                PgCharges::settle(work.connection()?, account, id, change_with).await
            }
        }
    }
}

/// Stores a new charge in memory, unless its operation (or its id) already has one: that one is
/// kept and returned. The operation is held for `window`.
fn insert(charges: &Mutex<Charges>, mut charge: Charge, window: Duration) -> Charge {
    use std::collections::hash_map::Entry;
    let now = Instant::now();
    let mut guard = lock(charges);
    let charges = &mut *guard;
    let operation = (charge.account.id().to_owned(), charge.provider_key.clone());
    match charges.operations.entry(operation) {
        Entry::Occupied(held) if held.get().0 > now => {
            if let Some(earlier) = charges.by_id.get(&held.get().1) {
                return earlier.clone();
            }
            // Its charge is gone (never in this ledger): the operation is this one's.
            *held.into_mut() = (now + window, charge.id.clone());
        }
        Entry::Occupied(expired) => *expired.into_mut() = (now + window, charge.id.clone()),
        Entry::Vacant(vacant) => {
            vacant.insert((now + window, charge.id.clone()));
        }
    }
    charges.next_seq += 1;
    charge.seq = charges.next_seq;
    charges
        .by_id
        .entry(charge.id.clone())
        .or_insert(charge)
        .clone()
}

impl RedisOperations {
    /// Claims the operation of `charge` for it, for `window`, unless another charge holds it:
    /// `None` when claimed now, or the id the operation holds (the charge's own, for a resend).
    async fn claim(&self, charge: &Charge, window: Duration) -> Result<Option<String>, ApiError> {
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let mut set = redis::cmd("SET");
        set.arg(format!(
            "{}{}:{}",
            self.prefix,
            charge.account.id(),
            charge.provider_key
        ))
        .arg(&charge.id)
        .arg("NX")
        .arg("PX")
        .arg(window.max(1))
        .arg("GET");
        self.conn
            .run(move |mut c| async move { set.query_async(&mut c).await })
            .await
            .map_err(|err| {
                tracing::warn!(error = %super::report(&err), "cannot claim the charge's operation in Redis");
                ApiError::storage_unavailable()
            })
    }
}

/// Changes the account's charge `id` in memory with `change_with`, all or nothing.
fn change(
    charges: &Mutex<Charges>,
    account: &Account,
    id: &str,
    change_with: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
) -> Result<Charge, ApiError> {
    let mut charges = lock(charges);
    let charge = charges
        .by_id
        .get_mut(id)
        .filter(|charge| &charge.account == account)
        .ok_or_else(|| ApiError::no_such_charge(id))?;
    let mut changed = charge.clone();
    change_with(&mut changed)?;
    *charge = changed.clone();
    Ok(changed)
}

fn lock(charges: &Mutex<Charges>) -> std::sync::MutexGuard<'_, Charges> {
    charges.lock().unwrap_or_else(PoisonError::into_inner)
}
