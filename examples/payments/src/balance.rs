//! Every account's available balance, per currency, and the events that made it.
//!
//! [`Balances::apply`] is where the money moves, and it is idempotent on its own: the balance
//! change and the record "event `evt_...` was applied" are one atomic step, so an event applied
//! twice changes the balance once, whatever happened in between.
//!
//! - In memory: both change under one lock.
//! - In Redis: one Lua script checks and records the event id in the account's set of applied
//!   events (`ZADD NX`) and, only if it was new, `HINCRBY`s the balance. Both keys carry the
//!   account as their hash tag, so Redis Cluster keeps them in one slot.
//! - In PostgreSQL (`pg/balances.rs`): in one transaction, the event id is recorded as processed
//!   with [`PgStore::mark_processed`](tower_idempotency_postgres::PgStore::mark_processed) (a row the
//!   primary key refuses twice) and, only if it was new, the balance row is changed. The outbox
//!   consumer (`pg/outbox.rs`) runs both in the transaction that takes the event off the outbox.
//!
//! A balance is an `i64` of minor units, changed with checked arithmetic: an event that would take
//! it past `i64::MAX` or below `i64::MIN` is refused ([`BalanceError::Overflow`]), changes nothing
//! and is not recorded as applied; so is an event whose amount is not positive
//! ([`BalanceError::InvalidAmount`]). Both are permanent: the consumer logs and drops such an
//! event instead of retrying it. In Redis the check is `HINCRBY`'s own, run before the event id
//! is recorded; in PostgreSQL it is `bigint`'s own, which rolls the id back with it.
//!
//! Retention: an applied event id is remembered for [`RETENTION`] (7 days) after it was applied,
//! then forgotten (in Redis: trimmed from the sorted set by score on the account's next apply, and
//! the whole set expires with an idle account). An event delivered again later than that would be
//! applied again: keep the retention above the longest time an event can wait in the queue or be
//! republished (the stream's retention, the idempotency layer's 24 h window). The balances
//! themselves never expire: they are the money.
//!
//! `GET /v1/balance` answers `{"object": "balance", "available": [{"amount": 2500, "currency":
//! "eur"}]}`, one entry per currency the account has seen money in, sorted by currency.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, State};
use deadpool_redis::redis::{self, Script};
use serde::Serialize;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_idempotency_redis::{RedisStoreError, SharedConnection};

use super::AppState;
use super::auth::Account;
use super::error::ApiError;
use super::events::PaymentEvent;
use sqlx::{self, PgConnection};
use tower_idempotency_postgres::PgStore;

/// How long an applied event id is remembered.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Applies one event, once. KEYS[1] the account's applied events (a sorted set, scored by the
/// time of application), KEYS[2] its balances (a hash: currency -> amount). ARGV[1] the event id,
/// ARGV[2] the currency ("" for no change), ARGV[3] the change, ARGV[4] the retention in ms.
/// Returns 1 when applied now, 0 when it had been applied before, -1 when the balance would
/// overflow (nothing written). The balance changes before the id is recorded: a script that
/// stops at an error keeps the writes it made, and an id recorded without its change would make
/// the event look applied.
const APPLY: &str = r"
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local retention = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - retention)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
if ARGV[2] ~= '' then
  local changed = redis.pcall('HINCRBY', KEYS[2], ARGV[2], ARGV[3])
  if type(changed) == 'table' and changed.err then
    if string.find(changed.err, 'overflow', 1, true) then
      return -1
    end
    return changed
  end
end
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
redis.call('PEXPIRE', KEYS[1], retention)
return 1
";

/// What [`Balances::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The event was applied now.
    New,
    /// The event had been applied before: nothing changed.
    Already,
}

