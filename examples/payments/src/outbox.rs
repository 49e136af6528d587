//! The outbox: the at-least-once queue PostgreSQL users already have.
//!
//! A handler inserts its event into `payment_events` in the request's transaction
//! ([`insert`]), so the event commits with the change it reports and with the request's
//! idempotency record, or none of them does: no event is lost between the database and a queue,
//! and none is sent for a change that rolled back.
//!
//! The ledger consumer ([`OutboxConsumer`]) takes the oldest event with
//! `SELECT ... FOR UPDATE SKIP LOCKED` in a transaction, applies it to its balance in that
//! transaction ([`PgBalances::apply_in`]: the event id recorded as processed, then the balance
//! changed), deletes it and commits. Consumers on several instances each take another event
//! (`SKIP LOCKED`); a consumer that dies mid-event leaves nothing behind (its transaction rolls
//! back, its lock goes), and the next one takes the event at once. An event published twice (the
//! same id in two rows) is applied once: the second finds its id processed.
//!
//! | the event | what happens | taken off the outbox? |
//! |---|---|---|
//! | not processed before | applied: [`Handled::Applied`] | yes, in the same transaction |
//! | its id processed before | nothing: [`Handled::Duplicate`] | yes |
//! | the apply failed (the database, say) | rolled back: [`Handled::Failed`] | no: taken again |
//! | the apply can never succeed (the balance would overflow) | logged as an error: [`Handled::Rejected`] | yes |
//! | not an event | logged: [`Handled::Unreadable`] | yes |

use std::time::Duration;

use sqlx::{PgConnection, PgPool, Row};
use tokio_util::sync::CancellationToken;

use super::balance::{Applied, PgBalances};
use super::consumer::{Counts, Handled};
use super::events::PaymentEvent;

/// The longest pause after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Adds `event` to the outbox, in the transaction of `conn`.
pub async fn insert(conn: &mut PgConnection, event: &PaymentEvent) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO payment_events (event_id, payload) VALUES ($1, $2)")
        .bind(&event.id)
        .bind(event.to_json())
        .execute(conn)
        .await
        .map(drop)
}

/// One consumer of the outbox.
#[derive(Debug)]
pub struct OutboxConsumer {
    pool: PgPool,
    balances: PgBalances,
    /// How long to wait before looking again when the outbox is empty.
    poll: Duration,
}

impl OutboxConsumer {
    /// A consumer that applies the events of `pool`'s outbox to `balances`, and looks again
    /// every `poll` while the outbox is empty.
    pub fn new(pool: PgPool, balances: PgBalances, poll: Duration) -> Self {
        Self {
            pool,
            balances,
            poll,
        }
    }

    /// Takes events off the outbox until `stop` is cancelled; then finishes the event at hand and
    /// returns what it did.
    pub async fn run(self, stop: CancellationToken) -> Counts {
        tracing::info!("ledger consumer started (outbox)");
        let mut backoff = Duration::from_millis(100);
        let mut counts = Counts::default();
        while !stop.is_cancelled() {
            let pause = match self.next().await {
                Ok(Some(handled)) => {
                    counts.record(handled);
                    if handled != Handled::Failed {
                        backoff = Duration::from_millis(100);
                        continue;
                    }
                    backoff
                }
                Ok(None) => self.poll,
                Err(err) => {
                    tracing::warn!(error = %super::report(&err), ?backoff, "cannot take events off the outbox");
                    backoff
                }
            };
            if pause == backoff {
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        tracing::info!(?counts, "ledger consumer stopped");
        counts
    }

    /// Takes the oldest event no other consumer holds, applies it and deletes it, in one
    /// transaction; `None` when there is none.
    pub async fn next(&self) -> Result<Option<Handled>, sqlx::Error> {
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
            Ok(event) => match self.balances.apply_in(&mut tx, &event).await {
                Ok(Applied::New) => Handled::Applied,
                Ok(Applied::Already) => Handled::AlreadyApplied,
                Err(err) if err.is_permanent() => {
                    tracing::error!(event = %event.id, account = %event.account, error = %super::report(&err), "dropping an event the ledger refuses for good");
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
                Err(err) => {
                    tracing::warn!(event = %event.id, error = %super::report(&err), "applying the event failed; it will be retried");
                    tx.rollback().await?;
                    return Ok(Some(Handled::Failed));
                }
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
