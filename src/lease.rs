//! Running work under a claim: store calls bounded by a timeout, lease renewal while the work runs,
//! and fenced writes retried within a bound. Shared by the HTTP layer and the consumer.

use std::fmt;
use std::time::Duration;

use crate::record::{ClaimToken, RecordId};
use crate::store::{Store, StoreError};

/// How often a failed store write is retried, and the first pause between attempts (doubled each
/// time): 100 ms + 200 ms + 400 ms.
const WRITE_RETRIES: u32 = 3;
const WRITE_BACKOFF: Duration = Duration::from_millis(100);

/// Bounds one store call by `timeout`.
pub(crate) async fn timed<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or(Err(StoreError::Timeout(timeout)))
}

/// A claim held on a record: what renewing and writing it needs.
pub(crate) struct Held<'a, St> {
    pub(crate) store: &'a St,
    pub(crate) id: &'a RecordId,
    pub(crate) token: &'a ClaimToken,
    pub(crate) lease: Duration,
    pub(crate) timeout: Duration,
}

impl<St: Store> Held<'_, St> {
    /// Runs `work` while renewing the claim's lease every third of it, so slow work keeps its claim.
    pub(crate) async fn renewing<F: Future>(&self, work: F) -> F::Output {
        let renewal = async {
            let every = self.lease / 3;
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let renewed = timed(
                    self.timeout,
                    self.store.renew(self.id, self.token, self.lease),
                )
                .await;
                match renewed {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        target: "tower_idempotency",
                        "the claim's lease was lost while its work ran; its result will not be stored"
                    ),
                    Err(err) => tracing::warn!(
                        target: "tower_idempotency",
                        error = %ErrorChain(&err),
                        "renewing the claim's lease failed"
                    ),
                }
            }
        };
        tokio::select! {
            output = work => output,
            _ = renewal => unreachable!("the renewal loop never ends"),
        }
    }

    /// Makes a fenced write (`what`: "complete" or "release"), retrying a failed one within a bound.
    /// `on_failure` runs after each failed attempt (the layer sends its response at the first).
    /// Returns whether the write was made: `false` when the claim was lost or the store kept failing.
    pub(crate) async fn write<F, Fut>(
        &self,
        what: &'static str,
        mut call: F,
        mut on_failure: impl FnMut(),
    ) -> bool
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let mut backoff = WRITE_BACKOFF;
        for attempt in 0..=WRITE_RETRIES {
            match timed(self.timeout, call()).await {
                Ok(true) => return true,
                Ok(false) => {
                    tracing::warn!(
                        target: "tower_idempotency",
                        operation = what,
                        "the claim was lost (its lease ran out and the key was claimed again); nothing written"
                    );
                    return false;
                }
                Err(err) => {
                    tracing::warn!(
                        target: "tower_idempotency",
                        operation = what,
                        attempt,
                        error = %ErrorChain(&err),
                        "store write failed"
                    );
                    on_failure();
                    if attempt < WRITE_RETRIES {
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                    }
                }
            }
        }
        tracing::error!(
            target: "tower_idempotency",
            operation = what,
            "giving up on the store write; the claim's lease will run out, and a retry after that runs again"
        );
        false
    }
}

/// Displays an error with its sources.
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}
