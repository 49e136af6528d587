//! A reference model of the store table of PROTOCOL.md §10.1, one slot per record id, held
//! against every answer the real store gives. A call's moment is known only between its sending
//! and its answer (on the paused clock, one instant): an expiry inside that span may have passed
//! or not, and then the answer decides, as a later reply decides between the branches of a lost
//! one. A call that failed in a way that may or may not have applied leaves the slot unknown, and
//! the next answer decides it too.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, Record, RecordId};
use tower_idempotency::store::{Claim, StoreError};

use super::Rule;

/// When a call reached the store: somewhere between these two moments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub sent: Instant,
    pub answered: Instant,
}

/// When a record expires: somewhere between these two moments.
#[derive(Debug, Clone, Copy)]
struct Window {
    earliest: Instant,
    latest: Instant,
}

impl Window {
    fn after(call: Call, span: Duration) -> Self {
        Self {
            earliest: call.sent + span,
            latest: call.answered + span,
        }
    }
}

#[derive(Debug, Clone)]
enum Slot {
    /// `token` is `None` when the slot was learnt from an answer, not from the claim.
    InFlight {
        token: Option<ClaimToken>,
        fingerprint: Fingerprint,
        expires: Window,
    },
    /// `by`: the claim that wrote it, when the model saw the write.
    Completed {
        completed: Completed,
        by: Option<ClaimToken>,
        expires: Window,
    },
    /// What the store holds is not known: the next answer decides.
    Unknown,
}

/// Whether a slot is live at a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Live {
    Yes,
    No,
    Either,
}

/// What the model expects a boolean answer to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Is(bool),
    Either,
}

/// What the model saw, kept for the rules on answers.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// Each lease end a record of the id had, as (when it was set, its latest end).
    pub leases: HashMap<RecordId, Vec<(Instant, Instant)>>,
    /// The completed records the store accepted, per id.
    pub landed: HashMap<RecordId, Vec<Completed>>,
    /// Ids whose completed record ran out its window and whose key was claimed again.
    pub window_passed: HashSet<RecordId>,
}

pub(crate) struct Model {
    slots: HashMap<RecordId, Slot>,
    /// How far a store's clock and expiry may stray from the model's (real time only).
    fuzz: Duration,
    /// For a store that releases behind a claim answered with an error, how long that may take.
    releases_behind: Option<Duration>,
    fences: HashMap<RecordId, Fence>,
    tokens: HashSet<ClaimToken>,
    /// Records a call was abandoned on, until when: a store may clean up after an abandoned
    /// call in the background (`RedisStore` releases a claim its `SET` may still make), so
    /// until then every answer is taken as it comes.
    loose: HashMap<RecordId, Instant>,
    /// The last calls on each record, for a violation's report.
    notes: HashMap<RecordId, std::collections::VecDeque<String>>,
    /// When the model began: the times of its notes are from it.
    origin: Instant,
    pub seen: Seen,
}

type Found = Vec<(Rule, String)>;

impl Model {
    pub(crate) fn new(fuzz: Duration, releases_behind: Option<Duration>) -> Self {
        Self {
            slots: HashMap::new(),
            fuzz,
            releases_behind,
            fences: HashMap::new(),
            tokens: HashSet::new(),
            loose: HashMap::new(),
            notes: HashMap::new(),
            origin: Instant::now(),
            seen: Seen::default(),
        }
    }

    /// Notes what happened to `id` (the last few notes are kept).
    pub(crate) fn note(&mut self, id: &RecordId, what: impl FnOnce(Instant) -> String) {
        let note = what(self.origin);
        let notes = self.notes.entry(*id).or_default();
        if notes.len() == 6 {
            notes.pop_front();
        }
        notes.push_back(note);
    }

    /// The last notes on `id`, oldest first.
    pub(crate) fn notes(&self, id: &RecordId) -> Vec<String> {
        self.notes.get(id).into_iter().flatten().cloned().collect()
    }

    fn live(&self, expires: Window, call: Call) -> Live {
        if call.answered + self.fuzz < expires.earliest {
            Live::Yes
        } else if call.sent >= expires.latest + self.fuzz {
            Live::No
        } else {
            Live::Either
        }
    }

    /// The slot of `id`, and whether it is live at `call` (`None`: no record).
    fn slot(&self, id: &RecordId, call: Call) -> Option<(Slot, Live)> {
        let slot = self.slots.get(id)?.clone();
        let live = match &slot {
            Slot::InFlight { expires, .. } | Slot::Completed { expires, .. } => {
                self.live(*expires, call)
            }
            Slot::Unknown => Live::Either,
        };
        Some((slot, live))
    }

