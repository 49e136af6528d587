//! The provider's idempotency keys: for the dedup window, each remembers the request it was used
//! for, the reply that request got, and the largest fence a call with it carried.
//!
//! The fence is the caller's claim number ([`tower_idempotency::Fence`]): a call whose fence is
//! smaller than one the key has seen comes from a run that another run took over, and is refused
//! (`Provider` answers it [`ProviderError::Superseded`](super::ProviderError::Superseded)). The
//! check and the raise of the fence are one atomic step with the claim of the key:
//!
//! - In memory: a map under one lock, and the keys in the order they were first used, so that
//!   the expired ones are dropped from the front.
//! - In Redis: one key per idempotency key, `<prefix><key>`, holding the JSON of [`Used`], written
//!   by one Lua script that sets a vacant key (`PX <window>`) or returns what it holds, raising its
//!   fence (`KEEPTTL`): one key per script, so it runs on a Redis Cluster as on one server, and
//!   every instance on that Redis shares one table and two of them never both win a key. Redis
//!   drops a key when its window ends. The provider's keys share one hash tag (the prefix's
//!   `{provider}`), so that a call's script also writes its payment's record in the same step.
//! - In PostgreSQL: one row per idempotency key in `provider_keys` (`pg/schema.sql`), written
//!   with one `INSERT ... ON CONFLICT` that claims a vacant or expired key or returns the live row
//!   with its fence raised; the primary key lets only one of two instances win a key, and
//!   [`KeyTable::sweep`] deletes the expired rows; a call's payment row (`provider_payments`) is
//!   written in the same transaction. (A real provider keeps its keys in its own
//!   database: the table stands for that outside service, so that every instance of the example,
//!   and a restarted one, calls one provider.)

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_redis::redis;
use serde::{Deserialize, Serialize};
use sqlx::{self, PgPool, Row};
use tokio::time::Instant;
use tower_idempotency_redis::{RedisStoreError, SharedConnection};

use super::{Effect, PaymentRecord, ProviderError};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// What an idempotency key was used for, and what it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Used {
    /// The operation and its parameters, as [`super::Request::describe`] writes them.
    pub request: String,
    /// The id the call answered with: the payment's, or the refund's.
    pub id: String,
    /// The largest fence a call with the key carried (0 for a record written before fences).
    /// Written as 20 decimal digits, so that the Redis script compares two as strings, exactly.
    #[serde(default, with = "fence_digits")]
    pub fence: u64,
}

