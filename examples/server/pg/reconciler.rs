//! The reconciler: settles the charges left `authorizing` by a process that died during the
//! provider call, when no retry came to resume them.
//!
//! Every `every`, it takes the charges `authorizing` for longer than `after` (a few lease lengths
//! of the idempotency layer, far above the longest provider call: a live request renews its
//! lease, and its provider call has long ended by then) and asks the provider, by the charge's
//! key, what became of the call (its lookup, [`ProviderClient::find_payment`]):
//!
//! - a payment: the charge moves to the state the payment says (authorized, captured, or failed
//!   for a declined card), with its event in the outbox, in one transaction, and only if it is
//!   still `authorizing` (`UPDATE ... WHERE status = 'authorizing'`): of two reconcilers, or a
//!   reconciler and a resumed request, exactly one moves it on, and exactly one event is written;
//! - none: the call never reached the provider (or was refused), so nothing happened: the charge
//!   goes (the state machine's `provider_did_nothing`), unless a retry resumed it meanwhile. A
//!   later retry makes it again;
//! - the provider unavailable: the charge waits for the next round.
//!
//! The provider remembers a key for its window (24 h): a charge must be reconciled within it.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tower_idempotency::store::sqlx::{self, PgPool};

use super::super::events::PaymentEvent;
use super::super::ledger::Charge;
use super::super::provider::{Outcome, ProviderClient};
use super::super::state_machine::Event;
use super::charges::{COLUMNS, read};
use super::outbox;

/// Charges looked at per round.
const BATCH: i64 = 100;

/// What a round of the reconciler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Charges moved to the provider's answer.
    pub settled: usize,
    /// Charges the provider knew nothing of, removed.
    pub removed: usize,
    /// Charges left for the next round (the provider unavailable, a retry on them meanwhile).
    pub left: usize,
}

/// The reconciler of one instance (several may run: they agree through the database).
#[derive(Debug, Clone)]
pub struct Reconciler {
    pool: PgPool,
    provider: ProviderClient,
    /// How long a charge stays `authorizing` before the reconciler settles it.
    after: Duration,
    /// How often it looks.
    every: Duration,
}

impl Reconciler {
    /// A reconciler of the charges in `pool`'s database, asking `provider`, for charges
    /// `authorizing` longer than `after`; it looks every quarter of `after` (at least every
    /// 50 ms, at most every 30 s).
    pub fn new(pool: PgPool, provider: ProviderClient, after: Duration) -> Self {
        Self {
            pool,
            provider,
            after,
            every: (after / 4).clamp(Duration::from_millis(50), Duration::from_secs(30)),
        }
    }

    /// Runs a round every `every` until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        tracing::info!(after = ?self.after, "reconciler started");
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(self.every) => {}
            }
            match self.round().await {
                Ok(Reconciled {
                    settled: 0,
                    removed: 0,
                    ..
                }) => {}
                Ok(done) => tracing::info!(?done, "reconciled charges left authorizing"),
                Err(err) => {
                    tracing::warn!(error = %super::super::report(&err), "reconciling failed; trying again next round");
                }
            }
        }
    }

    /// Settles the charges `authorizing` for longer than `after`, now.
    pub async fn round(&self) -> Result<Reconciled, sqlx::Error> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE status = 'authorizing'
               AND updated_at < statement_timestamp() - $1::int8 * interval '1 millisecond'
             ORDER BY updated_at LIMIT $2"
        ))
        .bind(self.after_ms())
        .bind(BATCH)
        .fetch_all(&self.pool)
        .await?;
        let mut done = Reconciled::default();
        for row in &rows {
            let charge = read(row)?;
            let found = self
                .provider
                .find_payment(
                    &charge.provider_key,
                    charge.source,
                    charge.amount,
                    charge.capture,
                )
                .await;
            let changed = match found {
                Ok(Some(payment)) => {
                    let settled = self.settle(charge, payment.id, payment.outcome).await?;
                    done.settled += usize::from(settled);
                    settled
                }
                Ok(None) => {
                    let removed = self.remove(&charge).await?;
                    done.removed += usize::from(removed);
                    removed
                }
                Err(err) => {
                    tracing::debug!(charge = %charge.id, %err, "the provider cannot tell yet");
                    false
                }
            };
            done.left += usize::from(!changed);
        }
        Ok(done)
    }

    /// Moves `charge` to the provider's answer, with its event, if it is still `authorizing`.
    async fn settle(
        &self,
        mut charge: Charge,
        payment: String,
        outcome: Outcome,
    ) -> Result<bool, sqlx::Error> {
        charge.payment = payment;
        let events: &[Event] = match outcome {
            Outcome::Declined => &[Event::Declined],
            Outcome::Authorized => &[Event::Approved],
            Outcome::Captured => &[Event::Approved, Event::Capture, Event::Captured],
        };
        for event in events {
            if charge.apply(*event).is_err() {
                return Ok(false);
            }
        }
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query(
            "UPDATE charges SET status = $2, payment = $3, updated_at = statement_timestamp()
             WHERE id = $1 AND status = 'authorizing'",
        )
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(&charge.payment)
        .execute(&mut *tx)
        .await?;
        if updated.rows_affected() == 0 {
            // A resumed request got there first.
            return Ok(false);
        }
        if outcome != Outcome::Declined {
            let event = PaymentEvent::succeeded(&charge, outcome == Outcome::Captured);
            outbox::insert(&mut tx, &event).await?;
        }
        tx.commit().await?;
        tracing::info!(charge = %charge.id, status = charge.status.as_str(), "reconciled a charge from the provider's answer");
        Ok(true)
    }

    /// Removes `charge`, which the provider never saw, unless a retry resumed it meanwhile.
    async fn remove(&self, charge: &Charge) -> Result<bool, sqlx::Error> {
        let deleted = sqlx::query(
            "DELETE FROM charges
             WHERE id = $1 AND status = 'authorizing'
               AND updated_at < statement_timestamp() - $2::int8 * interval '1 millisecond'",
        )
        .bind(&charge.id)
        .bind(self.after_ms())
        .execute(&self.pool)
        .await?;
        let removed = deleted.rows_affected() == 1;
        if removed {
            tracing::info!(charge = %charge.id, "removed a charge the provider never saw");
        }
        Ok(removed)
    }

    fn after_ms(&self) -> i64 {
        i64::try_from(self.after.as_millis()).unwrap_or(i64::MAX)
    }
}
