//! The provider's keys in PostgreSQL: one row per key in `provider_keys`, claimed with one
//! `INSERT ... ON CONFLICT` that takes a vacant or expired key or returns the live row with its
//! fence raised (the primary key lets one of two instances win a key); a call's payment row
//! (`provider_payments`) is written in the same transaction. Expired rows are swept.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::{KeyTable, KeyTableError, Used};
use crate::provider::{Effect, Outcome, PaymentRecord, ProviderError, Source};

/// Expired rows deleted per sweep statement, so that one sweep never holds many locks at once.
const SWEEP_BATCH: i64 = 1000;

/// The keys in the `provider_keys` table of `pool`'s database, each remembered for `window`.
#[derive(Debug, Clone)]
pub struct PgKeys {
    pool: PgPool,
    window: Duration,
}

impl PgKeys {
    pub fn new(pool: PgPool, window: Duration) -> Self {
        Self { pool, window }
    }
}

#[async_trait]
impl KeyTable for PgKeys {
    async fn get(&self, key: &str) -> Result<Option<Used>, KeyTableError> {
        let row = sqlx::query(
            "SELECT request, id, fence::text FROM provider_keys
             WHERE key = $1 AND expires_at > statement_timestamp()",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| read_used(&row)).transpose()?)
    }

    async fn insert(
        &self,
        key: &str,
        used: &Used,
        effect: Effect,
    ) -> Result<Result<Option<Used>, ProviderError>, KeyTableError> {
        let window = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
        let mut tx = self.pool.begin().await?;
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
                let amount = *amount;
                return Ok(Err(ProviderError::AmountTooLarge { amount, refundable }));
            }
        }
        // A live row keeps its request and id, and takes the larger fence when it was used for
        // the same request (the update takes its lock, so two calls raise it in turn); an expired
        // one is taken over. The new id is unique: finding it in the row means this call won.
        let row = sqlx::query(
            "INSERT INTO provider_keys AS k (key, request, id, fence, expires_at)
             VALUES ($1, $2, $3, $5::numeric, statement_timestamp() + $4::int8 * interval '1 millisecond')
             ON CONFLICT (key) DO UPDATE SET
                 request = CASE WHEN k.expires_at > statement_timestamp()
                                THEN k.request ELSE excluded.request END,
                 id = CASE WHEN k.expires_at > statement_timestamp() THEN k.id ELSE excluded.id END,
                 fence = CASE WHEN k.expires_at <= statement_timestamp() THEN excluded.fence
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
                // Stamped when written, not when the statement began: a write held up by a lock
                // is listed among the later payments.
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
                .bind(payment.outcome.as_str())
                .bind(&payment.reference)
                .execute(&mut *tx)
                .await?;
            }
            Effect::Refund { payment, amount } => {
                sqlx::query("UPDATE provider_payments SET refunded = refunded + $2 WHERE id = $1")
                    .bind(&payment)
                    .bind(amount)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(Ok(None))
    }

    async fn payments_since(
        &self,
        since: u64,
        limit: usize,
    ) -> Result<Vec<PaymentRecord>, KeyTableError> {
        let rows = sqlx::query(
            "SELECT id, key, amount, refunded, source, capture, outcome, reference,
                    (extract(epoch FROM created_at) * 1000)::int8
             FROM provider_payments
             WHERE created_at >= to_timestamp($1::int8 / 1000.0)
             ORDER BY created_at, id LIMIT $2",
        )
        .bind(i64::try_from(since).unwrap_or(i64::MAX))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(read_payment).collect::<Result<_, _>>()?)
    }

    async fn sweep(&self) -> Result<u64, KeyTableError> {
        let deleted = sqlx::query(
            "DELETE FROM provider_keys WHERE key IN (
                 SELECT key FROM provider_keys WHERE expires_at <= statement_timestamp()
                 LIMIT $1 FOR UPDATE SKIP LOCKED)",
        )
        .bind(SWEEP_BATCH)
        .execute(&self.pool)
        .await?;
        Ok(deleted.rows_affected())
    }
}

/// A [`PaymentRecord`] from a row as [`PgKeys::payments_since`] reads it.
fn read_payment(row: &PgRow) -> Result<PaymentRecord, sqlx::Error> {
    let bad = |what: &str| sqlx::Error::Decode(format!("a provider payment's {what}").into());
    let source: String = row.try_get(4)?;
    let outcome: String = row.try_get(6)?;
    Ok(PaymentRecord {
        id: row.try_get(0)?,
        key: row.try_get(1)?,
        amount: row.try_get(2)?,
        refunded: row.try_get(3)?,
        source: Source::parse(&source).ok_or_else(|| bad("source"))?,
        capture: row.try_get(5)?,
        outcome: Outcome::parse(&outcome).ok_or_else(|| bad("outcome"))?,
        reference: row.try_get(7)?,
        created: u64::try_from(row.try_get::<i64, _>(8)?).unwrap_or(0),
    })
}

/// A [`Used`] from a row of `request, id, fence::text`.
fn read_used(row: &PgRow) -> Result<Used, sqlx::Error> {
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
