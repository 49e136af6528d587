//! The breaker's states and their changes: which claims may go to the store, and what their
//! answers say of it (`docs/PROTOCOL.md` §9.11).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::error_chain::ErrorChain;
use crate::layer_metrics::{self, BREAKER_STATES};
use crate::store::StoreError;

/// A breaker's settings, bounded as [`CircuitBreaker`](super::CircuitBreaker)'s builder
/// methods say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    pub(crate) failures: u32,
    pub(crate) within: Duration,
    pub(crate) cool_down: Duration,
}

impl Default for Settings {
    /// 5 failures within 10 s open the breaker for 5 s.
    fn default() -> Self {
        Self {
            failures: 5,
            within: Duration::from_secs(10),
            cool_down: Duration::from_secs(5),
        }
    }
}

/// Whether a store error says the store is away (unreachable or too slow), rather than answering.
fn is_away(err: &StoreError) -> bool {
    matches!(err, StoreError::Timeout(_) | StoreError::Unavailable(_))
}

/// A breaker's state, as the place of its name in [`BREAKER_STATES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entered {
    Open = 0,
    HalfOpen = 1,
    Closed = 2,
}

impl Entered {
    pub(crate) fn as_str(self) -> &'static str {
        BREAKER_STATES[self as usize]
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Claims go to the store; `failures` in a row so far, the first at `since`.
    Closed { failures: u32, since: Instant },
    /// No claim goes to the store until `until`.
    Open { until: Instant },
    /// The cool-down is over: one probe at a time goes to the store.
    HalfOpen { probing: bool },
}

/// The state of one breaker, shared by the clones of its [`CircuitBreaker`](super::CircuitBreaker).
pub(crate) struct Breaker {
    pub(crate) settings: Settings,
    /// Closed with no failure counted: a request passes, and a success is noted, with one load
    /// each and no lock.
    clean: AtomicBool,
    /// Bumped at every change of state, so that the answer of a claim admitted before the change
    /// is not taken for one of the new state's.
    epoch: AtomicU64,
    state: Mutex<State>,
}

/// What the breaker says of a claim about to be made.
#[derive(Debug)]
pub(crate) enum Admission<'a> {
    /// Make the claim, and tell the ticket its answer.
    Pass(Ticket<'a>),
    /// Make no store call: the cool-down left (zero while a probe runs).
    Refuse(Duration),
}

/// A claim the breaker let through: its answer goes back to the breaker
/// ([`answered`](Self::answered)). A probe dropped unanswered (its client went away during the
/// claim) frees the half-open breaker for the next request's probe.
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    breaker: &'a Breaker,
    epoch: u64,
    probe: bool,
    answered: bool,
}

/// A change of state, announced (logged and counted) once the lock is released.
struct Change {
    entered: Entered,
    /// Failures in the run that opened the breaker (0 when a probe's failure reopened it).
    failures: u32,
}

