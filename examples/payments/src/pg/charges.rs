//! The charges in the `charges` table: the PostgreSQL backend of [`Ledger`](super::super::Ledger).
//!
//! A new charge gets its id and its `authorizing` row, committed, before the provider is called.
//! Its retry finds it by the provider's key (the same on every retry): still `authorizing` (the
//! first attempt crashed, and its claim's lease ran out), it is resumed, and the provider,
//! called with the same key, answers with the same payment; settled meanwhile (by the
//! reconciler), it is the answer. The provider's answer is written only over an `authorizing`
//! row (`UPDATE ... WHERE status = 'authorizing'`), so that of a resumed request and the
//! reconciler, exactly one moves the charge on.
//!
//! One charge per operation is the database's to enforce, not the lock in front of it: the row
//! holds its operation (the account and the provider's key of its create call) in `operation`,
//! under `UNIQUE (account, operation)`. Two runs of one request that both found nothing (a lease
//! ran out under a stalled handler, and a retry took the key over) both try to insert: one row
//! goes in (`ON CONFLICT DO NOTHING`), and the other run finds it and resumes it. After the
//! provider's window the key is new again: the old row gives its operation up (`operation` set
//! to NULL, which the index does not count) in the statement before the new row's insert.
//!
//! The handlers need no fence for these rows' final writes: they go through the request's
//! [`PgTx`](tower_idempotency_postgres::PgTx), which commits with the idempotency record only while the
//! claim is still the request's, and rolls back whole for a run that was taken over. The
//! provider call is outside that transaction, so it carries the fence (`charges.rs`).

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{self, PgConnection, PgPool, Row};

