//! Store wrappers for the cases: [`Counting`] counts calls, [`Faulty`] injects failures.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;

use tower_idempotency::record::{ClaimToken, Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};

/// How often each store method was called.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// Calls of [`Store::claim`].
    pub claim: usize,
    /// Calls of [`Store::complete`].
    pub complete: usize,
    /// Calls of [`Store::renew`].
    pub renew: usize,
    /// Calls of [`Store::release`].
    pub release: usize,
}

impl Calls {
    /// Calls of every method but [`Store::prepare`].
    pub fn total(&self) -> usize {
        self.claim + self.complete + self.renew + self.release
    }
}

#[derive(Debug, Default)]
struct CallCounters {
    claim: AtomicUsize,
    complete: AtomicUsize,
    renew: AtomicUsize,
    release: AtomicUsize,
}

/// A store that counts the calls of each method, then delegates.
#[derive(Debug, Clone)]
pub struct Counting<St> {
    inner: St,
    counters: Arc<CallCounters>,
}

impl<St> Counting<St> {
    /// Counts the calls made to `inner`. Clones share the counts.
    pub fn new(inner: St) -> Self {
        Self {
            inner,
            counters: Arc::default(),
        }
    }

    /// How often each method was called so far.
    pub fn calls(&self) -> Calls {
        Calls {
            claim: self.counters.claim.load(Ordering::SeqCst),
            complete: self.counters.complete.load(Ordering::SeqCst),
            renew: self.counters.renew.load(Ordering::SeqCst),
            release: self.counters.release.load(Ordering::SeqCst),
        }
    }

    /// The store that the calls reach.
    pub fn inner(&self) -> &St {
        &self.inner
    }
}

impl<St: Store> Store for Counting<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.counters.claim.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(id, fingerprint, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.counters.complete.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(id, token, completed, ttl).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.counters.renew.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(id, token, lease).await
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.counters.release.fetch_add(1, Ordering::SeqCst);
        self.inner.release(id, token).await
    }

    tower_idempotency::forward_store!(inner => prepare, changed);
}

impl<St: OperatorStore> OperatorStore for Counting<St> {
    tower_idempotency::forward_store!(inner => inspect, forget);
}

/// One kind of store call, for faults that strike that kind alone ([`Faulty::fail_call`],
/// [`Faulty::delay_call`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreCall {
    /// [`Store::claim`].
    Claim,
    /// [`Store::complete`].
    Complete,
    /// [`Store::renew`].
    Renew,
    /// [`Store::release`].
    Release,
    /// [`OperatorStore::inspect`].
    Inspect,
    /// [`OperatorStore::forget`].
    Forget,
}

impl StoreCall {
    const COUNT: usize = 6;

    /// Whether [`Faulty::fail_writes`] fails it.
    fn is_write(self) -> bool {
        matches!(
            self,
            StoreCall::Complete | StoreCall::Renew | StoreCall::Release | StoreCall::Forget
        )
    }
}

#[derive(Debug, Default)]
struct Faults {
    /// Every call fails.
    all: AtomicBool,
    /// Complete, renew and release fail; claims work.
    writes: AtomicBool,
    /// Every call waits this long before it reaches the store.
    delay: Mutex<Option<Duration>>,
    /// Every call fails as a store that gave up waiting does.
    time_out: AtomicBool,
    /// Completions roll back: the claim is released and `complete` answers `Aborted`.
    abort: AtomicBool,
    /// Completions are refused for good: the claim is released and `complete` answers `Rejected`.
    reject: AtomicBool,
    /// How many of the next renewals fail.
    renewals_to_fail: AtomicUsize,
    /// Claims find a record the store cannot decode.
    undecodable: AtomicBool,
    /// Calls of one kind fail, by [`StoreCall`].
    kind_fails: [AtomicBool; StoreCall::COUNT],
    /// Calls of one kind wait this long before they reach the store, by [`StoreCall`].
    kind_delays: Mutex<[Option<Duration>; StoreCall::COUNT]>,
    /// Answers of one kind come back this long after the store applied the call.
    answer_delays: Mutex<[Option<Duration>; StoreCall::COUNT]>,
}

/// What [`Faulty`]'s `prepare` puts into a claimed request's extensions: the claim's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared(pub ClaimToken);

/// A store whose calls fail with [`StoreError::Unavailable`] (or time out) while a shared flag is
/// set, or are slowed down; otherwise it delegates. Clones share the flags.
#[derive(Debug, Clone)]
pub struct Faulty<St> {
    inner: St,
    faults: Arc<Faults>,
}

impl<St> Faulty<St> {
    /// `inner`, with no fault injected yet.
    pub fn new(inner: St) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// The store that the calls reach, without the faults.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// Makes every call fail (`true`) or work (`false`).
    pub fn fail(&self, failing: bool) {
        self.faults.all.store(failing, Ordering::SeqCst);
    }

    /// Makes complete, renew and release fail (`true`) or work (`false`); claims keep working.
    pub fn fail_writes(&self, failing: bool) {
        self.faults.writes.store(failing, Ordering::SeqCst);
    }

    /// Makes every call fail with [`StoreError::Timeout`] (`true`) or work (`false`).
    pub fn time_out(&self, timing_out: bool) {
        self.faults.time_out.store(timing_out, Ordering::SeqCst);
    }

