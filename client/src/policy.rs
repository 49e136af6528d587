//! `AttemptPolicy`: the [`tower::retry::Policy`] that decides, after each attempt, whether and
//! when to send the request again.
//!
//! tower's `Retry` runs the attempts; this policy, one per operation, keeps the attempt count
//! (shared with the response future, which reports it), the deadline and the jitter's random
//! numbers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

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
    /// Seeded per operation, so that operations started together draw different waits.
    rng: HasherRng,
}

impl AttemptPolicy {
    pub(crate) fn new(
        config: Arc<Config>,
        attempts: Arc<AtomicU32>,
        deadline: Instant,
        retryable: bool,
    ) -> Self {
        Self {
            config,
            attempts,
            deadline,
            retryable,
            rng: HasherRng::new(),
        }
    }

    /// Whether to retry after attempt number `attempt` ended as `outcome`, and after what wait;
    /// `None` ends the operation with this attempt's result. Logs the decision.
    fn decide(&mut self, attempt: u32, outcome: Retryable) -> Option<std::time::Duration> {
        let Retryable {
            reason,
            retry_after,
        } = outcome;
        let reason = reason.as_str();
        if attempt >= self.config.max_attempts {
            tracing::warn!(target: "tower_idempotency_client", attempt, reason, "retry: out of attempts");
            return None;
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
            return None;
        }
        if let Some(budget) = &self.config.budget
            && !budget.withdraw()
        {
            tracing::warn!(target: "tower_idempotency_client", attempt, reason, "retry: the retry budget is spent");
            return None;
        }
        tracing::info!(
            target: "tower_idempotency_client",
            attempt,
            reason,
            delay_ms = delay.as_millis() as u64,
            server_asked = retry_after.is_some(),
            "retry"
        );
        Some(delay)
    }
}

impl<ResBody> Policy<Request<Full<Bytes>>, Response<ResBody>, BoxError> for AttemptPolicy {
    type Future = Sleep;

    fn retry(
        &mut self,
        _request: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<ResBody>, BoxError>,
    ) -> Option<Sleep> {
        let outcome = classify(result)?;
        let attempt = self.attempts.load(Ordering::SeqCst);
        let delay = self.decide(attempt, outcome)?;
        self.attempts.fetch_add(1, Ordering::SeqCst);
        Some(tokio::time::sleep(delay))
    }

    fn clone_request(&mut self, request: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        // Cloning the buffered body shares its bytes: every attempt sends the same ones.
        self.retryable.then(|| request.clone())
    }
}
