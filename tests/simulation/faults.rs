//! The faults a run injects, and how often: per store call (a delay, a loss, a stall, a call
//! delivered twice, an error of each kind), per kind of call (one kind failing, or slow, for a
//! while, the others working), per instance (a partition from the store that heals,
//! a clock that is off and jumps), and on the store (a restart, a failover, one whose clock is
//! behind, an eviction).

use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::store::StoreError;

use super::rng::Rng;

/// The classes of fault, as the checker reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Fault {
    /// A call delayed, well within the lease.
    Delay,
    /// A call lost before the store saw it, with an error of any kind.
    LostCall,
    /// A reply lost after the store applied the call.
    LostReply,
    /// A call stalled for longer than the lease.
    Stall,
    /// A call the store applied twice, the second time a moment later.
    Duplicate,
    /// An instance cut off from the store for less than a quarter of a lease.
    Partition,
    /// An instance cut off from the store for a lease or more.
    LongPartition,
    /// An instance's clock off from the store's, or jumping: the lease left it reads is off.
    Skew,
    /// A completion's transaction refused for good (`StoreError::Rejected`, §9.9).
    Rejected,
    /// The store restarted empty.
    Restart,
    /// The store failed over to a replica without the claims of the last moments.
    Failover,
    /// A failover to a replica whose clock is behind the old primary's: the fences the store
    /// numbers from its clock (§5.3) go back by as much.
    ClockBack,
    /// A failover lost the completions of the last moments.
    LostWrites,
    /// The store evicted a completed record before its window ended.
    Evict,
    /// An instance died, its handlers and detached work with it.
    Death,
    /// The calls of one kind failed for a while, the others working: completions failing while
    /// renewals land (a replication wait that times out on a record's write), claims refused
    /// while the running handlers renew. Renewals fail for at most half a lease: longer, and the
    /// claim is lost by the protocol's own terms (§9.2).
    KindDown,
    /// The calls of one kind were slow for a while (up to a quarter of a lease each), the others
    /// not: a completion that waits for replicas, a claim queued behind a busy connection.
    KindSlow,
    /// On real time, the machine itself held the run's tasks back for longer than a delay may
    /// last (a loaded CI machine): a stall no one injected, but a stall all the same.
    Starved,
}

impl Fault {
    /// Whether the fault can outlast a lease or forget a record: then an unfenced effect may run
    /// twice, by the protocol's own terms (PROTOCOL.md §9.6).
    pub(crate) fn is_long(self) -> bool {
        matches!(
            self,
            Fault::Stall
                | Fault::LongPartition
                | Fault::Restart
                | Fault::LostWrites
                | Fault::Evict
                | Fault::Death
                | Fault::Starved
        )
    }

    /// Whether the fault loses a completed record while the work it records stays done.
    pub(crate) fn loses_record_alone(self) -> bool {
        matches!(self, Fault::LostWrites | Fault::Evict)
    }
}

/// How often each per-call fault strikes in one run, per mille.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Profile {
    pub delay: u64,
    pub lost_call: u64,
    pub lost_reply: u64,
    pub stall: u64,
    pub duplicate: u64,
    pub rejected: u64,
    /// Whether a failover loses the completions of the last moments too.
    pub lossy_failover: bool,
    /// Per-call faults stop here: every fault of the run is over by then.
    pub quiet: Option<Instant>,
    /// One kind of call failing or slow for a while.
    pub partial: Option<Partial>,
}

/// A kind of store call, for the faults that strike one kind alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    Claim,
    Complete,
    Renew,
    Release,
    /// A read past a scope's quota.
    Inspect,
}

/// One kind of call failing (`slow: None`) or slow, from `from` to `to`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Partial {
    pub kind: CallKind,
    pub from: Instant,
    pub to: Instant,
    pub slow: Option<Duration>,
}

impl Partial {
    /// In about half the runs: a kind drawn at random, failing or slow for up to two leases
    /// (renewals failing for at most half a lease), all before `quiet`.
    pub(crate) fn draw(
        rng: &mut Rng,
        start: Instant,
        lease: Duration,
        quiet: Instant,
    ) -> Option<Self> {
        if !rng.chance(500) {
            return None;
        }
        let ms = |f: f64| lease.mul_f64(f).as_millis() as u64;
        let kinds = [
            CallKind::Claim,
            CallKind::Complete,
            CallKind::Renew,
            CallKind::Release,
            CallKind::Inspect,
        ];
        let kind = kinds[rng.below(0..kinds.len() as u64) as usize];
        let slow = rng.chance(400).then(|| rng.millis(ms(0.05)..ms(0.25)));
        let longest = if kind == CallKind::Renew && slow.is_none() {
            ms(0.5)
        } else {
            ms(2.0)
        };
        let from = start + rng.millis(0..ms(3.0));
        let to = (from + rng.millis(ms(0.1)..longest)).min(quiet);
        Some(Self {
            kind,
            from,
            to,
            slow,
        })
    }