impl Breaker {
    pub(crate) fn new(settings: Settings) -> Self {
        Self {
            settings,
            clean: AtomicBool::new(true),
            epoch: AtomicU64::new(0),
            state: Mutex::new(State::Closed {
                failures: 0,
                since: Instant::now(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ticket(&self, epoch: u64, probe: bool) -> Admission<'_> {
        Admission::Pass(Ticket {
            breaker: self,
            epoch,
            probe,
            answered: false,
        })
    }

    /// Whether a claim may go to the store now.
    pub(crate) fn admit(&self, now: Instant) -> Admission<'_> {
        if self.clean.load(Ordering::Acquire) {
            return self.ticket(self.epoch.load(Ordering::Acquire), false);
        }
        let mut state = self.lock();
        let epoch = self.epoch.load(Ordering::Acquire);
        match *state {
            State::Closed { .. } => self.ticket(epoch, false),
            State::Open { until } if now < until => Admission::Refuse(until - now),
            State::Open { .. } => {
                *state = State::HalfOpen { probing: true };
                let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
                drop(state);
                self.announce(Change::to(Entered::HalfOpen), None);
                self.ticket(epoch, true)
            }
            State::HalfOpen { probing: false } => {
                *state = State::HalfOpen { probing: true };
                self.ticket(epoch, true)
            }
            State::HalfOpen { probing: true } => Admission::Refuse(Duration::ZERO),
        }
    }

    /// Takes a claim's answer.
    fn answer(&self, ticket: &Ticket<'_>, answer: Result<(), &StoreError>, now: Instant) {
        let failed = answer.is_err_and(is_away);
        if !failed && !ticket.probe && self.clean.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.lock();
        if self.epoch.load(Ordering::Acquire) != ticket.epoch {
            return;
        }
        let change = match (*state, failed) {
            (State::Closed { .. }, false) => {
                *state = State::Closed {
                    failures: 0,
                    since: now,
                };
                self.clean.store(true, Ordering::Release);
                None
            }
            (State::Closed { failures, since }, true) => {
                let run = if failures == 0 || now.duration_since(since) > self.settings.within {
                    (1, now)
                } else {
                    (failures + 1, since)
                };
                self.clean.store(false, Ordering::Release);
                if run.0 >= self.settings.failures {
                    *state = State::Open {
                        until: now + self.settings.cool_down,
                    };
                    Some(Change {
                        entered: Entered::Open,
                        failures: run.0,
                    })
                } else {
                    *state = State::Closed {
                        failures: run.0,
                        since: run.1,
                    };
                    None
                }
            }
            (State::HalfOpen { .. }, false) if ticket.probe => {
                *state = State::Closed {
                    failures: 0,
                    since: now,
                };
                self.clean.store(true, Ordering::Release);
                Some(Change::to(Entered::Closed))
            }
            (State::HalfOpen { .. }, true) if ticket.probe => {
                *state = State::Open {
                    until: now + self.settings.cool_down,
                };
                Some(Change::to(Entered::Open))
            }
            // Not the probe's answer (a probe's epoch is the half-open state's own), or the
            // breaker opened meanwhile: nothing to learn from it.
            _ => None,
        };
        if let Some(change) = change {
            self.epoch.fetch_add(1, Ordering::AcqRel);
            drop(state);
            self.announce(change, answer.err());
        }
    }

    /// A probe that went unanswered: the next request probes instead.
    fn abandon(&self, ticket: &Ticket<'_>) {
        let mut state = self.lock();
        if self.epoch.load(Ordering::Acquire) == ticket.epoch
            && matches!(*state, State::HalfOpen { probing: true })
        {
            *state = State::HalfOpen { probing: false };
        }
    }

    /// Logs and counts a change of state.
    fn announce(&self, change: Change, error: Option<&StoreError>) {
        layer_metrics::breaker_entered(change.entered);
        let state = change.entered.as_str();
        let cool_down_ms = u64::try_from(self.settings.cool_down.as_millis()).unwrap_or(u64::MAX);
        match change.entered {
            Entered::Open => {
                let error = error
                    .map(|err| ErrorChain(err).to_string())
                    .unwrap_or_default();
                if change.failures > 0 {
                    tracing::warn!(
                        target: "tower_idempotency",
                        state,
                        failures = change.failures,
                        cool_down_ms,
                        error,
                        "idempotency store circuit breaker opened: the store keeps failing; \
                         answering claims without it for the cool-down"
                    );
                } else {
                    tracing::warn!(
                        target: "tower_idempotency",
                        state,
                        cool_down_ms,
                        error,
                        "idempotency store circuit breaker opened again: the probe failed; \
                         answering claims without the store for the cool-down"
                    );
                }
            }
            Entered::HalfOpen => tracing::info!(
                target: "tower_idempotency",
                state,
                "idempotency store circuit breaker half-open: the next claim probes the store"
            ),
            Entered::Closed => tracing::info!(
                target: "tower_idempotency",
                state,
                "idempotency store circuit breaker closed: the store answered the probe"
            ),
        }
    }
}

impl Change {
    fn to(entered: Entered) -> Self {
        Self {
            entered,
            failures: 0,
        }
    }
}

impl fmt::Debug for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Breaker")
            .field("settings", &self.settings)
            .field("state", &*self.lock())
            .finish()
    }
}

impl Ticket<'_> {
    /// Tells the breaker what the store answered the claim (or, past a scope's quota, the read
    /// that stands for it).
    pub(crate) fn answered<T>(mut self, claim: &Result<T, StoreError>) {
        self.answered = true;
        let answer = claim.as_ref().map(|_| ());
        self.breaker.answer(&self, answer, Instant::now());
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.probe && !self.answered {
            self.breaker.abandon(self);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Claim;
    use tokio::time::advance;

    fn away() -> Result<Claim, StoreError> {
        Err(StoreError::Timeout(Duration::from_secs(1)))
    }

    fn answered() -> Result<Claim, StoreError> {
        Err(StoreError::Full { retry_after: None })
    }

    fn breaker() -> Breaker {
        Breaker::new(Settings {
            failures: 3,
            within: Duration::from_secs(10),
            cool_down: Duration::from_secs(5),
        })
    }

    /// Three failures open `breaker`, and its cool-down passes: the next claim is the probe.
    async fn open_until_the_probe(breaker: &Breaker) {
        for _ in 0..3 {
            claim(breaker, away());
        }
        advance(Duration::from_secs(5)).await;
    }

    /// Makes a claim through `breaker` that the store answers with `claim`; `None` when refused.
    fn claim(breaker: &Breaker, claim: Result<Claim, StoreError>) -> Option<()> {
        match breaker.admit(Instant::now()) {
            Admission::Pass(ticket) => {
                ticket.answered(&claim);
                Some(())
            }
            Admission::Refuse(_) => None,
        }
    }

    fn refused_for(breaker: &Breaker) -> Option<Duration> {
        match breaker.admit(Instant::now()) {
            Admission::Refuse(left) => Some(left),
            Admission::Pass(_) => None,
        }
    }

    fn state(breaker: &Breaker) -> State {
        *breaker.lock()
    }

    #[tokio::test(start_paused = true)]
    async fn failures_in_a_row_within_the_window_open_it() {
        let breaker = breaker();
        for _ in 0..2 {
            assert_eq!(claim(&breaker, away()), Some(()));
        }
        assert!(matches!(state(&breaker), State::Closed { failures: 2, .. }));
        assert_eq!(claim(&breaker, away()), Some(()));
        assert!(matches!(state(&breaker), State::Open { .. }));
        assert_eq!(refused_for(&breaker), Some(Duration::from_secs(5)));
        advance(Duration::from_millis(3_500)).await;
        assert_eq!(refused_for(&breaker), Some(Duration::from_millis(1_500)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_between_failures_ends_the_run() {
        let breaker = breaker();
        for _ in 0..10 {
            claim(&breaker, away());
            claim(&breaker, away());
            // `Full` is the store's answer: it is there.
            claim(&breaker, answered());
        }
        assert!(matches!(state(&breaker), State::Closed { failures: 0, .. }));
        assert!(breaker.clean.load(Ordering::SeqCst));
        claim(&breaker, away());
        claim(
            &breaker,
            Ok(Claim::Existing(crate::record::Record::InFlight(inflight()))),
        );
        claim(&breaker, away());
        claim(&breaker, away());
        assert!(matches!(state(&breaker), State::Closed { failures: 2, .. }));
    }

    fn inflight() -> crate::record::InFlight {
        crate::record::InFlight {
            fingerprint: crate::record::Fingerprint::from_bytes([0; 32]),
            lease_remaining: Duration::from_secs(1),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failures_further_apart_than_the_window_do_not_open_it() {
        let breaker = breaker();
        for _ in 0..10 {
            claim(&breaker, away());
            advance(Duration::from_millis(5_001)).await;
        }
        assert!(matches!(state(&breaker), State::Closed { .. }));
        // Within the window of the run's first failure: the third opens it.
        claim(&breaker, away());
        advance(Duration::from_secs(5)).await;
        claim(&breaker, away());
        assert!(matches!(state(&breaker), State::Closed { failures: 2, .. }));
        advance(Duration::from_secs(5)).await;
        claim(&breaker, away());
        assert!(matches!(state(&breaker), State::Open { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_cool_down_one_probe_passes_and_its_answer_closes_it() {
        let breaker = breaker();
        open_until_the_probe(&breaker).await;
        let Admission::Pass(probe) = breaker.admit(Instant::now()) else {
            panic!("the probe passes");
        };
        assert!(probe.probe);
        // While it runs, everyone else is refused, with no time named.
        assert_eq!(refused_for(&breaker), Some(Duration::ZERO));
        assert_eq!(refused_for(&breaker), Some(Duration::ZERO));
        assert!(format!("{breaker:?}").contains("HalfOpen"), "{breaker:?}");
        probe.answered(&answered());
        assert!(matches!(state(&breaker), State::Closed { failures: 0, .. }));
        assert_eq!(claim(&breaker, away()), Some(()), "closed: claims pass");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_opens_it_for_another_cool_down() {
        let breaker = breaker();
        open_until_the_probe(&breaker).await;
        assert_eq!(claim(&breaker, away()), Some(()), "the probe");
        assert_eq!(refused_for(&breaker), Some(Duration::from_secs(5)));
        advance(Duration::from_secs(5)).await;
        assert_eq!(claim(&breaker, Ok(Claim::Claimed(token()))), Some(()));
        assert!(matches!(state(&breaker), State::Closed { .. }));
    }

    fn token() -> crate::record::ClaimToken {
        crate::record::ClaimToken::new(crate::record::Fence::new(1))
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_lets_the_next_request_probe() {
        let breaker = breaker();
        open_until_the_probe(&breaker).await;
        let Admission::Pass(probe) = breaker.admit(Instant::now()) else {
            panic!("the probe passes");
        };
        drop(probe);
        assert!(matches!(
            state(&breaker),
            State::HalfOpen { probing: false }
        ));
        assert_eq!(claim(&breaker, answered()), Some(()), "the next probe");
        assert!(matches!(state(&breaker), State::Closed { .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn answers_of_claims_admitted_before_a_change_count_for_nothing() {
        let breaker = breaker();
        // Admitted while closed, answered after the breaker opened and closed again.
        let Admission::Pass(late_failure) = breaker.admit(Instant::now()) else {
            panic!("closed");
        };
        let Admission::Pass(late_success) = breaker.admit(Instant::now()) else {
            panic!("closed");
        };
        open_until_the_probe(&breaker).await;
        let Admission::Pass(probe) = breaker.admit(Instant::now()) else {
            panic!("the probe passes");
        };
        // A claim admitted while closed answers during the probe: it does not close it.
        late_success.answered(&answered());
        assert!(matches!(state(&breaker), State::HalfOpen { probing: true }));
        probe.answered(&answered());
        assert!(matches!(state(&breaker), State::Closed { failures: 0, .. }));
        // One admitted before the breaker opened, failing now: not a failure of the new run.
        late_failure.answered(&away());
        assert!(matches!(state(&breaker), State::Closed { failures: 0, .. }));
        assert!(breaker.clean.load(Ordering::SeqCst));
    }
}
