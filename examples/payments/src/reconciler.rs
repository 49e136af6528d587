//! The reconciler: settles the charges a process left in an intermediate state (`authorizing`,
//! `capturing`, `refunding`, `canceling`) when it died during the provider call and no retry came
//! to resume them.
//!
//! Every `every`, it takes the charges in one of those states for longer than `after` (a few lease
//! lengths of the idempotency layer, far above the longest provider call: a live request renews
//! its lease, and its provider call has long ended by then) and asks the provider, by the key of
//! the call in flight, what became of it: the charge's `provider_key` for a creation
//! ([`ProviderClient::find_payment`]), its `call_key` for a capture, a refund or a cancellation
//! ([`ProviderClient::find_call`]):
//!
//! - the provider made it: the charge moves to the state the answer says (a payment authorized,
//!   captured or declined; a capture, a refund in part or in full, a cancellation), with its event
//!   in the outbox, in one transaction, and only if it is still in the state and call it was found
//!   in (`UPDATE ... WHERE status = $state AND call_key = $key`): of two reconcilers, or a
//!   reconciler and a resumed request, exactly one moves it on. The event's id is the provider's
//!   payment or refund id, the one the request itself would have published: the ledger consumer
//!   applies the payment once, whoever published it;
//! - none: the call never reached the provider (or was refused), so nothing happened: a new charge
//!   goes (the state machine's `provider_did_nothing` back to `created`), and a charge in the
//!   middle of a capture, refund or cancellation goes back to the state before it. A later retry
//!   does it again;
//! - the provider unavailable: the charge waits for the next round.
//!
//! The reconciler never inserts a charge: it only moves the one row the operation has (`UNIQUE
//! (account, operation)`), so it can make neither a second charge nor a second event for one
//! payment.
//!
//! The provider remembers a key for its window (24 h): a charge must be reconciled within it.

use std::time::Duration;

use sqlx::{self, PgPool};
use tokio_util::sync::CancellationToken;

use super::super::events::PaymentEvent;
use super::super::ledger::Charge;
use super::super::provider::{Outcome, ProviderClient, ProviderError, Request};
use super::super::state_machine::{Event, Status};
use super::charges::{COLUMNS, read};
use super::outbox;

/// Charges looked at per round.
const BATCH: i64 = 100;