    /// Makes every completion roll back as a transactional store's does when its commit fails:
    /// the claim is released and `complete` answers [`StoreError::Aborted`].
    pub fn abort_completions(&self, aborting: bool) {
        self.faults.abort.store(aborting, Ordering::SeqCst);
    }

    /// Makes every completion be refused as a transactional store's is when the work's writes
    /// break a rule of the database: the claim is released and `complete` answers
    /// [`StoreError::Rejected`].
    pub fn reject_completions(&self, rejecting: bool) {
        self.faults.reject.store(rejecting, Ordering::SeqCst);
    }

    /// Makes the next `n` renewals fail with [`StoreError::Unavailable`], whatever the other
    /// flags say: a short fault, seen by the claim's renewals alone.
    pub fn fail_renewals(&self, n: usize) {
        self.faults.renewals_to_fail.store(n, Ordering::SeqCst);
    }

    /// Makes every claim answer [`StoreError::Codec`], as a store does whose record under the key
    /// it cannot decode (a kind a newer release writes, or damaged bytes): a record is there.
    pub fn undecodable(&self, undecodable: bool) {
        self.faults.undecodable.store(undecodable, Ordering::SeqCst);
    }

    /// Makes every call wait `delay` before it reaches the store.
    pub fn delay(&self, delay: Option<Duration>) {
        *self.faults.delay.lock().unwrap_or_else(|e| e.into_inner()) = delay;
    }

    /// Makes the calls of one kind fail with [`StoreError::Unavailable`] (`true`) or work
    /// (`false`) while the others work: a partial fault, as completions failing while renewals
    /// land (a replication wait that times out on writes of a record's size).
    pub fn fail_call(&self, call: StoreCall, failing: bool) {
        self.faults.kind_fails[call as usize].store(failing, Ordering::SeqCst);
    }

    /// Makes the calls of one kind wait `delay` before they reach the store (on top of
    /// [`Faulty::delay`]): a store slow at one thing, as a completion that waits for replicas.
    pub fn delay_call(&self, call: StoreCall, delay: Option<Duration>) {
        self.faults
            .kind_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())[call as usize] = delay;
    }

    /// Makes the answers of one kind come back `delay` after the store applied the call: the
    /// write is made at once, its caller learns it late, as over a slow network.
    pub fn delay_answer(&self, call: StoreCall, delay: Option<Duration>) {
        self.faults
            .answer_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())[call as usize] = delay;
    }

    /// `answer`, once the answer delay of `call` has passed.
    async fn answer<T>(&self, call: StoreCall, answer: T) -> T {
        let delay = self
            .faults
            .answer_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())[call as usize];
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        answer
    }

    async fn enter(&self, call: StoreCall) -> Result<(), StoreError> {
        let delay = *self.faults.delay.lock().unwrap_or_else(|e| e.into_inner());
        let kind_delay = self
            .faults
            .kind_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())[call as usize];
        for delay in [delay, kind_delay].into_iter().flatten() {
            tokio::time::sleep(delay).await;
        }
        if self.faults.time_out.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout(Duration::from_secs(1)));
        }
        if self.faults.all.load(Ordering::SeqCst)
            || (call.is_write() && self.faults.writes.load(Ordering::SeqCst))
            || self.faults.kind_fails[call as usize].load(Ordering::SeqCst)
        {
            return Err(StoreError::Unavailable(Box::new(std::io::Error::other(
                "injected store failure",
            ))));
        }
        Ok(())
    }
}

impl<St: Store> Store for Faulty<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        self.enter(StoreCall::Claim).await?;
        if self.faults.undecodable.load(Ordering::SeqCst) {
            return Err(StoreError::Codec(Box::new(std::io::Error::other(
                "injected record of an unknown kind",
            ))));
        }
        let claim = self.inner.claim(id, fingerprint, lease).await;
        self.answer(StoreCall::Claim, claim).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.enter(StoreCall::Complete).await?;
        if self.faults.abort.load(Ordering::SeqCst) {
            self.inner.release(id, token).await?;
            return Err(StoreError::Aborted(Box::new(std::io::Error::other(
                "injected failed commit",
            ))));
        }
        if self.faults.reject.load(Ordering::SeqCst) {
            self.inner.release(id, token).await?;
            return Err(StoreError::Rejected(Box::new(std::io::Error::other(
                "injected integrity violation",
            ))));
        }
        let written = self.inner.complete(id, token, completed, ttl).await;
        self.answer(StoreCall::Complete, written).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.enter(StoreCall::Renew).await?;
        let to_fail = &self.faults.renewals_to_fail;
        if to_fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(StoreError::Unavailable(Box::new(std::io::Error::other(
                "injected renewal failure",
            ))));
        }
        let renewed = self.inner.renew(id, token, lease).await;
        self.answer(StoreCall::Renew, renewed).await
    }

    fn prepare(&self, id: &RecordId, token: &ClaimToken, extensions: &mut Extensions) {
        extensions.insert(Prepared(*token));
        self.inner.prepare(id, token, extensions);
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        self.enter(StoreCall::Release).await?;
        let released = self.inner.release(id, token).await;
        self.answer(StoreCall::Release, released).await
    }

    tower_idempotency::forward_store!(inner => changed);
}

/// An operator's calls meet the same faults: a store that is down cannot be read either.
impl<St: OperatorStore> OperatorStore for Faulty<St> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        self.enter(StoreCall::Inspect).await?;
        self.inner.inspect(id).await
    }

    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        self.enter(StoreCall::Forget).await?;
        self.inner.forget(id, force).await
    }
}