use super::super::auth::Account;
use super::super::error::ApiError;
use super::super::events::PaymentEvent;
use super::super::ledger::{Charge, NewCharge, Opened};
use super::super::provider::Source;
use super::super::state_machine::{Event, Status};
use super::{outbox, unavailable};

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The columns [`read`] reads, in its order.
pub(super) const COLUMNS: &str = "id, account, amount, currency, description, metadata, source, \
                                  capture, status, amount_refunded, created, provider_key, payment, \
                                  call_key, call_amount, seq";

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
        // A few times at most: a charge the reconciler removed between the read and the touch is
        // gone, and another run may insert the operation's charge between the read and ours.
        for _ in 0..3 {
            if let Some(earlier) = self.find(account, provider_key).await? {
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
                continue;
            }
            let mut charge = Charge::new(account.clone(), request, provider_key);
            charge.id = self.new_id();
            charge.apply(Event::Authorize)?;
            let mut tx = self.pool.begin().await.map_err(unavailable)?;
            // A charge older than the window gives the operation up: the key is new again.
            sqlx::query(
                "UPDATE charges SET operation = NULL
                 WHERE account = $1 AND operation = $2
                   AND opened_at <= statement_timestamp() - $3::int8 * interval '1 millisecond'",
            )
            .bind(account.id())
            .bind(provider_key)
            .bind(self.window_ms())
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
            let inserted = insert(&mut *tx, &charge).await.map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
            if let Some(seq) = inserted {
                charge.seq = seq;
                return Ok(Opened::Authorizing(charge));
            }
            // Another run inserted the operation's charge first: find it.
        }
        tracing::warn!("the charge's operation changed hands too often; giving up for now");
        Err(ApiError::storage_unavailable())
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
        if let Some(settled) = settled {
            return Ok(settled);
        }
        let mut charge = charge;
        match insert(&mut *conn, &charge).await.map_err(unavailable)? {
            Some(seq) => {
                charge.seq = seq;
                Ok(charge)
            }
            // A new charge of the operation went in meanwhile: it is the operation's charge, and
            // its own run records it.
            None => Err(ApiError::superseded()),
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
                                call_key = $5, call_amount = $6,
                                updated_at = statement_timestamp()
             WHERE id = $1",
        )
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(charge.amount_refunded)
        .bind(&charge.payment)
        .bind(&charge.call_key)
        .bind(charge.call_amount)
        .execute(&mut *conn)
        .await
        .map_err(unavailable)?;
        Ok(charge)
    }

    /// See [`Ledger::has_operation`](super::super::Ledger::has_operation).
    pub async fn has_operation(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<bool, ApiError> {
        Ok(self.find(account, provider_key).await?.is_some())
    }

    /// See [`Ledger::unsettled`](super::super::Ledger::unsettled).
    pub async fn unsettled(
        &self,
        after: Duration,
        limit: usize,
    ) -> Result<Vec<Charge>, sqlx::Error> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE status IN ('authorizing', 'capturing', 'refunding', 'canceling')
               AND updated_at < statement_timestamp() - $1::int8 * interval '1 millisecond'
             ORDER BY updated_at LIMIT $2"
        ))
        .bind(millis(after))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(read).collect()
    }

    /// See [`Ledger::swap`](super::super::Ledger::swap): with `event` in the outbox, in one
    /// transaction, only if the charge is still in the state and call it was found in, and
    /// unchanged for `unchanged_for`.
    pub async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<&PaymentEvent>,
        unchanged_for: Duration,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query(
            "UPDATE charges SET status = $2, payment = $3, amount_refunded = $4,
                                call_key = $7, call_amount = $8,
                                updated_at = statement_timestamp()
             WHERE id = $1 AND status = $5 AND call_key = $6
               AND updated_at <= statement_timestamp() - $9::int8 * interval '1 millisecond'",
        )
        .bind(&settled.id)
        .bind(settled.status.as_str())
        .bind(&settled.payment)
        .bind(settled.amount_refunded)
        .bind(found.status.as_str())
        .bind(&found.call_key)
        .bind(&settled.call_key)
        .bind(settled.call_amount)
        .bind(millis(unchanged_for))
        .execute(&mut *tx)
        .await?;
        if updated.rows_affected() == 0 {
            // A resumed request got there first.
            return Ok(false);
        }
        if let Some(event) = event {
            outbox::insert(&mut tx, event).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// See [`Ledger::remove`](super::super::Ledger::remove): unless it changed within `after`
    /// (a retry resumed it).
    pub async fn remove(&self, found: &Charge, after: Duration) -> Result<bool, sqlx::Error> {
        let deleted = sqlx::query(
            "DELETE FROM charges
             WHERE id = $1 AND status = $2 AND call_key = $3
               AND updated_at < statement_timestamp() - $4::int8 * interval '1 millisecond'",
        )
        .bind(&found.id)
        .bind(found.status.as_str())
        .bind(&found.call_key)
        .bind(millis(after))
        .execute(&self.pool)
        .await?;
        Ok(deleted.rows_affected() == 1)
    }

    /// See [`Ledger::adopt`](super::super::Ledger::adopt): with `event` in the outbox, in one
    /// transaction.
    pub async fn adopt(
        &self,
        charge: &Charge,
        event: Option<&PaymentEvent>,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if insert(&mut *tx, charge).await?.is_none() {
            return Ok(false);
        }
        if let Some(event) = event {
            outbox::insert(&mut tx, event).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    fn window_ms(&self) -> i64 {
        i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX)
    }

    /// The charge that holds the account's operation with the provider's key, within the window.
    async fn find(
        &self,
        account: &Account,
        provider_key: &str,
    ) -> Result<Option<Charge>, ApiError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE account = $1 AND operation = $2
               AND opened_at > statement_timestamp() - $3::int8 * interval '1 millisecond'"
        ))
        .bind(account.id())
        .bind(provider_key)
        .bind(self.window_ms())
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

/// Inserts `charge`, holding its operation; returns its `seq`, or `None` when the operation
/// already has a charge (nothing is inserted).
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
    let Some(row) = row else {
        return Ok(None);
    };
    let seq: i64 = row.try_get(0)?;
    Ok(Some(u64::try_from(seq).unwrap_or(0)))
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
        call_key: row.try_get("call_key")?,
        call_amount: row.try_get("call_amount")?,
        seq: u64::try_from(seq).unwrap_or(0),
        updated: 0,
    })
}
