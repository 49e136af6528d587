//! The oracle: what the simulation holds every step against, beyond its effect counters. A
//! reference model of the store (`model`) checks each store call as it is made; the rules on
//! answers (`answers`) check each answer a client saw, and whether each client with time left
//! finished (`progress`), once the run is over.

pub(crate) mod answers;
pub(crate) mod model;
pub(crate) mod progress;

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::record::{ClaimToken, Fence, RecordId};

use model::{Call, Model, Seen};

/// The rule a violation breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Rule {
    /// A store answer the §10.1 table does not give.
    Store,
    /// A claim whose fence is not larger than every earlier claim's of the key (§5.3).
    FenceGrows,
    /// A completed record gone before its window, with no fault that forgets it.
    RecordVanished,
    /// A `422` mismatch to a request identical to every other sent with its key (§4.3).
    Mismatch,
    /// A replay that is not, byte for byte, a response the store accepted for its key (§6.4).
    ReplayEqual,
    /// A replay to a request other than the one whose run it replays (§4.3).
    ReplayIdentical,
    /// A `409`'s `Retry-After` pointing past the lease left, or past `retry_after` (§6.3).
    RetryAfter,
    /// `still_held()` true for a claim that does not own its key (§5.3).
    StillHeld,
    /// A client whose deadline outlasted the faults ended without an answer the protocol names.
    Progress,
}

#[derive(Debug, Clone)]
pub(crate) struct Violation {
    pub rule: Rule,
    pub subject: String,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({}): {}", self.rule, self.subject, self.detail)
    }
}

#[derive(Default)]
struct Counts {
    calls: u64,
    answers: u64,
}

struct State {
    model: Model,
    /// The operation each record id belongs to, for reports.
    names: std::collections::HashMap<RecordId, String>,
    counts: Counts,
    violations: Vec<Violation>,
}

impl State {
    fn subject(&self, id: &RecordId) -> String {
        self.names
            .get(id)
            .cloned()
            .unwrap_or_else(|| id.tag().to_string())
    }
}

/// One run's oracle, shared by the store's handles and the handlers.
pub(crate) struct Oracle {
    state: Mutex<State>,
}

impl Oracle {
    /// `fuzz`: how far the store's clock may stray from the run's (zero on the paused clock);
    /// `releases_behind`: for a store that releases behind a claim answered with an error, how
    /// long that may take.
    pub(crate) fn new(fuzz: Duration, releases_behind: Option<Duration>) -> Self {
        Self {
            state: Mutex::new(State {
                model: Model::new(fuzz, releases_behind),
                names: Default::default(),
                counts: Counts::default(),
                violations: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("the oracle's lock")
    }

    /// Checks one store call with the model: `check` gives the rules it broke.
    pub(crate) fn call(
        &self,
        id: &RecordId,
        check: impl FnOnce(&mut Model) -> Vec<(Rule, String)>,
    ) {
        let mut state = self.lock();
        state.counts.calls += 1;
        let found = check(&mut state.model);
        let subject = state.subject(id);
        let notes = state.model.notes(id).join("; ");
        for (rule, detail) in found {
            state.violations.push(Violation {
                rule,
                subject: subject.clone(),
                detail: format!("{detail} (the record's last calls: {notes})"),
            });
        }
    }

    /// Names `id` in reports.
    pub(crate) fn name(&self, id: RecordId, name: String) {
        self.lock().names.insert(id, name);
    }

    /// The token that owns `id` now, as the model knows it.
    pub(crate) fn owner(&self, id: &RecordId) -> Option<ClaimToken> {
        self.lock().model.owner(id, Instant::now())
    }

    /// Whether the model holds a completed record under `id` now.
    pub(crate) fn is_completed(&self, id: &RecordId) -> bool {
        self.lock().model.is_completed(id, Instant::now())
    }

    /// Whether the model knows `id`'s completed record to be another claim's than `token`'s.
    pub(crate) fn completed_by_another(&self, id: &RecordId, token: &ClaimToken) -> bool {
        self.lock()
            .model
            .completed_by_another(id, token, Instant::now())
    }

    /// Whether a completed record of `id` ran out its window and the key was claimed again.
    pub(crate) fn window_passed(&self, id: &RecordId) -> bool {
        self.lock().model.seen.window_passed.contains(id)
    }

    /// `still_held()` answered `true` for the claim with `fence`, just now.
    pub(crate) fn held(&self, id: &RecordId, fence: Fence, asked: Instant) {
        let mut state = self.lock();
        state.counts.answers += 1;
        let call = Call {
            sent: asked,
            answered: Instant::now(),
        };
        if !state.model.may_own(id, fence, call) {
            let subject = state.subject(id);
            state.violations.push(Violation {
                rule: Rule::StillHeld,
                subject,
                detail: format!(
                    "still_held() was true for fence {fence:?}, which does not own the key"
                ),
            });
        }
    }

    /// The store's clock went back: the fences it gives from now on may be smaller than those
    /// it gave before (§5.3), and need grow only from here.
    pub(crate) fn clock_went_back(&self) {
        self.lock().model.clock_went_back();
    }

    pub(crate) fn forget_all(&self) {
        self.lock().model.forget_all();
    }

    pub(crate) fn forget(&self, id: &RecordId) {
        self.lock().model.forget(id);
    }

    /// The run is over: the rules on answers, given what the model saw.
    pub(crate) fn finish(&self, judge: impl FnOnce(&Seen) -> (u64, Vec<Violation>)) -> Report {
        let mut state = self.lock();
        let (answers, violations) = judge(&state.model.seen);
        state.counts.answers += answers;
        state.violations.extend(violations);
        Report {
            calls: state.counts.calls,
            answers: state.counts.answers,
            violations: std::mem::take(&mut state.violations),
        }
    }
}

/// What the oracle found in one run.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub calls: u64,
    pub answers: u64,
    pub violations: Vec<Violation>,
}
