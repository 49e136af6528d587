//! The store every instance shares: a real store (the crate's `MemoryStore`, or `RedisStore` or
//! `PgStore` on a server of its own), behind a seeded fault injector at the `Store` boundary. Calls are delayed, lost before the store saw them, or answered with an
//! error after the store applied them (a lost reply); a call can stall past the lease. The store
//! can restart empty, and fail over to a replica that lacks the claims made within the replication
//! lag. It also models a transactional store (`PgTx`): an effect staged by a handler commits with
//! its record, in the completion.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::store::{Claim, Store, StoreError};
use tower_idempotency::{
    BoxStore, ClaimToken, Completed, Fence, Fingerprint, MemoryStore, RecordId,
};

use super::ledger::{Ledger, Staged};
use super::rng::Rng;

/// The classes of fault, as the checker reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A call delayed, well within the lease.
    Delay,
    /// A call lost before the store saw it.
    LostCall,
    /// A reply lost after the store applied the call.
    LostReply,
    /// A call stalled for longer than the lease.
    Stall,
    /// The store restarted empty.
    Restart,
    /// The store failed over to a replica without the claims of the last moments.
    Failover,
    /// An instance died, its handlers and detached work with it.
    Death,
    /// On real time, the machine itself held the run's tasks back for longer than a delay may
    /// last (a loaded CI machine): a stall no one injected, but a stall all the same.
    Starved,
}

impl Fault {
    /// Whether the fault can outlast a lease (or forget a claim): then an unfenced effect may run
    /// twice, by the protocol's own terms (PROTOCOL.md §9.6).
    pub fn is_long(self) -> bool {
        matches!(
            self,
            Fault::Stall | Fault::Restart | Fault::Death | Fault::Starved
        )
    }
}

/// How often each per-call fault strikes in one run, per mille.
#[derive(Debug, Clone, Copy)]
pub struct Profile {
    pub delay: u64,
    pub lost_call: u64,
    pub lost_reply: u64,
    pub stall: u64,
}

/// Forgets every record of a store: the same store emptied, or `Some` new one.
pub type Forget =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Option<BoxStore>> + Send>> + Send + Sync>;

/// A real store and how to make it forget everything (a restart without persistence).
pub struct Backend {
    pub store: BoxStore,
    pub forget: Forget,
    /// On tokio's real clock (a server's store), where the machine's load can stall a run.
    pub real_time: bool,
}

impl Backend {
    /// A fresh `MemoryStore`; a restart replaces it by another.
    pub fn memory() -> Self {
        Self {
            store: BoxStore::new(MemoryStore::new()),
            forget: Box::new(|| Box::pin(async { Some(BoxStore::new(MemoryStore::new())) })),
            real_time: false,
        }
    }
}

/// What the store saw of one claim: how its completion ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// A completion was written (`Ok(true)`).
    pub landed: bool,
    /// A completion was refused (`Ok(false)`): the layer was told, and logs it.
    pub refused: bool,
}

#[derive(Default)]
struct Log {
    /// The faults that touched each record.
    hits: HashMap<RecordId, BTreeSet<Fault>>,
    /// Each claim's completions, by token.
    written: HashMap<ClaimToken, Written>,
    /// Claims still inside the replication lag: a failover loses them.
    unreplicated: Vec<(Instant, RecordId, ClaimToken)>,
    /// The records each instance claimed.
    claimed_by: HashMap<usize, BTreeSet<RecordId>>,
    /// The fences of each record's claims, in the order they were made.
    fences: HashMap<RecordId, Vec<Fence>>,
    /// Transactions begun by `prepare`, by token.
    open: HashMap<ClaimToken, Staged>,
    /// How many calls each fault struck.
    counts: HashMap<Fault, u64>,
}