/// A fence as 20 decimal digits, zero-padded: string order is number order, and no Lua number
/// (a double) ever holds it.
mod fence_digits {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(fence: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format!("{fence:020}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        let digits = String::deserialize(deserializer)?;
        digits.parse().map_err(D::Error::custom)
    }
}

/// Sets a vacant key (`KEYS[1]`) to `ARGV[1]` for `ARGV[4]` ms, or returns what it holds; a live
/// key used for the same request (`ARGV[2]`) with a smaller fence gets the call's fence (`ARGV[3]`,
/// 20 digits) and keeps its expiry. Returns the key's record as it was before, or nil for a vacant
/// key. With the vacant key, `ARGV[5]` says what else the call does: `payment` writes the payment's
/// record (`KEYS[2]`, `ARGV[6]`) and lists it (`KEYS[3]`, scored `ARGV[7]`, member `ARGV[8]`);
/// `refund` takes `ARGV[6]` from what is left of the payment `KEYS[2]`, or returns `!none` (no
/// such payment) or `!left:<n>` (more than the `n` left) and claims nothing.
const INSERT: &str = r"
local held = redis.call('GET', KEYS[1])
if not held then
    if ARGV[5] == 'refund' then
        local record = redis.call('GET', KEYS[2])
        if not record then
            return '!none'
        end
        local payment = cjson.decode(record)
        local left = payment.amount - payment.refunded
        if tonumber(ARGV[6]) > left then
            return '!left:' .. string.format('%d', left)
        end
        payment.refunded = payment.refunded + tonumber(ARGV[6])
        redis.call('SET', KEYS[2], cjson.encode(payment))
    elseif ARGV[5] == 'payment' then
        redis.call('SET', KEYS[2], ARGV[6])
        redis.call('ZADD', KEYS[3], ARGV[7], ARGV[8])
    end
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
    return false
end
local used = cjson.decode(held)
local fence = used.fence or '00000000000000000000'
if used.request == ARGV[2] and ARGV[3] > fence then
    used.fence = ARGV[3]
    redis.call('SET', KEYS[1], cjson.encode(used), 'KEEPTTL')
end
return held
";

/// Expired rows deleted per [`KeyTable::sweep`] statement, so that one sweep never holds many
/// locks at once.
const SWEEP_BATCH: i64 = 1000;

/// The key table could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyTableError {
    /// Redis failed, or did not answer in time.
    #[error("the provider's key table is unavailable")]
    Redis(#[from] RedisStoreError),
    /// A key holds something that is not a [`Used`].
    #[error("the provider's key table holds an unreadable record")]
    Unreadable(#[from] serde_json::Error),
    /// PostgreSQL failed.
    #[error("the provider's key table is unavailable")]
    Postgres(#[from] sqlx::Error),
}

/// The idempotency keys, in memory or in Redis; clones share them.
#[derive(Debug, Clone)]
pub struct KeyTable {
    window: Duration,
    backend: Backend,
}

#[derive(Clone)]
enum Backend {
    Memory(Arc<Mutex<MemoryKeys>>),
    Redis {
        conn: SharedConnection,
        prefix: Arc<str>,
        insert: Arc<redis::Script>,
    },
    Postgres(PgPool),
}

#[derive(Debug, Default)]
struct MemoryKeys {
    used: HashMap<String, (Instant, Used)>,
    /// Every payment, by id (kept for good, as a provider keeps them).
    payments: HashMap<String, PaymentRecord>,
    /// Each key with the deadline it was given, first used first: with one window for every
    /// key, that is also the order in which they expire.
    order: VecDeque<(Instant, String)>,
}

impl KeyTable {
    /// Keys in memory, each remembered for `window`.
    pub fn memory(window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Memory(Arc::default()),
        }
    }

    /// Keys in the Redis of `conn`, under `prefix`, each remembered for `window`.
    pub fn redis(conn: SharedConnection, prefix: &str, window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Redis {
                conn,
                prefix: prefix.into(),
                insert: Arc::new(redis::Script::new(INSERT)),
            },
        }
    }

    /// Keys in the `provider_keys` table of `pool`'s database, each remembered for `window`.
    pub fn postgres(pool: PgPool, window: Duration) -> Self {
        Self {
            window,
            backend: Backend::Postgres(pool),
        }
    }

    /// How long a key is remembered after its first use.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// What `key` was used for within the window, if it was.
    pub async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => Ok(lock(keys).live(key, Instant::now()).cloned()),
            Backend::Redis { conn, prefix, .. } => {
                let mut get = redis::cmd("GET");
                get.arg(format!("{prefix}key:{key}"));
                let held: Option<String> = conn.query(&get).await?;
                Ok(held.as_deref().map(serde_json::from_str).transpose()?)
            }
            Backend::Postgres(pool) => {
                let row = sqlx::query(
                    "SELECT request, id, fence::text FROM provider_keys
                     WHERE key = $1 AND expires_at > statement_timestamp()",
                )
                .bind(key)
                .fetch_optional(pool)
                .await?;
                Ok(row.map(|row| read_used(&row)).transpose()?)
            }
        }
    }

    /// Records `used` under `key`, and makes `effect`, unless the key was used within the window:
    /// `Ok(None)` when `used` is recorded now, `Ok(Some(_))` with what the key was used for, or a
    /// refund's refusal (nothing recorded). A key used for the same request keeps the larger of
    /// its fence and `used.fence`, in the same step; the fence answered is larger than
    /// `used.fence` exactly when the key had seen a larger one. The key, its fence and the effect
    /// (a payment's record, a refund taken from what is left of its payment) are one atomic step.
    pub async fn insert(
        &self,
        key: &str,
        used: &Used,
        effect: Effect,
    ) -> Result<Result<Option<Used>, ProviderError>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let now = Instant::now();
                let mut keys = lock(keys);
                keys.forget_expired(now);
                if let Some((_, earlier)) = keys.used.get_mut(key).filter(|(at, _)| *at > now) {
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
                        keys.payments.insert(payment.id.clone(), payment);
                    }
                    Effect::Refund { payment, amount } => {
                        let Some(payment) = keys.payments.get_mut(&payment) else {
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
                keys.used.insert(key.to_owned(), (deadline, used.clone()));
                keys.order.push_back((deadline, key.to_owned()));
                Ok(Ok(None))
            }
            Backend::Redis {
                conn,
                prefix,
                insert,
            } => {
                let window = u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX);
                let mut invocation = insert.key(format!("{prefix}key:{key}"));
                invocation
                    .arg(serde_json::to_string(used)?)
                    .arg(&used.request)
                    .arg(format!("{:020}", used.fence))
                    .arg(window.max(1));
                let mut refund = 0;
                match effect {
                    Effect::None => {
                        invocation.arg("");
                    }
                    Effect::Payment(mut payment) => {
                        payment.created = now_ms();
                        invocation
                            .key(format!("{prefix}payment:{}", payment.id))
                            .key(format!("{prefix}payments"))
                            .arg("payment")
                            .arg(serde_json::to_string(&payment)?)
                            .arg(payment.created)
                            .arg(&payment.id);
                    }
                    Effect::Refund { payment, amount } => {
                        refund = amount;
                        invocation
                            .key(format!("{prefix}payment:{payment}"))
                            .arg("refund")
                            .arg(amount);
                    }
                }
                let held: Option<String> = conn
                    .run(move |mut c| async move { invocation.invoke_async(&mut c).await })
                    .await?;
                match held.as_deref() {
                    Some("!none") => Ok(Err(ProviderError::NoSuchPayment)),
                    Some(refused) if refused.starts_with("!left:") => {
                        let refundable = refused["!left:".len()..].parse().unwrap_or(0);
                        Ok(Err(ProviderError::AmountTooLarge {
                            amount: refund,
                            refundable,
                        }))
                    }
                    held => Ok(Ok(held.map(serde_json::from_str).transpose()?)),
                }
            }
            Backend::Postgres(pool) => {
                let window = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
                let mut tx = pool.begin().await?;
                // A refund locks its payment's row first: two refunds of it take turns.
                if let Effect::Refund { payment, amount } = &effect {
                    let row = sqlx::query(
                        "SELECT amount - refunded FROM provider_payments WHERE id = $1 FOR UPDATE",
                    )
                    .bind(payment)
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some(row) = row else {
                        return Ok(Err(ProviderError::NoSuchPayment));
                    };
                    let refundable: i64 = row.try_get(0)?;
                    let known = sqlx::query(
                        "SELECT 1 FROM provider_keys WHERE key = $1 AND expires_at > statement_timestamp()",
                    )
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if known.is_none() && *amount > refundable {
                        return Ok(Err(ProviderError::AmountTooLarge {
                            amount: *amount,
                            refundable,
                        }));
                    }
                }
                // A live row keeps its request and id, and takes the larger fence when it was used
                // for the same request (the update takes its lock, so two calls raise it in
                // turn); an expired one is taken over. The row comes back as written: its fence
                // is larger than the call's exactly when it was before. The new id is unique, so
                // finding it in the row means this call won the key.
                let row = sqlx::query(
                    "INSERT INTO provider_keys AS k (key, request, id, fence, expires_at)
                     VALUES ($1, $2, $3, $5::numeric, statement_timestamp() + $4::int8 * interval '1 millisecond')
                     ON CONFLICT (key) DO UPDATE SET
                         request = CASE WHEN k.expires_at > statement_timestamp()
                                        THEN k.request ELSE excluded.request END,
                         id = CASE WHEN k.expires_at > statement_timestamp()
                                   THEN k.id ELSE excluded.id END,
                         fence = CASE WHEN k.expires_at <= statement_timestamp()
                                      THEN excluded.fence
                                      WHEN k.request = excluded.request
                                      THEN greatest(k.fence, excluded.fence)
                                      ELSE k.fence END,
                         expires_at = CASE WHEN k.expires_at > statement_timestamp()
                                           THEN k.expires_at ELSE excluded.expires_at END
                     RETURNING request, id, fence::text",
                )
                .bind(key)
                .bind(&used.request)
                .bind(&used.id)
                .bind(window.max(1))
                // As text: a fence is a u64, which no integer type of PostgreSQL holds whole.
                .bind(used.fence.to_string())
                .fetch_one(&mut *tx)
                .await?;
                let held = read_used(&row)?;
                if held.id != used.id {
                    tx.commit().await?;
                    return Ok(Ok(Some(held)));
                }
                match effect {
                    Effect::None => {}
                    Effect::Payment(payment) => {
                        // Stamped when it is written (not when the statement began), so that a
                        // write held up by a lock is listed among the later payments.
                        sqlx::query(
                            "INSERT INTO provider_payments
                                 (id, key, amount, source, capture, outcome, reference, created_at)
                             VALUES ($1, $2, $3, $4, $5, $6, $7, clock_timestamp())",
                        )
                        .bind(&payment.id)
                        .bind(&payment.key)
                        .bind(payment.amount)
                        .bind(payment.source.token())
                        .bind(payment.capture)
                        .bind(outcome_text(payment.outcome))
                        .bind(&payment.reference)
                        .execute(&mut *tx)
                        .await?;
                    }
                    Effect::Refund { payment, amount } => {
                        sqlx::query(
                            "UPDATE provider_payments SET refunded = refunded + $2 WHERE id = $1",
                        )
                        .bind(&payment)
                        .bind(amount)
                        .execute(&mut *tx)
                        .await?;
                    }
                }
                tx.commit().await?;
                Ok(Ok(None))
            }
        }
    }

    /// Up to `limit` payments made since `since` (milliseconds since the Unix epoch), oldest
    /// first.
    pub async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let keys = lock(keys);
                let mut listed: Vec<PaymentRecord> = keys
                    .payments
                    .values()
                    .filter(|payment| payment.created >= since)
                    .cloned()
                    .collect();
                listed.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
                listed.truncate(limit);
                Ok(listed)
            }
            Backend::Redis { conn, prefix, .. } => {
                let mut range = redis::cmd("ZRANGE");
                range
                    .arg(format!("{prefix}payments"))
                    .arg(since)
                    .arg("+inf")
                    .arg("BYSCORE")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(limit);
                let ids: Vec<String> = conn.query(&range).await?;
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let mut get = redis::cmd("MGET");
                for id in &ids {
                    get.arg(format!("{prefix}payment:{id}"));
                }
                let records: Vec<Option<String>> = conn.query(&get).await?;
                let records = records.into_iter().flatten();
                Ok(records
                    .map(|record| serde_json::from_str(&record))
                    .collect::<Result<_, _>>()?)
            }
            Backend::Postgres(pool) => {
                let rows = sqlx::query(
                    "SELECT id, key, amount, refunded, source, capture, outcome, reference,
                            (extract(epoch FROM created_at) * 1000)::int8
                     FROM provider_payments
                     WHERE created_at >= to_timestamp($1::int8 / 1000.0)
                     ORDER BY created_at, id LIMIT $2",
                )
                .bind(i64::try_from(since).unwrap_or(i64::MAX))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(pool)
                .await?;
                Ok(rows.iter().map(read_payment).collect::<Result<_, _>>()?)
            }
        }
    }

    /// Deletes the keys whose window ended (PostgreSQL; in memory and in Redis they go by
    /// themselves); returns how many went.
    #[allow(dead_code)] // with the postgres feature
    pub async fn sweep(&self) -> Result<u64, KeyTableError> {
        match &self.backend {
            Backend::Memory(keys) => {
                let mut keys = lock(keys);
                let before = keys.used.len();
                keys.forget_expired(Instant::now());
                Ok((before - keys.used.len()) as u64)
            }
            Backend::Redis { .. } => Ok(0),
            Backend::Postgres(pool) => {
                let deleted = sqlx::query(
                    "DELETE FROM provider_keys WHERE key IN (
                         SELECT key FROM provider_keys
                         WHERE expires_at <= statement_timestamp()
                         LIMIT $1 FOR UPDATE SKIP LOCKED)",
                )
                .bind(SWEEP_BATCH)
                .execute(pool)
                .await?;
                Ok(deleted.rows_affected())
            }
        }
    }
}

