//! The charges in PostgreSQL's `charges` table (`pg/schema.sql`): what a query looks for in
//! columns of their own (the account, the operation, the status, when it changed), the rest of
//! the charge as JSON beside them.
//!
//! A new charge's `authorizing` row is committed before the provider is called; its retry finds
//! it by the operation and resumes it. One charge per operation is the `UNIQUE (account,
//! operation)` index: two runs of one request that both found nothing both insert, one row goes
//! in (`ON CONFLICT DO NOTHING`), and the other run finds and resumes it. After the provider's
//! window the old row gives its operation up (`operation` set to NULL, which the index does not
//! count) before the new row goes in. Every change locks its row (`FOR UPDATE`) and goes through
//! the state machine, so of a resumed request and the reconciler exactly one moves it on.
//!
//! The final writes and their events go through the request's [`PgTx`], which commits with the
//! idempotency record only while the claim is still the request's: a displaced run's whole
//! transaction rolls back, so these rows need no fence. (With the records in Redis, they commit
//! on their own, guarded by the state they are written over.)

use std::time::Duration;

use async_trait::async_trait;
use axum::http::Extensions;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use tower_idempotency_postgres::{PgTx, PgTxError};

use super::{Change, Charge, EventOf, Ledger};
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
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
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

    /// The charges `sql` selects (`SELECT charge, seq FROM charges ...`), bound to `binds`.
    async fn select(&self, sql: &str, binds: &[&str]) -> Result<Vec<Charge>, ApiError> {
        let mut query = sqlx::query(sql);
        for bind in binds {
            query = query.bind(*bind);
        }
        let rows = query.fetch_all(&self.pool).await.map_err(unavailable)?;
        rows.iter().map(read).collect()
    }
}

/// Where a request's final write goes: the request's transaction, which commits with its
/// idempotency record ([`PgTx`]), or, when the records are kept elsewhere (Redis), a transaction
/// of the ledger's own, committed at once.
enum Work {
    Request(PgTx),
    Own(sqlx::Transaction<'static, sqlx::Postgres>),
}

impl Work {
    async fn begin(pool: &PgPool, request: &Extensions) -> Result<Self, ApiError> {
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
    async fn finish(self) -> Result<(), ApiError> {
        match self {
            Work::Request(_) => Ok(()),
            Work::Own(tx) => tx.commit().await.map_err(unavailable),
        }
    }
}

/// Writes `charge` over its row, with its event, in the transaction of `conn`.
async fn write(
    conn: &mut PgConnection,
    charge: &Charge,
    event: Option<PaymentEvent>,
) -> Result<(), ApiError> {
    sqlx::query(
        "UPDATE charges SET status = $2, charge = $3, updated_at = statement_timestamp()
         WHERE id = $1",
    )
    .bind(&charge.id)
    .bind(charge.status.as_str())
    .bind(json(charge)?)
    .execute(&mut *conn)
    .await
    .map_err(unavailable)?;
    if let Some(event) = event {
        outbox::insert(conn, &event).await.map_err(unavailable)?;
    }
    Ok(())
}

#[async_trait]
impl Ledger for PgLedger {
    async fn find(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<Option<Charge>, ApiError> {
        let sql = format!(
            "SELECT charge, seq FROM charges
             WHERE account = $1 AND operation = $2 AND opened_at > {}",
            ago(3)
        );
        let row = (sqlx::query(&sql).bind(account.id()).bind(provider_key))
            .bind(ms(self.window))
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.as_ref().map(read).transpose()
    }

    async fn insert(&self, mut charge: Charge) -> Result<Option<Charge>, ApiError> {
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
                                   AND (charge::jsonb ->> 'reconciling')::boolean = $2",
        )
        .bind(&charge.id)
        .bind(charge.reconciling)
        .execute(&self.pool)
        .await;
        match deleted {
            Ok(deleted) => deleted.rows_affected() == 1,
            Err(err) => {
                // The reconciler finds it, and asks the provider.
                tracing::warn!(charge = %charge.id, error = %crate::report(&err), "cannot remove a charge the provider did not make");
                true
            }
        }
    }

    async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        let sql = "SELECT charge, seq FROM charges WHERE id = $1 AND account = $2";
        let found = self.select(sql, &[id, account.id()]).await?;
        found
            .into_iter()
            .next()
            .ok_or_else(|| ApiError::no_such_charge(id))
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        let sql = "SELECT charge, seq FROM charges WHERE account = $1 ORDER BY seq DESC";
        self.select(sql, &[account.id()]).await
    }

    async fn settle(
        &self,
        request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let mut work = Work::begin(&self.pool, request).await?;
        let row = sqlx::query(
            "SELECT charge, seq FROM charges WHERE id = $1 AND account = $2 FOR UPDATE",
        )
        .bind(id)
        .bind(account.id())
        .fetch_optional(work.conn())
        .await
        .map_err(unavailable)?
        .ok_or_else(|| ApiError::no_such_charge(id))?;
        let mut charge = read(&row)?;
        change(&mut charge)?;
        write(work.conn(), &charge, event(&charge)).await?;
        work.finish().await?;
        Ok(charge)
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let rows = sqlx::query(&format!(
            "SELECT charge, seq FROM charges
             WHERE status IN ('authorizing', 'capturing', 'refunding', 'canceling')
               AND updated_at < {}
             ORDER BY updated_at LIMIT $2",
            ago(1)
        ))
        .bind(ms(after))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        rows.iter().map(read).collect()
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        unchanged_for: Duration,
    ) -> Result<bool, ApiError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let unchanged = sqlx::query(&format!(
            "SELECT FROM charges
             WHERE id = $1 AND status = $2 AND charge::jsonb ->> 'call_key' = $3
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
fn json(charge: &Charge) -> Result<String, ApiError> {
    serde_json::to_string(charge).map_err(|err| {
        tracing::error!(%err, "cannot encode a charge");
        ApiError::storage_unavailable()
    })
}

/// A charge from a row of `charge, seq`.
fn read(row: &PgRow) -> Result<Charge, ApiError> {
    let charge: String = row.try_get("charge").map_err(unavailable)?;
    let mut charge: Charge = serde_json::from_str(&charge).map_err(|err| {
        tracing::error!(%err, "a charge that does not decode");
        ApiError::storage_unavailable()
    })?;
    charge.seq = u64::try_from(row.try_get::<i64, _>("seq").map_err(unavailable)?).unwrap_or(0);
    Ok(charge)
}
