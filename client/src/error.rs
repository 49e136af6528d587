//! `Error`: why the client layer returns no response.

use std::time::{Duration, SystemTime};

use http::HeaderValue;

/// The inner service's failures, and a body's, as tower and http-body pass them on.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a request through the client layer ended without a response.
///
/// A response of any status, retried or not, is a response, not an error: the layer returns the
/// last one when it stops retrying. Errors carry the number of attempts made
/// ([`Error::attempts`]); the inner service's failure is kept as the [source].
///
/// [source]: std::error::Error::source
///
/// ```
/// use tower_idempotency_client::Error;
///
/// let err = Error::BodyTooLarge { limit: 1024 };
/// assert_eq!(err.attempts(), 0);
/// assert_eq!(err.to_string(), "the request body is over the client's limit of 1024 bytes, so it cannot be sent again on a retry");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request body is larger than the layer buffers: nothing was sent. Raise the limit, or
    /// send such bodies around the layer.
    #[error(
        "the request body is over the client's limit of {limit} bytes, so it cannot be sent again on a retry"
    )]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// Reading the request body failed: nothing was sent.
    #[error("reading the request body failed")]
    Body(#[source] BoxError),
    /// The last attempt ran out of time: its own timeout, or the overall deadline. Whether the
    /// operation happened is unknown; a later request with the same key finds out.
    #[error("the request timed out after {attempts} attempt(s) ({elapsed:?} in all)")]
    TimedOut {
        /// The attempts made, the one that timed out included.
        attempts: u32,
        /// The time from the call to the end.
        elapsed: Duration,
    },
    /// A retry was due, but it would have been sent at or after the moment the server forgets the
    /// key, less the layer's margin: the moment its retention header stated, or the call plus the
    /// configured [`retention`](crate::IdempotentRetryLayer::retention). The server would not
    /// recognise the key and would run the operation again, so no retry was sent. The operation
    /// may have run once (the last answer was a retryable one): look its result up before
    /// sending it again.
    #[error(
        "not retrying the request with key {}: the server keeps that key only until {}, and a \
         retry after that would run the operation again ({attempts} attempt(s) made)",
        String::from_utf8_lossy(key.as_bytes()),
        httpdate::fmt_http_date(*expires)
    )]
    RetentionPassed {
        /// The operation's key.
        key: HeaderValue,
        /// The moment the server stated, or the call plus the configured retention (on this
        /// process's wall clock).
        expires: SystemTime,
        /// The attempts made.
        attempts: u32,
    },
    /// The server answered that the operation ran once and its response is not kept (the server
    /// layer's `not-replayable`, a `409` named so in its `Idempotency-Problem` header): the
    /// response was too large to store, or failed while it was produced. No retry can get it, and
    /// none was sent. Look the operation's result up; a new key would run it again.
    #[error(
        "the request with key {} ran once on the server, and its response is not kept, so a \
         retry cannot get it ({attempts} attempt(s) made): look the operation's result up",
        String::from_utf8_lossy(key.as_bytes())
    )]
    NotReplayable {
        /// The operation's key.
        key: HeaderValue,
        /// The attempts made, the one answered `not-replayable` included.
        attempts: u32,
    },
    /// The inner service failed on the last attempt (or was not ready for the first).
    #[error("the request failed after {attempts} attempt(s)")]
    Transport {
        /// The attempts made.
        attempts: u32,
        /// The inner service's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// The attempts made before the error: 0 when nothing was sent.
    pub fn attempts(&self) -> u32 {
        match self {
            Error::BodyTooLarge { .. } | Error::Body(_) => 0,
            Error::TimedOut { attempts, .. }
            | Error::Transport { attempts, .. }
            | Error::RetentionPassed { attempts, .. }
            | Error::NotReplayable { attempts, .. } => *attempts,
        }
    }
}
