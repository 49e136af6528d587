//! The charges of every account: one ledger per deployment. In memory (one process), in Redis
//! (`REDIS_URL`, `REDIS_CLUSTER_URLS`), or in PostgreSQL (`pg/charges.rs`): every instance on a
//! shared store reads and writes the same charges, so a charge made on one instance is listed,
//! captured, refunded and canceled on any other, and no instance keeps a copy of its own.
//!
//! A charge changes state only through [`Charge::apply`], which asks the state machine; no lock
//! and no transaction is held across a call to the provider. A handler writes in two kinds of
//! steps:
//!
//! - before the provider call, the `-ing` state that holds the charge ([`Ledger::open`],
//!   [`Ledger::update`]): committed at once, so that a call whose outcome is unknown (a timeout,
//!   a crash) leaves the charge where a retry, or the reconciler (`reconciler.rs`), finds it;
//! - after it, the provider's answer ([`Ledger::record`], [`Ledger::settle`]) through the
//!   request's `Work` (`work.rs`): in PostgreSQL, the transaction that commits with the request's
//!   idempotency record and its event, or not at all.
//!
//! Every write reads the charge, applies the change to it, and writes it back only if nobody
//! wrote it meanwhile: under the map's lock in memory; in Redis, a Lua script that compares the
//! charge with the one read and sets it (a compare-and-set, retried on a conflict); in PostgreSQL,
//! `SELECT ... FOR UPDATE` in the write's transaction. Two instances that refund one charge at once
//! cannot both pass the state machine.
//!
//! **One charge per operation.** An operation is the account and the provider's key of its
//! create call (derived from the client's `Idempotency-Key`); the store itself refuses a second
//! charge for one, whatever ran twice in front of it:
//!
//! - in memory: a map from the operation to its charge, under the charges' lock;
//! - in Redis: `SET NX PX <window>` of the operation's key, in the script that writes the charge;
//! - in PostgreSQL: a `UNIQUE` index on `charges (account, operation)` (`pg/charges.rs`).
//!
//! Each holds the operation for the provider's window, after which the key is new again, as at
//! the provider.
//!
//! In Redis every key of the ledger carries one hash tag, `{ledger}`, so that a script changes a
//! charge, its account's list and the index of charges in an `-ing` state together, on a cluster
//! as on one server: the ledger lives in one slot (as the event stream does). The charges are
//! durable data, with no expiry: keep them on a Redis with persistence and no eviction.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_redis::redis;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower_idempotency_redis::{RedisStoreError, SharedConnection};

use super::auth::Account;
use super::error::ApiError;
use super::events::{PaymentEvent, Publisher};
use super::pg::PgCharges;
use super::provider::{Source, now_ms};
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
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// When it last changed, in milliseconds since the Unix epoch (memory and Redis; PostgreSQL
    /// keeps `updated_at`): the reconciler leaves a charge alone while it is recent.
    #[serde(default)]
    pub updated: u64,
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
            updated: now_ms(),
        }
    }

    /// Whether the charge waits on a provider call: in one of the `-ing` states.
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
    Memory(Box<Mutex<Charges>>),
    Redis(RedisCharges),
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

/// The charges in Redis, under [`LEDGER_PREFIX`]: `charge:<id>` (the charge's JSON),
/// `op:<account>:<key>` (an operation's charge id, for the window), `list:<account>` (the
/// account's charge ids by `seq`), `unsettled` (the ids of charges in an `-ing` state, by when
/// they last changed), `seq`.
#[derive(Debug, Clone)]
struct RedisCharges {
    conn: SharedConnection,
    open: Arc<redis::Script>,
    swap: Arc<redis::Script>,
    remove: Arc<redis::Script>,
}

/// The prefix of the ledger's keys in Redis; `{ledger}` is their hash tag.
pub const LEDGER_PREFIX: &str = "payments:{ledger}:";