/// What a round of the reconciler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Charges moved to the provider's answer.
    pub settled: usize,
    /// Charges the provider knew nothing of: removed when new, rolled back to the state before
    /// the call otherwise.
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

    /// Settles the charges in an intermediate state for longer than `after`, now.
    pub async fn round(&self) -> Result<Reconciled, sqlx::Error> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM charges
             WHERE status IN ('authorizing', 'capturing', 'refunding', 'canceling')
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
            let found = self.ask(&charge).await;
            let changed = match found {
                Ok(Some(answer)) => {
                    let settled = self.settle(charge, answer).await?;
                    done.settled += usize::from(settled);
                    settled
                }
                Ok(None) => {
                    let removed = self.undo(charge).await?;
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

    /// What the provider did with the call `charge` waits on: `None` when it did nothing.
    async fn ask(&self, charge: &Charge) -> Result<Option<Answer>, ProviderError> {
        let provider = &self.provider;
        let payment = charge.payment.as_str();
        Ok(match charge.status {
            Status::Authorizing => provider
                .find_payment(
                    &charge.provider_key,
                    charge.source,
                    charge.amount,
                    charge.capture,
                )
                .await?
                .map(|payment| Answer::Payment(payment.id, payment.outcome)),
            Status::Capturing => provider
                .find_call(&charge.call_key, Request::Capture { payment })
                .await?
                .map(|_| Answer::Done(&[Event::Captured])),
            Status::Canceling => provider
                .find_call(&charge.call_key, Request::Cancel { payment })
                .await?
                .map(|_| Answer::Done(&[Event::Canceled])),
            Status::Refunding => {
                let amount = charge.call_amount;
                provider
                    .find_call(&charge.call_key, Request::Refund { payment, amount })
                    .await?
                    .map(Answer::Refund)
            }
            _ => None,
        })
    }

    /// Moves `charge` to the provider's `answer`, with its event, if it is still where it was
    /// found.
    async fn settle(&self, mut charge: Charge, answer: Answer) -> Result<bool, sqlx::Error> {
        let found = charge.status;
        let mut event = None;
        let moves: &[Event] = match &answer {
            Answer::Payment(payment, outcome) => {
                charge.payment.clone_from(payment);
                match outcome {
                    Outcome::Declined => &[Event::Declined],
                    Outcome::Authorized => &[Event::Approved],
                    Outcome::Captured => &[Event::Approved, Event::Capture, Event::Captured],
                }
            }
            Answer::Done(moves) => moves,
            Answer::Refund(_) => {
                charge.amount_refunded += charge.call_amount;
                if charge.refundable() == 0 {
                    &[Event::Refunded]
                } else {
                    &[Event::PartiallyRefunded]
                }
            }
        };
        for step in moves {
            if charge.apply(*step).is_err() {
                return Ok(false);
            }
        }
        match &answer {
            Answer::Payment(_, Outcome::Declined) => {}
            Answer::Payment(_, outcome) => {
                event = Some(PaymentEvent::succeeded(
                    &charge,
                    *outcome == Outcome::Captured,
                ));
            }
            Answer::Done(_) if charge.status == Status::Captured => {
                event = Some(PaymentEvent::captured(&charge));
            }
            Answer::Done(_) => {}
            Answer::Refund(refund) => {
                event = Some(PaymentEvent::refunded(&charge, refund, charge.call_amount));
            }
        }
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query(
            "UPDATE charges SET status = $2, payment = $3, amount_refunded = $4,
                                updated_at = statement_timestamp()
             WHERE id = $1 AND status = $5 AND call_key = $6",
        )
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(&charge.payment)
        .bind(charge.amount_refunded)
        .bind(found.as_str())
        .bind(&charge.call_key)
        .execute(&mut *tx)
        .await?;
        if updated.rows_affected() == 0 {
            // A resumed request got there first.
            return Ok(false);
        }
        if let Some(event) = &event {
            outbox::insert(&mut tx, event).await?;
        }
        tx.commit().await?;
        tracing::info!(charge = %charge.id, from = found.as_str(), status = charge.status.as_str(), "reconciled a charge from the provider's answer");
        Ok(true)
    }

    /// The provider never saw the call `charge` waits on: a new charge is removed, one in the
    /// middle of a capture, refund or cancellation goes back to where it was; unless a retry
    /// resumed it meanwhile.
    async fn undo(&self, mut charge: Charge) -> Result<bool, sqlx::Error> {
        let found = charge.status;
        if found == Status::Authorizing {
            return self.remove(&charge).await;
        }
        if charge.apply(Event::ProviderDidNothing).is_err() {
            return Ok(false);
        }
        let updated = sqlx::query(
            "UPDATE charges SET status = $2, call_key = '', call_amount = 0,
                                updated_at = statement_timestamp()
             WHERE id = $1 AND status = $3 AND call_key = $4
               AND updated_at < statement_timestamp() - $5::int8 * interval '1 millisecond'",
        )
        .bind(&charge.id)
        .bind(charge.status.as_str())
        .bind(found.as_str())
        .bind(&charge.call_key)
        .bind(self.after_ms())
        .execute(&self.pool)
        .await?;
        let undone = updated.rows_affected() == 1;
        if undone {
            tracing::info!(charge = %charge.id, from = found.as_str(), to = charge.status.as_str(), "rolled back a call the provider never saw");
        }
        Ok(undone)
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

/// What the provider did with a call a charge waits on.
enum Answer {
    /// A payment was made: its id and outcome.
    Payment(String, Outcome),
    /// The capture or cancellation was made: the charge's moves.
    Done(&'static [Event]),
    /// The refund was made: its id.
    Refund(String),
}
