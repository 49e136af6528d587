//! Where handlers' effects land, in three modes: unfenced (every run charges), fenced (one charge
//! per operation, under a unique key, and a run displaced by a larger fence refused), and
//! transactional (the charge is staged and commits with the idempotency record, as with `PgTx`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tower_idempotency::record::{ClaimToken, Fence};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Mode {
    Unfenced,
    Fenced,
    Transactional,
}

impl Mode {
    pub(crate) const ALL: [Mode; 3] = [Mode::Unfenced, Mode::Fenced, Mode::Transactional];
}

/// A claimed request's transaction (what `prepare` offers the handler): the claim's token, and
/// the charge the handler staged in it.
#[derive(Debug, Clone)]
pub(crate) struct Staged(Arc<(ClaimToken, Mutex<Option<Charge>>)>);

/// A charge of an operation: the operation, and the charge's id.
type Charge = (usize, String);

impl Staged {
    pub(crate) fn new(token: ClaimToken) -> Self {
        Self(Arc::new((token, Mutex::new(None))))
    }

    pub(crate) fn token(&self) -> ClaimToken {
        self.0.0
    }

    fn stage(&self, op: usize, charge: String) {
        *self.0.1.lock().unwrap() = Some((op, charge));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.1.lock().unwrap().is_none()
    }
}

/// A fenced run that found a larger fence on its operation: it must not act.
#[derive(Debug)]
pub(crate) struct Superseded;

#[derive(Default)]
struct State {
    next_charge: u64,
    /// Every charge made, per operation, in every mode.
    charges: HashMap<usize, Vec<String>>,
    /// Fenced: one row per operation, its charge and the largest fence seen.
    rows: HashMap<usize, (String, Fence)>,
    /// Which claim finished each run, per operation (token, instance).
    finished: Vec<(usize, ClaimToken, usize)>,
    /// Operations a handler ran for without a claim (fail-open, §9.7).
    unprotected: std::collections::HashSet<usize>,
}

pub(crate) struct Ledger {
    state: Mutex<State>,
    /// Each operation's mode.
    modes: Vec<Mode>,
    /// A bug to show the checker can fail: fenced handlers charge without their guard.
    unguarded: bool,
}

impl Ledger {
    pub(crate) fn new(modes: Vec<Mode>, unguarded: bool) -> Self {
        Self {
            state: Mutex::default(),
            modes,
            unguarded,
        }
    }

    pub(crate) fn mode(&self, op: usize) -> Mode {
        self.modes[op]
    }

    fn new_charge(state: &mut State, op: usize) -> String {
        state.next_charge += 1;
        format!("ch_{op}_{}", state.next_charge)
    }

    /// Unfenced: a new charge, every run.
    pub(crate) fn charge(&self, op: usize) -> String {
        let mut state = self.state.lock().unwrap();
        let charge = Self::new_charge(&mut state, op);
        state.charges.entry(op).or_default().push(charge.clone());
        charge
    }

    /// A run without a claim (fail-open): a new charge, whatever the mode, since nothing guards it.
    pub(crate) fn unprotected(&self, op: usize) -> String {
        self.state.lock().unwrap().unprotected.insert(op);
        self.charge(op)
    }

    /// Whether a handler ran for `op` without a claim.
    pub(crate) fn ran_unprotected(&self, op: usize) -> bool {
        self.state.lock().unwrap().unprotected.contains(&op)
    }

    /// Fenced: the operation's one charge, made by the first run; a later run with a fence at
    /// least as large takes the row over and resumes it; a smaller fence is refused.
    pub(crate) fn charge_fenced(&self, op: usize, fence: Fence) -> Result<String, Superseded> {
        if self.unguarded {
            return Ok(self.charge(op));
        }
        let mut state = self.state.lock().unwrap();
        match state.rows.get(&op).cloned() {
            Some((charge, seen)) if fence >= seen => {
                state.rows.insert(op, (charge.clone(), fence));
                Ok(charge)
            }
            Some(_) => Err(Superseded),
            None => {
                let charge = Self::new_charge(&mut state, op);
                state.charges.entry(op).or_default().push(charge.clone());
                state.rows.insert(op, (charge.clone(), fence));
                Ok(charge)
            }
        }
    }

    /// Fenced: whether `fence` still owns the operation's row (before answering).
    pub(crate) fn owns(&self, op: usize, fence: Fence) -> bool {
        self.unguarded
            || self
                .state
                .lock()
                .unwrap()
                .rows
                .get(&op)
                .is_some_and(|(_, seen)| *seen == fence)
    }

    /// Transactional: a charge staged in the request's transaction.
    pub(crate) fn stage(&self, op: usize, staged: &Staged) -> String {
        let charge = {
            let mut state = self.state.lock().unwrap();
            Self::new_charge(&mut state, op)
        };
        staged.stage(op, charge.clone());
        charge
    }

    /// The transaction commits with its record.
    pub(crate) fn commit(&self, staged: Staged) {
        if let Some((op, charge)) = staged.0.1.lock().unwrap().take() {
            self.state
                .lock()
                .unwrap()
                .charges
                .entry(op)
                .or_default()
                .push(charge);
        }
    }

    /// A store that restarted empty lost the transactional charges with their records: they were
    /// in one database.
    pub(crate) fn forget_committed(&self) {
        let mut state = self.state.lock().unwrap();
        state
            .charges
            .retain(|op, _| self.modes[*op] != Mode::Transactional);
    }

    pub(crate) fn finished(&self, op: usize, token: ClaimToken, instance: usize) {
        self.state
            .lock()
            .unwrap()
            .finished
            .push((op, token, instance));
    }

    pub(crate) fn charges(&self, op: usize) -> Vec<String> {
        let state = self.state.lock().unwrap();
        state.charges.get(&op).cloned().unwrap_or_default()
    }

    /// The runs that finished with a charge for `op`: (token, instance).
    pub(crate) fn runs(&self, op: usize) -> Vec<(ClaimToken, usize)> {
        let state = self.state.lock().unwrap();
        state
            .finished
            .iter()
            .filter(|(o, _, _)| *o == op)
            .map(|(_, token, instance)| (*token, *instance))
            .collect()
    }
}
