//! The outbox in PostgreSQL: the at-least-once queue a PostgreSQL team already has, rather than a
//! broker whose write could not join the charge's transaction. A handler inserts its event
//! ([`insert`]) in the request's transaction, so it commits with the change it reports and the
//! request's idempotency record, or none does: no event is lost, none reports a rolled-back change.
//!
//! The consumer (`consumer.rs`, over [`PgOutbox`]) takes the oldest event `FOR UPDATE SKIP LOCKED`,
//! applies it in that transaction ([`PgBalances::apply_in`]: its id recorded as processed, then the
//! balance changed), deletes it and commits. Consumers on several instances take different events;
//! one that dies mid-event leaves nothing behind (its transaction rolls back), and the next takes
//! the event at once. An event published twice is applied once: the second finds its id processed.

use async_trait::async_trait;
use sqlx::{PgConnection, PgPool, Row};

use super::balance::PgBalances;
use super::consumer::{Handled, Outbox, OutboxError, handled};
use super::events::PaymentEvent;

/// Adds `event` to the outbox, in the transaction of `conn`.
pub async fn insert(conn: &mut PgConnection, event: &PaymentEvent) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO payment_events (event_id, payload) VALUES ($1, $2)")
        .bind(&event.id)
        .bind(event.to_json())
        .execute(conn)
        .await
        .map(drop)
}

/// The outbox table of `pool`, whose events go to `balances`.
#[derive(Debug)]
pub struct PgOutbox {
    pool: PgPool,
    balances: PgBalances,
}

#[async_trait]
impl Outbox for PgOutbox {
    async fn next(&self) -> Result<Option<Handled>, OutboxError> {
        Ok(self.take().await?)
    }
}

impl PgOutbox {
    pub fn new(pool: PgPool, balances: PgBalances) -> Self {
        Self { pool, balances }
    }

    /// Takes the oldest event no other consumer holds, applies it and deletes it, in one
    /// transaction; `None` when there is none.
    async fn take(&self) -> Result<Option<Handled>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT seq, payload FROM payment_events ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED",
        )
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.commit().await?;
            return Ok(None);
        };
        let seq: i64 = row.try_get(0)?;
        let payload: String = row.try_get(1)?;
        let handled = match serde_json::from_str::<PaymentEvent>(&payload) {
            Err(err) => {
                tracing::error!(seq, %err, "dropping an outbox row that is not an event");
                Handled::Unreadable
            }
            Ok(event) => match handled(&event, self.balances.apply_in(&mut tx, &event).await) {
                Handled::Rejected => {
                    // The failed statement aborted the transaction: drop the event in another.
                    tx.rollback().await?;
                    tx = self.pool.begin().await?;
                    let still_here = sqlx::query(
                        "SELECT FROM payment_events WHERE seq = $1 FOR UPDATE SKIP LOCKED",
                    )
                    .bind(seq)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if still_here.is_none() {
                        // Another consumer has it now.
                        return Ok(Some(Handled::InProgress));
                    }
                    Handled::Rejected
                }
                Handled::Failed => {
                    tx.rollback().await?;
                    return Ok(Some(Handled::Failed));
                }
                other => other,
            },
        };
        sqlx::query("DELETE FROM payment_events WHERE seq = $1")
            .bind(seq)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        tracing::debug!(seq, ?handled, "outbox event handled");
        Ok(Some(handled))
    }
}
