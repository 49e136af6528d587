//! Running work under a claim: lease renewal while the work runs, and fenced writes retried
//! within a bound. Shared by the HTTP layer and the consumer.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error_chain::ErrorChain;
use crate::record::{ClaimToken, RecordId};
use crate::store::{Store, StoreError};

/// The first pause before a failed store write is tried again; it doubles after each failure, up
/// to [`WRITE_BACKOFF_MAX`].
const WRITE_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause between two attempts of a failed store write: once the store is back, a
/// pending write lands within about this long.
const WRITE_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// The first pause before a failed renewal is tried again; it doubles after each failure, up to
/// [`WRITE_BACKOFF_MAX`], and no attempt starts past the lease's end.
const RENEW_BACKOFF: Duration = Duration::from_millis(50);

/// A claim held on a record: what renewing and writing it needs.
pub(crate) struct Held<'a, St> {
    pub(crate) store: &'a St,
    pub(crate) id: &'a RecordId,
    pub(crate) token: &'a ClaimToken,
    pub(crate) lease: Duration,
}

impl<St> Clone for Held<'_, St> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<St> Copy for Held<'_, St> {}

pin_project! {
    /// Work running under a claim whose lease is renewed every third of it. A hand-written future
    /// rather than an `async fn`, to keep one copy of the work in it; its timer is made (boxed)
    /// only when the work does not finish at its first poll.
    pub(crate) struct Renewing<'a, St, F> {
        #[pin]
        work: F,
        tick: Option<Pin<Box<Sleep>>>,
        every: Duration,
        held: Held<'a, St>,
        // When the lease ends, as of the last renewal that landed (the claim's own lease is a
        // full one from about when the work started).
        lease_end: Instant,
        // Boxed: renewals are rare (work longer than a third of the lease), and the renewal
        // future would otherwise swell every request's future. It answers when a renewal that
        // landed was sent, if one did.
        renewal: Option<Pin<Box<dyn Future<Output = Option<Instant>> + Send + 'a>>>,
    }
}

impl<St: Store, F: Future> Future for Renewing<'_, St, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(output);
        }
        let every = *this.every;
        let tick = this
            .tick
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        loop {
            if let Some(renewal) = this.renewal.as_mut() {
                let Poll::Ready(renewed) = renewal.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                if let Some(sent) = renewed {
                    *this.lease_end = sent + this.held.lease;
                }
                *this.renewal = None;
            }
            if tick.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            tick.as_mut().reset(Instant::now() + every);
            *this.renewal = Some(Box::pin(this.held.renew_within(*this.lease_end)));
        }
    }
}

