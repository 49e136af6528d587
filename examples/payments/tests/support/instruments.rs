//! Test-only wrappers around the example's components: what a test counts, holds, hangs or
//! fails, through the components' own traits or the provider's HTTP edge, so that the production
//! code has no hook for it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use axum::Json;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Extensions, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tokio::sync::{Notify, OwnedRwLockWriteGuard, RwLock};

use example_payments::auth::Account;
use example_payments::balance::{Applied, Available, BalanceError, Balances};
use example_payments::events::PaymentEvent;
use example_payments::ledger::{Change, Charge, EventOf, Ledger, NewCharge, Opened};
use example_payments::provider::Provider;

type ApiResult<T> = Result<T, example_payments::error::ApiError>;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A gate that holds whoever passes it while a test holds it shut, and counts who waits.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    lock: Arc<RwLock<()>>,
    waiting: AtomicUsize,
}

impl Gate {
    /// Shuts the gate until the guard is dropped.
    pub(crate) async fn shut(&self) -> OwnedRwLockWriteGuard<()> {
        self.lock.clone().write_owned().await
    }

    /// How many wait at it now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    async fn pass(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        drop(self.lock.read().await);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------------
// The provider, probed at its HTTP edge as a proxy in front of a real provider would be.

/// Where every provider call stops for good, as a process that dies there would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hang {
    /// Before the provider does anything.
    BeforeEffect,
    /// Once the provider did it (money moved, the key recorded), before it answers.
    AfterEffect,
}

/// In front of the provider's API: counts the calls and the keys answered (its effects), holds
/// or hangs calls, answers `503` while the provider is down, and loses answers or calls (`500`).
#[derive(Debug, Default)]
pub(crate) struct ProviderProbe {
    calls: AtomicUsize,
    answered_keys: Mutex<HashSet<String>>,
    stall: Gate,
    hang: AtomicU8,
    down: AtomicBool,
    down_for: AtomicUsize,
    losing: AtomicBool,
    dropping: AtomicBool,
}

impl ProviderProbe {
    /// How many calls reached the provider, repeated and refused ones included.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// How many keys the provider answered with success: its effects.
    pub(crate) fn effects(&self) -> usize {
        lock(&self.answered_keys).len()
    }

    /// Holds every call before the provider until the guard is dropped; a held call whose caller
    /// gave up meanwhile (its attempt timed out) never reaches the provider.
    pub(crate) async fn stall(&self) -> OwnedRwLockWriteGuard<()> {
        self.stall.shut().await
    }

    /// How many calls [`ProviderProbe::stall`] holds now.
    pub(crate) fn stalled(&self) -> usize {
        self.stall.waiting()
    }

    /// Makes every call from now on stop for good `at` that point.
    pub(crate) fn hang(&self, at: Hang) {
        let code = match at {
            Hang::BeforeEffect => 1,
            Hang::AfterEffect => 2,
        };
        self.hang.store(code, Ordering::SeqCst);
    }

    /// Lets the calls from now on through again, as a provider restarted after a hang; those
    /// hung already stay hung.
    pub(crate) fn stop_hanging(&self) {
        self.hang.store(0, Ordering::SeqCst);
    }

    /// Makes every call fail as unavailable until switched off.
    pub(crate) fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Makes the next `calls` calls fail as unavailable: a provider down for a moment.
    pub(crate) fn set_down_for(&self, calls: usize) {
        self.down_for.store(calls, Ordering::SeqCst);
    }

    /// Makes every call take effect and then fail as the provider's `500` until switched off.
    pub(crate) fn set_losing_answers(&self, losing: bool) {
        self.losing.store(losing, Ordering::SeqCst);
    }

    /// Makes every call fail as the provider's `500` without reaching it until switched off.
    pub(crate) fn set_dropping_calls(&self, dropping: bool) {
        self.dropping.store(dropping, Ordering::SeqCst);
    }

    /// `provider`'s API behind this probe.
    pub(crate) fn router(self: &Arc<Self>, provider: &Provider) -> Router {
        provider
            .router()
            .layer(middleware::from_fn_with_state(self.clone(), probe))
    }

    async fn hang_at(&self, code: u8) {
        if self.hang.load(Ordering::SeqCst) == code {
            std::future::pending::<()>().await;
        }
    }
}

