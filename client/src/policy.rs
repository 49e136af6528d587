//! `AttemptPolicy`: the [`tower::retry::Policy`] that decides, after each attempt, whether and
//! when to send the request again.
//!
//! tower's `Retry` runs the attempts; this policy, one per operation, keeps the attempt count
//! (shared with the response future, which reports it), the deadline and the jitter's random
//! numbers.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::time::{Instant, Sleep};
use tower::retry::Policy;
use tower::util::rng::HasherRng;

use super::BoxError;
use super::classify::{Retryable, classify, not_replayable};
use super::layer::Config;

/// The retry state of one operation.
#[derive(Clone)]
pub(crate) struct AttemptPolicy {
    config: Arc<Config>,
    /// Attempts sent so far; the response future reads it when the operation ends.
    attempts: Arc<AtomicU32>,
    deadline: Instant,
    /// Whether the request may be sent more than once (a key, or an idempotent method).
    retryable: bool,
    /// Whether the request carries a key: only then does the server's retention bound it.
    keyed: bool,
    /// The earliest moment a response stated for the key's record to expire.
    expires: Option<SystemTime>,
    /// The call's start plus the configured retention: the key's record is kept at least until
    /// then, since the operation completes after the call started.
    kept_until: Option<Instant>,
    /// Seeded per operation, so that operations started together draw different waits.
    rng: HasherRng,
}

impl AttemptPolicy {
    pub(crate) fn new(
        config: Arc<Config>,
        attempts: Arc<AtomicU32>,
        started: Instant,
        deadline: Instant,
        retryable: bool,
        keyed: bool,
    ) -> Self {
        let kept_until = (config.retention)
            .filter(|_| keyed)
            .and_then(|kept| started.checked_add(kept));
        Self {
            config,
            attempts,
            deadline,
            retryable,
            keyed,
            expires: None,
            kept_until,
            rng: HasherRng::new(),
        }
    }

    /// Whether to retry after attempt number `attempt` ended as `outcome`, and after what wait;
    /// `None` ends the operation with this attempt's result. Logs the decision.
    fn decide(&mut self, attempt: u32, outcome: Retryable) -> Decision {
        let Retryable {
            reason,
            retry_after,
        } = outcome;
        let reason = reason.as_str();
        if attempt >= self.config.max_attempts {
            tracing::warn!(target: "tower_idempotency_client", attempt, reason, "retry: out of attempts");
            return Decision::Stop;
        }
        let delay =
            retry_after.unwrap_or_else(|| self.config.backoff.delay(attempt, &mut self.rng));
        let left = self.deadline.saturating_duration_since(Instant::now());
        if delay >= left {
            tracing::warn!(
                target: "tower_idempotency_client",
                attempt,
                reason,
                delay_ms = delay.as_millis() as u64,
                left_ms = left.as_millis() as u64,
                "retry: the wait would pass the deadline"
            );
            return Decision::Stop;
        }
        // The server forgets the key at `expires`: a retry at or after it (less the margin for
        // the clocks' difference) would run the operation again.
        if let Some(expires) = self.retention_passed(delay) {
            tracing::warn!(
                target: "tower_idempotency_client",
                attempt,
                reason,
                delay_ms = delay.as_millis() as u64,
                "retry: the server would have forgotten the key"
            );
            return Decision::RetentionPassed(expires);
        }
        if let Some(budget) = &self.config.budget
            && !budget.withdraw()
        {
            tracing::warn!(target: "tower_idempotency_client", attempt, reason, "retry: the retry budget is spent");
            return Decision::Stop;
        }
        tracing::info!(
            target: "tower_idempotency_client",
            attempt,
            reason,
            delay_ms = delay.as_millis() as u64,
            server_asked = retry_after.is_some(),
            "retry"
        );
        Decision::Retry(delay)
    }

    /// The moment the server forgets the key, if a retry after `delay` would reach it at or
    /// after that moment less the margin: the moment a response stated (the server's clock), or
    /// the call's start plus the configured retention (this process's monotonic clock).
    fn retention_passed(&self, delay: Duration) -> Option<SystemTime> {
        let margin = self.config.retention_margin;
        if let Some(expires) = self.expires {
            let last = expires
                .checked_sub(margin)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            if SystemTime::now() + delay >= last {
                return Some(expires);
            }
        }
        let kept_until = self.kept_until?;
        let now = Instant::now();
        let last = kept_until.checked_sub(margin).unwrap_or(now);
        (now + delay >= last).then(|| SystemTime::now() + kept_until.saturating_duration_since(now))
    }

    /// Notes the retention moment a response states, keeping the earliest.
    fn note_retention(&mut self, headers: &http::HeaderMap) {
        if !self.keyed {
            return;
        }
        if let Some(expires) = super::retention::expires(headers, &self.config.retention_header) {
            self.expires = Some(self.expires.map_or(expires, |seen| seen.min(expires)));
        }
    }
}

/// What follows an attempt whose outcome is retryable.
enum Decision {
    /// Send the request again after this wait.
    Retry(Duration),
    /// End with the attempt's result.
    Stop,
    /// End with [`RetentionPassed`]: the retry would come after the server forgot the key.
    RetentionPassed(SystemTime),
}

/// The attempt's result when the server answered `not-replayable`: the response future turns it
/// into [`Error::NotReplayable`](super::Error::NotReplayable).
#[derive(Debug)]
pub(crate) struct NotReplayable;

impl fmt::Display for NotReplayable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the operation ran once and its response is not kept")
    }
}

impl std::error::Error for NotReplayable {}

/// The attempt's result when a retry would come after the key's record expires: the response
/// future turns it into [`Error::RetentionPassed`](super::Error::RetentionPassed).
#[derive(Debug)]
pub(crate) struct RetentionPassed(pub(crate) SystemTime);

impl fmt::Display for RetentionPassed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a retry would come after the server forgot the key")
    }
}

impl std::error::Error for RetentionPassed {}

impl<ResBody> Policy<Request<Full<Bytes>>, Response<ResBody>, BoxError> for AttemptPolicy {
    type Future = Sleep;

    fn retry(
        &mut self,
        _request: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<ResBody>, BoxError>,
    ) -> Option<Sleep> {
        let attempt = self.attempts.load(Ordering::SeqCst);
        if let Ok(response) = result {
            self.note_retention(response.headers());
            // Not retried, and not an answer to return as one: the operation ran, and no retry
            // can get its response.
            if self.keyed && not_replayable(response.headers()) {
                tracing::warn!(
                    target: "tower_idempotency_client",
                    attempt,
                    reason = "not_replayable",
                    "retry: not retrying, the operation ran once and its response is not kept"
                );
                *result = Err(Box::new(NotReplayable));
                return None;
            }
        }
        let outcome = classify(result)?;
        match self.decide(attempt, outcome) {
            Decision::Retry(delay) => {
                self.attempts.fetch_add(1, Ordering::SeqCst);
                Some(tokio::time::sleep(delay))
            }
            Decision::Stop => None,
            Decision::RetentionPassed(expires) => {
                *result = Err(Box::new(RetentionPassed(expires)));
                None
            }
        }
    }

    fn clone_request(&mut self, request: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        // Cloning the buffered body shares its bytes: every attempt sends the same ones.
        self.retryable.then(|| request.clone())
    }
}
