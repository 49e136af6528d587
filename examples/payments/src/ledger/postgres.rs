//! The charges in PostgreSQL's `charges` table (`pg/schema.sql`): what a query looks for in
//! columns (account, operation, status, when it changed), the charge itself as JSON.
//!
//! One charge per operation is the `UNIQUE (account, operation)` index, the last line of defence:
//! of two runs that both found nothing, one row goes in (`ON CONFLICT DO NOTHING`), the other
//! resumes it. Past the provider's window the old row gives its operation up (NULL, which the
//! index does not count). Every change locks its row (`FOR UPDATE`) and goes through the state
//! machine: of a resumed request and the reconciler, one moves it on.
//!
//! A request's final write and event commit in its [`PgTx`] with its idempotency record, or not
//! at all once another run took the claim: these rows need no fence. (With the records in Redis,
//! they commit alone, guarded by the state they are written over.)

use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use tower_idempotency_postgres::{PgTx, PgTxError};

use super::{Change, Charge, EventOf, Ledger, Result, millis};
use crate::auth::Account;
use crate::error::ApiError;
use crate::events::PaymentEvent;
use crate::outbox;
use crate::pg::unavailable;

/// `$n` milliseconds ago, in SQL.
fn ago(n: u8) -> String {
    format!("statement_timestamp() - ${n}::int8 * interval '1 millisecond'")
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(millis(duration)).unwrap_or(i64::MAX)
}

/// The charges in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    /// How long a retry finds its charge by its operation: the provider's window.
    window: Duration,
}

impl PgLedger {
    /// The charges of `pool`'s database; a retry finds its charge for `window`.
    pub fn new(pool: PgPool, window: Duration) -> Self {
        Self { pool, window }
    }

    /// The charges `query` (`SELECT charge, seq FROM charges ...`) finds.
    async fn select(&self, query: Query<'_, Postgres, PgArguments>) -> Result<Vec<Charge>> {
        let rows = query.fetch_all(&self.pool).await.map_err(unavailable)?;
        rows.iter().map(read).collect()
    }
}

/// Where a request's final write goes: its [`PgTx`], or, with the records elsewhere (Redis), a
/// transaction of the ledger's own, committed at once.
enum Work {
    Request(PgTx),
    Own(sqlx::Transaction<'static, sqlx::Postgres>),
}

impl Work {
    async fn begin(pool: &PgPool, request: &Extensions) -> Result<Self> {
        match PgTx::from_extensions(request).await {
            Ok(tx) => Ok(Work::Request(tx)),
            Err(PgTxError::NotClaimed) => Ok(Work::Own(pool.begin().await.map_err(unavailable)?)),
            Err(err) => {
                tracing::warn!(error = %crate::report(&err), "no transaction for the request");
                Err(ApiError::storage_unavailable())
            }
        }
    }

    fn conn(&mut self) -> &mut PgConnection {
        match self {
            Work::Request(tx) => tx,
            Work::Own(tx) => tx,
        }
    }

    /// Commits a transaction of the ledger's own; the request's commits with its record.
    async fn finish(self) -> Result<()> {
        match self {
            Work::Request(_) => Ok(()),
            Work::Own(tx) => tx.commit().await.map_err(unavailable),
        }
    }
}

/// Writes `charge` over its row, with its event, in the transaction `tx`.
async fn write(tx: &mut PgConnection, charge: &Charge, event: Option<PaymentEvent>) -> Result<()> {
    sqlx::query(
        "UPDATE charges SET status = $2, charge = $3, call_key = $4, reconciling = $5,
                            updated_at = statement_timestamp()
         WHERE id = $1",
    )
    .bind(&charge.id)
    .bind(charge.status.as_str())
    .bind(json(charge)?)
    .bind(&charge.call_key)
    .bind(charge.reconciling)
    .execute(&mut *tx)
    .await
    .map_err(unavailable)?;
    if let Some(event) = event {
        outbox::insert(tx, &event).await.map_err(unavailable)?;
    }
    Ok(())
}

#[async_trait]
impl Ledger for PgLedger {
    async fn find(&self, account: &Account, provider_key: &str) -> Result<Option<Charge>> {
        let sql = format!(
            "SELECT charge, seq FROM charges
             WHERE account = $1 AND operation = $2 AND opened_at > {}",
            ago(3)
        );
        let query = sqlx::query(&sql).bind(account.id()).bind(provider_key);
        Ok(self.select(query.bind(ms(self.window))).await?.pop())
    }

