//! The store every instance shares: a real store (`MemoryStore`s, or `RedisStore` or `PgStore` on
//! a server of its own), sealed if the run seals, behind a seeded fault injector at the `Store`
//! boundary, with the oracle's model of the store checking every call the injector lets through.
//! Calls are delayed, lost before the store saw them (with an error of any kind), answered with
//! an error after the store applied them (a lost reply), applied twice, or stall past the lease;
//! the calls of one kind can fail, or be slow, for a while as the others work; an instance can be cut off from the store for a while, and read leases with a clock that is
//! off. The store can restart empty, fail over to a replica that lacks the claims (and perhaps
//! the completions) of the replication lag and whose clock may be behind (its fences then go
//! back), and evict a completed record. It also models a
//! transactional store (`PgTx`): an effect staged by a handler commits with its record, in the
//! completion, or is refused for good.

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::BoxStore;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, Record, RecordId};
use tower_idempotency::store::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};

use super::backend::{Backend, Evict, Forget};
use super::bugs::Bug;
use super::faults::{CallKind, Fault, InstanceFaults, Profile, lost_call_error};
use super::ledger::{Ledger, Staged};
use super::oracle::Oracle;
use super::oracle::model::Call;
use super::rng::Rng;

/// What the store saw of one claim: how its completion ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Written {
    /// A completion was written (`Ok(true)`).
    pub landed: bool,
    /// A completion was refused (`Ok(false)`, or a transaction rolled back): the layer was told.
    pub refused: bool,
}

#[derive(Default)]
struct Log {
    /// The faults that touched each record.
    hits: HashMap<RecordId, BTreeSet<Fault>>,
    /// Each claim's completions, by token.
    written: HashMap<ClaimToken, Written>,
    /// Claims, and completions, still inside the replication lag: a failover loses them.
    unreplicated: Vec<(Instant, RecordId, Option<ClaimToken>)>,
    /// The records each instance claimed.
    claimed_by: HashMap<usize, BTreeSet<RecordId>>,
    /// The fences of each record's claims, in the order they were made, each with how many
    /// times the store's clock had gone back by then.
    fences: HashMap<RecordId, Vec<(u64, Fence)>>,
    /// Each time the store's clock went back, and by how much. Until that much time has passed,
    /// the fences it gives are smaller than those it gave before, by what is left of it (§5.3).
    clock_backs: Vec<(Instant, Duration)>,
    /// The token each claim's caller holds, by the token the store holds (when its clock is
    /// behind, the fences differ).
    tokens: HashMap<ClaimToken, ClaimToken>,
    /// Transactions begun by `prepare`, by token.
    open: HashMap<ClaimToken, Staged>,
    /// How many calls each fault struck.
    counts: HashMap<Fault, u64>,
}

struct Shared {
    inner: Mutex<BoxStore>,
    forget: Forget,
    evict: Evict,
    rng: Mutex<Rng>,
    profile: Profile,
    instances: Vec<InstanceFaults>,
    lease: Duration,
    /// With the replication wait a claim is answered only once the replica has it (after `lag`).
    replication_wait: bool,
    lag: Duration,
    /// The longest delay, and how far past the lease a stall goes at most.
    delay: Duration,
    failovers: AtomicU64,
    ledger: Arc<Ledger>,
    oracle: Arc<Oracle>,
    bug: Bug,
    log: Mutex<Log>,
    /// Each record's calls reach the store one at a time, so that the model knows their order
    /// (on the paused clock they are anyway; on real time, this is the price of checking each).
    order: Mutex<HashMap<RecordId, Arc<tokio::sync::Mutex<()>>>>,
    /// A completion's record write and its transaction's commit are one step, as in a database:
    /// a restart waits for the steps under way, so that it never forgets a record whose effects
    /// then commit, or the effects of a record it kept.
    commit_gate: tokio::sync::RwLock<()>,
    /// Every call holds it while the store has it: a restart waits for the calls under way, so
    /// that the model knows whether each came before it or after.
    calls_gate: tokio::sync::RwLock<()>,
}

/// One instance's handle on the shared store: a dead instance's calls never finish.
#[derive(Clone)]
pub(crate) struct SimStore {
    shared: Arc<Shared>,
    instance: usize,
    dead: Arc<AtomicBool>,
}

impl std::fmt::Debug for SimStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStore")
            .field("instance", &self.instance)
            .finish()
    }
}

