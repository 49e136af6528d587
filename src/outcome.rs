//! What the layer did with a request.

use std::fmt;

/// What the layer did with a request: in every response's extensions, and the `outcome` field of
/// the layer's `tracing` events (target `tower_idempotency`).
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
/// let request = || Request::post("/").header("idempotency-key", "k").body(String::new()).unwrap();
///
/// let first = app.clone().oneshot(request()).await.unwrap();
/// assert_eq!(first.extensions().get::<Outcome>(), Some(&Outcome::Executed));
/// let retry = app.oneshot(request()).await.unwrap();
/// assert_eq!(retry.extensions().get::<Outcome>(), Some(&Outcome::Replayed));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// A covered method without a key, passed through because keys are optional.
    Unprotected,
    /// The handler ran and its response (or a tombstone) was stored.
    Executed,
    /// The handler ran, and its response was not stored (store policy, `Cache-Control: no-store`):
    /// the claim was released.
    NotStored,
    /// The stored response was replayed; the handler did not run.
    Replayed,
    /// The key's first request is still running: 409.
    InFlight,
    /// The key was used for a different request: 422.
    Mismatch,
    /// The key's request completed, but its response was not stored.
    NotReplayable,
    /// The request was refused before any claim: a missing or invalid key, a body over the limit,
    /// or the scope function's rejection.
    Rejected,
    /// The store failed at claim time: 503.
    StoreUnavailable,
    /// The store failed at claim time and the layer is fail-open: the handler ran unprotected.
    FailedOpen,
    /// The handler failed or panicked: 500, and the claim was released.
    HandlerFailed,
    /// The handler ran, but its transaction was refused at commit for a reason that sending it
    /// again cannot fix (a store whose completion commits with the work, [`StoreError::Rejected`]):
    /// 422, nothing was done, and the claim was released.
    ///
    /// [`StoreError::Rejected`]: crate::StoreError::Rejected
    CommitRejected,
    /// The key's record cannot be opened or trusted (a sealed record that does not open, or one in
    /// clear where sealed ones are required): 500, neither replayed nor run again.
    RecordUnreadable,
    /// The request's scope has written its quota of records through this instance: 429, nothing
    /// read or claimed ([`ScopeQuota`](crate::ScopeQuota)).
    QuotaExceeded,
}

impl Outcome {
    /// The outcome's name, as it appears in logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Unprotected => "unprotected",
            Outcome::Executed => "executed",
            Outcome::NotStored => "not_stored",
            Outcome::Replayed => "replayed",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::NotReplayable => "not_replayable",
            Outcome::Rejected => "rejected",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::FailedOpen => "failed_open",
            Outcome::HandlerFailed => "handler_failed",
            Outcome::CommitRejected => "commit_rejected",
            Outcome::RecordUnreadable => "record_unreadable",
            Outcome::QuotaExceeded => "quota_exceeded",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