/// Opens an operation: the charge its key (`KEYS[1]`) names, if there is one (`ARGV[6]` is the
/// charges' key prefix); else the operation is claimed for `ARGV[2]` ms and the new charge
/// (`KEYS[2]`, `ARGV[1]`, id `ARGV[4]`) written, listed by `seq` (`KEYS[3]`, `ARGV[3]`) and
/// indexed as unsettled (`KEYS[4]`, `ARGV[5]`). Returns the earlier charge, or nil.
const OPEN: &str = r"
local held = redis.call('GET', KEYS[1])
if held then
    local charge = redis.call('GET', ARGV[6] .. held)
    if charge then
        return charge
    end
end
redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[4])
return false
";

/// Sets the charge `KEYS[1]` to `ARGV[2]` if it still holds `ARGV[1]` (nil: if it is gone, a
/// charge written again), keeping its id `ARGV[3]` in the unsettled index `KEYS[2]` (scored
/// `ARGV[4]`) exactly while `ARGV[5]` is `1`; `KEYS[3]` and `ARGV[6]` list a charge written again.
/// Returns 1, or 0 when the charge changed meanwhile.
const SWAP: &str = r"
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then
    return 0
end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[5] == '1' then
    redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
else
    redis.call('ZREM', KEYS[2], ARGV[3])
end
if not now then
    redis.call('ZADD', KEYS[3], ARGV[6], ARGV[3])
end
return 1
";

/// Deletes the charge `KEYS[1]` if it still holds `ARGV[1]`, with its place in the unsettled index
/// (`KEYS[2]`) and the account's list (`KEYS[3]`), and its operation (`KEYS[4]`) if that still
/// names it (`ARGV[2]`). Returns 1, or 0 when the charge changed meanwhile.
const REMOVE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
if redis.call('GET', KEYS[4]) == ARGV[2] then
    redis.call('DEL', KEYS[4])
end
return 1
";

/// How often a Redis write is tried again when the charge changed between its read and its write.
const SWAP_TRIES: usize = 8;

impl Default for Ledger {
    fn default() -> Self {
        Self::on(Backend::Memory(Box::default()))
    }
}

impl Ledger {
    /// The charges in PostgreSQL.
    pub fn postgres(charges: PgCharges) -> Self {
        Self::on(Backend::Postgres(charges))
    }

    /// The charges in the Redis of `conn`, under [`LEDGER_PREFIX`]: one ledger for every instance
    /// on that Redis.
    pub fn redis(conn: SharedConnection) -> Self {
        Self::on(Backend::Redis(RedisCharges {
            conn,
            open: Arc::new(redis::Script::new(OPEN)),
            swap: Arc::new(redis::Script::new(SWAP)),
            remove: Arc::new(redis::Script::new(REMOVE)),
        }))
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
        matches!(self.backend, Backend::Postgres(_))
    }