/// How the store is built for one run.
pub(crate) struct Wiring {
    pub backend: Backend,
    /// Wraps the backend (sealing, when the run seals).
    pub seal: Box<dyn Fn(BoxStore) -> BoxStore + Send + Sync>,
    pub rng: Rng,
    pub profile: Profile,
    pub instances: Vec<InstanceFaults>,
    pub lease: Duration,
    pub ledger: Arc<Ledger>,
    pub oracle: Arc<Oracle>,
    pub bug: Bug,
}

/// The world's hold on the store: faults it injects at once, and what it reads at the end.
#[derive(Clone)]
pub(crate) struct StoreControl {
    shared: Arc<Shared>,
}

impl StoreControl {
    pub(crate) fn new(wiring: Wiring) -> Self {
        let Wiring {
            backend,
            seal,
            rng,
            profile,
            instances,
            lease,
            ledger,
            oracle,
            bug,
        } = wiring;
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(seal(backend.store)),
                forget: backend.forget,
                evict: backend.evict,
                rng: Mutex::new(rng),
                profile,
                instances,
                lease,
                replication_wait: bug != Bug::NoReplicationWait,
                // In proportion to the lease: a tenth of it, and a twentieth.
                lag: lease / 20,
                delay: lease / 10,
                failovers: AtomicU64::new(0),
                ledger,
                oracle,
                bug,
                order: Mutex::default(),
                commit_gate: tokio::sync::RwLock::new(()),
                calls_gate: tokio::sync::RwLock::new(()),
                log: Mutex::default(),
            }),
        }
    }

    pub(crate) fn handle(&self, instance: usize, dead: Arc<AtomicBool>) -> SimStore {
        SimStore {
            shared: self.shared.clone(),
            instance,
            dead,
        }
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.shared.log.lock().expect("the log's lock")
    }

    fn hit_all(&self, fault: Fault) {
        let mut log = self.log();
        let claimed: Vec<RecordId> = log.claimed_by.values().flatten().copied().collect();
        for id in claimed {
            log.hits.entry(id).or_default().insert(fault);
        }
        *log.counts.entry(fault).or_default() += 1;
    }

    /// The store comes back empty: every record, and the effects committed with records, gone.
    pub(crate) async fn restart(&self) {
        let _no_commit_under_way = self.shared.commit_gate.write().await;
        let _no_call_under_way = self.shared.calls_gate.write().await;
        (self.shared.forget)().await;
        self.shared.oracle.forget_all();
        self.shared.ledger.forget_committed();
        self.hit_all(Fault::Restart);
    }

    /// The machine held the run back (`Fault::Starved`): every record claimed so far may have
    /// had a handler outlast its lease.
    pub(crate) fn starved(&self) {
        self.hit_all(Fault::Starved);
    }

    /// A replica takes over without the claims made within the replication lag, and, if the
    /// run's failovers are lossy, without the completions made within it either. With `behind`,
    /// the replica's clock is behind the old primary's by that much: a store that numbers claims
    /// from its clock alone (`RedisStore`'s `TIME`; `PgStore` for a key whose row is gone) gives
    /// fences smaller by as much from now on (§5.3).
    pub(crate) async fn fail_over(&self, behind: Option<Duration>) {
        self.shared.failovers.fetch_add(1, Ordering::SeqCst);
        if let Some(behind) = behind {
            self.log().clock_backs.push((Instant::now(), behind));
            self.hit_all(Fault::ClockBack);
            self.shared.oracle.clock_went_back();
        }
        let now = Instant::now();
        let lossy = self.shared.profile.lossy_failover;
        let lost: Vec<_> = {
            let mut log = self.log();
            *log.counts.entry(Fault::Failover).or_default() += 1;
            let lag = self.shared.lag;
            let (lost, kept) = std::mem::take(&mut log.unreplicated)
                .into_iter()
                .partition(|(at, _, token)| *at + lag > now && (token.is_some() || lossy));
            log.unreplicated = kept;
            for (_, id, token) in &lost {
                let fault = if token.is_some() {
                    Fault::Failover
                } else {
                    Fault::LostWrites
                };
                log.hits.entry(*id).or_default().insert(fault);
            }
            lost
        };
        for (_, id, token) in lost {
            match token {
                // Through the model: the claim is gone as if released.
                Some(token) => {
                    let sim = self.handle(usize::MAX, Arc::default());
                    let _ = sim.checked_release(&id, &token).await;
                }
                None => {
                    *self.log().counts.entry(Fault::LostWrites).or_default() += 1;
                    self.evict(&id).await;
                }
            }
        }
    }

    /// The store forgets one record.
    pub(crate) async fn evict(&self, id: &RecordId) {
        let lock = self.handle(usize::MAX, Arc::default()).order(id);
        let _in_order = lock.lock().await;
        (self.shared.evict)(*id).await;
        self.shared.oracle.forget(id);
    }

    /// Evicts a completed record (`Fault::Evict`), one of `ids` picked by `pick`.
    pub(crate) async fn evict_one(&self, ids: &[RecordId], pick: u64) {
        let Some(id) = ids.get(pick as usize % ids.len().max(1)) else {
            return;
        };
        if !self.shared.oracle.is_completed(id) {
            return;
        }
        {
            let mut log = self.log();
            log.hits.entry(*id).or_default().insert(Fault::Evict);
            *log.counts.entry(Fault::Evict).or_default() += 1;
        }
        self.evict(id).await;
    }

    /// An instance died: the records it claimed were touched by its death.
    pub(crate) fn died(&self, instance: usize) {
        let mut log = self.log();
        let claimed: Vec<RecordId> = log
            .claimed_by
            .get(&instance)
            .into_iter()
            .flatten()
            .copied()
            .collect();
        for id in claimed {
            log.hits.entry(id).or_default().insert(Fault::Death);
        }
        *log.counts.entry(Fault::Death).or_default() += 1;
    }

    /// The record under `id` now, read without faults or checks.
    pub(crate) async fn record(&self, id: &RecordId) -> Option<Completed> {
        let inner = self.shared.inner.lock().expect("the store's lock").clone();
        // A claim of a completed record returns it, unchanged; of a free key, claims it (then
        // released at once): reading the store leaves it as it was.
        match inner
            .claim(
                id,
                &Fingerprint::from_bytes([0; 32]),
                Duration::from_millis(1),
            )
            .await
        {
            Ok(Claim::Existing(Record::Completed(completed))) => Some(completed),
            Ok(Claim::Claimed(token)) => {
                let _ = inner.release(id, &token).await;
                None
            }
            _ => None,
        }
    }

    pub(crate) fn hits(&self, id: &RecordId) -> BTreeSet<Fault> {
        self.log().hits.get(id).cloned().unwrap_or_default()
    }

    /// The fences of `id`'s claims, in the order they were made, each with how many times the
    /// store's clock had gone back by then.
    pub(crate) fn fences(&self, id: &RecordId) -> Vec<(u64, Fence)> {
        self.log().fences.get(id).cloned().unwrap_or_default()
    }

    pub(crate) fn written(&self, token: &ClaimToken) -> Written {
        self.log().written.get(token).copied().unwrap_or_default()
    }

    pub(crate) fn counts(&self) -> HashMap<Fault, u64> {
        self.log().counts.clone()
    }
}