struct Shared {
    inner: Mutex<BoxStore>,
    forget: Forget,
    rng: Mutex<Rng>,
    profile: Profile,
    lease: Duration,
    /// With the replication wait a claim is answered only once the replica has it (after `lag`).
    replication_wait: bool,
    lag: Duration,
    /// The longest delay, and how far past the lease a stall goes at most.
    delay: Duration,
    failovers: AtomicU64,
    ledger: Arc<Ledger>,
    log: Mutex<Log>,
    /// A completion's record write and its transaction's commit are one step, as in a database:
    /// a restart waits for the steps under way, so that it never forgets a record whose effects
    /// then commit, or the effects of a record it kept.
    commit_gate: tokio::sync::RwLock<()>,
}

/// One instance's handle on the shared store: a dead instance's calls never finish.
#[derive(Clone)]
pub struct SimStore {
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

/// The world's hold on the store: faults it injects at once, and what it reads at the end.
#[derive(Clone)]
pub struct StoreControl {
    shared: Arc<Shared>,
}

impl StoreControl {
    pub fn new(
        backend: Backend,
        rng: Rng,
        profile: Profile,
        lease: Duration,
        replication_wait: bool,
        ledger: Arc<Ledger>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(backend.store),
                forget: backend.forget,
                rng: Mutex::new(rng),
                profile,
                lease,
                replication_wait,
                // In proportion to the lease: a tenth of it, and a twentieth.
                lag: lease / 20,
                delay: lease / 10,
                failovers: AtomicU64::new(0),
                ledger,
                commit_gate: tokio::sync::RwLock::new(()),
                log: Mutex::default(),
            }),
        }
    }

    pub fn handle(&self, instance: usize, dead: Arc<AtomicBool>) -> SimStore {
        SimStore {
            shared: self.shared.clone(),
            instance,
            dead,
        }
    }

    /// The store comes back empty: every record, and the effects committed with records, gone.
    pub async fn restart(&self) {
        let _no_commit_under_way = self.shared.commit_gate.write().await;
        if let Some(fresh) = (self.shared.forget)().await {
            *self.shared.inner.lock().unwrap() = fresh;
        }
        self.shared.ledger.forget_committed();
        let mut log = self.shared.log.lock().unwrap();
        let claimed: Vec<RecordId> = log.claimed_by.values().flatten().copied().collect();
        for id in claimed {
            log.hits.entry(id).or_default().insert(Fault::Restart);
        }
        *log.counts.entry(Fault::Restart).or_default() += 1;
    }

    /// The machine held the run back (`Fault::Starved`): every record claimed so far may have
    /// had a handler outlast its lease.
    pub fn starved(&self) {
        let mut log = self.shared.log.lock().unwrap();
        let claimed: Vec<RecordId> = log.claimed_by.values().flatten().copied().collect();
        for id in claimed {
            log.hits.entry(id).or_default().insert(Fault::Starved);
        }
        *log.counts.entry(Fault::Starved).or_default() += 1;
    }

    /// A replica takes over without the claims made within the replication lag.
    pub async fn fail_over(&self) {
        self.shared.failovers.fetch_add(1, Ordering::SeqCst);
        let now = Instant::now();
        let lost: Vec<_> = {
            let mut log = self.shared.log.lock().unwrap();
            *log.counts.entry(Fault::Failover).or_default() += 1;
            let lag = self.shared.lag;
            let (lost, kept) = std::mem::take(&mut log.unreplicated)
                .into_iter()
                .partition(|(at, _, _)| *at + lag > now);
            log.unreplicated = kept;
            for (_, id, _) in &lost {
                log.hits.entry(*id).or_default().insert(Fault::Failover);
            }
            lost
        };
        let inner = self.shared.inner.lock().unwrap().clone();
        for (_, id, token) in lost {
            let _ = inner.release(&id, &token).await;
        }
    }

    /// An instance died: the records it claimed were touched by its death.
    pub fn died(&self, instance: usize) {
        let mut log = self.shared.log.lock().unwrap();
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

    /// The record under `id` now, read without faults.
    pub async fn record(&self, id: &RecordId) -> Option<Completed> {
        let inner = self.shared.inner.lock().unwrap().clone();
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
            Ok(Claim::Existing(tower_idempotency::Record::Completed(completed))) => Some(completed),
            Ok(Claim::Claimed(token)) => {
                let _ = inner.release(id, &token).await;
                None
            }
            _ => None,
        }
    }

    pub fn hits(&self, id: &RecordId) -> BTreeSet<Fault> {
        let log = self.shared.log.lock().unwrap();
        log.hits.get(id).cloned().unwrap_or_default()
    }

    /// The fences of `id`'s claims, in the order they were made.
    pub fn fences(&self, id: &RecordId) -> Vec<Fence> {
        let log = self.shared.log.lock().unwrap();
        log.fences.get(id).cloned().unwrap_or_default()
    }

    pub fn written(&self, token: &ClaimToken) -> Written {
        let log = self.shared.log.lock().unwrap();
        log.written.get(token).copied().unwrap_or_default()
    }

    pub fn counts(&self) -> HashMap<Fault, u64> {
        self.shared.log.lock().unwrap().counts.clone()
    }
}