impl<'a, St: Store> Held<'a, St> {
    /// Runs `work` while renewing the claim's lease every third of it, so slow work keeps its claim.
    pub(crate) fn renewing<F: Future>(&self, work: F) -> Renewing<'a, St, F> {
        Renewing {
            work,
            tick: None,
            every: self.lease / 3,
            held: *self,
            // The clock is read once per piece of work, not per poll.
            lease_end: Instant::now() + self.lease,
            renewal: None,
        }
    }

    /// Renews the lease; a renewal that fails is tried again at once and then with capped
    /// backoff until one lands or `lease_end` has passed, so that only an outage longer than
    /// what is left of the lease loses the claim (§9.2). Answers when the renewal that landed was
    /// sent.
    async fn renew_within(self, lease_end: Instant) -> Option<Instant> {
        let mut backoff = RENEW_BACKOFF;
        let mut failures = 0u32;
        loop {
            let sent = Instant::now();
            match self.store.renew(self.id, self.token, self.lease).await {
                Ok(true) => {
                    if failures > 0 {
                        tracing::info!(
                            target: "tower_idempotency",
                            failures,
                            "the claim's lease renewed after the store came back"
                        );
                    }
                    return Some(sent);
                }
                Ok(false) => {
                    tracing::warn!(
                        target: "tower_idempotency",
                        "the claim's lease ran out before it was renewed; its result is stored only if nobody claimed the key since"
                    );
                    return None;
                }
                Err(err) => {
                    failures += 1;
                    // One warning per renewal, not one per attempt.
                    if failures == 1 {
                        tracing::warn!(
                            target: "tower_idempotency",
                            error = %ErrorChain(&err),
                            "renewing the claim's lease failed; trying again until the lease ends"
                        );
                    }
                    let next = Instant::now() + backoff;
                    if next >= lease_end {
                        tracing::error!(
                            target: "tower_idempotency",
                            failures,
                            "the claim's lease could not be renewed before it ended; a retry may now claim the key"
                        );
                        return None;
                    }
                    tokio::time::sleep_until(next).await;
                    backoff = (backoff * 2).min(WRITE_BACKOFF_MAX);
                }
            }
        }
    }

    /// Writes a completion (`call` makes one attempt) for as long as the claim can still be
    /// ours: a failed attempt is retried with backoff, and the lease renewed meanwhile, until the
    /// write lands, the store answers that the record is no longer this claim's (`false`), or
    /// `within` has passed. A record that vanished meanwhile (its lease ran out and nobody claimed
    /// it since) is written all the same: the work did run. `failed` is how many attempts failed
    /// (and were logged) before this call.
    pub(crate) async fn complete_with<F, Fut>(self, within: Duration, failed: u32, call: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        self.renewing(self.retried("complete", within, failed, call))
            .await
    }

    /// Releases the claim (`call` makes one attempt), retrying a failed attempt with backoff for
    /// up to a lease: after that the claim has run out by itself. `failed` as for
    /// [`Held::complete_with`].
    pub(crate) async fn release_with<F, Fut>(self, failed: u32, call: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        self.retried("release", self.lease, failed, call).await
    }

    /// Makes a fenced write (`what`: "complete" or "release"), retrying a failed one with capped
    /// exponential backoff for up to `within`; after `failed` earlier failures, it starts with a
    /// pause. Whether it was made is logged: no caller acts on it.
    async fn retried<F, Fut>(
        self,
        what: &'static str,
        within: Duration,
        mut failures: u32,
        mut call: F,
    ) where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let deadline = Instant::now() + within;
        let mut backoff = WRITE_BACKOFF;
        if failures > 0 {
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        loop {
            match call().await {
                Ok(true) => {
                    if failures > 0 {
                        tracing::info!(
                            target: "tower_idempotency",
                            operation = what,
                            failures,
                            "store write made after the store came back"
                        );
                    }
                    return;
                }
                Ok(false) => {
                    not_written(what);
                    return;
                }
                // Refused for good: the same write sent again is refused again.
                Err(StoreError::Rejected(err)) => {
                    tracing::error!(
                        target: "tower_idempotency",
                        operation = what,
                        error = %ErrorChain(&*err),
                        "the store rejected the write; it cannot succeed as it is, giving up"
                    );
                    return;
                }
                Err(err) => {
                    failures += 1;
                    // One warning per write, not one per attempt: an outage would flood the log.
                    if failures == 1 {
                        tracing::warn!(
                            target: "tower_idempotency",
                            operation = what,
                            error = %ErrorChain(&err),
                            "store write failed; retrying it until the store answers"
                        );
                    } else {
                        tracing::debug!(
                            target: "tower_idempotency",
                            operation = what,
                            failures,
                            error = %ErrorChain(&err),
                            "store write failed again"
                        );
                    }
                    if Instant::now() + backoff >= deadline {
                        tracing::error!(
                            target: "tower_idempotency",
                            operation = what,
                            failures,
                            "giving up on the store write: the store stayed unreachable past the point where the write could matter"
                        );
                        return;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(WRITE_BACKOFF_MAX);
                }
            }
        }
    }
}

/// Logs a fenced write (`what`) that found the record no longer this claim's: the claim was lost
/// (its lease ran out and the key was claimed again), or an earlier attempt whose answer was lost
/// did land.
pub(crate) fn not_written(what: &'static str) {
    tracing::warn!(
        target: "tower_idempotency",
        operation = what,
        "the record no longer carries this claim; nothing written"
    );
}