/// Whether a call's reply is lost after the store applied it.
struct ReplyLost(bool);

impl ReplyLost {
    /// The caller's answer: `answer`, or the error a lost reply leaves it with.
    fn reply<T>(self, answer: T) -> Result<T, StoreError> {
        if self.0 { Err(lost()) } else { Ok(answer) }
    }
}

fn lost() -> StoreError {
    StoreError::Unavailable("the simulated network lost the call or its reply".into())
}

impl SimStore {
    fn inner(&self) -> BoxStore {
        self.shared.inner.lock().expect("the store's lock").clone()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.shared.log.lock().expect("the log's lock")
    }

    fn hit(&self, id: &RecordId, fault: Fault) {
        let mut log = self.log();
        log.hits.entry(*id).or_default().insert(fault);
        *log.counts.entry(fault).or_default() += 1;
    }

    fn chance(&self, per_mille: u64) -> bool {
        self.shared.profile.active()
            && self
                .shared
                .rng
                .lock()
                .expect("the rng's lock")
                .chance(per_mille)
    }

    /// A claim the store answered, as a store whose clock is behind would have numbered it.
    fn numbered(&self, claim: Result<Claim, StoreError>) -> Result<Claim, StoreError> {
        let Ok(Claim::Claimed(token)) = claim else {
            return claim;
        };
        let mut log = self.log();
        // The store numbers claims from its clock; the memory store's is the process's, which
        // paused time does not move, so the part of the lag that time has made up is taken off.
        let behind: Duration = (log.clock_backs.iter())
            .map(|(at, behind)| behind.saturating_sub(at.elapsed()))
            .sum();
        if behind.is_zero() {
            return Ok(Claim::Claimed(token));
        }
        let fence = Fence::new((token.fence().get()).saturating_sub(behind.as_micros() as u64));
        let given = token.with_fence(fence);
        log.tokens.insert(given, token);
        Ok(Claim::Claimed(given))
    }

