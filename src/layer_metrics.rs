//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`): what the
//! layer did with each request, and how long each store call took. Without the feature, or
//! without a recorder installed, nothing is recorded.
//!
//! The metrics and their labels are PROTOCOL §12.5's; the values of the labels come from
//! [`Outcome::ALL`] and `RESULTS`, and a test checks the docs' tables against them. No label
//! carries a key, a scope or anything else of a request's.

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

/// The counter of the circuit breaker's changes of state, by the state entered.
#[cfg(feature = "metrics")]
const BREAKER: &str = "idempotency_circuit_breaker_transitions_total";

/// The values of the breaker's `state` label (and of the `state` field of its log lines): the
/// state entered, in the order of `store::Entered`.
#[cfg(any(feature = "circuit-breaker", test))]
pub(crate) const BREAKER_STATES: [&str; 3] = ["open", "half_open", "closed"];

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
        ::metrics::describe_counter!(
            BREAKER,
            ::metrics::Unit::Count,
            "Changes of state of the idempotency store's circuit breaker, by the state entered"
        );
    }
}

/// What the `counter!` and `histogram!` macros would say of the layer's metrics.
#[cfg(feature = "metrics")]
static METADATA: ::metrics::Metadata<'static> =
    ::metrics::Metadata::new(module_path!(), ::metrics::Level::INFO, Some(module_path!()));

/// A metric's key with fixed labels, made at compile time. The `counter!` and `histogram!` macros
/// make a key on every call when a label's value is not a literal: its labels in a fresh `Vec`,
/// then its hash, once or twice per request for nothing when no recorder is installed.
#[cfg(feature = "metrics")]
macro_rules! static_key {
    ($name:expr; $($label:literal => $value:expr),+) => {{
        static LABELS: [::metrics::Label; [$($label),+].len()] =
            [$(::metrics::Label::from_static_parts($label, $value)),+];
        static KEY: ::metrics::Key = ::metrics::Key::from_static_parts($name, &LABELS);
        &KEY
    }};
}