    async fn insert(&self, mut charge: Charge) -> Result<Option<Charge>> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let release = format!(
            "UPDATE charges SET operation = NULL
             WHERE account = $1 AND operation = $2 AND opened_at <= {}",
            ago(3)
        );
        (sqlx::query(&release).bind(charge.account.id()))
            .bind(&charge.provider_key)
            .bind(ms(self.window))
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        let seq: Option<i64> = sqlx::query_scalar(
            "INSERT INTO charges (id, account, operation, status, charge)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (account, operation) DO NOTHING
             RETURNING seq",
        )
        .bind(&charge.id)
        .bind(charge.account.id())
        .bind(&charge.provider_key)
        .bind(charge.status.as_str())
        .bind(json(&charge)?)
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(seq.map(|seq| {
            charge.seq = u64::try_from(seq).unwrap_or(0);
            charge
        }))
    }

    async fn abandon(&self, charge: &Charge) -> bool {
        let deleted = sqlx::query(
            "DELETE FROM charges WHERE id = $1 AND status = 'authorizing'
                                   AND reconciling = $2",
        )
        .bind(&charge.id)
        .bind(charge.reconciling)
        .execute(&self.pool)
        .await;
        match deleted {
            Ok(deleted) => deleted.rows_affected() == 1,
            Err(err) => {
                // Kept: the reconciler finds it and asks the provider, whose answer may differ
                // by then (the refusal was transient), so nothing is said of it to the client.
                tracing::warn!(charge = %charge.id, error = %crate::report(&err), "cannot remove a charge the provider did not make");
                false
            }
        }
    }

    async fn get(&self, account: &Account, id: &str) -> Result<Charge> {
        let sql = "SELECT charge, seq FROM charges WHERE id = $1 AND account = $2";
        let mut found = self
            .select(sqlx::query(sql).bind(id).bind(account.id()))
            .await?;
        found.pop().ok_or_else(|| ApiError::no_such_charge(id))
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>> {
        let sql = "SELECT charge, seq FROM charges WHERE account = $1 ORDER BY seq DESC";
        self.select(sqlx::query(sql).bind(account.id())).await
    }

    async fn settle(
        &self,
        request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge> {
        let mut work = Work::begin(&self.pool, request).await?;
        let sql = "SELECT charge, seq FROM charges WHERE id = $1 AND account = $2 FOR UPDATE";
        let row = (sqlx::query(sql).bind(id).bind(account.id()))
            .fetch_optional(work.conn())
            .await
            .map_err(unavailable)?;
        let mut charge = read(&row.ok_or_else(|| ApiError::no_such_charge(id))?)?;
        change(&mut charge)?;
        write(work.conn(), &charge, event(&charge)).await?;
        work.finish().await?;
        Ok(charge)
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>> {
        let sql = format!(
            "SELECT charge, seq FROM charges
             WHERE status IN ('authorizing', 'capturing', 'refunding', 'canceling')
               AND updated_at < {}
             ORDER BY updated_at LIMIT $2",
            ago(1)
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.select(sqlx::query(&sql).bind(ms(after)).bind(limit))
            .await
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        unchanged_for: Duration,
    ) -> Result<bool> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let unchanged = sqlx::query(&format!(
            "SELECT FROM charges
             WHERE id = $1 AND status = $2 AND call_key = $3
               AND updated_at <= {}
             FOR UPDATE",
            ago(4)
        ))
        .bind(&found.id)
        .bind(found.status.as_str())
        .bind(&found.call_key)
        .bind(ms(unchanged_for))
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        if unchanged.is_none() {
            // A resumed request got there first.
            return Ok(false);
        }
        write(&mut tx, settled, event).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(true)
    }
}

/// A charge as its row's `charge` column holds it.
fn json(charge: &Charge) -> Result<String> {
    serde_json::to_string(charge).map_err(|err| {
        tracing::error!(%err, "cannot encode a charge");
        ApiError::storage_unavailable()
    })
}

/// A charge from a row of `charge, seq`.
fn read(row: &PgRow) -> Result<Charge> {
    let charge: String = row.try_get("charge").map_err(unavailable)?;
    let mut charge: Charge = serde_json::from_str(&charge).map_err(|err| {
        tracing::error!(%err, "a charge that does not decode");
        ApiError::storage_unavailable()
    })?;
    charge.seq = u64::try_from(row.try_get::<i64, _>("seq").map_err(unavailable)?).unwrap_or(0);
    Ok(charge)
}