    /// The token the store holds for the one a caller sent.
    fn held(&self, token: &ClaimToken) -> ClaimToken {
        self.log().tokens.get(token).copied().unwrap_or(*token)
    }

    fn order(&self, id: &RecordId) -> Arc<tokio::sync::Mutex<()>> {
        let mut order = self.shared.order.lock().expect("the order's lock");
        order.entry(*id).or_default().clone()
    }

    fn faults(&self) -> Option<&InstanceFaults> {
        self.shared.instances.get(self.instance)
    }

    /// Draws this call's faults, and waits out a delay, a stall or a partition: an error when
    /// the call is lost before the store sees it, else whether its reply will be.
    async fn strike(&self, id: &RecordId, kind: CallKind) -> Result<ReplyLost, StoreError> {
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if let Some(span) = self.faults().and_then(|f| f.partitioned(Instant::now())) {
            let long = span >= self.shared.lease;
            self.hit(
                id,
                if long {
                    Fault::LongPartition
                } else {
                    Fault::Partition
                },
            );
            // The store's own bound runs out: nothing reached it.
            tokio::time::sleep(self.shared.delay).await;
            return Err(StoreError::Timeout(self.shared.delay));
        }
        let profile = self.shared.profile;
        if let Some(partial) = profile.partial.filter(|p| p.strikes(kind, Instant::now())) {
            match partial.slow {
                Some(slow) => {
                    self.hit(id, Fault::KindSlow);
                    tokio::time::sleep(slow).await;
                }
                None => {
                    self.hit(id, Fault::KindDown);
                    return Err(StoreError::Unavailable(
                        "the store fails this kind of call for now".into(),
                    ));
                }
            }
        }
        if !profile.active() {
            return Ok(ReplyLost(false));
        }
        let (delay, stall, lost_call, lost_reply) = {
            let mut rng = self.shared.rng.lock().expect("the rng's lock");
            let most = self.shared.delay.as_millis() as u64;
            let delay = rng.chance(profile.delay).then(|| rng.millis(1..most));
            let stall = rng
                .chance(profile.stall)
                .then(|| self.shared.lease + self.shared.lease / 2 + rng.millis(0..2 * most));
            let lost_call = rng
                .chance(profile.lost_call)
                .then(|| lost_call_error(&mut rng, self.shared.lease));
            (delay, stall, lost_call, rng.chance(profile.lost_reply))
        };
        if let Some(delay) = delay {
            self.hit(id, Fault::Delay);
            tokio::time::sleep(delay).await;
        }
        if let Some(stall) = stall {
            self.hit(id, Fault::Stall);
            tokio::time::sleep(stall).await;
        }
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if let Some(err) = lost_call {
            self.hit(id, Fault::LostCall);
            return Err(err);
        }
        if lost_reply {
            self.hit(id, Fault::LostReply);
        }
        Ok(ReplyLost(lost_reply))
    }

    /// Sends one call to the store, in the record's order, and has the model check its answer.
    async fn checked<T: std::fmt::Debug, F>(
        &self,
        id: &RecordId,
        what: &str,
        send: impl AsyncFnOnce(BoxStore) -> Result<T, StoreError>,
        check: F,
    ) -> Result<T, StoreError>
    where
        F: FnOnce(&mut super::oracle::model::Model, Call, &Result<T, StoreError>) -> Found,
    {
        let _not_across_a_restart = self.shared.calls_gate.read().await;
        let lock = self.order(id);
        let _in_order = lock.lock().await;
        let sent = Instant::now();
        let mut abandoned = Abandoned {
            oracle: &self.shared.oracle,
            id: Some(*id),
            settle: self.shared.lease,
        };
        let answer = send(self.inner()).await;
        abandoned.id = None;
        let call = Call {
            sent,
            answered: Instant::now(),
        };
        let instance = self.instance;
        self.shared.oracle.call(id, |model| {
            let found = check(model, call, &answer);
            model.note(id, |origin| {
                let at = |t: Instant| t.saturating_duration_since(origin).as_micros() as f64 / 1e3;
                let answer = format!("{answer:?}");
                let answer: String = answer.chars().take(80).collect();
                format!(
                    "{what} by {instance} at {}..{} ms: {answer}",
                    at(call.sent),
                    at(call.answered)
                )
            });
            found
        });
        answer
    }