async fn probe(State(probe): State<Arc<ProviderProbe>>, request: Request, next: Next) -> Response {
    probe.calls.fetch_add(1, Ordering::SeqCst);
    let counted_down = || {
        (probe.down_for)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    };
    if probe.down.load(Ordering::SeqCst) || counted_down() {
        let body = Json(serde_json::json!({ "error": "unavailable" }));
        return (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
    }
    let unknown = Json(serde_json::json!({ "error": "unknown" }));
    if probe.dropping.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, unknown).into_response();
    }
    let key = (request.headers().get("idempotency-key"))
        .and_then(|key| key.to_str().ok())
        .map(str::to_owned);
    probe.hang_at(1).await;
    probe.stall.pass().await;
    let answer = next.run(request).await;
    if let Some(key) = key
        && answer.status().is_success()
    {
        lock(&probe.answered_keys).insert(key);
        probe.hang_at(2).await;
    }
    if probe.losing.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, unknown).into_response();
    }
    answer
}

// ---------------------------------------------------------------------------------------------
// The ledger.

/// A ledger whose opens wait at a gate while a test holds it shut, right after the request's
/// claim, as behind a locked `charges` table; and one chosen update can be held the same way.
#[derive(Debug)]
pub(crate) struct GatedLedger {
    inner: Arc<dyn Ledger>,
    pub opens: Gate,
    /// Whether writes of the provider's answer fail, as a database that went away would.
    failing_records: AtomicBool,
    /// The update to hold (after how many more pass), and its gate.
    held_update: Mutex<Option<(usize, Arc<Gate>)>>,
}

impl GatedLedger {
    pub(crate) fn new(inner: Arc<dyn Ledger>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            opens: Gate::default(),
            failing_records: AtomicBool::new(false),
            held_update: Mutex::default(),
        })
    }

    /// Makes every write of a provider's answer fail until switched off.
    pub(crate) fn fail_records(&self, failing: bool) {
        self.failing_records.store(failing, Ordering::SeqCst);
    }

    /// Lets the next `pass` updates through, then holds the one after at `gate`.
    pub(crate) fn hold_update(&self, pass: usize, gate: Arc<Gate>) {
        *lock(&self.held_update) = Some((pass, gate));
    }
}

#[async_trait]
impl Ledger for GatedLedger {
    async fn find(&self, account: &Account, provider_key: &str) -> ApiResult<Option<Charge>> {
        self.inner.find(account, provider_key).await
    }

    async fn insert(&self, charge: Charge) -> ApiResult<Option<Charge>> {
        self.inner.insert(charge).await
    }

    async fn open(
        &self,
        account: &Account,
        provider_key: &str,
        request: &NewCharge,
    ) -> ApiResult<Opened> {
        self.opens.pass().await;
        self.inner.open(account, provider_key, request).await
    }

    async fn abandon(&self, charge: &Charge) -> bool {
        self.inner.abandon(charge).await
    }

    async fn record(
        &self,
        request: &Extensions,
        charge: Charge,
        event: EventOf<'_>,
    ) -> ApiResult<Charge> {
        if self.failing_records.load(Ordering::SeqCst) {
            return Err(example_payments::error::ApiError::storage_unavailable());
        }
        self.inner.record(request, charge, event).await
    }

    async fn get(&self, account: &Account, id: &str) -> ApiResult<Charge> {
        self.inner.get(account, id).await
    }

    async fn list(&self, account: &Account) -> ApiResult<Vec<Charge>> {
        self.inner.list(account).await
    }

    async fn update(&self, account: &Account, id: &str, change: Change<'_>) -> ApiResult<Charge> {
        let gate = {
            let mut held = lock(&self.held_update);
            match held.as_mut() {
                Some((0, _)) => held.take().map(|(_, gate)| gate),
                Some((pass, _)) => {
                    *pass -= 1;
                    None
                }
                None => None,
            }
        };
        if let Some(gate) = gate {
            gate.pass().await;
        }
        self.inner.update(account, id, change).await
    }

    async fn settle(
        &self,
        request: &Extensions,
        account: &Account,
        id: &str,
        change: Change<'_>,
        event: EventOf<'_>,
    ) -> ApiResult<Charge> {
        self.inner.settle(request, account, id, change, event).await
    }

