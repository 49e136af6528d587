//! The charges in Redis (or a Redis Cluster): one ledger for every instance on it.
//!
//! Keys, all under [`LEDGER_PREFIX`] and its `{ledger}` hash tag, so that one script changes a
//! charge, its account's list and the index of unsettled charges together, on a cluster as on
//! one server: `charge:<id>` (the charge's JSON), `op:<account>:<key>` (an operation's charge id,
//! held for the window and set only while no live charge holds it: one charge per operation; a
//! charge written again after the reconciler removed it takes it back), `list:<account>` (ids by
//! `seq`),
//! `unsettled` (ids of charges in an `-ing` state, by when they last changed), `seq`. The charges
//! never expire: keep them on a Redis with persistence and no eviction.
//!
//! Every write reads the charge, changes it, and writes it back only if nobody wrote it
//! meanwhile (a Lua compare-and-set, tried again on a conflict): two instances that refund one
//! charge at once cannot both pass the state machine.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use deadpool_redis::redis::{self, Script};
use tower_idempotency_redis::{RedisStoreError, SharedConnection};

use super::{Change, Charge, EventOf, Ledger, NewCharge, Opened, millis, reopen};
use crate::auth::Account;
use crate::error::ApiError;
use crate::events::{PaymentEvent, Publisher};
use crate::provider::now_ms;
use crate::state_machine::{Event, Status};

/// The prefix of the ledger's keys in Redis; `{ledger}` is their hash tag.
pub const LEDGER_PREFIX: &str = "payments:{ledger}:";

/// Opens an operation: the charge it holds (`KEYS[1]`, the charges' prefix `ARGV[6]`), if any;
/// else the operation is held for `ARGV[2]` ms and the new charge (`KEYS[2]`, `ARGV[1]`, id
/// `ARGV[4]`) written, listed (`KEYS[3]`, `ARGV[3]`) and indexed unsettled (`KEYS[4]`, `ARGV[5]`).
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

/// Sets the charge `KEYS[1]` to `ARGV[2]` if it still holds `ARGV[1]` (empty: if it is gone, a
/// charge written again, then listed in `KEYS[3]` by `ARGV[6]` and holding its operation
/// `KEYS[4]` again for `ARGV[7]` ms, unless another charge, under the prefix `ARGV[8]`, holds it
/// by now), keeping its id `ARGV[3]` in the unsettled index `KEYS[2]` (scored `ARGV[4]`) exactly
/// while `ARGV[5]` is `1`. Returns 1, or 0 when the charge or its operation changed meanwhile.
const SWAP: &str = r"
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then
    return 0
end
if not now then
    local held = redis.call('GET', KEYS[4])
    if held and held ~= ARGV[3] and redis.call('EXISTS', ARGV[8] .. held) == 1 then
        return 0
    end
    redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[7])
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

/// Deletes the charge `KEYS[1]` if it still holds `ARGV[1]`, with its id `ARGV[2]` in the
/// unsettled index (`KEYS[2]`) and the list (`KEYS[3]`), and its operation (`KEYS[4]`) if that
/// still names it. Returns 1, or 0 when the charge changed meanwhile.
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

/// How often a write is tried again when the charge changed between its read and its write.
const SWAP_TRIES: usize = 8;

/// The charges in the Redis of a [`SharedConnection`]; events go to `events` once written.
#[derive(Debug, Clone)]
pub struct RedisLedger {
    conn: SharedConnection,
    events: Publisher,
    window: Duration,
    scripts: Arc<[Script; 3]>,
}

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

impl RedisLedger {
    /// The charges in `conn`'s Redis, each holding its operation for `window`.
    pub fn new(conn: SharedConnection, events: Publisher, window: Duration) -> Self {
        let scripts = [OPEN, SWAP, REMOVE].map(Script::new);
        Self {
            conn,
            events,
            window,
            scripts: Arc::new(scripts),
        }
    }

