//! The balances in Redis: one Lua script changes the balance (`HINCRBY`) and records the event id
//! in the account's applied set (`ZADD`), or does nothing for an id the set holds. Both keys carry the account as
//! their hash tag, so a Redis Cluster keeps them in one slot.

use std::sync::Arc;

use async_trait::async_trait;
use deadpool_redis::redis::{self, Script};
use tower_idempotency_redis::SharedConnection;

use super::{Applied, Available, BalanceError, Balances, RETENTION, check_amount};
use crate::events::PaymentEvent;

/// The prefix of the balance keys in Redis.
pub const BALANCES_PREFIX: &str = "payments:balance:";

/// Applies one event, once. KEYS[1] the account's applied events (a sorted set scored by the time
/// of application), KEYS[2] its balances (currency -> amount). ARGV: the event id, the currency
/// ("" for no change), the change, the retention in ms. Returns 1 when applied now, 0 when applied
/// before, -1 when the balance would overflow (nothing written). The balance changes before the id
/// is recorded: a script stopped by an error keeps the writes it made, and an id recorded without
/// its change would make the event look applied.
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

/// The balances in the Redis of a [`SharedConnection`], under [`BALANCES_PREFIX`]:
/// `<prefix>{<account>}:applied` and `<prefix>{<account>}:available`.
#[derive(Debug, Clone)]
pub struct RedisBalances {
    conn: SharedConnection,
    apply: Arc<Script>,
}

impl RedisBalances {
    pub fn new(conn: SharedConnection) -> Self {
        Self {
            conn,
            apply: Arc::new(Script::new(APPLY)),
        }
    }
}

fn key(account: &str, what: &str) -> String {
    format!("{BALANCES_PREFIX}{{{account}}}:{what}")
}

#[async_trait]
impl Balances for RedisBalances {
    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        check_amount(event)?;
        let (currency, change) = event.balance_change().unwrap_or(("", 0));
        let retention = u64::try_from(RETENTION.as_millis()).unwrap_or(u64::MAX);
        let mut invocation = self.apply.key(key(&event.account, "applied"));
        invocation
            .key(key(&event.account, "available"))
            .arg(&event.id)
            .arg(currency)
            .arg(change)
            .arg(retention);
        let run = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await });
        match run.await? {
            1 => Ok(Applied::New),
            -1 => Err(BalanceError::Overflow {
                currency: currency.to_owned(),
            }),
            _ => Ok(Applied::Already),
        }
    }

    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        let mut all = redis::cmd("HGETALL");
        all.arg(key(account, "available"));
        let amounts: Vec<(String, i64)> = self.conn.query(&all).await?;
        let mut available: Vec<Available> = (amounts.into_iter())
            .map(|(currency, amount)| Available { amount, currency })
            .collect();
        available.sort_by(|a, b| a.currency.cmp(&b.currency));
        Ok(available)
    }
}