impl SimStore {
    fn inner(&self) -> BoxStore {
        self.shared.inner.lock().unwrap().clone()
    }

    fn hit(&self, id: &RecordId, fault: Fault) {
        let mut log = self.shared.log.lock().unwrap();
        log.hits.entry(*id).or_default().insert(fault);
        *log.counts.entry(fault).or_default() += 1;
    }

    /// Draws this call's faults, and waits out a delay or a stall: an error when the call is
    /// lost before the store sees it, else whether its reply will be.
    async fn strike(&self, id: &RecordId) -> Result<ReplyLost, StoreError> {
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let profile = self.shared.profile;
        let (delay, stall, lost_call, lost_reply) = {
            let mut rng = self.shared.rng.lock().unwrap();
            let most = self.shared.delay.as_millis() as u64;
            let delay = rng.chance(profile.delay).then(|| rng.millis(1..most));
            let stall = rng
                .chance(profile.stall)
                .then(|| self.shared.lease + self.shared.lease / 2 + rng.millis(0..2 * most));
            (
                delay,
                stall,
                rng.chance(profile.lost_call),
                rng.chance(profile.lost_reply),
            )
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
        if lost_call {
            self.hit(id, Fault::LostCall);
            return Err(lost());
        }
        if lost_reply {
            self.hit(id, Fault::LostReply);
        }
        Ok(ReplyLost(lost_reply))
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

impl Store for SimStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let reply_lost = self.strike(id).await?;
        let failovers = self.shared.failovers.load(Ordering::SeqCst);
        let claim = self.inner().claim(id, fingerprint, lease).await?;
        if let Claim::Claimed(token) = &claim {
            let mut log = self.shared.log.lock().unwrap();
            log.unreplicated.push((Instant::now(), *id, *token));
            log.claimed_by.entry(self.instance).or_default().insert(*id);
            log.fences.entry(*id).or_default().push(token.fence());
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
        reply_lost.reply(claim)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let reply_lost = match self.strike(id).await {
            Ok(reply_lost) => reply_lost,
            Err(lost) => {
                // As `PgStore` does: a transaction whose commit could not be sent rolled back, and
                // the work is not reported as done.
                let mut log = self.shared.log.lock().unwrap();
                if log.open.get(token).is_some_and(|staged| !staged.is_empty()) {
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
        let commit = self.shared.commit_gate.read().await;
        let written = self.inner().complete(id, token, completed, ttl).await?;
        let aborted = {
            let mut log = self.shared.log.lock().unwrap();
            // The transaction commits with the record, or rolls back.
            let staged = log.open.remove(token).filter(|staged| !staged.is_empty());
            let aborted = staged.is_some() && !written;
            if let Some(staged) = staged
                && written
            {
                self.shared.ledger.commit(staged);
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
        let reply_lost = self.strike(id).await?;
        let renewed = self.inner().renew(id, token, lease).await?;
        reply_lost.reply(renewed)
    }

    fn prepare(&self, _id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        let staged = Staged::new(*token);
        self.shared
            .log
            .lock()
            .unwrap()
            .open
            .insert(*token, staged.clone());
        extensions.insert(staged);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        let reply_lost = self.strike(id).await?;
        let released = self.inner().release(id, token).await?;
        self.shared.log.lock().unwrap().open.remove(token);
        reply_lost.reply(released)
    }
}
