//! The reconciler, beside every instance (instances agree through the ledger: of two
//! reconcilers, or a reconciler and a resumed request, exactly one moves a charge on).
//!
//! A call whose outcome is unknown (a timeout, a connection lost after the call was sent, a
//! crash) leaves its charge `authorizing`, `capturing`, `refunding` or `canceling`. Every round
//! the reconciler takes those unchanged for longer than `after` (far above the provider client's
//! deadline: a live request's call has long ended), marks each as its own, and settles it as one
//! settles an unknown outcome with Stripe: it drives the call again through the provider's API
//! under the same key, which the provider makes once (now, or answering what it made before; a
//! late run of the request gets the same answer). Rolling it back instead would let a call held up
//! at the provider land after, money moved under a charge that says otherwise:
//!
//! - made: the charge moves to the state the answer says, with the event the request would have
//!   published (the same id: the consumer applies it once), only if it is still as it was found;
//! - refused (a refund beyond what is left, a key used for another request): a new charge goes,
//!   one in the middle of a capture, refund or cancellation goes back to where it was;
//! - the provider unavailable, or its answer lost: the charge waits for the next round.
//!
//! The provider remembers a key for 24 h. Past that (less an hour's margin), a call sent again
//! could be made twice: a create is then found by its metadata (the account and operation the
//! example gives every payment), and any other call is left for an operator, at ERROR.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::auth::Account;
use super::error::ApiError;
use super::events::PaymentEvent;
use super::ledger::{Charge, Ledger};
use super::now_ms;
use super::provider::{Outcome, PaymentRecord, ProviderClient, ProviderError, WINDOW};
use super::state_machine::{Event, Status};

/// Charges, and provider payments, looked at per round.
const BATCH: usize = 100;

/// The metadata field of a payment that names its operation: the provider key of its create call.
pub const OPERATION: &str = "operation";

/// The metadata field of a payment that names its account.
pub const ACCOUNT: &str = "account";

