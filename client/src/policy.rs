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
use super::classify::{Retryable, classify};
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
    /// Seeded per operation, so that operations started together draw different waits.
    rng: HasherRng,
}

impl AttemptPolicy {
    pub(crate) fn new(
        config: Arc<Config>,
        attempts: Arc<AtomicU32>,
        deadline: Instant,
        retryable: bool,
        keyed: bool,
    ) -> Self {
        Self {
            config,
            attempts,
            deadline,
            retryable,
            keyed,
            expires: None,
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
        if let Some(expires) = self.expires {
            let last = expires
                .checked_sub(self.config.retention_margin)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            if SystemTime::now() + delay >= last {
                tracing::warn!(
                    target: "tower_idempotency_client",
                    attempt,
                    reason,
                    delay_ms = delay.as_millis() as u64,
                    "retry: the server would have forgotten the key"
                );
                return Decision::RetentionPassed(expires);
            }
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
        if let Ok(response) = result {
            self.note_retention(response.headers());
        }
        let outcome = classify(result)?;
        let attempt = self.attempts.load(Ordering::SeqCst);
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
