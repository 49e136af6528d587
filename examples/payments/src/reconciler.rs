//! The reconciler, beside every instance (they agree through the ledger: of two reconcilers, or
//! a reconciler and a resumed request, one moves a charge on).
//!
//! A call whose outcome is unknown (a timeout, a lost connection, a crash) leaves its charge in an
//! `-ing` state. Each round the reconciler takes those unchanged for longer than `after` (far
//! above the client's deadline: no live request's call is still running), marks each as its own
//! and drives the call again through the provider's API under the same key, as one settles an
//! unknown outcome with Stripe: the provider makes it once (now, or by answering what it made).
//! It does not roll back: a call held up at the provider could land after, money moved under a
//! charge that says otherwise.
//!
//! - made: the charge moves to the answer, with the event the request would have published (the
//!   same id: the consumer applies it once), if it is still as it was found;
//! - refused (a refund beyond what is left, a key reused): a new charge goes, one mid-call goes
//!   back to where it was;
//! - the provider unavailable, or its answer lost: the charge waits for the next round.
//!
//! Past the provider's key window, less a margin, a call sent again could be made twice: a create
//! is then found by its metadata, any other call is left for an operator, at ERROR.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::auth::Account;
use super::error::ApiError;
use super::events::PaymentEvent;
use super::ledger::{Charge, Ledger, millis};
use super::now_ms;
use super::provider::{Outcome, PaymentRecord, ProviderClient, ProviderError, WINDOW};
use super::state_machine::{Event, Status};

/// Charges looked at per round.
const BATCH: usize = 100;

/// The metadata fields of a payment that name its operation (its create's key) and account.
pub const OPERATION: &str = "operation";
pub const ACCOUNT: &str = "account";

/// The metadata the example gives a charge's payment, by which the reconciler finds it once the
/// provider has forgotten its key.
pub fn metadata(account: &Account, operation: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ACCOUNT.to_owned(), account.id().to_owned()),
        (OPERATION.to_owned(), operation.to_owned()),
    ])
}

/// What a round of the reconciler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Charges moved to the provider's answer.
    pub settled: usize,
    /// Charges whose call the provider did not make: removed when new, rolled back otherwise.
    pub removed: usize,
    /// Charges left for the next round (the provider unavailable, a retry on them meanwhile).
    pub left: usize,
}

/// The reconciler of one instance (several may run: they agree through the ledger).
#[derive(Debug, Clone)]
pub struct Reconciler {
    ledger: Arc<dyn Ledger>,
    provider: ProviderClient,
    /// How long a charge stays in an `-ing` state before the reconciler settles it.
    after: Duration,
    /// How often it looks.
    every: Duration,
}

