//! The charges in the `charges` table: the PostgreSQL backend of [`Ledger`](super::super::Ledger).
//!
//! A new charge gets its id and its `authorizing` row, committed, before the provider is called.
//! Its retry finds it by the provider's key (the same on every retry): still `authorizing` (the
//! first attempt crashed, and its claim's lease ran out), it is resumed, and the provider,
//! called with the same key, answers with the same payment; settled meanwhile (by the
//! reconciler), it is the answer. The provider's answer is written only over an `authorizing`
//! row (`UPDATE ... WHERE status = 'authorizing'`), so that of a resumed request and the
//! reconciler, exactly one moves the charge on.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_idempotency::store::sqlx::postgres::PgRow;
use tower_idempotency::store::sqlx::{self, PgConnection, PgPool, Row};

use super::super::auth::Account;
use super::super::error::ApiError;
use super::super::ledger::{Charge, NewCharge, Opened};
use super::super::provider::Source;
use super::super::state_machine::{Event, Status};
use super::unavailable;

/// The columns [`read`] reads, in its order.
pub(super) const COLUMNS: &str = "id, account, amount, currency, description, metadata, source, \
                                  capture, status, amount_refunded, created, provider_key, payment, seq";

/// The charges in PostgreSQL.
#[derive(Debug)]
pub struct PgCharges {
    pool: PgPool,
    /// How long a retry may find its charge by its key: the provider's window, after which the
    /// provider takes the key for a new payment too.
    window: Duration,
    ids: RandomState,
    next_id: AtomicU64,
}

impl PgCharges {
    /// The charges of `pool`'s database; a retry finds its charge for `window`.
    pub fn new(pool: PgPool, window: Duration) -> Self {
        Self {
            pool,
            window,
            ids: RandomState::new(),
            next_id: AtomicU64::new(0),
        }
    }

    /// See [`Ledger::open`](super::super::Ledger::open).
    pub async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> Result<Opened, ApiError> {
        // Twice at most: a charge the reconciler removed between the read and the touch is gone.
        for _ in 0..2 {
            let Some(earlier) = self.find(account, provider_key).await? else {
                break;
            };
            if !earlier.is_for(request) {
                return Err(ApiError::idempotency_key_reused());
            }
            if earlier.status != Status::Authorizing {
                return Ok(Opened::Settled(earlier));
            }
            // Resumed: the reconciler leaves a charge alone while it is recent.
            let touched = sqlx::query(
                "UPDATE charges SET updated_at = statement_timestamp()
                 WHERE id = $1 AND status = 'authorizing'",
            )
            .bind(&earlier.id)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
            if touched.rows_affected() == 1 {
                tracing::info!(charge = %earlier.id, "resuming a charge an earlier attempt left authorizing");
                return Ok(Opened::Authorizing(earlier));
            }
        }
        let mut charge = Charge::new(account.clone(), request, provider_key);
        charge.id = self.new_id();
        charge.apply(Event::Authorize)?;
        charge.seq = insert(&self.pool, &charge).await.map_err(unavailable)?;
        Ok(Opened::Authorizing(charge))
    }

    /// See [`Ledger::abandon`](super::super::Ledger::abandon): the state machine's
    /// `provider_did_nothing` takes an `authorizing` charge back to `created`, where a new charge
    /// has no row yet.
    pub async fn abandon(&self, charge: &Charge) {
        let deleted = sqlx::query("DELETE FROM charges WHERE id = $1 AND status = 'authorizing'")
            .bind(&charge.id)
            .execute(&self.pool)
            .await;
        if let Err(err) = deleted {
            // The reconciler will find it, and ask the provider.
            tracing::warn!(charge = %charge.id, error = %super::super::report(&err), "cannot remove a charge the provider did not make");
        }
    }

    /// See [`Ledger::record`](super::super::Ledger::record).
    pub async fn record(conn: &mut PgConnection, charge: Charge) -> Result<Charge, ApiError> {
        let updated = sqlx::query(&format!(
            "UPDATE charges SET status = $2, payment = $3, updated_at = statement_timestamp()
             WHERE id = $1 AND status = 'authorizing'
             RETURNING {COLUMNS}"
        ))
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(&charge.payment)
        .fetch_optional(&mut *conn)
        .await
        .map_err(unavailable)?;
        if let Some(row) = updated {
            return read(&row).map_err(unavailable);
        }
        // Settled by the reconciler meanwhile: that is the charge. Or removed by it, when the
        // provider answered this call only after the reconciler found nothing there: written
        // again, with the answer.
        let settled = select_by_id(&mut *conn, &charge.id)
            .await
            .map_err(unavailable)?;
        match settled {
            Some(settled) => Ok(settled),
            None => {
                let mut charge = charge;
                charge.seq = insert(&mut *conn, &charge).await.map_err(unavailable)?;
                Ok(charge)
            }
        }
    }