    /// A charge for `request`, made with the provider's key `provider_key`, moved to
    /// `authorizing` and stored now, before the provider is called; the operation is held for
    /// `window`. A charge an earlier attempt with the same key left `authorizing` is resumed (or
    /// answered, once settled), and one made for another request is refused
    /// (`idempotency_key_reused`).
    pub async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
        window: Duration,
    ) -> Result<Opened, ApiError> {
        self.held.fetch_add(1, Ordering::SeqCst);
        drop(self.gate.read().await);
        self.held.fetch_sub(1, Ordering::SeqCst);
        let mut charge = Charge::new(account.clone(), request, provider_key);
        charge.id = new_id();
        charge.apply(Event::Authorize)?;
        let earlier = match &self.backend {
            Backend::Memory(charges) => {
                let mut charges = lock(charges);
                match charges.operation(account.id(), provider_key) {
                    Some(earlier) => Some(earlier.clone()),
                    None => {
                        charges.insert(&mut charge, window);
                        None
                    }
                }
            }
            Backend::Redis(redis) => redis.open(&mut charge, window).await?,
            // PostgreSQL holds an operation for the window its ledger was made with.
            Backend::Postgres(pg) => return pg.open(account, provider_key, request).await,
        };
        let Some(earlier) = earlier else {
            return Ok(Opened::Authorizing(charge));
        };
        if !earlier.is_for(request) {
            return Err(ApiError::idempotency_key_reused());
        }
        if earlier.status != Status::Authorizing {
            return Ok(Opened::Settled(earlier));
        }
        // Resumed: touched, so that the reconciler leaves it alone while this attempt runs.
        let resumed = self.update(account, &earlier.id, |_| Ok(())).await?;
        if resumed.status != Status::Authorizing {
            return Ok(Opened::Settled(resumed));
        }
        tracing::info!(charge = %resumed.id, "resuming a charge an earlier attempt left authorizing");
        Ok(Opened::Authorizing(resumed))
    }

    /// The provider refused the `authorizing` charge's call before doing anything (it said it was
    /// down, or knew the key from another request): the charge was never made, and goes. Never
    /// for a call whose outcome is unknown.
    pub async fn abandon(&self, charge: &Charge) {
        match &self.backend {
            Backend::Memory(charges) => {
                lock(charges).remove_if(&charge.id, |c| c.status == Status::Authorizing);
            }
            Backend::Redis(redis) => {
                if let Ok(Some(stored)) = redis.read(&charge.id).await
                    && stored.status == Status::Authorizing
                {
                    // Lost to a resumed attempt meanwhile: the reconciler looks at it later.
                    let _ = redis.remove(&stored).await;
                }
            }
            Backend::Postgres(pg) => pg.abandon(charge).await,
        }
    }

    /// Records the provider's answer for an `authorizing` charge (its state and payment set), in
    /// `work`, and returns the charge as recorded. A charge settled meanwhile (another run of the
    /// request, the reconciler) is kept and returned; one the reconciler removed (it found no
    /// payment before this call's answer) is written again.
    pub async fn record(&self, work: &mut Work, charge: Charge) -> Result<Charge, ApiError> {
        let answer = charge.clone();
        let write = |c: &mut Charge| {
            if c.status == Status::Authorizing {
                c.status = answer.status;
                c.payment.clone_from(&answer.payment);
            }
            Ok(())
        };
        match &self.backend {
            Backend::Memory(charges) => {
                let _ = work;
                let mut guard = lock(charges);
                if !guard.by_id.contains_key(&charge.id) {
                    return guard.reinsert(charge);
                }
                drop(guard);
                change(charges, &charge.account, &charge.id, write)
            }
            Backend::Redis(redis) => {
                let _ = work;
                redis
                    .change(&charge.account, &charge.id, Some(charge.clone()), write)
                    .await
            }
            Backend::Postgres(_) => PgCharges::record(work.connection()?, charge).await,
        }
    }

    /// The account's charge `id`; another account's charge is not found either.
    pub async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => change(charges, account, id, |_| Ok(())),
            Backend::Redis(redis) => match redis.read(id).await? {
                Some(charge) if &charge.account == account => Ok(charge),
                _ => Err(ApiError::no_such_charge(id)),
            },
            Backend::Postgres(pg) => pg.get(account, id).await,
        }
    }

    /// The account's charges, newest first.
    pub async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => {
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
            Backend::Redis(redis) => redis.list(account).await,
            Backend::Postgres(pg) => pg.list(account).await,
        }
    }

    /// Changes the account's charge `id` with `change`, all or nothing, committed at once, and
    /// returns the result.
    pub async fn update(
        &self,
        account: &Account,
        id: &str,
        change_with: impl FnMut(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => change(charges, account, id, change_with),
            Backend::Redis(redis) => redis.change(account, id, None, change_with).await,
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
        change_with: impl FnMut(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => {
                let _ = work;
                change(charges, account, id, change_with)
            }
            Backend::Redis(redis) => {
                let _ = work;
                redis.change(account, id, None, change_with).await
            }
            Backend::Postgres(_) => {
                PgCharges::settle(work.connection()?, account, id, change_with).await
            }
        }
    }

    /// Up to `limit` charges in an `-ing` state that have not changed for `after`, oldest first:
    /// what the reconciler settles.
    pub async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let before = now_ms().saturating_sub(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
        match &self.backend {
            Backend::Memory(charges) => {
                let charges = lock(charges);
                let mut found: Vec<Charge> = charges
                    .by_id
                    .values()
                    .filter(|c| c.is_busy() && c.updated <= before)
                    .cloned()
                    .collect();
                found.sort_by_key(|c| c.updated);
                found.truncate(limit);
                Ok(found)
            }
            Backend::Redis(redis) => redis.unsettled(before, limit).await,
            Backend::Postgres(pg) => pg.unsettled(after, limit).await.map_err(pg_unavailable),
        }
    }

    /// Moves `found` to `settled`, with its `event` (if any), unless the charge changed since it
    /// was found (in PostgreSQL: left its state or call, or changed within `unchanged_for`); says
    /// whether it did. In PostgreSQL the event goes into the outbox in the same transaction;
    /// otherwise to `events`, once the charge is written.
    pub async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        events: &Publisher,
        unchanged_for: Duration,
    ) -> Result<bool, ApiError> {
        let swapped = match &self.backend {
            Backend::Memory(charges) => {
                let mut charges = lock(charges);
                match charges.by_id.get_mut(&found.id) {
                    Some(now) if now.updated == found.updated => {
                        *now = settled.clone();
                        now.updated = now_ms();
                        true
                    }
                    _ => false,
                }
            }
            Backend::Redis(redis) => redis.swap_if(found, settled).await?,
            Backend::Postgres(pg) => {
                let event = event.as_ref();
                return pg
                    .swap(found, settled, event, unchanged_for)
                    .await
                    .map_err(pg_unavailable);
            }
        };
        if let (true, Some(event)) = (swapped, event) {
            events.publish(event).await;
        }
        Ok(swapped)
    }

    /// Removes `found`, a new charge whose call the provider never saw, unless it changed since it
    /// was found (in PostgreSQL: within `after`); says whether it went.
    pub async fn remove(&self, found: &Charge, after: Duration) -> Result<bool, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => Ok(lock(charges)
                .remove_if(&found.id, |now| now.updated == found.updated)
                .is_some()),
            Backend::Redis(redis) => redis.remove(found).await,
            Backend::Postgres(pg) => pg.remove(found, after).await.map_err(pg_unavailable),
        }
    }

    /// Whether the account's operation with the provider's key `provider_key` has a charge.
    pub async fn has_operation(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<bool, ApiError> {
        match &self.backend {
            Backend::Memory(charges) => Ok(lock(charges)
                .operation(account.id(), provider_key)
                .is_some()),
            Backend::Redis(redis) => redis.operation(account, provider_key).await,
            Backend::Postgres(pg) => pg.has_operation(account, provider_key).await,
        }
    }

    /// Stores `charge`, made from a provider payment that no charge named, with its `event` (as
    /// [`Ledger::swap`] publishes), unless its operation has a charge by now; says whether it went
    /// in.
    pub async fn adopt(
        &self,
        mut charge: Charge,
        event: Option<PaymentEvent>,
        events: &Publisher,
        window: Duration,
    ) -> Result<bool, ApiError> {
        let adopted = match &self.backend {
            Backend::Memory(charges) => {
                let mut charges = lock(charges);
                let free = charges
                    .operation(charge.account.id(), &charge.provider_key)
                    .is_none();
                if free {
                    charges.insert(&mut charge, window);
                }
                free
            }
            Backend::Redis(redis) => redis.open(&mut charge, window).await?.is_none(),
            Backend::Postgres(pg) => {
                return pg
                    .adopt(&charge, event.as_ref())
                    .await
                    .map_err(pg_unavailable);
            }
        };
        if let (true, Some(event)) = (adopted, event) {
            events.publish(event).await;
        }
        Ok(adopted)
    }
}

