//! What the layer did with a request.

use std::fmt;

/// Defines [`Outcome`] from one list: each variant, its docs and its name in logs and metrics.
macro_rules! outcomes {
    (
        $(#[$meta:meta])*
        pub enum Outcome { $($(#[$doc:meta])* $variant:ident => $name:literal,)+ }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Outcome {
            $($(#[$doc])* $variant,)+
        }

        impl Outcome {
            /// Every outcome, in the order of the enum.
            ///
            /// ```
            /// use tower_idempotency::Outcome;
            ///
            /// assert_eq!(Outcome::ALL[1], Outcome::Executed);
            /// assert!(Outcome::ALL.iter().all(|outcome| !outcome.as_str().is_empty()));
            /// ```
            pub const ALL: &'static [Outcome] = &[$(Outcome::$variant),+];

            /// The outcome's name, as it appears in logs and in the `outcome` label of the
            /// `idempotency_requests_total` metric.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Outcome::$variant => $name,)+
                }
            }
        }
    };
}

outcomes! {
    /// What the layer did with a request: in every response's extensions, and the `outcome` field
    /// of the layer's `tracing` events (target `tower_idempotency`).
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use http::Request;
    /// use tower::ServiceExt;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let app = Router::new()
    ///     .route("/", post(|| async { "done" }))
    ///     .layer(IdempotencyLayer::new(MemoryStore::new()));
    /// let request = || {
    ///     let request = Request::post("/").header("idempotency-key", "k");
    ///     request.body(String::new()).unwrap()
    /// };
    ///
    /// let first = app.clone().oneshot(request()).await.unwrap();
    /// assert_eq!(first.extensions().get::<Outcome>(), Some(&Outcome::Executed));
    /// let retry = app.oneshot(request()).await.unwrap();
    /// assert_eq!(retry.extensions().get::<Outcome>(), Some(&Outcome::Replayed));
    /// # }
    /// ```
    pub enum Outcome {
        /// A covered method without a key, passed through because keys are optional.
        Unprotected => "unprotected",
        /// The handler ran and its response (or a tombstone) was stored.
        Executed => "executed",
        /// The handler ran, and its response was not stored (store policy, `Cache-Control:
        /// no-store`): the claim was released.
        NotStored => "not_stored",
        /// The stored response was replayed; the handler did not run.
        Replayed => "replayed",
        /// The key's first request is still running: 409.
        InFlight => "in_flight",
        /// The key was used for a different request: 422.
        Mismatch => "mismatch",
        /// The key's request completed, but its response was not stored.
        NotReplayable => "not_replayable",
        /// The request was refused before any claim: a missing or invalid key, a body over the
        /// limit, or the scope function's rejection.
        Rejected => "rejected",
        /// The store failed at claim time: 503.
        StoreUnavailable => "store_unavailable",
        /// The store failed at claim time, or the circuit breaker is open, and the layer is
        /// fail-open: the handler ran unprotected.
        FailedOpen => "failed_open",
        /// The handler failed or panicked: 500, and the claim was released.
        HandlerFailed => "handler_failed",
        /// The handler ran, but its transaction was refused at commit for a reason that sending it
        /// again cannot fix (a store whose completion commits with the work,
        /// [`StoreError::Rejected`]): 422, nothing was done, and the claim was released.
        ///
        /// [`StoreError::Rejected`]: crate::store::StoreError::Rejected
        CommitRejected => "commit_rejected",
        /// The key's record cannot be opened or trusted (a sealed record that does not open, or one
        /// in clear where sealed ones are required): 500, neither replayed nor run again.
        RecordUnreadable => "record_unreadable",
        /// The request's scope has written its quota of records through this instance, and its
        /// key has no record: 429, nothing claimed (`store::ScopeQuota`, feature `scope-quota`).
        QuotaExceeded => "quota_exceeded",
        /// The store's circuit breaker is open (the store kept failing): 503 at once, without a
        /// store call (`store::CircuitBreaker`, feature `circuit-breaker`). On a fail-open layer
        /// the request runs unprotected instead, as `FailedOpen`.
        CircuitOpen => "circuit_open",
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::text::{PROTOCOL, named_pairs, section};

    /// PROTOCOL §6.5 names every outcome, with its name in logs and metrics, and no other.
    #[test]
    fn the_protocol_lists_every_outcome_and_no_other() {
        let documented = named_pairs(section(PROTOCOL, "### 6.5"));
        let emitted = (Outcome::ALL.iter())
            .map(|outcome| (format!("{outcome:?}"), outcome.as_str().to_owned()))
            .collect();
        assert_eq!(documented, emitted);
    }
}