/// Applying or reading failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BalanceError {
    /// Redis failed: nothing is known to have changed (the script may have run; applying again
    /// is safe).
    #[error("the balance ledger is unavailable")]
    Redis(#[from] RedisStoreError),
    /// The event would take the balance past what an `i64` holds: nothing changed, and applying
    /// it again fails the same way.
    #[error("the {currency} balance would overflow")]
    Overflow { currency: String },
    /// The event's amount is not positive: nothing changed.
    #[error("the event's amount is not positive: {0}")]
    InvalidAmount(i64),
    /// A failure injected by a test ([`Fault`]).
    #[error("injected failure ({0})")]
    Injected(&'static str),
    /// PostgreSQL failed: nothing changed (the transaction rolled back).
    #[error("the balance ledger is unavailable")]
    Postgres(#[from] sqlx::Error),
    /// This backend does not keep what was asked for.
    #[error("{0}")]
    Unsupported(&'static str),
}

impl BalanceError {
    /// Whether applying the same event again can never succeed.
    pub fn is_permanent(&self) -> bool {
        match self {
            BalanceError::Overflow { .. } | BalanceError::InvalidAmount(_) => true,
            BalanceError::Redis(_) | BalanceError::Injected(_) | BalanceError::Unsupported(_) => {
                false
            }
            BalanceError::Postgres(_) => false,
        }
    }
}

/// One currency's balance, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Available {
    pub amount: i64,
    pub currency: String,
}

/// `GET /v1/balance`'s body.
#[derive(Debug, Serialize)]
pub struct BalanceJson {
    object: &'static str,
    available: Vec<Available>,
}

/// `GET /v1/balance`: the account's available balance per currency; 503 when the ledger is
/// unreachable.
pub async fn show(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
) -> Result<Json<BalanceJson>, ApiError> {
    let available = state.balances.get(account.id()).await.map_err(|err| {
        tracing::warn!(error = %super::report(&err), "cannot read the balance");
        ApiError::ledger_unavailable()
    })?;
    Ok(Json(BalanceJson {
        object: "balance",
        available,
    }))
}

/// The balances, in memory or in Redis; clones share them.
#[derive(Debug, Clone)]
pub struct Balances {
    backend: Backend,
    faults: Arc<Faults>,
}

#[derive(Debug, Clone)]
enum Backend {
    Memory(Arc<Mutex<HashMap<String, Book>>>),
    Redis(RedisBalances),
    /// The `balances` table, and the store whose table records the applied event ids.
    Postgres(PgStore),
}

/// One account's balances and applied events, in memory.
#[derive(Debug, Default)]
struct Book {
    available: BTreeMap<String, i64>,
    applied: HashSet<String>,
    /// The applied ids, oldest first, to forget them after [`RETENTION`].
    order: VecDeque<(Instant, String)>,
}

#[derive(Clone)]
struct RedisBalances {
    conn: SharedConnection,
    prefix: Arc<str>,
    apply: Arc<Script>,
}

impl Balances {
    /// Empty balances in memory.
    pub fn memory() -> Self {
        Self::with(Backend::Memory(Arc::default()))
    }

    /// Balances in Redis, under keys that start with `prefix`.
    pub fn redis(conn: SharedConnection, prefix: &str) -> Self {
        Self::with(Backend::Redis(RedisBalances {
            conn,
            prefix: prefix.into(),
            apply: Arc::new(Script::new(APPLY)),
        }))
    }

    /// Balances in the `balances` table of `store`'s database; the applied event ids are
    /// records of `store`.
    pub fn postgres(store: PgStore) -> Self {
        Self::with(Backend::Postgres(store))
    }

    fn with(backend: Backend) -> Self {
        Self {
            backend,
            faults: Arc::default(),
        }
    }

    /// Applies `event` to its account's balance unless it was applied before, in one atomic step.
    pub async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        self.with_faults(event, async {
            match &self.backend {
                Backend::Memory(books) => apply_in_memory(books, event),
                Backend::Redis(redis) => redis.apply(event).await,
                Backend::Postgres(store) => {
                    let mut tx = store.pool().begin().await?;
                    let applied = super::pg::balances::apply(&mut tx, store, event).await?;
                    tx.commit().await?;
                    Ok(applied)
                }
            }
        })
        .await
    }

    /// Applies `event` in the transaction of `conn`, unless it was applied before: both the
    /// balance change and the record that the event was applied commit with that transaction.
    /// For balances in PostgreSQL only.
    pub async fn apply_in(
        &self,
        conn: &mut PgConnection,
        event: &PaymentEvent,
    ) -> Result<Applied, BalanceError> {
        let Backend::Postgres(store) = &self.backend else {
            return Err(BalanceError::Unsupported(
                "only balances in PostgreSQL apply in a transaction",
            ));
        };
        self.with_faults(event, super::pg::balances::apply(conn, store, event))
            .await
    }

    /// Runs `apply` for `event` as the faults injected for it say.
    async fn with_faults(
        &self,
        event: &PaymentEvent,
        apply: impl Future<Output = Result<Applied, BalanceError>>,
    ) -> Result<Applied, BalanceError> {
        let fault = self.faults.attempt(&event.id);
        match &fault {
            Some(Fault::Fail { .. }) => return Err(BalanceError::Injected("before applying")),
            Some(Fault::Hold { reached, release }) => {
                reached.notify_one();
                release.notified().await;
            }
            _ => {}
        }
        if event.amount <= 0 {
            return Err(BalanceError::InvalidAmount(event.amount));
        }
        let applied = apply.await?;
        match fault {
            Some(Fault::FailAfterApplying { .. }) => Err(BalanceError::Injected("after applying")),
            Some(Fault::HangAfterApplying) => std::future::pending().await,
            _ => Ok(applied),
        }
    }

    /// The account's balance per currency, sorted by currency.
    pub async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        let mut available: Vec<Available> = match &self.backend {
            Backend::Memory(books) => lock(books)
                .get(account)
                .map(|book| {
                    book.available
                        .iter()
                        .map(|(currency, amount)| Available {
                            amount: *amount,
                            currency: currency.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Backend::Redis(redis) => redis.get(account).await?,
            Backend::Postgres(store) => super::pg::balances::get(store.pool(), account).await?,
        };
        available.sort_by(|a, b| a.currency.cmp(&b.currency));
        Ok(available)
    }

    /// How many events the account has applied (within the retention).
    #[allow(dead_code)] // for tests
    pub async fn applied_count(&self, account: &str) -> Result<usize, BalanceError> {
        match &self.backend {
            Backend::Memory(books) => Ok(lock(books)
                .get(account)
                .map_or(0, |book| book.applied.len())),
            Backend::Redis(redis) => redis.applied_count(account).await,
            Backend::Postgres(_) => Err(BalanceError::Unsupported(
                "in PostgreSQL, applied event ids are not kept per account",
            )),
        }
    }

    /// Makes the applies of `event_id` misbehave (tests only).
    #[allow(dead_code)] // for tests
    pub fn inject(&self, event_id: &str, fault: Fault) {
        self.faults.inject(event_id, fault);
    }

    /// How many times the apply of `event_id` was attempted (counted only for injected events).
    #[allow(dead_code)] // for tests
    pub fn attempts(&self, event_id: &str) -> usize {
        self.faults.attempts(event_id)
    }
}

fn apply_in_memory(
    books: &Mutex<HashMap<String, Book>>,
    event: &PaymentEvent,
) -> Result<Applied, BalanceError> {
    let now = Instant::now();
    let mut books = lock(books);
    let book = books.entry(event.account.clone()).or_default();
    while let Some((at, _)) = book.order.front() {
        if now.duration_since(*at) < RETENTION {
            break;
        }
        if let Some((_, id)) = book.order.pop_front() {
            book.applied.remove(&id);
        }
    }
    if book.applied.contains(&event.id) {
        return Ok(Applied::Already);
    }
    if let Some((currency, change)) = event.balance_change() {
        let balance = book.available.entry(currency.to_owned()).or_default();
        *balance = balance
            .checked_add(change)
            .ok_or_else(|| BalanceError::Overflow {
                currency: currency.to_owned(),
            })?;
    }
    book.applied.insert(event.id.clone());
    book.order.push_back((now, event.id.clone()));
    Ok(Applied::New)
}

impl RedisBalances {
    /// `<prefix>{<account>}:applied` and `<prefix>{<account>}:available`.
    fn keys(&self, account: &str) -> (String, String) {
        let prefix = &self.prefix;
        (
            format!("{prefix}{{{account}}}:applied"),
            format!("{prefix}{{{account}}}:available"),
        )
    }

    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        let (applied, available) = self.keys(&event.account);
        let (currency, change) = event.balance_change().unwrap_or(("", 0));
        let retention = u64::try_from(RETENTION.as_millis()).unwrap_or(u64::MAX);
        let mut invocation = self.apply.key(applied);
        invocation
            .key(available)
            .arg(&event.id)
            .arg(currency)
            .arg(change)
            .arg(retention);
        let applied: i64 = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
            .await?;
        match applied {
            1 => Ok(Applied::New),
            -1 => Err(BalanceError::Overflow {
                currency: currency.to_owned(),
            }),
            _ => Ok(Applied::Already),
        }
    }

    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        let (_, available) = self.keys(account);
        let mut all = redis::cmd("HGETALL");
        all.arg(available);
        let amounts: Vec<(String, i64)> = self.conn.query(&all).await?;
        Ok(amounts
            .into_iter()
            .map(|(currency, amount)| Available { amount, currency })
            .collect())
    }

    async fn applied_count(&self, account: &str) -> Result<usize, BalanceError> {
        let (applied, _) = self.keys(account);
        let mut count = redis::cmd("ZCARD");
        count.arg(applied);
        Ok(self.conn.query(&count).await?)
    }
}

impl fmt::Debug for RedisBalances {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBalances")
            .field("conn", &self.conn)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A misbehaviour of [`Balances::apply`] for one event id, for tests.
#[derive(Debug, Clone)]
#[allow(dead_code)] // for tests
pub enum Fault {
    /// The next `times` attempts fail before changing anything.
    Fail { times: usize },
    /// The next `times` attempts apply the event, then fail: the effect is made, its reply lost.
    FailAfterApplying { times: usize },
    /// The next attempt applies the event and then never returns, as a process that dies right
    /// after the effect (the test aborts the consumer).
    HangAfterApplying,
    /// The next attempt signals `reached`, waits for `release`, then applies normally.
    Hold {
        reached: Arc<Notify>,
        release: Arc<Notify>,
    },
}

#[derive(Debug, Default)]
struct Faults {
    injected: Mutex<HashMap<String, Fault>>,
    attempts: Mutex<HashMap<String, usize>>,
}

impl Faults {
    fn inject(&self, event_id: &str, fault: Fault) {
        lock(&self.attempts).entry(event_id.to_owned()).or_default();
        lock(&self.injected).insert(event_id.to_owned(), fault);
    }

    /// Counts an attempt at an event a fault was ever injected for, and returns the fault it
    /// meets, using one up.
    fn attempt(&self, event_id: &str) -> Option<Fault> {
        *lock(&self.attempts).get_mut(event_id)? += 1;
        let mut injected = lock(&self.injected);
        let fault = injected.get_mut(event_id)?;
        let current = fault.clone();
        let used_up = match fault {
            Fault::Fail { times } | Fault::FailAfterApplying { times } => {
                *times = times.saturating_sub(1);
                *times == 0
            }
            Fault::HangAfterApplying | Fault::Hold { .. } => true,
        };
        if used_up {
            injected.remove(event_id);
        }
        Some(current)
    }

    fn attempts(&self, event_id: &str) -> usize {
        lock(&self.attempts).get(event_id).copied().unwrap_or(0)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