/// A fresh, unguessable charge id such as `ch_3f9a0c1b7e2d4a68`.
pub fn new_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("ch_{:016x}", RandomState::new().hash_one(n))
}

impl Charges {
    /// The charge that holds the operation, within its window.
    fn operation(&self, account: &str, provider_key: &str) -> Option<&Charge> {
        let now = Instant::now();
        let key = (account.to_owned(), provider_key.to_owned());
        let (until, id) = self.operations.get(&key)?;
        (*until > now).then(|| self.by_id.get(id)).flatten()
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

    /// Writes `charge` again (the reconciler removed it before its answer came), unless its
    /// operation has another charge by now.
    fn reinsert(&mut self, mut charge: Charge) -> Result<Charge, ApiError> {
        let now = Instant::now();
        let operation = (charge.account.id().to_owned(), charge.provider_key.clone());
        match self.operations.get(&operation) {
            Some((until, id))
                if *until > now && *id != charge.id && self.by_id.contains_key(id) =>
            {
                Err(ApiError::superseded())
            }
            _ => {
                self.next_seq += 1;
                charge.seq = self.next_seq;
                self.by_id.insert(charge.id.clone(), charge.clone());
                Ok(charge)
            }
        }
    }

    /// Removes the charge `id` if `test` holds for it.
    fn remove_if(&mut self, id: &str, test: impl Fn(&Charge) -> bool) -> Option<Charge> {
        if !self.by_id.get(id).is_some_and(test) {
            return None;
        }
        self.by_id.remove(id)
    }
}

impl RedisCharges {
    fn charge_key(id: &str) -> String {
        format!("{LEDGER_PREFIX}charge:{id}")
    }