    fn set_lease(&mut self, id: &RecordId, call: Call, expires: Window) {
        self.seen
            .leases
            .entry(*id)
            .or_default()
            .push((call.answered, expires.latest));
    }

    /// The token that owns `id` now, as far as the model knows.
    pub(crate) fn owner(&self, id: &RecordId, now: Instant) -> Option<ClaimToken> {
        let call = Call {
            sent: now,
            answered: now,
        };
        match self.slot(id, call) {
            Some((Slot::InFlight { token, .. }, Live::Yes | Live::Either)) => token,
            _ => None,
        }
    }

    /// Whether `id` holds a completed record for certain at `now`.
    pub(crate) fn is_completed(&self, id: &RecordId, now: Instant) -> bool {
        let call = Call {
            sent: now,
            answered: now,
        };
        matches!(
            self.slot(id, call),
            Some((Slot::Completed { .. }, Live::Yes))
        )
    }

    /// Whether `id` holds, for certain at `now`, a completed record written by a claim other than
    /// `token`'s.
    pub(crate) fn completed_by_another(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        now: Instant,
    ) -> bool {
        let call = Call {
            sent: now,
            answered: now,
        };
        matches!(
            self.slot(id, call),
            Some((Slot::Completed { by: Some(by), .. }, Live::Yes)) if by != *token
        )
    }

    /// Whether the claim with `fence` may own `id` at `call`.
    pub(crate) fn may_own(&self, id: &RecordId, fence: Fence, call: Call) -> bool {
        match self.slot(id, call) {
            Some((Slot::InFlight { token: None, .. }, _)) | Some((Slot::Unknown, _)) => true,
            Some((Slot::InFlight { token: Some(t), .. }, live)) => {
                t.fence() == fence && live != Live::No
            }
            _ => false,
        }
    }

    /// A store error: nothing applied for `Full`, anything else may have.
    fn failed(&mut self, id: &RecordId, err: &StoreError) {
        if !matches!(err, StoreError::Full { .. }) {
            self.slots.insert(*id, Slot::Unknown);
        }
    }

    /// A claim answered with an error may have landed; a store that releases such a claim behind
    /// it (`RedisStore`, §10.6) may do so a moment later: its answers are taken as they come
    /// until then, as after an abandoned call.
    fn claim_failed(&mut self, id: &RecordId, err: &StoreError) {
        self.failed(id, err);
        if let Some(settle) = self.releases_behind
            && !matches!(err, StoreError::Full { .. })
        {
            self.loose.insert(*id, Instant::now() + settle);
        }
    }

