//! The charges in PostgreSQL's `charges` table (`pg/schema.sql`).
//!
//! A new charge's `authorizing` row is committed before the provider is called; its retry finds
//! it by the provider's key and resumes it. The provider's answer is written only over an
//! `authorizing` row, so that of a resumed request and the reconciler exactly one moves it on.
//! One charge per operation is the `UNIQUE (account, operation)` index: two runs of one request
//! that both found nothing both insert, one row goes in (`ON CONFLICT DO NOTHING`), and the other
//! run finds and resumes it. After the provider's window the old row gives its operation up
//! (`operation` set to NULL, which the index does not count) before the new row goes in.
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

use super::{Change, Charge, EventOf, Ledger, NewCharge, Opened};
use crate::auth::Account;
use crate::error::ApiError;
use crate::events::PaymentEvent;
use crate::outbox;
use crate::pg::unavailable;
use crate::provider::{ProviderError, Source};
use crate::state_machine::{Event, Status};

/// The columns [`read`] reads.
const COLUMNS: &str = "id, account, amount, currency, description, metadata, source, capture, \
                       status, amount_refunded, created, provider_key, payment, call_key, \
                       call_amount, call_started, refunds, capture_key, reconciling, seq";

/// `$n` milliseconds ago, in SQL.
const AGO: &str = "statement_timestamp() - $N::int8 * interval '1 millisecond'";

/// The charges in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    /// How long a retry finds its charge by its key: the provider's window.
    window: Duration,
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn ago(n: u8) -> String {
    AGO.replace("$N", &format!("${n}"))
}

impl PgLedger {
    /// The charges of `pool`'s database; a retry finds its charge for `window`.
    pub fn new(pool: PgPool, window: Duration) -> Self {
        Self { pool, window }
    }

    /// The charge that holds the account's operation, within the window.
    async fn find(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<Option<Charge>, ApiError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE account = $1 AND operation = $2 AND opened_at > {}",
            ago(3)
        ))
        .bind(account.id())
        .bind(provider_key)
        .bind(ms(self.window))
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        row.as_ref().map(read).transpose().map_err(unavailable)
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

/// Changes the account's charge `id` in the transaction of `conn`, row locked.
async fn change(
    conn: &mut PgConnection,
    account: &Account,
    id: &str,
    change: Change<'_>,
) -> Result<Charge, ApiError> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM charges WHERE id = $1 AND account = $2 FOR UPDATE"
    ))
    .bind(id)
    .bind(account.id())
    .fetch_optional(&mut *conn)
    .await
    .map_err(unavailable)?
    .ok_or_else(|| ApiError::no_such_charge(id))?;
    let mut charge = read(&row).map_err(unavailable)?;
    change(&mut charge)?;
    sqlx::query(
        "UPDATE charges SET status = $2, amount_refunded = $3, payment = $4, call_key = $5,
                            call_amount = $6, refunds = $7, reconciling = $8, call_started = $9,
                            capture_key = $10, updated_at = statement_timestamp()
         WHERE id = $1",
    )
    .bind(&charge.id)
    .bind(charge.status.as_str())
    .bind(charge.amount_refunded)
    .bind(&charge.payment)
    .bind(&charge.call_key)
    .bind(charge.call_amount)
    .bind(refunds_json(&charge)?)
    .bind(charge.reconciling)
    .bind(i64::try_from(charge.call_started).unwrap_or(i64::MAX))
    .bind(&charge.capture_key)
    .execute(&mut *conn)
    .await
    .map_err(unavailable)?;
    Ok(charge)
}

/// Adds `event`, if any, to the outbox in the transaction of `conn`.
async fn publish(conn: &mut PgConnection, event: Option<PaymentEvent>) -> Result<(), ApiError> {
    match event {
        Some(event) => outbox::insert(conn, &event).await.map_err(unavailable),
        None => Ok(()),
    }
}

