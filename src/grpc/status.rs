//! The gRPC statuses of the layer's own answers, and the statuses of a handler's answers that are
//! stored (PROTOCOL.md §16.4, §16.5).

use tonic::Code;

use crate::problem::ProblemKind;

/// The gRPC code of each of the layer's own answers (PROTOCOL.md §16.4).
///
/// | `ProblemKind` | code | why |
/// |---|---|---|
/// | `MissingKey`, `InvalidKey` | `INVALID_ARGUMENT` | the call is malformed, whatever the server's state |
/// | `BodyTooLarge` | `RESOURCE_EXHAUSTED` | gRPC's code for a message over the size limit |
/// | `BodyUnreadable` | `UNAVAILABLE` | the request stream broke before it was whole; nothing was claimed |
/// | `InFlight` | `ABORTED`, with `RetryInfo` | a concurrency conflict: retry later, as 409 says |
/// | `Mismatch` | `FAILED_PRECONDITION` | the key is bound to another call: not until the caller changes it |
/// | `NotReplayable` | `ALREADY_EXISTS` | the call ran; its answer cannot be given again |
/// | `StoreUnavailable` | `UNAVAILABLE`, with `RetryInfo` | transient: retry later with the same key |
/// | `HandlerFailed` | `INTERNAL` | the handler failed or panicked; nothing was stored |
/// | `CommitRejected` | `FAILED_PRECONDITION` | the handler's writes were refused for the data they met |
/// | `RecordUnreadable` | `DATA_LOSS` | the stored answer is corrupt or cannot be opened |
/// | `QuotaExceeded` | `RESOURCE_EXHAUSTED`, with `RetryInfo` | the caller's quota of stored calls is spent for now |
///
/// ```
/// use tonic::Code;
/// use tower_idempotency::ProblemKind;
/// use tower_idempotency::grpc::code_for;
///
/// assert_eq!(code_for(ProblemKind::InFlight), Code::Aborted);
/// assert_eq!(code_for(ProblemKind::Mismatch), Code::FailedPrecondition);
/// ```
pub fn code_for(kind: ProblemKind) -> Code {
    match kind {
        ProblemKind::MissingKey | ProblemKind::InvalidKey => Code::InvalidArgument,
        ProblemKind::BodyTooLarge => Code::ResourceExhausted,
        ProblemKind::BodyUnreadable | ProblemKind::StoreUnavailable => Code::Unavailable,
        ProblemKind::InFlight => Code::Aborted,
        ProblemKind::Mismatch | ProblemKind::CommitRejected => Code::FailedPrecondition,
        ProblemKind::NotReplayable => Code::AlreadyExists,
        ProblemKind::HandlerFailed => Code::Internal,
        ProblemKind::RecordUnreadable => Code::DataLoss,
        ProblemKind::QuotaExceeded => Code::ResourceExhausted,
    }
}

/// Whether a handler's answer with this status is stored and replayed (PROTOCOL.md §16.5): `OK`
/// and the failures that the same call gets again (`INVALID_ARGUMENT`, `NOT_FOUND`,
/// `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`,
/// `UNAUTHENTICATED`). Every other code releases the claim, so that a retry runs the call again:
/// `UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`, `UNKNOWN`, and
/// `CANCELLED`, `UNIMPLEMENTED` and `DATA_LOSS` (as HTTP stores no 5xx).
///
/// ```
/// use tonic::Code;
/// use tower_idempotency::grpc::is_stored;
///
/// assert!(is_stored(Code::Ok));
/// assert!(is_stored(Code::FailedPrecondition));
/// assert!(!is_stored(Code::Unavailable));
/// ```
pub fn is_stored(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unauthenticated
    )
}

/// The `reason` of each answer's `google.rpc.ErrorInfo`: the problem type's anchor, in the
/// UPPER_SNAKE_CASE that `ErrorInfo` reasons are written in.
pub(crate) fn reason(kind: ProblemKind) -> &'static str {
    match kind {
        ProblemKind::MissingKey => "MISSING_KEY",
        ProblemKind::InvalidKey => "INVALID_KEY",
        ProblemKind::BodyTooLarge => "BODY_TOO_LARGE",
        ProblemKind::BodyUnreadable => "BODY_UNREADABLE",
        ProblemKind::InFlight => "IN_FLIGHT",
        ProblemKind::Mismatch => "MISMATCH",
        ProblemKind::NotReplayable => "NOT_REPLAYABLE",
        ProblemKind::StoreUnavailable => "STORE_UNAVAILABLE",
        ProblemKind::HandlerFailed => "HANDLER_FAILED",
        ProblemKind::CommitRejected => "COMMIT_REJECTED",
        ProblemKind::RecordUnreadable => "RECORD_UNREADABLE",
        ProblemKind::QuotaExceeded => "QUOTA_EXCEEDED",
    }
}

/// The kind whose `reason` this is.
pub(crate) fn kind_of(reason: &str) -> Option<ProblemKind> {
    ProblemKind::ALL
        .into_iter()
        .find(|kind| self::reason(*kind) == reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_reason_of_its_own() {
        for kind in ProblemKind::ALL {
            assert_eq!(kind_of(reason(kind)), Some(kind));
        }
    }

    #[test]
    fn the_storage_table() {
        let stored = [0, 3, 5, 6, 7, 9, 11, 16];
        for n in 0..=16 {
            assert_eq!(
                is_stored(Code::from_i32(n)),
                stored.contains(&n),
                "code {n}"
            );
        }
    }

    #[test]
    fn answers_that_say_later_are_retried_by_grpc_clients_and_the_rest_are_not() {
        // The codes a gRPC client's retry policy retries: `UNAVAILABLE` (everyone's) and
        // `ABORTED`. Only "in flight", "store away" and a request stream that broke say later.
        for kind in ProblemKind::ALL {
            let later = matches!(code_for(kind), Code::Unavailable | Code::Aborted);
            let expected = matches!(
                kind,
                ProblemKind::InFlight | ProblemKind::StoreUnavailable | ProblemKind::BodyUnreadable
            );
            assert_eq!(later, expected, "{kind:?}");
        }
    }
}