    pub(crate) fn claim(
        &mut self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        call: Call,
        answer: &Result<Claim, StoreError>,
    ) -> Found {
        if self.is_loose(id, call) {
            if let Ok(Claim::Claimed(token)) = answer {
                self.tokens.insert(*token);
            }
            return Found::new();
        }
        let mut found = Found::new();
        let slot = self.slot(id, call);
        match answer {
            Ok(Claim::Claimed(token)) => {
                if !self.tokens.insert(*token) {
                    found.push((
                        Rule::Store,
                        format!("claim: a token given twice: {token:?}"),
                    ));
                }
                let fence = token.fence();
                if let Some(max) = self.fences.insert(*id, fence)
                    && fence <= max
                {
                    self.fences.insert(*id, max);
                    found.push((
                        Rule::FenceGrows,
                        format!("claim: fence {fence:?} after {max:?} (§5.3)"),
                    ));
                }
                match slot {
                    Some((Slot::Completed { .. }, Live::Yes)) => found.push((
                        Rule::RecordVanished,
                        "claim: claimed over a live completed record".into(),
                    )),
                    Some((Slot::InFlight { .. }, Live::Yes)) => found.push((
                        Rule::Store,
                        "claim: claimed over a live claim (§10.2)".into(),
                    )),
                    Some((Slot::Completed { .. }, _)) => {
                        self.seen.window_passed.insert(*id);
                    }
                    _ => {}
                }
                let expires = Window::after(call, lease);
                self.slots.insert(
                    *id,
                    Slot::InFlight {
                        token: Some(*token),
                        fingerprint: *fingerprint,
                        expires,
                    },
                );
                self.set_lease(id, call, expires);
            }
            Ok(Claim::Existing(Record::InFlight(record))) => {
                let left = record.lease_remaining;
                match slot {
                    Some((
                        Slot::InFlight {
                            fingerprint: held,
                            expires,
                            ..
                        },
                        Live::Yes | Live::Either,
                    )) => {
                        if held != record.fingerprint {
                            found.push((
                                Rule::Store,
                                "claim: the record's fingerprint changed".into(),
                            ));
                        }
                        let most = expires.latest.saturating_duration_since(call.sent) + self.fuzz;
                        let least = expires
                            .earliest
                            .saturating_duration_since(call.answered)
                            .saturating_sub(self.fuzz);
                        // A live record's lease left is more than zero (§10.1), whatever a
                        // store's clock rounds to.
                        if left.is_zero() || left > most || left < least || left > lease {
                            found.push((
                                Rule::Store,
                                format!(
                                    "claim: {left:?} of the lease left, the model says {least:?} to {most:?}"
                                ),
                            ));
                        }
                    }
                    Some((Slot::Unknown, _)) => {
                        let expires = Window {
                            earliest: call.sent + left,
                            latest: call.answered + left,
                        };
                        self.slots.insert(
                            *id,
                            Slot::InFlight {
                                token: None,
                                fingerprint: record.fingerprint,
                                expires,
                            },
                        );
                        self.set_lease(id, call, expires);
                    }
                    other => found.push((
                        Rule::Store,
                        format!("claim: a record in flight where the model has {other:?}"),
                    )),
                }
            }
            Ok(Claim::Existing(Record::Completed(completed))) => match slot {
                Some((
                    Slot::Completed {
                        completed: held, ..
                    },
                    Live::Yes | Live::Either,
                )) if held == *completed => {}
                Some((Slot::Unknown, _)) => {
                    let expires = Window {
                        earliest: call.answered,
                        latest: call.answered + Duration::from_secs(30 * 86_400),
                    };
                    self.slots.insert(
                        *id,
                        Slot::Completed {
                            completed: completed.clone(),
                            by: None,
                            expires,
                        },
                    );
                }
                other => found.push((
                    Rule::Store,
                    format!("claim: a completed record where the model has {other:?}"),
                )),
            },
            Err(err) => self.claim_failed(id, err),
        }
        found
    }

    pub(crate) fn complete(
        &mut self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
        call: Call,
        answer: &Result<bool, StoreError>,
    ) -> Found {
        if self.is_loose(id, call) {
            if let Ok(true) = answer {
                self.seen
                    .landed
                    .entry(*id)
                    .or_default()
                    .push(completed.clone());
            }
            return Found::new();
        }
        let slot = self.slot(id, call);
        let expect = match &slot {
            None | Some((_, Live::No)) => Expect::Is(true),
            Some((Slot::Unknown, _)) | Some((Slot::InFlight { token: None, .. }, _)) => {
                Expect::Either
            }
            Some((Slot::InFlight { token: Some(t), .. }, live)) => match (t == token, live) {
                (true, _) => Expect::Is(true),
                (false, Live::Yes) => Expect::Is(false),
                (false, _) => Expect::Either,
            },
            // The same completion sent again is accepted; the same bytes from another claim may
            // be told apart or not.
            Some((
                Slot::Completed {
                    completed: held,
                    by,
                    ..
                },
                live,
            )) => match (held == completed, *by == Some(*token), live) {
                (true, true, _) => Expect::Is(true),
                (true, false, _) => Expect::Either,
                (false, _, Live::Yes) => Expect::Is(false),
                (false, _, _) => Expect::Either,
            },
        };
        let mut found = Found::new();
        match answer {
            Ok(written) => {
                if let Expect::Is(expected) = expect
                    && expected != *written
                {
                    found.push((
                        Rule::Store,
                        format!(
                            "complete: answered {written}, the model says {expected} over {:?}",
                            slot.as_ref().map(|(slot, _)| slot)
                        ),
                    ));
                }
                let same = matches!(&slot, Some((Slot::Completed { completed: held, .. }, Live::Yes)) if held == completed);
                if *written && !same {
                    self.slots.insert(
                        *id,
                        Slot::Completed {
                            completed: completed.clone(),
                            by: Some(*token),
                            expires: Window::after(call, ttl),
                        },
                    );
                    self.seen
                        .landed
                        .entry(*id)
                        .or_default()
                        .push(completed.clone());
                }
            }
            Err(err) => self.failed(id, err),
        }
        found
    }