    /// The same call, delivered again a moment later: checked, and its answer dropped.
    fn again(
        &self,
        id: &RecordId,
        send: impl FnOnce(SimStore) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + 'static,
    ) {
        if !self.chance(self.shared.profile.duplicate) {
            return;
        }
        self.hit(id, Fault::Duplicate);
        let later = self
            .shared
            .rng
            .lock()
            .expect("the rng's lock")
            .millis(0..self.shared.delay.as_millis() as u64);
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(later).await;
            send(this).await;
        });
    }

    async fn checked_claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.checked(
            id,
            "claim",
            async |store| self.numbered(store.claim(id, fingerprint, lease).await),
            |model, call, answer| model.claim(id, fingerprint, lease, call, answer),
        )
        .await
    }

    async fn checked_complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let (mut sent_token, mut sent_ttl) = (self.held(token), ttl);
        if self.shared.bug == Bug::StaleToken
            && let Some(owner) = self.shared.oracle.owner(id)
        {
            sent_token = self.held(&owner);
        }
        if self.shared.bug == Bug::ShortWindow {
            sent_ttl = self.shared.lease;
        }
        let transaction = self.log().open.get(token).is_some_and(|s| !s.is_empty());
        self.checked(
            id,
            "complete",
            async |store| {
                // A store whose completion commits with the work (`PgStore`) tells claims apart
                // by their token: a record of the same bytes written by another claim (two
                // tombstones) is not this claim's, and the transaction rolls back.
                if transaction && self.shared.oracle.completed_by_another(id, token) {
                    return Ok(false);
                }
                store.complete(id, &sent_token, completed, sent_ttl).await
            },
            |model, call, answer| model.complete(id, token, completed, ttl, call, answer),
        )
        .await
    }

    async fn checked_renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.checked(
            id,
            "renew",
            async |store| store.renew(id, &self.held(token), lease).await,
            |model, call, answer| model.renew(id, token, lease, call, answer),
        )
        .await
    }

    async fn checked_release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.checked(
            id,
            "release",
            async |store| store.release(id, &self.held(token)).await,
            |model, call, answer| model.release(id, token, call, answer),
        )
        .await
    }

    /// A lease left, as this instance reads it with its clock off by its skew.
    fn skewed(&self, id: &RecordId, left: Duration) -> Duration {
        let skew = self.faults().map_or(0, |f| f.skew(Instant::now()));
        if skew == 0 {
            return left;
        }
        self.hit(id, Fault::Skew);
        let off = Duration::from_millis(skew.unsigned_abs());
        if skew > 0 {
            left + off
        } else {
            left.saturating_sub(off)
        }
    }
}

type Found = Vec<(super::oracle::Rule, String)>;

/// A call in flight: dropped before its answer (its caller went away, as a request's claim does
/// when its client leaves), it may or may not have reached the store, and the model is told so.
struct Abandoned<'a> {
    oracle: &'a Oracle,
    id: Option<RecordId>,
    /// How long the store may take to clean up after it: a lease.
    settle: Duration,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.oracle.call(&id, |model| {
                model.abandoned(&id, self.settle);
                model.note(&id, |origin| {
                    let at = Instant::now().saturating_duration_since(origin);
                    format!("a call abandoned at {} ms", at.as_millis())
                });
                Vec::new()
            });
        }
    }
}

