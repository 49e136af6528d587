//! The rules every answer a client saw is held to, once the run is over, given what the store
//! model saw: an identical retry never gets `422`; a replay is, byte for byte, a response the
//! store accepted for its key, and answers only a request identical to the one that ran;
//! a `409`'s `Retry-After` never points past the lease left (§6.3).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tokio::time::Instant;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::RecordId;
use tower_idempotency::{IDEMPOTENT_REPLAYED, Outcome};

use super::model::Seen;
use super::{Rule, Violation};

/// Which of an operation's bodies a request sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum BodyClass {
    /// The operation's body.
    Same,
    /// The same JSON with its members in another order: the same request only with canonical
    /// JSON (§4.4).
    Reordered,
    /// Another request under the same key (a client's bug, §4.3).
    Other,
}

/// The response header where a handler names the body it ran for: a replay carries it.
pub(crate) const RAN_FOR: &str = "x-ran-for";

impl BodyClass {
    pub(crate) fn body(self, op: usize) -> Bytes {
        Bytes::from(match self {
            BodyClass::Same => format!(r#"{{"op":{op},"amount":100}}"#),
            BodyClass::Reordered => format!(r#"{{"amount":100,"op":{op}}}"#),
            BodyClass::Other => format!(r#"{{"op":{op},"amount":101}}"#),
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            BodyClass::Same => "same",
            BodyClass::Reordered => "reordered",
            BodyClass::Other => "other",
        }
    }

    /// Whether two requests of these bodies are the same request.
    pub(crate) fn identical(self, other: Self, canonical_json: bool) -> bool {
        self == other || (canonical_json && self != BodyClass::Other && other != BodyClass::Other)
    }
}

/// One answer a client saw, as its link to the server got it.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub op: usize,
    pub client: usize,
    pub instance: usize,
    pub id: RecordId,
    pub class: BodyClass,
    pub answered: Instant,
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: Option<Outcome>,
    pub problem: Option<ProblemKind>,
}

impl Answer {
    pub(crate) fn is_replay(&self) -> bool {
        self.outcome == Some(Outcome::Replayed) || self.headers.contains_key(IDEMPOTENT_REPLAYED)
    }
}

/// What the rules need to know of the run.
pub(crate) struct Context<'a> {
    pub canonical_json: bool,
    pub retry_after: Duration,
    /// Per instance, the most its clock was behind the store's: a lease left it reads is longer
    /// by that much.
    pub behind: &'a [Duration],
    /// How far the store's clock may stray from the run's.
    pub fuzz: Duration,
    /// The bodies sent under each record id.
    pub sent: &'a HashMap<RecordId, BTreeSet<BodyClass>>,
}

pub(crate) fn judge(answers: &[Answer], context: &Context<'_>, seen: &Seen) -> Vec<Violation> {
    let mut violations = Vec::new();
    for answer in answers {
        for (rule, detail) in rules(answer, context, seen) {
            violations.push(Violation {
                rule,
                subject: format!("op-{} on instance {}", answer.op, answer.instance),
                detail,
            });
        }
    }
    violations
}

fn rules(answer: &Answer, context: &Context<'_>, seen: &Seen) -> Vec<(Rule, String)> {
    let mut found = Vec::new();
    if answer.status == StatusCode::UNPROCESSABLE_ENTITY
        && answer.problem == Some(ProblemKind::Mismatch)
    {
        let others = context.sent.get(&answer.id).into_iter().flatten();
        let mut others = others.filter(|c| !c.identical(answer.class, context.canonical_json));
        if others.next().is_none() {
            found.push((
                Rule::Mismatch,
                format!(
                    "422 to a {} body, identical to every body sent with its key",
                    answer.class.name()
                ),
            ));
        }
    }
    if answer.is_replay() {
        let landed = seen.landed.get(&answer.id).into_iter().flatten();
        let mut stored = landed.filter_map(|c| c.plain());
        let mut headers = answer.headers.clone();
        headers.remove(IDEMPOTENT_REPLAYED);
        if !stored
            .any(|s| s.status == answer.status && s.body == answer.body && s.headers == headers)
        {
            found.push((
                Rule::ReplayEqual,
                format!(
                    "a replay ({} {:?}) that no completion the store accepted holds",
                    answer.status, answer.body
                ),
            ));
        }
        let ran_for = answer.headers.get(RAN_FOR).and_then(|v| v.to_str().ok());
        let ran_for = [BodyClass::Same, BodyClass::Reordered, BodyClass::Other]
            .into_iter()
            .find(|c| Some(c.name()) == ran_for);
        if let Some(ran_for) = ran_for
            && !ran_for.identical(answer.class, context.canonical_json)
        {
            found.push((
                Rule::ReplayIdentical,
                format!(
                    "a replay of the run for a {} body, to a {} body",
                    ran_for.name(),
                    answer.class.name()
                ),
            ));
        }
    }
    if answer.status == StatusCode::CONFLICT && answer.problem == Some(ProblemKind::InFlight) {
        found.extend(retry_after(answer, context, seen));
    }
    found
}

/// §6.3: a 409 in flight says when to come back, in whole seconds rounded up, at least 1, never
/// past `retry_after` nor past the lease left. No lease the layer read can end later than the
/// latest the model knew of by the answer (plus, for an instance whose clock is behind, by how
/// far).
fn retry_after(answer: &Answer, context: &Context<'_>, seen: &Seen) -> Option<(Rule, String)> {
    let Some(value) = answer
        .headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return Some((
            Rule::RetryAfter,
            "a 409 in flight without Retry-After".into(),
        ));
    };
    let seconds = |d: Duration| d.as_secs_f64().ceil().max(1.0) as u64;
    let lease_end = seen
        .leases
        .get(&answer.id)
        .into_iter()
        .flatten()
        .filter(|(set, _)| *set <= answer.answered)
        .map(|(_, end)| *end)
        .max()
        .unwrap_or(answer.answered);
    let behind = context
        .behind
        .get(answer.instance)
        .copied()
        .unwrap_or_default();
    let left = lease_end.saturating_duration_since(answer.answered) + behind + context.fuzz;
    // A millisecond of slack for the rounding of a lease left measured a moment before.
    let bound = seconds(left + Duration::from_millis(1)).min(seconds(context.retry_after));
    (value > bound || value == 0).then(|| {
        (
            Rule::RetryAfter,
            format!(
                "Retry-After {value} s with {left:?} of the lease left and retry_after {:?}",
                context.retry_after
            ),
        )
    })
}