    pub(crate) fn renew(
        &mut self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
        call: Call,
        answer: &Result<bool, StoreError>,
    ) -> Found {
        if self.is_loose(id, call) {
            return Found::new();
        }
        let slot = self.slot(id, call);
        let (expect, ours) = match &slot {
            Some((Slot::Unknown, _)) | Some((Slot::InFlight { token: None, .. }, _)) => {
                (Expect::Either, false)
            }
            Some((Slot::InFlight { token: Some(t), .. }, live)) if t == token => match live {
                Live::Yes => (Expect::Is(true), true),
                Live::Either => (Expect::Either, true),
                Live::No => (Expect::Is(false), true),
            },
            _ => (Expect::Is(false), false),
        };
        self.boolean(id, "renew", expect, ours, answer, |model, fingerprint| {
            let expires = Window::after(call, lease);
            model.slots.insert(
                *id,
                Slot::InFlight {
                    token: Some(*token),
                    fingerprint,
                    expires,
                },
            );
            model.set_lease(id, call, expires);
        })
    }

    pub(crate) fn release(
        &mut self,
        id: &RecordId,
        token: &ClaimToken,
        call: Call,
        answer: &Result<bool, StoreError>,
    ) -> Found {
        if self.is_loose(id, call) {
            return Found::new();
        }
        let slot = self.slot(id, call);
        let (expect, ours) = match &slot {
            Some((Slot::Unknown, _)) | Some((Slot::InFlight { token: None, .. }, _)) => {
                (Expect::Either, false)
            }
            Some((Slot::InFlight { token: Some(t), .. }, live))
                if t.unique_half() == token.unique_half() =>
            {
                match live {
                    Live::Yes => (Expect::Is(true), true),
                    Live::Either => (Expect::Either, true),
                    Live::No => (Expect::Is(false), true),
                }
            }
            _ => (Expect::Is(false), false),
        };
        self.boolean(id, "release", expect, ours, answer, |model, _| {
            model.slots.remove(id);
        })
    }

    /// A renewal's or a release's answer: `applied` runs on `true`; on `false` a claim of ours
    /// that may have run out did run out.
    fn boolean(
        &mut self,
        id: &RecordId,
        what: &str,
        expect: Expect,
        ours: bool,
        answer: &Result<bool, StoreError>,
        applied: impl FnOnce(&mut Self, Fingerprint),
    ) -> Found {
        let mut found = Found::new();
        match answer {
            Ok(answer) => {
                if let Expect::Is(expected) = expect
                    && expected != *answer
                {
                    found.push((
                        Rule::Store,
                        format!(
                            "{what}: answered {answer}, the model says {expected} over {:?}",
                            self.slots.get(id)
                        ),
                    ));
                }
                let fingerprint = match self.slots.get(id) {
                    Some(Slot::InFlight { fingerprint, .. }) => Some(*fingerprint),
                    _ => None,
                };
                match (answer, fingerprint) {
                    (true, Some(fingerprint)) => applied(self, fingerprint),
                    // A renewal the model cannot place (an unknown slot): the record is in
                    // flight, of a fingerprint not known; the next claim's answer tells.
                    (true, None) => {
                        self.slots.insert(*id, Slot::Unknown);
                    }
                    (false, _) if ours => {
                        self.slots.remove(id);
                    }
                    (false, _) => {}
                }
            }
            Err(err) => self.failed(id, err),
        }
        found
    }

    /// A call that was abandoned on its way (its caller went away): it may have applied or not,
    /// and the store may clean up after it within `settle`.
    pub(crate) fn abandoned(&mut self, id: &RecordId, settle: Duration) {
        self.slots.insert(*id, Slot::Unknown);
        self.loose.insert(*id, Instant::now() + settle);
    }

    /// Whether `id`'s answers are taken as they come at `call`: its slot stays unknown.
    fn is_loose(&mut self, id: &RecordId, call: Call) -> bool {
        let loose = self.loose.get(id).is_some_and(|until| call.sent <= *until);
        if loose {
            self.slots.insert(*id, Slot::Unknown);
        }
        loose
    }

    /// The store's clock went back (a failover to a replica behind): fences grow from here.
    pub(crate) fn clock_went_back(&mut self) {
        self.fences.clear();
    }

    /// A fault that forgets every record (a restart without persistence).
    pub(crate) fn forget_all(&mut self) {
        let ids: Vec<RecordId> = self.slots.keys().copied().collect();
        for id in ids {
            self.note(&id, |origin| format!("a restart at {} ms", since(origin)));
        }
        self.slots.clear();
    }

    /// A fault that forgets one record (an eviction, a failover losing a write).
    pub(crate) fn forget(&mut self, id: &RecordId) {
        self.note(id, |origin| format!("forgotten at {} ms", since(origin)));
        self.slots.remove(id);
    }
}

/// The milliseconds from `origin` to now.
fn since(origin: Instant) -> u128 {
    Instant::now().saturating_duration_since(origin).as_millis()
}