/// A payment's outcome as the `provider_payments` table writes it.
fn outcome_text(outcome: super::Outcome) -> &'static str {
    match outcome {
        super::Outcome::Authorized => "authorized",
        super::Outcome::Captured => "captured",
        super::Outcome::Declined => "declined",
    }
}

/// A [`PaymentRecord`] from a row of `provider_payments` as [`KeyTable::payments_since`] reads it.
fn read_payment(row: &sqlx::postgres::PgRow) -> Result<PaymentRecord, sqlx::Error> {
    let bad = |what: &str| sqlx::Error::Decode(format!("a provider payment's {what}").into());
    let source: String = row.try_get(4)?;
    let outcome: String = row.try_get(6)?;
    let created: i64 = row.try_get(8)?;
    Ok(PaymentRecord {
        id: row.try_get(0)?,
        key: row.try_get(1)?,
        amount: row.try_get(2)?,
        refunded: row.try_get(3)?,
        source: super::Source::parse(&source).ok_or_else(|| bad("source"))?,
        capture: row.try_get(5)?,
        outcome: [
            super::Outcome::Authorized,
            super::Outcome::Captured,
            super::Outcome::Declined,
        ]
        .into_iter()
        .find(|o| outcome_text(*o) == outcome)
        .ok_or_else(|| bad("outcome"))?,
        reference: row.try_get(7)?,
        created: u64::try_from(created).unwrap_or(0),
    })
}