    async fn unsettled(&self, after: Duration, limit: usize) -> ApiResult<Vec<Charge>> {
        self.inner.unsettled(after, limit).await
    }

    async fn swap(
        &self,
        found: &Charge,
        settled: &Charge,
        event: Option<PaymentEvent>,
        unchanged_for: Duration,
    ) -> ApiResult<bool> {
        self.inner.swap(found, settled, event, unchanged_for).await
    }
}

// ---------------------------------------------------------------------------------------------
// The balances.

/// A misbehaviour of [`Balances::apply`] for one event id.
#[derive(Debug, Clone)]
pub(crate) enum Fault {
    /// The next `times` attempts fail before changing anything.
    Fail { times: usize },
    /// The next `times` attempts apply the event, then fail: the effect made, its reply lost.
    FailAfterApplying { times: usize },
    /// The next attempt applies the event and then never returns, as a process that dies right
    /// after the effect (the test aborts the consumer).
    HangAfterApplying,
    /// The next attempt signals `reached`, waits for `release`, then applies normally.
    Hold {
        reached: Arc<Notify>,
        release: Arc<Notify>,
    },
}

/// Balances that misbehave as injected, count the attempts at each injected event, and note the
/// events the ledger applied anew, per account.
#[derive(Debug)]
pub(crate) struct FaultyBalances {
    inner: Arc<dyn Balances>,
    injected: Mutex<HashMap<String, Fault>>,
    attempts: Mutex<HashMap<String, usize>>,
    applied: Mutex<HashMap<String, HashSet<String>>>,
}

impl FaultyBalances {
    pub(crate) fn new(inner: Arc<dyn Balances>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            injected: Mutex::default(),
            attempts: Mutex::default(),
            applied: Mutex::default(),
        })
    }

    /// Makes the applies of `event_id` misbehave.
    pub(crate) fn inject(&self, event_id: &str, fault: Fault) {
        lock(&self.attempts).entry(event_id.to_owned()).or_default();
        lock(&self.injected).insert(event_id.to_owned(), fault);
    }

    /// How many times the apply of `event_id` was attempted (counted for injected events).
    pub(crate) fn attempts(&self, event_id: &str) -> usize {
        lock(&self.attempts).get(event_id).copied().unwrap_or(0)
    }

    /// How many distinct events the ledger applied anew to `account`'s balance.
    pub(crate) fn applied(&self, account: &str) -> usize {
        lock(&self.applied).get(account).map_or(0, HashSet::len)
    }

    /// Counts an attempt at an injected event, and uses one fault up.
    fn attempt(&self, event_id: &str) -> Option<Fault> {
        *lock(&self.attempts).get_mut(event_id)? += 1;
        let mut injected = lock(&self.injected);
        let fault = injected.get_mut(event_id)?;
        let current = fault.clone();
        let used_up = match fault {
            Fault::Fail { times } | Fault::FailAfterApplying { times } => {
                *times = times.saturating_sub(1);
                *times == 0
            }
            Fault::HangAfterApplying | Fault::Hold { .. } => true,
        };
        if used_up {
            injected.remove(event_id);
        }
        Some(current)
    }
}

#[async_trait]
impl Balances for FaultyBalances {
    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        let fault = self.attempt(&event.id);
        match &fault {
            Some(Fault::Fail { .. }) => return Err(injected()),
            Some(Fault::Hold { reached, release }) => {
                reached.notify_one();
                release.notified().await;
            }
            _ => {}
        }
        let applied = self.inner.apply(event).await?;
        if applied == Applied::New {
            let mut all = lock(&self.applied);
            all.entry(event.account.clone())
                .or_default()
                .insert(event.id.clone());
        }
        match fault {
            Some(Fault::FailAfterApplying { .. }) => Err(injected()),
            Some(Fault::HangAfterApplying) => std::future::pending().await,
            _ => Ok(applied),
        }
    }

    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        self.inner.get(account).await
    }
}

/// A transient failure, as an unreachable ledger's.
fn injected() -> BalanceError {
    BalanceError::Postgres(sqlx::Error::PoolTimedOut)
}