    async fn invoke<T: redis::FromRedisValue + Send>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, ApiError> {
        let run = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await });
        run.await.map_err(unavailable)
    }

    /// Writes `charge` as its operation's (with a new `seq`), or returns the operation's charge.
    async fn insert(&self, charge: &mut Charge) -> Result<Option<Charge>, ApiError> {
        let mut incr = redis::cmd("INCR");
        incr.arg(format!("{LEDGER_PREFIX}seq"));
        charge.seq = self.conn.query(&incr).await.map_err(unavailable)?;
        let mut invocation =
            self.scripts[0].key(operation_key(&charge.account, &charge.provider_key));
        invocation
            .key(charge_key(&charge.id))
            .key(list_key(&charge.account))
            .key(unsettled_key())
            .arg(encode(charge)?)
            .arg(millis(self.window).max(1))
            .arg(charge.seq)
            .arg(&charge.id)
            .arg(charge.updated)
            .arg(format!("{LEDGER_PREFIX}charge:"));
        let earlier: Option<String> = self.invoke(invocation).await?;
        earlier.as_deref().map(decode).transpose()
    }

    async fn read_raw(&self, id: &str) -> Result<Option<String>, ApiError> {
        let mut get = redis::cmd("GET");
        get.arg(charge_key(id));
        self.conn.query(&get).await.map_err(unavailable)
    }

    /// Sets the charge from `expected` (its JSON, `""` for none) to `new`.
    async fn write(&self, expected: &str, new: &Charge) -> Result<bool, ApiError> {
        let mut invocation = self.scripts[1].key(charge_key(&new.id));
        invocation
            .key(unsettled_key())
            .key(list_key(&new.account))
            .key(operation_key(&new.account, &new.provider_key))
            .arg(expected)
            .arg(encode(new)?)
            .arg(&new.id)
            .arg(new.updated)
            .arg(if new.is_busy() { "1" } else { "0" })
            .arg(new.seq)
            .arg(millis(self.window).max(1))
            .arg(format!("{LEDGER_PREFIX}charge:"));
        let swapped: i64 = self.invoke(invocation).await?;
        Ok(swapped == 1)
    }

    /// Changes the account's charge `id`, compare-and-set, tried again while other writes get
    /// in between. `missing`: the charge to write again should it be gone.
    async fn change(
        &self,
        account: &Account,
        id: &str,
        missing: Option<&Charge>,
        change: Change<'_>,
    ) -> Result<Charge, ApiError> {
        for _ in 0..SWAP_TRIES {
            let (expected, mut charge) = match (self.read_raw(id).await?, missing) {
                (Some(raw), _) => {
                    let charge = decode(&raw)?;
                    (raw, charge)
                }
                (None, Some(again)) => {
                    if self
                        .has_operation(&again.account, &again.provider_key)
                        .await?
                    {
                        return Err(ApiError::superseded());
                    }
                    let mut again = again.clone();
                    again.seq = again.seq.max(1);
                    (String::new(), again)
                }
                (None, None) => return Err(ApiError::no_such_charge(id)),
            };
            if &charge.account != account {
                return Err(ApiError::no_such_charge(id));
            }
            change(&mut charge)?;
            charge.updated = now_ms();
            if self.write(&expected, &charge).await? {
                return Ok(charge);
            }
        }
        tracing::warn!(
            charge = id,
            "the charge kept changing under this write; giving up for now"
        );
        Err(ApiError::storage_unavailable())
    }

    /// The charges of `ids`, in their order (those gone are skipped).
    async fn read_many(&self, ids: Vec<String>) -> Result<Vec<Charge>, ApiError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut get = redis::cmd("MGET");
        for id in &ids {
            get.arg(charge_key(id));
        }
        let found: Vec<Option<String>> = self.conn.query(&get).await.map_err(unavailable)?;
        found.iter().flatten().map(|raw| decode(raw)).collect()
    }

    async fn publish(&self, event: Option<PaymentEvent>) {
        if let Some(event) = event {
            self.events.publish(event).await;
        }
    }
}

#[async_trait]
impl Ledger for RedisLedger {
    async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened, ApiError> {
        let mut charge = Charge::new(account.clone(), request, provider_key);
        charge.apply(Event::Authorize)?;
        match self.insert(&mut charge).await? {
            None => Ok(Opened::Authorizing(charge)),
            Some(earlier) => reopen(self, request, earlier).await,
        }
    }

