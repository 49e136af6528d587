//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`): what the
//! layer did with each request, and how long each store call took. Without the feature, or
//! without a recorder installed, nothing is recorded.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idempotency_requests_total` | counter | `outcome`: the [`Outcome`]'s name |
//! | `idempotency_store_call_duration_seconds` | histogram | `operation`: `claim`, `complete`, `renew` or `release`; `result`: `ok`, or the error's kind |
//!
//! No label carries a key, a scope or anything else of a request's: the label values are the
//! fixed sets above.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::outcome::Outcome;
use crate::record::{ClaimToken, Completed, RecordId};
use crate::store::{Claim, Store, StoreError};

/// The counter of requests, by outcome.
#[cfg(feature = "metrics")]
const REQUESTS: &str = "idempotency_requests_total";
/// The histogram of store call latencies, by operation and result.
#[cfg(feature = "metrics")]
const STORE_CALLS: &str = "idempotency_store_call_duration_seconds";

/// Describes the metrics to the recorder installed now, if any.
pub(crate) fn describe() {
    #[cfg(feature = "metrics")]
    {
        ::metrics::describe_counter!(
            REQUESTS,
            ::metrics::Unit::Count,
            "Requests the idempotency layer covered, by outcome"
        );
        ::metrics::describe_histogram!(
            STORE_CALLS,
            ::metrics::Unit::Seconds,
            "Idempotency store calls, by operation and result"
        );
    }
}

/// Counts a covered request's outcome.
#[inline]
pub(crate) fn outcome(outcome: Outcome) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(REQUESTS, "outcome" => outcome.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// The `result` label of a store call.
#[cfg(feature = "metrics")]
fn result<T>(result: &Result<T, StoreError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(StoreError::Full { .. }) => "full",
        Err(StoreError::Timeout(_)) => "timeout",
        Err(StoreError::Unavailable(_)) => "unavailable",
        Err(StoreError::Aborted(_)) => "aborted",
        Err(StoreError::Codec(_)) => "codec",
    }
}

/// Times `call`, a store call of `operation`.
#[cfg(feature = "metrics")]
async fn timed<T>(
    operation: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let answer = call.await;
    let elapsed = started.elapsed();
    ::metrics::histogram!(STORE_CALLS, "operation" => operation, "result" => result(&answer))
        .record(elapsed.as_secs_f64());
    answer
}

/// A store whose calls are timed: the layer and the consumer call their store through it.
#[derive(Clone)]
pub(crate) struct Metered<St>(pub(crate) St);

impl<St: fmt::Debug> fmt::Debug for Metered<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(feature = "metrics")]
impl<St: Store> Store for Metered<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        timed("claim", self.0.claim(id, fingerprint, lease)).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        timed("complete", self.0.complete(id, token, completed, ttl)).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        timed("renew", self.0.renew(id, token, lease)).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        self.0.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        timed("release", self.0.release(id, token)).await
    }

    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.0.changed(id)
    }
}

#[cfg(not(feature = "metrics"))]
impl<St: Store> Store for Metered<St> {
    fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.0.claim(id, fingerprint, lease)
    }

    fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.0.complete(id, token, completed, ttl)
    }

    fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.0.renew(id, token, lease)
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        self.0.prepare(id, token, extensions);
    }

    fn release(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.0.release(id, token)
    }

    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        self.0.changed(id)
    }
}