/// The metadata the example gives a charge's payment: its account and operation, by which the
/// reconciler finds it once the provider has forgotten its key.
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
    /// Charges the provider knew nothing of: removed when new, rolled back to the state before
    /// the call otherwise.
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
    /// A reconciler of `ledger`, asking `provider`, for charges unchanged in an `-ing` state for
    /// longer than `after`; it looks every quarter of `after` (at least every 50 ms, at most
    /// every 30 s).
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
                Ok(Reconciled {
                    settled: 0,
                    removed: 0,
                    ..
                }) => {}
                Ok(done) => tracing::info!(?done, "reconciled charges with the provider"),
                Err(err) => {
                    tracing::warn!(?err, "reconciling failed; trying again next round");
                }
            }
        }
    }

    /// Settles the charges in an intermediate state for longer than `after`, now.
    pub async fn round(&self) -> Result<Reconciled, ApiError> {
        let charges = self.ledger.unsettled(self.after, BATCH).await?;
        let mut done = Reconciled::default();
        for charge in charges {
            let Some(charge) = self.take_over(charge).await? else {
                // Changed since it was listed: a run of its request is on it.
                done.left += 1;
                continue;
            };
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

    /// Marks a call in flight as the reconciler's before it is sent again, unless the charge
    /// changed since it was listed (`None`): a run of the request that then finds its own call
    /// refused leaves the charge to the reconciler instead of rolling back a call the reconciler
    /// may make, and a retry answers the outcome unknown until the reconciler settles it.
    async fn take_over(&self, found: Charge) -> Result<Option<Charge>, ApiError> {
        if outlived_its_key(&found) && found.status != Status::Authorizing {
            // The provider may have forgotten the call's key: sent again, a call it made would be
            // made twice, and one it refuses could be rolled back though it was made.
            tracing::error!(charge = %found.id, status = found.status.as_str(), "a call in flight past the provider's key window: settle it by hand from the provider's records");
            // Touched, so that it goes to the back of the list and such charges never fill a
            // round's batch; it is reported again a round length later.
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

    /// What the provider did with the call `charge` waits on, or does now with it: `None` when
    /// it refused. The call is sent again under its key: the provider makes it once. A create
    /// whose key the provider may have forgotten is searched for by its metadata instead: not
    /// found a day after it began, it was never made.
    async fn ask(&self, charge: &Charge) -> Result<Option<Answer>, ProviderError> {
        let provider = &self.provider;
        let payment = charge.payment.as_str();
        let (key, amount) = (charge.call_key.as_str(), charge.call_amount);
        let create = (charge.source, charge.amount, charge.capture);
        Ok(match charge.status {
            Status::Authorizing if !outlived_its_key(charge) => {
                let metadata = metadata(&charge.account, &charge.provider_key);
                made(
                    provider
                        .create_payment(&charge.provider_key, create, metadata)
                        .await,
                )?
                .map(|made| Answer::Payment(made.id, made.outcome))
            }
            Status::Authorizing => {
                let found = provider.search(OPERATION, &charge.provider_key).await?;
                // The operation's payment, if the provider made it for this charge's request (a
                // key reused for another request made none).
                let mine = |p: &PaymentRecord| {
                    p.metadata.get(ACCOUNT).map(String::as_str) == Some(charge.account.id())
                        && (p.amount, p.source, p.capture)
                            == (charge.amount, charge.source, charge.capture)
                };
                (found.into_iter().find(mine)).map(|p| Answer::Payment(p.id, p.outcome))
            }
            Status::Capturing => made(provider.capture(key, payment).await)?
                .map(|()| Answer::Done(&[Event::Captured])),
            Status::Canceling => made(provider.cancel(key, payment).await)?
                .map(|()| Answer::Done(&[Event::Canceled])),
            Status::Refunding => {
                made(provider.refund(key, payment, amount).await)?.map(Answer::Refund)
            }
            _ => None,
        })
    }

    /// Moves `charge` to the provider's `answer`, with its event, if it is still where it was
    /// found.
    async fn settle(&self, found: Charge, answer: Answer) -> Result<bool, ApiError> {
        let mut charge = found.clone();
        let mut event = None;
        let moves: &[Event] = match &answer {
            Answer::Payment(payment, outcome) => {
                charge.payment.clone_from(payment);
                match outcome {
                    Outcome::Declined => &[Event::Declined],
                    Outcome::Authorized => &[Event::Approved],
                    Outcome::Captured => &[Event::Approved, Event::Capture, Event::Captured],
                    Outcome::Canceled => &[Event::Approved, Event::Cancel, Event::Canceled],
                }
            }
            Answer::Done(moves) => {
                if found.status == Status::Capturing {
                    charge.capture_key.clone_from(&found.call_key);
                }
                moves
            }
            Answer::Refund(refund) => {
                let (key, amount) = (charge.call_key.clone(), charge.call_amount);
                if charge.record_refund(&key, refund, amount).is_err() {
                    return Ok(false);
                }
                &[]
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
        let settled = self
            .ledger
            .swap(&found, &charge, event, Duration::ZERO)
            .await?;
        if settled {
            tracing::info!(charge = %charge.id, from = found.status.as_str(), status = charge.status.as_str(), "reconciled a charge from the provider's answer");
        }
        Ok(settled)
    }

    /// The provider refused the call `charge` waits on, or never made a create it forgot: a new
    /// charge is removed, one in the middle of a call goes back to where it was.
    async fn undo(&self, found: Charge) -> Result<bool, ApiError> {
        if found.status == Status::Authorizing {
            let removed = self.ledger.abandon(&found).await;
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
        // Marked as the reconciler's: no run rolls it back or settles it from a refusal meanwhile,
        // so it need not have stood still for `after`.
        let undone = (self.ledger.swap(&found, &charge, None, Duration::ZERO)).await?;
        if undone {
            tracing::info!(charge = %charge.id, from = found.status.as_str(), to = charge.status.as_str(), "rolled back a call the provider has not seen");
        }
        Ok(undone)
    }
}

/// How long before the provider forgets a call's key the reconciler stops sending the call again:
/// an hour, for the clocks of the provider and this process to differ and the call to take its
/// time.
const KEY_MARGIN: Duration = Duration::from_secs(60 * 60);

/// Whether the call `charge` waits on began too long ago to be sent again under its key.
fn outlived_its_key(charge: &Charge) -> bool {
    let usable = WINDOW.saturating_sub(KEY_MARGIN);
    let usable = u64::try_from(usable.as_millis()).unwrap_or(u64::MAX);
    now_ms().saturating_sub(charge.call_started) >= usable
}

/// A call's answer: made (`Some`), refused, so nothing was done (`None`), or not known yet.
fn made<T>(answer: Result<T, ProviderError>) -> Result<Option<T>, ProviderError> {
    match answer {
        Ok(made) => Ok(Some(made)),
        Err(
            ProviderError::AmountTooLarge { .. }
            | ProviderError::NoSuchPayment
            | ProviderError::KeyReused,
        ) => Ok(None),
        Err(err) => Err(err),
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
