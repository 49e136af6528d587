//! The gRPC statuses of the layer's own answers, and the statuses of a handler's answers that are
//! stored (PROTOCOL.md §16.4, §16.5).

use http::StatusCode;
use tonic::Code;

use crate::problem::ProblemKind;
use crate::store_policy::StorePolicy;

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
/// use tower_idempotency::problem::ProblemKind;
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

/// Whether a handler's answer with this status is stored and replayed under the default store
/// policy (PROTOCOL.md §16.5): `OK`, and the failures the call's state decided, which its retry
/// would meet again (`ALREADY_EXISTS`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`).
///
/// A call refused as it was sent, before the handler acted (`INVALID_ARGUMENT`,
/// `UNAUTHENTICATED`, `PERMISSION_DENIED`, `NOT_FOUND`), is stored as the store policy stores the
/// HTTP status gRPC maps it to (400, 401, 403, 404): not by [`DefaultStorePolicy`], so that the
/// corrected call under the same key runs; by [`Every4xxStorePolicy`]. Every other code releases
/// the claim, so that a retry runs the call again: `UNAVAILABLE`, `DEADLINE_EXCEEDED`,
/// `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`, `UNKNOWN`, and `CANCELLED`, `UNIMPLEMENTED` and
/// `DATA_LOSS` (as HTTP stores no 5xx).
///
/// [`DefaultStorePolicy`]: crate::DefaultStorePolicy
/// [`Every4xxStorePolicy`]: crate::Every4xxStorePolicy
///
/// ```
/// use tonic::Code;
/// use tower_idempotency::grpc::is_stored;
///
/// assert!(is_stored(Code::Ok));
/// assert!(is_stored(Code::FailedPrecondition));
/// assert!(!is_stored(Code::InvalidArgument));
/// assert!(!is_stored(Code::Unavailable));
/// ```
pub fn is_stored(code: Code) -> bool {
    stored_under(code, &http::HeaderMap::new(), &crate::DefaultStorePolicy)
}

/// Whether an answer with `code` is stored under `policy`: the decided outcomes always, a refusal
/// as `policy` stores it with its HTTP status (the answer's headers kept, its extensions not:
/// they cannot be copied), nothing else.
pub(crate) fn stored_under(
    code: Code,
    headers: &http::HeaderMap,
    policy: &dyn StorePolicy,
) -> bool {
    match code {
        Code::Ok | Code::AlreadyExists | Code::FailedPrecondition | Code::OutOfRange => true,
        _ => refused_as(code).is_some_and(|status| {
            let (mut head, ()) = http::Response::new(()).into_parts();
            head.status = status;
            head.headers = headers.clone();
            policy.store(&head)
        }),
    }
}

/// The HTTP status of a code that refuses a call as it was sent, as gRPC's HTTP mapping gives it.
fn refused_as(code: Code) -> Option<StatusCode> {
    Some(match code {
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        _ => return None,
    })
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
        let stored = [0, 6, 9, 11];
        let refusals = [3, 5, 7, 16];
        for n in 0..=16 {
            let code = Code::from_i32(n);
            assert_eq!(is_stored(code), stored.contains(&n), "code {n}");
            assert_eq!(
                stored_under(code, &http::HeaderMap::new(), &crate::Every4xxStorePolicy),
                stored.contains(&n) || refusals.contains(&n),
                "code {n} under Every4xxStorePolicy"
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