    async fn abandon(&self, charge: &Charge) {
        if let Ok(Some(raw)) = self.read_raw(&charge.id).await
            && let Ok(stored) = decode(&raw)
            && stored.status == Status::Authorizing
        {
            // Lost to a resumed attempt meanwhile: the reconciler looks at it later.
            let _ = self.remove(&stored, Duration::ZERO).await;
        }
    }

    async fn record(
        &self,
        _request: &Extensions,
        charge: Charge,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let (id, account) = (charge.id.clone(), charge.account.clone());
        let recorded = self
            .change(&account, &id, Some(&charge), &mut |c| {
                if c.status == Status::Authorizing {
                    c.status = charge.status;
                    c.payment.clone_from(&charge.payment);
                }
                Ok(())
            })
            .await?;
        self.publish(event(&recorded)).await;
        Ok(recorded)
    }

    async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        match self
            .read_raw(id)
            .await?
            .as_deref()
            .map(decode)
            .transpose()?
        {
            Some(charge) if &charge.account == account => Ok(charge),
            _ => Err(ApiError::no_such_charge(id)),
        }
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        let mut range = redis::cmd("ZRANGE");
        range.arg(list_key(account)).arg(0).arg(-1).arg("REV");
        let ids: Vec<String> = self.conn.query(&range).await.map_err(unavailable)?;
        self.read_many(ids).await
    }

    async fn update(
        &self,
        account: &Account,
        id: &str,
        change: Change<'_>,
    ) -> Result<Charge, ApiError> {
        self.change(account, id, None, change).await
    }

    async fn settle(
        &self,
        _request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let charge = self.change(account, id, None, change).await?;
        self.publish(event(&charge)).await;
        Ok(charge)
    }

    async fn publish_again(&self, event: PaymentEvent) {
        self.events.publish(event).await;
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let before = now_ms().saturating_sub(millis(after));
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(unsettled_key())
            .arg("-inf")
            .arg(before)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let ids: Vec<String> = self.conn.query(&range).await.map_err(unavailable)?;
        self.read_many(ids).await
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        _unchanged_for: Duration,
    ) -> Result<bool, ApiError> {
        let Some(raw) = self.read_raw(&found.id).await? else {
            return Ok(false);
        };
        let now = decode(&raw)?;
        if now.updated != found.updated || now.status != found.status {
            return Ok(false);
        }
        let mut settled = settled.clone();
        settled.updated = now_ms();
        let swapped = self.write(&raw, &settled).await?;
        if swapped {
            self.publish(event).await;
        }
        Ok(swapped)
    }

    async fn remove(&self, found: &Charge, _after: Duration) -> Result<bool, ApiError> {
        let Some(raw) = self.read_raw(&found.id).await? else {
            return Ok(false);
        };
        if decode(&raw)?.updated != found.updated {
            return Ok(false);
        }
        let mut invocation = self.scripts[2].key(charge_key(&found.id));
        invocation
            .key(unsettled_key())
            .key(list_key(&found.account))
            .key(operation_key(&found.account, &found.provider_key))
            .arg(raw)
            .arg(&found.id);
        let removed: i64 = self.invoke(invocation).await?;
        Ok(removed == 1)
    }

    async fn has_operation(&self, account: &Account, provider_key: &str) -> Result<bool, ApiError> {
        let mut exists = redis::cmd("EXISTS");
        exists.arg(operation_key(account, provider_key));
        let found: i64 = self.conn.query(&exists).await.map_err(unavailable)?;
        Ok(found == 1)
    }

    async fn adopt(
        &self,
        mut charge: Charge,
        event: Option<PaymentEvent>,
    ) -> Result<bool, ApiError> {
        let adopted = self.insert(&mut charge).await?.is_none();
        if adopted {
            self.publish(event).await;
        }
        Ok(adopted)
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

fn unavailable(err: RedisStoreError) -> ApiError {
    tracing::warn!(error = %crate::report(&err), "the ledger's Redis failed");
    ApiError::storage_unavailable()
}