impl Store for SimStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let reply_lost = self.strike(id, CallKind::Claim).await?;
        let failovers = self.shared.failovers.load(Ordering::SeqCst);
        let claim = self.checked_claim(id, fingerprint, lease).await?;
        let (id_, fingerprint_) = (*id, *fingerprint);
        self.again(id, move |this| {
            Box::pin(async move {
                let _ = this.checked_claim(&id_, &fingerprint_, lease).await;
            })
        });
        if let Claim::Claimed(token) = &claim {
            let mut log = self.log();
            log.unreplicated.push((Instant::now(), *id, Some(*token)));
            log.claimed_by.entry(self.instance).or_default().insert(*id);
            let clock_backs = log.clock_backs.len() as u64;
            log.fences
                .entry(*id)
                .or_default()
                .push((clock_backs, token.fence()));
        }
        if self.shared.replication_wait && matches!(claim, Claim::Claimed(_)) {
            // Answered once the replica has it: a failover meanwhile lost it, and says so.
            tokio::time::sleep(self.shared.lag).await;
            if self.shared.failovers.load(Ordering::SeqCst) != failovers {
                return Err(StoreError::Unavailable(
                    "the claim was not replicated before a failover".into(),
                ));
            }
        }
        let claim = match claim {
            Claim::Existing(Record::InFlight(mut record)) => {
                record.lease_remaining = if self.shared.bug == Bug::FullLeaseLeft {
                    lease
                } else {
                    self.skewed(id, record.lease_remaining)
                };
                Claim::Existing(Record::InFlight(record))
            }
            Claim::Existing(Record::Completed(mut completed))
                if self.shared.bug == Bug::SkipFingerprint =>
            {
                completed.fingerprint = *fingerprint;
                Claim::Existing(Record::Completed(completed))
            }
            claim => claim,
        };
        reply_lost.reply(claim)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let staged = |log: &Log| log.open.get(token).is_some_and(|staged| !staged.is_empty());
        let reply_lost = match self.strike(id, CallKind::Complete).await {
            Ok(reply_lost) => reply_lost,
            Err(lost) => {
                // As `PgStore` does: a transaction whose commit could not be sent rolled back, and
                // the work is not reported as done.
                let mut log = self.log();
                if staged(&log) {
                    log.open.remove(token);
                    // The layer is told: it answers 503, and the retry runs again.
                    log.written.entry(*token).or_default().refused = true;
                    return Err(StoreError::Aborted(
                        "the commit was lost; the work rolled back".into(),
                    ));
                }
                return Err(lost);
            }
        };
        if staged(&self.log()) && self.chance(self.shared.profile.rejected) {
            // The database refuses the work for good: it rolls back, and the claim is released.
            self.hit(id, Fault::Rejected);
            {
                let mut log = self.log();
                log.open.remove(token);
                log.written.entry(*token).or_default().refused = true;
            }
            let _ = self.checked_release(id, token).await;
            return Err(StoreError::Rejected(
                "the work broke a rule of the database".into(),
            ));
        }
        let commit = self.shared.commit_gate.read().await;
        let written = self.checked_complete(id, token, completed, ttl).await?;
        let (id_, token_, completed_) = (*id, *token, completed.clone());
        self.again(id, move |this| {
            Box::pin(async move {
                let _ = this.checked_complete(&id_, &token_, &completed_, ttl).await;
            })
        });
        let aborted = {
            let mut log = self.log();
            // The transaction commits with the record, or rolls back.
            let staged = log.open.remove(token).filter(|staged| !staged.is_empty());
            let aborted = staged.is_some() && !written;
            if let Some(staged) = staged
                && written
            {
                self.shared.ledger.commit(staged);
            }
            if written {
                log.unreplicated.push((Instant::now(), *id, None));
            }
            let entry = log.written.entry(*token).or_default();
            entry.landed |= written;
            entry.refused |= !written;
            aborted
        };
        drop(commit);
        if aborted {
            // As `PgStore` does: a fenced-out completion rolled the work back.
            return Err(StoreError::Aborted(
                "the completion was fenced out; the work rolled back".into(),
            ));
        }
        reply_lost.reply(written)
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let reply_lost = self.strike(id, CallKind::Renew).await?;
        let renewed = self.checked_renew(id, token, lease).await?;
        let (id_, token_) = (*id, *token);
        self.again(id, move |this| {
            Box::pin(async move {
                let _ = this.checked_renew(&id_, &token_, lease).await;
            })
        });
        reply_lost.reply(renewed || self.shared.bug == Bug::RenewAnyToken)
    }

    fn prepare(&self, _id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        let staged = Staged::new(*token);
        self.log().open.insert(*token, staged.clone());
        extensions.insert(staged);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        let reply_lost = self.strike(id, CallKind::Release).await?;
        let released = self.checked_release(id, token).await?;
        let (id_, token_) = (*id, *token);
        self.again(id, move |this| {
            Box::pin(async move {
                let _ = this.checked_release(&id_, &token_).await;
            })
        });
        self.log().open.remove(token);
        reply_lost.reply(released)
    }
}

/// A read for a scope past its quota (§3.4): the faults of any call, then the store as it is. It
/// writes nothing, so the model has nothing to learn from it.
impl OperatorStore for SimStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        let reply_lost = self.strike(id, CallKind::Inspect).await?;
        let seen = self.inner().inspect(id).await?;
        reply_lost.reply(seen)
    }

    /// Not drawn by the world: an operator's forget is the operator tests' (§10.9).
    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        self.inner().forget(id, force).await
    }
}