    /// Whether it strikes a call of `kind` now.
    pub(crate) fn strikes(&self, kind: CallKind, now: Instant) -> bool {
        self.kind == kind && (self.from..self.to).contains(&now)
    }
}

impl Profile {
    /// Each fault class is on in about half the runs (the older classes drawn first, so that a
    /// seed keeps its share of them), so that some runs meet short faults only.
    pub(crate) fn draw(rng: &mut Rng, quiet: Instant) -> Self {
        Self {
            delay: if rng.chance(500) { 150 } else { 0 },
            lost_call: if rng.chance(500) { 40 } else { 0 },
            lost_reply: if rng.chance(500) { 40 } else { 0 },
            stall: if rng.chance(300) { 50 } else { 0 },
            duplicate: if rng.chance(300) { 40 } else { 0 },
            rejected: if rng.chance(200) { 150 } else { 0 },
            lossy_failover: rng.chance(500),
            quiet: Some(quiet),
            partial: None,
        }
    }

    /// Whether per-call faults are still on.
    pub(crate) fn active(&self) -> bool {
        self.quiet.is_none_or(|quiet| Instant::now() < quiet)
    }
}

/// An error of a kind drawn at random, for a call lost before the store saw it: every kind a
/// store may answer when it did nothing (§10.3).
pub(crate) fn lost_call_error(rng: &mut Rng, lease: Duration) -> StoreError {
    match rng.below(0..4) {
        0 => StoreError::Timeout(lease / 10),
        1 => StoreError::Full {
            retry_after: Some(lease / 4),
        },
        2 => StoreError::Codec("the simulated store sent bytes that do not decode".into()),
        _ => StoreError::Unavailable("the simulated network lost the call or its reply".into()),
    }
}

/// An instance's links to the store and its clock, over the run.
#[derive(Debug, Clone, Default)]
pub(crate) struct InstanceFaults {
    /// Spans when the instance cannot reach the store.
    pub partitions: Vec<(Instant, Instant)>,
    /// From each moment on, how far the instance's clock is behind the store's, in
    /// milliseconds (negative: ahead).
    pub skews: Vec<(Instant, i64)>,
}

impl InstanceFaults {
    /// The faults of one instance: a partition in about a fifth of the runs (half of them
    /// long), a skew in about a fifth, with a jump half the time. All before `quiet`.
    pub(crate) fn draw(rng: &mut Rng, start: Instant, lease: Duration, quiet: Instant) -> Self {
        let ms = |f: f64| lease.mul_f64(f).as_millis() as u64;
        let mut faults = Self::default();
        if rng.chance(200) {
            let from = start + rng.millis(0..ms(4.0));
            let span = if rng.chance(500) {
                rng.millis(ms(0.05)..ms(0.25))
            } else {
                rng.millis(ms(1.0)..ms(3.0))
            };
            faults.partitions.push((from, (from + span).min(quiet)));
        }
        if rng.chance(200) {
            let off = rng.below(0..ms(0.5)) as i64 - ms(0.25) as i64;
            faults.skews.push((start, off));
            if rng.chance(500) {
                let jump = rng.below(0..ms(1.0)) as i64 - ms(0.5) as i64;
                faults
                    .skews
                    .push((start + rng.millis(0..ms(4.0)), off + jump));
            }
        }
        faults
    }

    pub(crate) fn partitioned(&self, now: Instant) -> Option<Duration> {
        self.partitions
            .iter()
            .find(|(from, to)| (*from..*to).contains(&now))
            .map(|(from, to)| *to - *from)
    }

    /// How far behind the store's clock the instance's is now, in milliseconds.
    pub(crate) fn skew(&self, now: Instant) -> i64 {
        self.skews
            .iter()
            .rev()
            .find(|(from, _)| *from <= now)
            .map_or(0, |(_, off)| *off)
    }

    /// The most the instance's clock is ever behind.
    pub(crate) fn most_behind(&self) -> Duration {
        let most = self.skews.iter().map(|(_, off)| *off).max().unwrap_or(0);
        Duration::from_millis(most.max(0) as u64)
    }
}