    /// See [`Ledger::get`](super::super::Ledger::get).
    pub async fn get(&self, account: &Account, id: &str) -> Result<Charge, ApiError> {
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

    /// See [`Ledger::list`](super::super::Ledger::list).
    pub async fn list(&self, account: &Account) -> Result<Vec<Charge>, ApiError> {
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

    /// See [`Ledger::update`](super::super::Ledger::update): in a transaction of its own.
    pub async fn update(
        &self,
        account: &Account,
        id: &str,
        change: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
    ) -> Result<Charge, ApiError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let charge = Self::settle(&mut tx, account, id, change).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(charge)
    }

    /// See [`Ledger::settle`](super::super::Ledger::settle): in the transaction of `conn`.
    pub async fn settle(
        conn: &mut PgConnection,
        account: &Account,
        id: &str,
        change: impl FnOnce(&mut Charge) -> Result<(), ApiError>,
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
            "UPDATE charges SET status = $2, amount_refunded = $3, payment = $4,
                                updated_at = statement_timestamp()
             WHERE id = $1",
        )
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(charge.amount_refunded)
        .bind(&charge.payment)
        .execute(&mut *conn)
        .await
        .map_err(unavailable)?;
        Ok(charge)
    }

    /// The newest charge of the account made with the provider's key, within the window.
    async fn find(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<Option<Charge>, ApiError> {
        let window = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE account = $1 AND provider_key = $2
               AND opened_at > statement_timestamp() - $3::int8 * interval '1 millisecond'
             ORDER BY seq DESC LIMIT 1"
        ))
        .bind(account.id())
        .bind(provider_key)
        .bind(window)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?;
        row.as_ref().map(read).transpose().map_err(unavailable)
    }

    /// A fresh id such as `ch_3f9a0c1b7e2d4a68`.
    fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("ch_{:016x}", self.ids.hash_one(n))
    }
}

/// Inserts `charge`; returns its `seq`.
async fn insert<'c>(conn: impl sqlx::PgExecutor<'c>, charge: &Charge) -> Result<u64, sqlx::Error> {
    let seq: i64 = sqlx::query(
        "INSERT INTO charges (id, account, provider_key, amount, currency, description, metadata,
                              source, capture, status, amount_refunded, payment, created)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
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
    .fetch_one(conn)
    .await?
    .try_get(0)?;
    Ok(u64::try_from(seq).unwrap_or(0))
}

/// The charge `id`, whatever its account, locked for the transaction.
pub(super) async fn select_by_id(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<Charge>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM charges WHERE id = $1 FOR UPDATE"
    ))
    .bind(id)
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(read).transpose()
}

/// A charge from a row of [`COLUMNS`].
pub(super) fn read(row: &PgRow) -> Result<Charge, sqlx::Error> {
    let bad = |what: &str, value: String| {
        sqlx::Error::Decode(format!("a charge with the unknown {what} {value:?}").into())
    };
    let source: String = row.try_get("source")?;
    let status: String = row.try_get("status")?;
    let created: i64 = row.try_get("created")?;
    let seq: i64 = row.try_get("seq")?;
    let metadata: String = row.try_get("metadata")?;
    let metadata = serde_json::from_str(&metadata)
        .map_err(|err| sqlx::Error::Decode(format!("a charge's metadata: {err}").into()))?;
    Ok(Charge {
        id: row.try_get("id")?,
        account: Account::from_id(row.try_get("account")?),
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        description: row.try_get("description")?,
        metadata,
        source: Source::parse(&source).ok_or_else(|| bad("source", source.clone()))?,
        capture: row.try_get("capture")?,
        status: Status::parse(&status).ok_or_else(|| bad("status", status.clone()))?,
        amount_refunded: row.try_get("amount_refunded")?,
        created: u64::try_from(created).unwrap_or(0),
        provider_key: row.try_get("provider_key")?,
        payment: row.try_get("payment")?,
        seq: u64::try_from(seq).unwrap_or(0),
    })
}