    fn list_key(account: &Account) -> String {
        format!("{LEDGER_PREFIX}list:{}", account.id())
    }

    fn operation_key(account: &Account, provider_key: &str) -> String {
        format!("{LEDGER_PREFIX}op:{}:{provider_key}", account.id())
    }

    fn unsettled_key() -> String {
        format!("{LEDGER_PREFIX}unsettled")
    }

    /// Writes `charge` as its operation's (with a new `seq`), or returns the operation's charge.
    async fn open(
        &self,
        charge: &mut Charge,
        window: Duration,
    ) -> Result<Option<Charge>, ApiError> {
        let mut incr = redis::cmd("INCR");
        incr.arg(format!("{LEDGER_PREFIX}seq"));
        charge.seq = self.conn.query(&incr).await.map_err(unavailable)?;
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let mut invocation = self
            .open
            .key(Self::operation_key(&charge.account, &charge.provider_key));
        invocation
            .key(Self::charge_key(&charge.id))
            .key(Self::list_key(&charge.account))
            .key(Self::unsettled_key())
            .arg(encode(charge)?)
            .arg(window.max(1))
            .arg(charge.seq)
            .arg(&charge.id)
            .arg(charge.updated)
            .arg(format!("{LEDGER_PREFIX}charge:"));
        let earlier: Option<String> = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
            .await
            .map_err(unavailable)?;
        earlier.as_deref().map(decode).transpose()
    }

    async fn read_raw(&self, id: &str) -> Result<Option<String>, ApiError> {
        let mut get = redis::cmd("GET");
        get.arg(Self::charge_key(id));
        self.conn.query(&get).await.map_err(unavailable)
    }

    async fn read(&self, id: &str) -> Result<Option<Charge>, ApiError> {
        self.read_raw(id).await?.as_deref().map(decode).transpose()
    }

    /// Sets the charge `id` from `expected` (its JSON, `""` for none) to `new`.
    async fn swap(&self, expected: &str, new: &Charge, seq: u64) -> Result<bool, ApiError> {
        let mut invocation = self.swap.key(Self::charge_key(&new.id));
        invocation
            .key(Self::unsettled_key())
            .key(Self::list_key(&new.account))
            .arg(expected)
            .arg(encode(new)?)
            .arg(&new.id)
            .arg(new.updated)
            .arg(if new.is_busy() { "1" } else { "0" })
            .arg(seq);
        let swapped: i64 = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
            .await
            .map_err(unavailable)?;
        Ok(swapped == 1)
    }

