//! Progress: a client whose deadline outlasts the faults by enough for the world to settle (a
//! lost claim's lease to run out, a long handler to finish, a pending write to land) ends with an
//! answer: the handler's own (a `2xx`, or a status it chose), or the one problem the protocol
//! names for its case (a `422` for a key reused with another body, `409 not-replayable` for a
//! response over the limit, ...). A `409` in flight, a `503` or no answer at all is no progress.

use http::StatusCode;
use tokio::time::Instant;
use tower_idempotency::problem::ProblemKind;

use super::{Rule, Violation};

/// How one client's operation ended.
#[derive(Debug, Clone)]
pub(crate) struct Finish {
    pub op: usize,
    pub client: usize,
    pub deadline: Instant,
    /// The last answer (status, and the layer's problem if it made one), or why there was none.
    pub last: Result<(StatusCode, Option<ProblemKind>), String>,
    /// The last answer the client got from a server, whatever it then did.
    pub last_seen: Option<(StatusCode, Option<ProblemKind>)>,
}

/// The clients whose deadline ends after `settled` must have finished; `named` says whether a
/// problem is the protocol's answer for the client's case. Returns how many were checked.
pub(crate) fn judge(
    finishes: &[Finish],
    settled: Instant,
    named: impl Fn(&Finish, ProblemKind) -> bool,
) -> (u64, Vec<Violation>) {
    let mut violations = Vec::new();
    let mut checked = 0;
    for finish in finishes.iter().filter(|f| f.deadline >= settled) {
        checked += 1;
        let detail = match &finish.last {
            Ok((_, None)) => continue,
            Ok((_, Some(kind))) if named(finish, *kind) => continue,
            Ok((status, Some(kind))) => format!("ended with {status} {kind:?}"),
            // The client layer retries every 409 (§14.3), `not-replayable` too, until its
            // deadline: the answer it kept getting is the protocol's for a tombstone.
            Err(_)
                if finish.last_seen.is_some_and(|(_, kind)| {
                    kind == Some(ProblemKind::NotReplayable)
                        && named(finish, ProblemKind::NotReplayable)
                }) =>
            {
                continue;
            }
            Err(err) => format!("ended without an answer: {err}"),
        };
        violations.push(Violation {
            rule: Rule::Progress,
            subject: format!("op-{} client {}", finish.op, finish.client),
            detail,
        });
    }
    (checked, violations)
}
