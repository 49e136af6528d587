//! The effect checker: per operation, how many charges; whether every `201` a client saw is the
//! stored response; whether a completion was lost (a handler finished, its record was never
//! written, and the layer was never told why). Each finding is held against the guarantee of its
//! mode under the faults that touched it (PROTOCOL.md §9.10): a violation is a finding the
//! guarantee rules out. The oracle's violations (`oracle/`) come with the history.

use std::collections::BTreeSet;
use std::fmt;

use http::StatusCode;

use super::faults::Fault;
use super::handler::charge_of;
use super::ledger::Mode;
use super::world::{History, OpHistory};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finding {
    DoubleEffect,
    WrongAnswer,
    LostCompletion,
    /// A claim of the key had a fence no larger than an earlier claim's (§5.3).
    FenceNotGrowing,
}

/// A finding the guarantees rule out.
#[derive(Debug)]
pub(crate) struct Violation {
    pub op: usize,
    pub mode: Mode,
    pub finding: Finding,
    pub faults: BTreeSet<Fault>,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "op-{} ({:?}): {:?} under {:?}: {}",
            self.op, self.mode, self.finding, self.faults, self.detail
        )
    }
}

/// What one run's history shows.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// Double effects per mode: unfenced, fenced, transactional.
    pub double_effects: [u64; 3],
    pub lost_completions: u64,
    pub wrong_answers: u64,
    pub stale_fences: u64,
    /// Every finding, allowed or not, for a seed's report.
    pub findings: Vec<String>,
    pub violations: Vec<Violation>,
}

fn mode_index(mode: Mode) -> usize {
    match mode {
        Mode::Unfenced => 0,
        Mode::Fenced => 1,
        Mode::Transactional => 2,
    }
}

pub(crate) fn check(history: &History) -> Verdict {
    let mut verdict = Verdict::default();
    for op in &history.ops {
        for (finding, detail) in findings(op) {
            match finding {
                Finding::DoubleEffect => verdict.double_effects[mode_index(op.mode)] += 1,
                Finding::WrongAnswer => verdict.wrong_answers += 1,
                Finding::LostCompletion => verdict.lost_completions += 1,
                Finding::FenceNotGrowing => verdict.stale_fences += 1,
            }
            verdict.findings.push(format!(
                "op-{} ({:?}): {finding:?} under {:?}: {detail}",
                op.op, op.mode, op.hits
            ));
            if !allowed(op, finding) {
                verdict.violations.push(Violation {
                    op: op.op,
                    mode: op.mode,
                    finding,
                    faults: op.hits.clone(),
                    detail,
                });
            }
        }
    }
    verdict
}

fn findings(op: &OpHistory) -> Vec<(Finding, String)> {
    let mut found = Vec::new();
    if op.charges.len() > 1 {
        found.push((
            Finding::DoubleEffect,
            format!("{} charges: {:?}", op.charges.len(), op.charges),
        ));
    }
    for answer in &op.answers {
        if answer.status != StatusCode::CREATED {
            continue;
        }
        let charge = charge_of(&answer.body);
        let wrong = match &op.record {
            // Every retry from now on gets the record: the client must have seen the same.
            Some(record) => charge_of(record) != charge,
            // A transactional store that restarted empty lost the record and the charge together
            // (a database restored from an old backup): nothing is left to hold the answer to.
            None if op.mode == Mode::Transactional && op.hits.contains(&Fault::Restart) => false,
            // No record left (the store forgot it, or kept a tombstone): the answer must name a
            // charge that was made.
            None => !op.charges.iter().any(|made| made.as_bytes() == charge),
        };
        if wrong {
            found.push((
                Finding::WrongAnswer,
                format!(
                    "the client got {:?}, the record holds {:?}, charges {:?}",
                    answer.body, op.record, op.charges
                ),
            ));
        }
    }
    if !op.fences_grew {
        found.push((
            Finding::FenceNotGrowing,
            String::from("a claim's fence was no larger than an earlier claim's"),
        ));
    }
    if op.unwritten > 0 {
        found.push((
            Finding::LostCompletion,
            format!(
                "{} finished runs whose completion was neither written nor refused",
                op.unwritten
            ),
        ));
    }
    found
}

/// The guarantees (PROTOCOL.md §9.10): fenced and transactional effects never double and answers
/// never disagree, under any fault but one that forgets records; unfenced effects neither while
/// every fault is short. A run without a claim (fail-open) and a key whose window passed (§8.6)
/// are the protocol's own exceptions. A completion is never lost silently, under any fault: the
/// runs of an instance that died are not counted.
fn allowed(op: &OpHistory, finding: Finding) -> bool {
    let hits = &op.hits;
    let long = hits.iter().any(|fault| fault.is_long());
    let forgot = hits
        .iter()
        .any(|fault| *fault == Fault::Restart || fault.loses_record_alone());
    let by_protocol = op.unprotected || op.window_passed;
    match (op.mode, finding) {
        (_, Finding::LostCompletion | Finding::FenceNotGrowing) => false,
        (Mode::Unfenced, _) => long || by_protocol,
        (_, Finding::WrongAnswer) => forgot || by_protocol,
        (Mode::Fenced, Finding::DoubleEffect) => op.unprotected,
        // The record lost alone: the work it recorded stays committed, and a retry does it again.
        (Mode::Transactional, Finding::DoubleEffect) => {
            hits.iter().any(|fault| fault.loses_record_alone()) || by_protocol
        }
    }
}