#[async_trait]
impl Ledger for PgLedger {
    async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened, ApiError> {
        // A few times at most: the charge found may be settled, taken over or abandoned between
        // the read and the touch, and another run may insert the operation's charge between the
        // read and ours.
        for _ in 0..3 {
            if let Some(earlier) = self.find(account, provider_key).await? {
                if !earlier.is_for(request) {
                    return Err(ApiError::idempotency_key_reused());
                }
                if earlier.status != Status::Authorizing {
                    return Ok(Opened::Settled(earlier));
                }
                if earlier.reconciling {
                    // The reconciler sends its create again: the outcome is its to learn.
                    return Err(ProviderError::Unknown.into());
                }
                // Touched: the reconciler leaves a recent charge alone.
                let touched = sqlx::query(
                    "UPDATE charges SET updated_at = statement_timestamp()
                     WHERE id = $1 AND status = 'authorizing' AND NOT reconciling",
                )
                .bind(&earlier.id)
                .execute(&self.pool)
                .await
                .map_err(unavailable)?;
                if touched.rows_affected() == 1 {
                    tracing::info!(charge = %earlier.id, "resuming a charge an earlier attempt left authorizing");
                    return Ok(Opened::Authorizing(earlier));
                }
                continue;
            }
            let mut charge = Charge::new(account.clone(), request, provider_key);
            charge.apply(Event::Authorize)?;
            let mut tx = self.pool.begin().await.map_err(unavailable)?;
            sqlx::query(&format!(
                "UPDATE charges SET operation = NULL
                 WHERE account = $1 AND operation = $2 AND opened_at <= {}",
                ago(3)
            ))
            .bind(account.id())
            .bind(provider_key)
            .bind(ms(self.window))
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
            let inserted = insert(&mut *tx, &charge).await.map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
            if let Some(seq) = inserted {
                charge.seq = seq;
                return Ok(Opened::Authorizing(charge));
            }
        }
        tracing::warn!("the charge's operation changed hands too often; giving up for now");
        Err(ApiError::storage_unavailable())
    }

    async fn abandon(&self, charge: &Charge) -> bool {
        let deleted = sqlx::query(
            "DELETE FROM charges WHERE id = $1 AND status = 'authorizing' AND reconciling = $2",
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

    async fn record(
        &self,
        request: &Extensions,
        charge: Charge,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let mut work = Work::begin(&self.pool, request).await?;
        let tx = work.conn();
        let updated = sqlx::query(&format!(
            "UPDATE charges SET status = $2, payment = $3, updated_at = statement_timestamp()
             WHERE id = $1 AND status = 'authorizing'
             RETURNING {COLUMNS}"
        ))
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(&charge.payment)
        .fetch_optional(&mut *tx)
        .await
        .map_err(unavailable)?;
        let recorded = match updated {
            Some(row) => read(&row).map_err(unavailable)?,
            // Settled by the reconciler meanwhile: that is the charge. (Gone only if the provider
            // refused its create: no answer to record.)
            None => {
                let settled = sqlx::query(&format!("SELECT {COLUMNS} FROM charges WHERE id = $1"))
                    .bind(&charge.id)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(unavailable)?
                    .ok_or_else(|| ApiError::no_such_charge(&charge.id))?;
                read(&settled).map_err(unavailable)?
            }
        };
        publish(tx, event(&recorded)).await?;
        work.finish().await?;
        Ok(recorded)
    }

    async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges WHERE id = $1 AND account = $2"
        ))
        .bind(id)
        .bind(account.id())
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?
        .ok_or_else(|| ApiError::no_such_charge(id))?;
        read(&row).map_err(unavailable)
    }

    async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges WHERE account = $1 ORDER BY seq DESC"
        ))
        .bind(account.id())
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?;
        rows.iter()
            .map(read)
            .collect::<Result<_, _>>()
            .map_err(unavailable)
    }

    async fn update(
        &self,
        account: &Account,
        id: &str,
        change_with: Change<'_>,
    ) -> Result<Charge, ApiError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let charge = change(&mut tx, account, id, change_with).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(charge)
    }

    async fn settle(
        &self,
        request: &Extensions,
        account: &Account,
        id: &str,
        change_with: Change<'_>,
        event: EventOf<'_>,
    ) -> Result<Charge, ApiError> {
        let mut work = Work::begin(&self.pool, request).await?;
        let charge = change(work.conn(), account, id, change_with).await?;
        publish(work.conn(), event(&charge)).await?;
        work.finish().await?;
        Ok(charge)
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> Result<Vec<Charge>, ApiError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
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
        rows.iter()
            .map(read)
            .collect::<Result<_, _>>()
            .map_err(unavailable)
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        unchanged_for: Duration,
    ) -> Result<bool, ApiError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let updated = sqlx::query(&format!(
            "UPDATE charges SET status = $2, payment = $3, amount_refunded = $4, call_key = $7,
                                call_amount = $8, refunds = $10, reconciling = $11,
                                call_started = $12, capture_key = $13,
                                updated_at = statement_timestamp()
             WHERE id = $1 AND status = $5 AND call_key = $6 AND updated_at <= {}",
            ago(9)
        ))
        .bind(&settled.id)
        .bind(settled.status.as_str())
        .bind(&settled.payment)
        .bind(settled.amount_refunded)
        .bind(found.status.as_str())
        .bind(&found.call_key)
        .bind(&settled.call_key)
        .bind(settled.call_amount)
        .bind(ms(unchanged_for))
        .bind(refunds_json(settled)?)
        .bind(settled.reconciling)
        .bind(i64::try_from(settled.call_started).unwrap_or(i64::MAX))
        .bind(&settled.capture_key)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
        if updated.rows_affected() == 0 {
            // A resumed request got there first.
            return Ok(false);
        }
        publish(&mut tx, event).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(true)
    }
}