impl Reconciler {
    /// A reconciler of `ledger` and `provider` for charges left in an `-ing` state for `after`; it
    /// looks every quarter of `after` (at least every 50 ms, at most every 30 s).
    pub fn new(ledger: Arc<dyn Ledger>, provider: ProviderClient, after: Duration) -> Self {
        Self {
            ledger,
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
                Ok(done) if done.settled + done.removed == 0 => {}
                Ok(done) => tracing::info!(?done, "reconciled charges with the provider"),
                Err(err) => tracing::warn!(?err, "reconciling failed; trying again next round"),
            }
        }
    }

    /// Settles the charges in an intermediate state for longer than `after`, now.
    pub async fn round(&self) -> Result<Reconciled, ApiError> {
        let charges = self.ledger.unsettled(self.after, BATCH).await?;
        let mut done = Reconciled::default();
        for charge in charges {
            // One charge the ledger fails on leaves the others to be settled.
            match self.reconcile(charge).await {
                Ok(Some(true)) => done.settled += 1,
                Ok(Some(false)) => done.removed += 1,
                Ok(None) => done.left += 1,
                Err((id, err)) => {
                    tracing::warn!(charge = %id, ?err, "cannot reconcile a charge; trying again next round");
                    done.left += 1;
                }
            }
        }
        Ok(done)
    }

    /// Settles one charge: `Some(true)` settled, `Some(false)` removed or rolled back, `None`
    /// left for the next round.
    async fn reconcile(&self, charge: Charge) -> Result<Option<bool>, (String, ApiError)> {
        let id = charge.id.clone();
        let failed = |err| (id.clone(), err);
        let Some(charge) = self.take_over(charge).await.map_err(failed)? else {
            // Changed since it was listed: a run of its request is on it.
            return Ok(None);
        };
        Ok(match self.ask(&charge).await {
            Ok(Some(answer)) => self
                .settle(&charge, &answer)
                .await
                .map_err(failed)?
                .then_some(true),
            Ok(None) => self.undo(&charge).await.map_err(failed)?.then_some(false),
            Err(err) => {
                tracing::debug!(charge = %charge.id, %err, "the provider cannot tell yet");
                None
            }
        })
    }

    /// Marks the call in flight as the reconciler's before sending it again, unless the charge
    /// changed since it was listed (`None`): a run of the request whose own call is refused then
    /// leaves the charge to it, not rolling back a call it may make, and a retry answers `504`.
    async fn take_over(&self, found: Charge) -> Result<Option<Charge>, ApiError> {
        if outlived_its_key(&found) && found.status != Status::Authorizing {
            // The provider may have forgotten the key: sent again, a call made would be made twice,
            // and one refused could be rolled back though it was made.
            tracing::error!(charge = %found.id, status = found.status.as_str(), "a call in flight past the provider's key window: settle it by hand from the provider's records");
            // Touched, to the back of the list, so such charges never fill a round's batch.
            let _ = self.ledger.swap(&found, &found, None, self.after).await?;
            return Ok(None);
        }
        if found.reconciling {
            return Ok(Some(found));
        }
        let mut marked = found.clone();
        marked.reconciling = true;
        if !self.ledger.swap(&found, &marked, None, self.after).await? {
            return Ok(None);
        }
        // As written (its time of change is the ledger's): what the next write compares.
        let now = self.ledger.get(&found.account, &found.id).await?;
        let same_call = now.status == found.status && now.call_key == found.call_key;
        Ok((now.reconciling && same_call).then_some(now))
    }

    /// What the provider did, or does now, with the call `charge` waits on, sent again under its
    /// key; `None` when refused. A create whose key may be forgotten is searched for by its
    /// metadata instead: not found 23 hours after it began, it was never made.
    async fn ask(&self, charge: &Charge) -> Result<Option<Answer>, ProviderError> {
        let provider = &self.provider;
        let payment = charge.payment.as_str();
        let (key, amount) = (charge.call_key.as_str(), charge.call_amount);
        let create = (charge.source, charge.amount, charge.capture);
        Ok(match charge.status {
            Status::Authorizing if !outlived_its_key(charge) => {
                let metadata = metadata(&charge.account, &charge.provider_key);
                let created = provider.create_payment(&charge.provider_key, create, metadata);
                made(created.await)?.map(|made| Answer::Payment(made.id, made.outcome))
            }
            Status::Authorizing => {
                let found = provider.search(OPERATION, &charge.provider_key).await?;
                // Made for this charge's request (a key reused for another request made none).
                let mine = |p: &PaymentRecord| {
                    p.metadata.get(ACCOUNT).map(String::as_str) == Some(charge.account.id())
                        && (p.amount, p.source, p.capture)
                            == (charge.amount, charge.source, charge.capture)
                };
                (found.into_iter().find(mine)).map(|p| Answer::Payment(p.id, p.outcome))
            }
            Status::Capturing => {
                made(provider.capture(key, payment).await)?.map(|()| Answer::Done(Event::Captured))
            }
            Status::Canceling => {
                made(provider.cancel(key, payment).await)?.map(|()| Answer::Done(Event::Canceled))
            }
            Status::Refunding => {
                made(provider.refund(key, payment, amount).await)?.map(Answer::Refund)
            }
            _ => None,
        })
    }

    /// Moves `found` to the provider's `answer`, with its event, if it is still as it was found.
    async fn settle(&self, found: &Charge, answer: &Answer) -> Result<bool, ApiError> {
        let mut charge = found.clone();
        let event = match answer {
            Answer::Payment(payment, outcome) => {
                charge.payment.clone_from(payment);
                let moves: &[Event] = match outcome {
                    Outcome::Declined => &[Event::Declined],
                    Outcome::Authorized => &[Event::Approved],
                    Outcome::Captured => &[Event::Approved, Event::Capture, Event::Captured],
                    Outcome::Canceled => &[Event::Approved, Event::Cancel, Event::Canceled],
                };
                let (made, captured) =
                    (*outcome != Outcome::Declined, *outcome == Outcome::Captured);
                (moves.iter().try_for_each(|step| charge.apply(*step)))
                    .map(|()| made.then(|| PaymentEvent::succeeded(&charge, captured)))
            }
            Answer::Done(step) => {
                let captured = *step == Event::Captured;
                if captured {
                    charge.capture_key.clone_from(&found.call_key);
                }
                (charge.apply(*step)).map(|()| captured.then(|| PaymentEvent::captured(&charge)))
            }
            Answer::Refund(refund) => {
                let (key, amount) = (&found.call_key, found.call_amount);
                (charge.record_refund(key, refund, amount))
                    .map(|()| Some(PaymentEvent::refunded(&charge, refund, amount)))
            }
        };
        let Ok(event) = event else { return Ok(false) };
        let settled = (self.ledger.swap(found, &charge, event, Duration::ZERO)).await?;
        if settled {
            tracing::info!(charge = %charge.id, from = found.status.as_str(), status = charge.status.as_str(), "reconciled a charge from the provider's answer");
        }
        Ok(settled)
    }

    /// The provider refused the call `found` waits on, or never made a create it forgot: a new
    /// charge is removed, one in the middle of a call goes back to where it was.
    async fn undo(&self, found: &Charge) -> Result<bool, ApiError> {
        if found.status == Status::Authorizing {
            let removed = self.ledger.abandon(found).await;
            if removed {
                tracing::info!(charge = %found.id, "removed a charge the provider refused");
            }
            return Ok(removed);
        }
        let mut charge = found.clone();
        if charge.apply(Event::ProviderDidNothing).is_err() {
            return Ok(false);
        }
        charge.call_key.clear();
        charge.call_amount = 0;
        // Marked as the reconciler's, no run rolls it back meanwhile: it need not stand still.
        let undone = (self.ledger.swap(found, &charge, None, Duration::ZERO)).await?;
        if undone {
            tracing::info!(charge = %charge.id, from = found.status.as_str(), to = charge.status.as_str(), "rolled back a call the provider has not seen");
        }
        Ok(undone)
    }
}

/// How long before the provider forgets a call's key the reconciler stops sending it again: an
/// hour, for the provider's clock and this process's to differ and the call to take its time.
const KEY_MARGIN: Duration = Duration::from_secs(60 * 60);

/// Whether the call `charge` waits on began too long ago to be sent again under its key.
fn outlived_its_key(charge: &Charge) -> bool {
    now_ms().saturating_sub(charge.call_started) >= millis(WINDOW.saturating_sub(KEY_MARGIN))
}

/// A call's answer: made (`Some`), refused, so nothing was done (`None`), or not known yet.
fn made<T>(answer: Result<T, ProviderError>) -> Result<Option<T>, ProviderError> {
    use ProviderError as E;
    match answer {
        Ok(made) => Ok(Some(made)),
        Err(E::AmountTooLarge { .. } | E::NoSuchPayment | E::KeyReused | E::UnexpectedState) => {
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// What the provider did with a call a charge waits on.
enum Answer {
    /// A payment was made: its id and outcome.
    Payment(String, Outcome),
    /// The capture or cancellation was made: the charge's move.
    Done(Event),
    /// The refund was made: its id.
    Refund(String),
}
