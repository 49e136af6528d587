//! The provider's keys in Redis: one key per idempotency key, `<prefix>key:<key>`, holding the
//! JSON of [`Used`] with the window as its expiry, written by one Lua script that sets a vacant
//! key or returns what it holds (raising its fence, `KEEPTTL`); a call's payment
//! (`<prefix>payment:<id>`, listed in `<prefix>payments` by time) is written in the same script.
//! Every key shares the prefix's `{provider}` hash tag: one slot of a cluster.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_redis::redis::{self, Script};
use tower_idempotency_redis::SharedConnection;

use super::{KeyTable, KeyTableError, Used, now_ms};
use crate::provider::{Effect, PaymentRecord, ProviderError};

/// The prefix of the provider's keys and payments in Redis.
pub const PROVIDER_PREFIX: &str = "payments:{provider}:";

/// Sets a vacant key (`KEYS[1]`) to `ARGV[1]` for `ARGV[4]` ms, or returns what it holds; a live
/// key used for the same request (`ARGV[2]`) with a smaller fence gets the call's (`ARGV[3]`, 20
/// digits). With a vacant key, `ARGV[5]` says what else the call does: `payment` writes the
/// payment (`KEYS[2]`, `ARGV[6]`) and lists it (`KEYS[3]`, scored `ARGV[7]`, member `ARGV[8]`);
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

/// The keys in the Redis of a [`SharedConnection`], under [`PROVIDER_PREFIX`], each remembered
/// for `window` (Redis drops them then).
#[derive(Debug, Clone)]
pub struct RedisKeys {
    conn: SharedConnection,
    window: Duration,
    insert: Arc<Script>,
}

impl RedisKeys {
    pub fn new(conn: SharedConnection, window: Duration) -> Self {
        Self {
            conn,
            window,
            insert: Arc::new(Script::new(INSERT)),
        }
    }
}

#[async_trait]
impl KeyTable for RedisKeys {
    async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError> {
        let mut get = redis::cmd("GET");
        get.arg(format!("{PROVIDER_PREFIX}key:{key}"));
        let held: Option<String> = self.conn.query(&get).await?;
        Ok(held.as_deref().map(serde_json::from_str).transpose()?)
    }

    async fn insert(
        &self,
        key: &str,
        used: &Used,
        effect: Effect,
    ) -> Result<Result<Option<Used>, ProviderError>, KeyTableError> {
        let window = u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX);
        let mut invocation = self.insert.key(format!("{PROVIDER_PREFIX}key:{key}"));
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
                    .key(format!("{PROVIDER_PREFIX}payment:{}", payment.id))
                    .key(format!("{PROVIDER_PREFIX}payments"))
                    .arg("payment")
                    .arg(serde_json::to_string(&payment)?)
                    .arg(payment.created)
                    .arg(&payment.id);
            }
            Effect::Refund { payment, amount } => {
                refund = amount;
                invocation
                    .key(format!("{PROVIDER_PREFIX}payment:{payment}"))
                    .arg("refund")
                    .arg(amount);
            }
        }
        let run = self
            .conn
            .run(move |mut c| async move { invocation.invoke_async(&mut c).await });
        let held: Option<String> = run.await?;
        Ok(match held.as_deref() {
            Some("!none") => Err(ProviderError::NoSuchPayment),
            Some(refused) if refused.starts_with("!left:") => Err(ProviderError::AmountTooLarge {
                amount: refund,
                refundable: refused["!left:".len()..].parse().unwrap_or(0),
            }),
            held => Ok(held.map(serde_json::from_str).transpose()?),
        })
    }

    async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, KeyTableError> {
        let mut range = redis::cmd("ZRANGE");
        range
            .arg(format!("{PROVIDER_PREFIX}payments"))
            .arg(since)
            .arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let ids: Vec<String> = self.conn.query(&range).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut get = redis::cmd("MGET");
        for id in &ids {
            get.arg(format!("{PROVIDER_PREFIX}payment:{id}"));
        }
        let records: Vec<Option<String>> = self.conn.query(&get).await?;
        let records = records
            .iter()
            .flatten()
            .map(|record| serde_json::from_str(record));
        Ok(records.collect::<Result<_, _>>()?)
    }

    async fn sweep(&self) -> Result<u64, KeyTableError> {
        // Redis drops each key when its window ends.
        Ok(0)
    }
}