/// Inserts `charge`, holding its operation; its `seq`, or `None` when the operation has a charge
/// (nothing is inserted).
async fn insert<'c>(
    conn: impl sqlx::PgExecutor<'c>,
    charge: &Charge,
) -> Result<Option<u64>, sqlx::Error> {
    let row = sqlx::query(
        "INSERT INTO charges (id, account, provider_key, operation, amount, currency, description,
                              metadata, source, capture, status, amount_refunded, payment, created)
         VALUES ($1, $2, $3, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         ON CONFLICT (account, operation) DO NOTHING
         RETURNING seq",
    )
    .bind(&charge.id)
    .bind(charge.account.id())
    .bind(&charge.provider_key)
    .bind(charge.amount)
    .bind(&charge.currency)
    .bind(&charge.description)
    // As JSON text: the metadata is only ever read back whole.
    .bind(serde_json::to_string(&charge.metadata).unwrap_or_else(|_| String::from("{}")))
    .bind(charge.source.token())
    .bind(charge.capture)
    .bind(charge.status.as_str())
    .bind(charge.amount_refunded)
    .bind(&charge.payment)
    .bind(i64::try_from(charge.created).unwrap_or(i64::MAX))
    .fetch_optional(conn)
    .await?;
    row.map(|row| {
        row.try_get::<i64, _>(0)
            .map(|seq| u64::try_from(seq).unwrap_or(0))
    })
    .transpose()
}

/// A charge's refunds, as the `refunds` column holds them (JSON).
fn refunds_json(charge: &Charge) -> Result<String, ApiError> {
    serde_json::to_string(&charge.refunds).map_err(|err| {
        tracing::error!(%err, "cannot encode a charge's refunds");
        ApiError::storage_unavailable()
    })
}

/// A charge from a row of [`COLUMNS`].
fn read(row: &PgRow) -> Result<Charge, sqlx::Error> {
    let bad = |what: &str, value: &str| {
        sqlx::Error::Decode(format!("a charge with the unknown {what} {value:?}").into())
    };
    let source: String = row.try_get("source")?;
    let status: String = row.try_get("status")?;
    let metadata: String = row.try_get("metadata")?;
    let metadata = serde_json::from_str(&metadata)
        .map_err(|err| sqlx::Error::Decode(format!("a charge's metadata: {err}").into()))?;
    let refunds: String = row.try_get("refunds")?;
    let refunds = serde_json::from_str(&refunds)
        .map_err(|err| sqlx::Error::Decode(format!("a charge's refunds: {err}").into()))?;
    Ok(Charge {
        id: row.try_get("id")?,
        account: Account::from_id(row.try_get("account")?),
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        description: row.try_get("description")?,
        metadata,
        source: Source::parse(&source).ok_or_else(|| bad("source", &source))?,
        capture: row.try_get("capture")?,
        status: Status::parse(&status).ok_or_else(|| bad("status", &status))?,
        amount_refunded: row.try_get("amount_refunded")?,
        created: u64::try_from(row.try_get::<i64, _>("created")?).unwrap_or(0),
        provider_key: row.try_get("provider_key")?,
        payment: row.try_get("payment")?,
        call_key: row.try_get("call_key")?,
        call_amount: row.try_get("call_amount")?,
        call_started: u64::try_from(row.try_get::<i64, _>("call_started")?).unwrap_or(0),
        refunds,
        capture_key: row.try_get("capture_key")?,
        reconciling: row.try_get("reconciling")?,
        seq: u64::try_from(row.try_get::<i64, _>("seq")?).unwrap_or(0),
        updated: 0,
    })
}