/// Counts a covered request's outcome.
#[inline]
pub(crate) fn outcome(outcome: Outcome) {
    #[cfg(feature = "metrics")]
    {
        // One key per outcome, made once: the labels of `Outcome::ALL`, in the enum's order.
        static KEYS: std::sync::OnceLock<Vec<::metrics::Key>> = std::sync::OnceLock::new();
        let keys = KEYS.get_or_init(|| {
            (Outcome::ALL.iter())
                .map(|outcome| {
                    let label = ::metrics::Label::from_static_parts("outcome", outcome.as_str());
                    ::metrics::Key::from_parts(REQUESTS, vec![label])
                })
                .collect()
        });
        let key = &keys[outcome as usize];
        ::metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Counts a change of state of a circuit breaker.
#[cfg(feature = "circuit-breaker")]
pub(crate) fn breaker_entered(state: crate::store::Entered) {
    #[cfg(feature = "metrics")]
    {
        static KEYS: [&::metrics::Key; BREAKER_STATES.len()] = [
            static_key!(BREAKER; "state" => BREAKER_STATES[0]),
            static_key!(BREAKER; "state" => BREAKER_STATES[1]),
            static_key!(BREAKER; "state" => BREAKER_STATES[2]),
        ];
        let key = KEYS[state as usize];
        ::metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = state;
}

/// The values of a store call's `result` label: `ok`, then each [`StoreError`] kind, in the
/// order of [`result`].
#[cfg(feature = "metrics")]
pub(crate) const RESULTS: [&str; 10] = [
    "ok",
    "full",
    "timeout",
    "unavailable",
    "aborted",
    "codec",
    "rejected",
    "unreadable",
    "circuit_open",
    "quota_exceeded",
];

/// The keys of one store operation's calls, by result ([`RESULTS`]).
#[cfg(feature = "metrics")]
type CallKeys = [&'static ::metrics::Key; RESULTS.len()];

/// The [`CallKeys`] of `operation`.
#[cfg(feature = "metrics")]
macro_rules! call_keys {
    ($operation:literal) => {{
        static KEYS: CallKeys = [
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[0]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[1]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[2]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[3]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[4]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[5]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[6]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[7]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[8]),
        static_key!(STORE_CALLS; "operation" => $operation, "result" => RESULTS[9]),
        ];
        &KEYS
    }};
}

/// The `result` label of a store call, as its place in [`CallKeys`].
#[cfg(feature = "metrics")]
fn result<T>(result: &Result<T, StoreError>) -> usize {
    match result {
        Ok(_) => 0,
        Err(StoreError::Full { .. }) => 1,
        Err(StoreError::Timeout(_)) => 2,
        Err(StoreError::Unavailable(_)) => 3,
        Err(StoreError::Aborted(_)) => 4,
        Err(StoreError::Codec(_)) => 5,
        Err(StoreError::Rejected(_)) => 6,
        Err(StoreError::Unreadable(_)) => 7,
        Err(StoreError::CircuitOpen { .. }) => 8,
        Err(StoreError::QuotaExceeded { .. }) => 9,
    }
}

/// Times `call`, a store call whose keys are `keys`.
#[cfg(feature = "metrics")]
async fn timed<T>(
    keys: &'static CallKeys,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let answer = call.await;
    let elapsed = started.elapsed();
    let key = keys[result(&answer)];
    ::metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
        .record(elapsed.as_secs_f64());
    answer
}

/// Without the `metrics` feature: no keys, and a call is only awaited.
#[cfg(not(feature = "metrics"))]
macro_rules! call_keys {
    ($operation:literal) => {
        ()
    };
}

/// Without the `metrics` feature: awaits `call`, timing nothing.
#[cfg(not(feature = "metrics"))]
async fn timed<T>(
    (): (),
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    call.await
}

/// A store whose calls are timed: the layer and the consumer call their store through it.
#[derive(Clone)]
pub(crate) struct Metered<St>(pub(crate) St);

impl<St: fmt::Debug> fmt::Debug for Metered<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<St: Store> Store for Metered<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        timed(call_keys!("claim"), self.0.claim(id, fingerprint, lease)).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        timed(
            call_keys!("complete"),
            self.0.complete(id, token, completed, ttl),
        )
        .await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        timed(call_keys!("renew"), self.0.renew(id, token, lease)).await
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        timed(call_keys!("release"), self.0.release(id, token)).await
    }

    crate::forward_store!(0 => prepare, changed);
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::protocol::text::{PROTOCOL, README, code_spans, row, section, table_rows};

    /// The metrics tables of PROTOCOL §12.5 and the README name the metrics and every value of
    /// their labels, and no other; an outcome's names are either all there or left to §6.5.
    #[test]
    fn the_docs_list_every_label_value_and_no_other() {
        let values = |cell: &str, skip: &[&str]| -> BTreeSet<String> {
            (code_spans(cell).into_iter())
                .filter(|span| !skip.contains(span))
                .map(str::to_owned)
                .collect()
        };
        let results: BTreeSet<String> = RESULTS.iter().map(|r| (*r).to_owned()).collect();
        let outcomes: BTreeSet<String> = (Outcome::ALL.iter())
            .map(|o| o.as_str().to_owned())
            .collect();
        for (doc, table) in [
            ("PROTOCOL", section(PROTOCOL, "### 12.5")),
            ("README", section(README, "## Metrics")),
        ] {
            let rows = table_rows(table);
            let calls = row(&rows, STORE_CALLS)[2];
            let (operations, results_cell) = calls.split_once("`result`").expect("a result label");
            assert_eq!(
                values(operations, &["operation"]),
                ["claim", "complete", "release", "renew"]
                    .map(str::to_owned)
                    .into(),
                "{doc}"
            );
            assert_eq!(values(results_cell, &["StoreError"]), results, "{doc}");
            let named = values(row(&rows, REQUESTS)[2], &["outcome", "Outcome"]);
            assert!(named.is_empty() || named == outcomes, "{doc}: {named:?}");
            let states: BTreeSet<String> = BREAKER_STATES.iter().map(|s| (*s).to_owned()).collect();
            assert_eq!(values(row(&rows, BREAKER)[2], &["state"]), states, "{doc}");
        }
    }

    /// Each store error counts under its own `result` label.
    #[test]
    fn each_store_error_has_its_result() {
        let err = || Box::new(std::io::Error::other("x"));
        let answers: [(Result<(), StoreError>, &str); 8] = [
            (Ok(()), "ok"),
            (Err(StoreError::Full { retry_after: None }), "full"),
            (
                Err(StoreError::Timeout(std::time::Duration::ZERO)),
                "timeout",
            ),
            (Err(StoreError::Unavailable(err())), "unavailable"),
            (Err(StoreError::Aborted(err())), "aborted"),
            (Err(StoreError::Codec(err())), "codec"),
            (Err(StoreError::Rejected(err())), "rejected"),
            (Err(StoreError::Unreadable(err())), "unreadable"),
        ];
        for (answer, name) in answers {
            assert_eq!(RESULTS[result(&answer)], name);
        }
    }
}