/// A [`Used`] from a row of `request, id, fence::text`.
fn read_used(row: &sqlx::postgres::PgRow) -> Result<Used, sqlx::Error> {
    let fence: String = row.try_get(2)?;
    let fence = fence.parse().map_err(|err| {
        sqlx::Error::Decode(format!("a provider key's fence {fence:?}: {err}").into())
    })?;
    Ok(Used {
        request: row.try_get(0)?,
        id: row.try_get(1)?,
        fence,
    })
}

impl MemoryKeys {
    /// The record of `key`, unless it expired.
    fn live(&self, key: &str, now: Instant) -> Option<&Used> {
        self.used
            .get(key)
            .filter(|(deadline, _)| *deadline > now)
            .map(|(_, used)| used)
    }

    fn forget_expired(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.order.front() {
            if *deadline > now {
                break;
            }
            let Some((deadline, key)) = self.order.pop_front() else {
                break;
            };
            // The key may have been used again since, with a later deadline: keep that record.
            if self.used.get(&key).is_some_and(|(at, _)| *at == deadline) {
                self.used.remove(&key);
            }
        }
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Memory(keys) => f
                .debug_struct("Memory")
                .field("keys", &lock(keys).used.len())
                .finish(),
            Backend::Redis { conn, prefix, .. } => f
                .debug_struct("Redis")
                .field("conn", conn)
                .field("prefix", prefix)
                .finish(),
            Backend::Postgres(_) => f.debug_struct("Postgres").finish_non_exhaustive(),
        }
    }
}

fn lock(keys: &Mutex<MemoryKeys>) -> std::sync::MutexGuard<'_, MemoryKeys> {
    keys.lock().unwrap_or_else(PoisonError::into_inner)
}