    /// Changes the account's charge `id` with `change_with`, compare-and-set, tried again while
    /// another write gets in between. `missing`: a charge to write again should it be gone.
    async fn change(
        &self,
        account: &Account,
        id: &str,
        missing: Option<Charge>,
        mut change_with: impl FnMut(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        for _ in 0..SWAP_TRIES {
            let raw = self.read_raw(id).await?;
            let (expected, mut charge) = match (raw, &missing) {
                (Some(raw), _) => {
                    let charge = decode(&raw)?;
                    (raw, charge)
                }
                (None, Some(again)) => {
                    let mut again = again.clone();
                    if self.operation(&again.account, &again.provider_key).await? {
                        return Err(ApiError::superseded());
                    }
                    again.seq = again.seq.max(1);
                    (String::new(), again)
                }
                (None, None) => return Err(ApiError::no_such_charge(id)),
            };
            if &charge.account != account {
                return Err(ApiError::no_such_charge(id));
            }
            change_with(&mut charge)?;
            charge.updated = now_ms();
            if self.swap(&expected, &charge, charge.seq).await? {
                return Ok(charge);
            }
        }
        tracing::warn!(
            charge = id,
            "the charge kept changing under this write; giving up for now"
        );
        Err(ApiError::storage_unavailable())
    }

    /// [`Ledger::swap`]: `found` as read (its JSON written again) to `settled`.
    async fn swap_if(&self, found: &Charge, settled: &Charge) -> Result<bool, ApiError> {
        let Some(raw) = self.read_raw(&found.id).await? else {
            return Ok(false);
        };
        let now = decode(&raw)?;
        if now.updated != found.updated || now.status != found.status {
            return Ok(false);
        }
        let mut settled = settled.clone();
        settled.updated = now_ms();
        self.swap(&raw, &settled, settled.seq).await
    }

    async fn remove(&self, found: &Charge) -> Result<bool, ApiError> {
        let Some(raw) = self.read_raw(&found.id).await? else {
            return Ok(false);
        };
        if decode(&raw)?.updated != found.updated {
            return Ok(false);
        }
        let mut invocation = self.remove.key(Self::charge_key(&found.id));
        invocation
            .key(Self::unsettled_key())
            .key(Self::list_key(&found.account))
            .key(Self::operation_key(&found.account, &found.provider_key))
            .arg(raw)
            .arg(&found.id);
        let removed: i64 = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
            .await
            .map_err(unavailable)?;
        Ok(removed == 1)
    }

    async fn operation(&self, account: &Account, provider_key: &str) -> Result<bool, ApiError> {
        let mut exists = redis::cmd("EXISTS");
        exists.arg(Self::operation_key(account, provider_key));
        let found: i64 = self.conn.query(&exists).await.map_err(unavailable)?;
        Ok(found == 1)
    }

    /// The charges of `ids`, in their order (those gone are skipped).
    async fn read_many(&self, ids: Vec<String>) -> Result<Vec<Charge>, ApiError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut get = redis::cmd("MGET");
        for id in &ids {
            get.arg(Self::charge_key(id));
        }
        let found: Vec<Option<String>> = self.conn.query(&get).await.map_err(unavailable)?;
        found.iter().flatten().map(|raw| decode(raw)).collect()
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        let mut range = redis::cmd("ZRANGE");
        range.arg(Self::list_key(account)).arg(0).arg(-1).arg("REV");
        let ids: Vec<String> = self.conn.query(&range).await.map_err(unavailable)?;
        self.read_many(ids).await
    }

    async fn unsettled(&self, before: u64, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(Self::unsettled_key())
            .arg("-inf")
            .arg(before)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let ids: Vec<String> = self.conn.query(&range).await.map_err(unavailable)?;
        self.read_many(ids).await
    }
}

fn encode(charge: &Charge) -> Result<String, ApiError> {
    serde_json::to_string(charge).map_err(|err| {
        tracing::error!(%err, "cannot encode a charge");
        ApiError::storage_unavailable()
    })
}

fn decode(raw: &str) -> Result<Charge, ApiError> {
    serde_json::from_str(raw).map_err(|err| {
        tracing::error!(%err, "the ledger holds a charge it cannot read");
        ApiError::storage_unavailable()
    })
}

fn pg_unavailable(err: sqlx::Error) -> ApiError {
    super::pg::unavailable(err)
}

fn unavailable(err: RedisStoreError) -> ApiError {
    tracing::warn!(error = %super::report(&err), "the ledger's Redis failed");
    ApiError::storage_unavailable()
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
    changed.updated = now_ms();
    *charge = changed.clone();
    Ok(changed)
}

fn lock(charges: &Mutex<Charges>) -> std::sync::MutexGuard<'_, Charges> {
    charges.lock().unwrap_or_else(PoisonError::into_inner)
}
