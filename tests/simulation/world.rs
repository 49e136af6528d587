//! One run of the world, from a seed: 2 to 4 instances of the layer, configured as the seed says,
//! over one faulty store; clients (the crate's client layer) per operation, some reusing a key
//! with another body; handlers charging a ledger; faults on the store's calls, on the instances'
//! links and clocks, and on the world (a restart, a failover, an eviction, a death). On the paused
//! clock everything runs on one thread, so one seed makes one history.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tower::ServiceBuilder;
use tower_idempotency::BoxStore;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::RecordId;

use super::backend::Backend;
use super::bugs::Bug;
use super::client::{self, Plan};
use super::faults::{Fault, InstanceFaults, Partial, Profile};
use super::handler::{self, Behaviour, Handlers};
use super::ledger::{Ledger, Mode};
use super::oracle::answers::{self, Answer, BodyClass, Context};
use super::oracle::{Oracle, Report, progress};
use super::rng::Rng;
use super::setup::{SMALL_RESPONSE_LIMIT, Setup};
use super::store::{StoreControl, Wiring};

/// The claim lease on the paused clock, before a run scales it. Every other time of a run is in
/// proportion to its lease.
pub(crate) const LEASE: Duration = Duration::from_secs(2);
/// Faults strike within this many leases of a run's start; then the world settles.
const FAULTS_FOR: f64 = 8.0;
/// How many leases after the faults a client's deadline must reach for it to owe an answer.
const SETTLE: f64 = 16.0;

/// What one operation's clients saw, and what the world holds for it at the end.
#[derive(Debug)]
pub(crate) struct OpHistory {
    pub op: usize,
    pub mode: Mode,
    pub behaviour: Behaviour,
    /// Each answer its clients got.
    pub answers: Vec<Answer>,
    /// Whether a client ended without an answer.
    pub gave_up: bool,
    /// The charges made for the operation.
    pub charges: Vec<String>,
    /// The body of the completed record under the key at the end, if any.
    pub record: Option<Bytes>,
    /// The faults that touched the key.
    pub hits: BTreeSet<Fault>,
    /// Runs whose handler finished with a charge, and whose completion the store neither wrote
    /// nor refused, on an instance that did not die.
    pub unwritten: usize,
    /// Whether every claim of the key had a larger fence than the claim before it, while the
    /// store's clock did not go back in between.
    pub fences_grew: bool,
    /// Claims whose fence was not larger than the claim's before it, the store's clock having
    /// gone back in between (§5.3).
    pub fences_back: usize,
    /// A handler ran for it without a claim (fail-open).
    pub unprotected: bool,
    /// Its completed record ran out its window and the key was claimed again (§8.6).
    pub window_passed: bool,
}

#[derive(Debug)]
pub(crate) struct History {
    /// When the run started: every time of the history is from it.
    pub start: Instant,
    pub setup: Setup,
    pub instances: usize,
    pub ops: Vec<OpHistory>,
    pub faults: BTreeMap<Fault, u64>,
    pub oracle: Report,
}

impl History {
    /// A digest of everything the run produced: two runs of one seed must agree on it.
    pub(crate) fn digest(&self) -> u64 {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut hasher = DefaultHasher::new();
        (format!("{:?}", self.setup), self.instances).hash(&mut hasher);
        for op in &self.ops {
            (
                op.op,
                op.mode,
                op.behaviour,
                op.gave_up,
                op.unwritten,
                op.fences_grew,
            )
                .hash(&mut hasher);
            for answer in &op.answers {
                (answer.client, answer.instance, answer.status.as_u16()).hash(&mut hasher);
                (&answer.body, answer.answered.duration_since(self.start)).hash(&mut hasher);
            }
            (&op.charges, &op.record, &op.hits).hash(&mut hasher);
        }
        self.faults.hash(&mut hasher);
        (self.oracle.calls, self.oracle.answers).hash(&mut hasher);
        for violation in &self.oracle.violations {
            // Not the detail: it names tokens, which hold a random part.
            (violation.rule, &violation.subject).hash(&mut hasher);
        }
        hasher.finish()
    }
}

/// Runs the world of `seed` to its end, over `MemoryStore`s, on the paused clock.
pub(crate) fn run(seed: u64, bug: Bug) -> History {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(world(seed, bug, Backend::memory(), LEASE))
}

/// Runs the world of `seed` over `backend`, with `lease` setting the pace of everything.
pub(crate) async fn world(seed: u64, bug: Bug, backend: Backend, lease: Duration) -> History {
    let start = Instant::now();
    let mut rng = Rng::new(seed);
    // The draws of faults added since, from a generator of their own: a seed keeps its history.
    let mut later = Rng::new(seed ^ 0xc10c_bac4_c10c_bac4);
    let instances = rng.below(2..5) as usize;
    let ops = rng.below(3..9) as usize;
    let modes: Vec<Mode> = (0..ops)
        .map(|_| Mode::ALL[rng.below(0..3) as usize])
        .collect();
    let real_time = backend.real_time;
    let mut setup = Setup::draw(&mut rng, lease, real_time);
    let lease = setup.lease;
    let ms = |factor: f64| lease.mul_f64(factor).as_millis() as u64;
    let quiet = start + lease.mul_f64(FAULTS_FOR);
    let mut profile = Profile::draw(&mut rng, quiet);
    profile.partial = Partial::draw(&mut later, start, lease, quiet);
    let instance_faults: Vec<InstanceFaults> = (0..instances)
        .map(|_| InstanceFaults::draw(&mut rng, start, lease, quiet))
        .collect();
    let mut behaviours: Vec<Behaviour> = (0..ops).map(|_| Behaviour::draw(&mut rng)).collect();
    // `SIM_LONG=1`: every handler runs for several leases, and every fault is short, so that any
    // unfenced double effect is one the renewals let through (§9.2).
    let long_only = std::env::var("SIM_LONG").is_ok();
    let (mut profile, mut instance_faults) = (profile, instance_faults);
    if long_only {
        behaviours.fill(Behaviour::Long);
        // Nor the protocol's own second runs: fail-open, a window that passes.
        setup.fail_open = false;
        setup.dedup_window = Duration::from_secs(3600);
        profile.stall = 0;
        profile.lossy_failover = false;
        for faults in &mut instance_faults {
            faults
                .partitions
                .retain(|(from, to)| *to - *from < lease / 4);
        }
    }
    let ledger = Arc::new(Ledger::new(modes.clone(), bug == Bug::UnguardedEffects));
    // On real time the model knows when a store call took effect only between its sending and
    // its answer (the machine's load included), and each expiry to within this band beyond that:
    // Redis counts `PX` and the lease end it stores in whole milliseconds (one each way), and a
    // store's wall clock strays from tokio's monotonic one by well under a millisecond in a run.
    // An answer inside the band may go either way; one outside it fails the run.
    let fuzz = if real_time {
        Duration::from_millis(5)
    } else {
        Duration::ZERO
    };
    let oracle = Arc::new(Oracle::new(fuzz, backend.releases_behind.then_some(lease)));
    let ids: Vec<RecordId> = (0..ops)
        .map(|op| {
            let (tenant, key) = setup.tenant_and_key(op);
            RecordId::new(&setup.scope(tenant), &key)
        })
        .collect();
    for (op, id) in ids.iter().enumerate() {
        oracle.name(*id, format!("op-{op}"));
    }
    let behind: Vec<Duration> = instance_faults.iter().map(|f| f.most_behind()).collect();
    let sealing = setup.clone();
    let store = StoreControl::new(Wiring {
        backend,
        seal: Box::new(move |store| sealing.seal(store)),
        rng: rng.fork(),
        profile,
        instances: instance_faults,
        lease,
        ledger: ledger.clone(),
        oracle: oracle.clone(),
        bug,
    });

    let dead: Vec<Arc<AtomicBool>> = (0..instances).map(|_| Arc::default()).collect();
    let handlers = Handlers {
        ledger: ledger.clone(),
        oracle: oracle.clone(),
        behaviours: Arc::new(behaviours.clone()),
        lease,
        scoped: setup.tenants > 1,
    };
    let mut shutdowns = Vec::new();
    let services: Vec<_> = (0..instances)
        .map(|i| {
            let layer = setup.layer(BoxStore::new(store.handle(i, dead[i].clone())));
            shutdowns.push(layer.shutdown_handle());
            let handler = handler::handler(handlers.clone(), i, dead[i].clone(), rng.fork());
            ServiceBuilder::new().layer(layer).service(handler)
        })
        .collect();

    // On real time, a watchdog: a tick that comes late by more than the longest injected delay
    // means the machine stalled the run, and the stall is recorded as the fault it is.
    let watchdog = real_time.then(|| {
        let (store, tick, bound) = (store.clone(), lease / 40, lease / 10);
        tokio::spawn(async move {
            loop {
                let before = Instant::now();
                tokio::time::sleep(tick).await;
                if before.elapsed() > tick + bound {
                    store.starved();
                }
            }
        })
    });

    // The world's own faults, each in about a third of the runs.
    if rng.chance(300) && !long_only {
        let (store, at) = (store.clone(), rng.millis(0..ms(2.0)));
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            store.restart().await;
        });
    }
    if rng.chance(300) {
        // Mostly while the first claims are made: a failover then finds claims unreplicated. A
        // lossy one, later, finds completions too. Half the time the replica's clock is behind
        // the old primary's, by up to two leases.
        let within = if profile.lossy_failover { 4.0 } else { 0.5 };
        let (store, at) = (store.clone(), rng.millis(0..ms(within)));
        let behind = later.chance(500).then(|| later.millis(1..ms(2.0)));
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            store.fail_over(behind).await;
        });
    }
    if rng.chance(300) && !long_only {
        let (store, at) = (store.clone(), rng.millis(0..ms(2.0)));
        let victim = rng.below(0..instances as u64) as usize;
        let flag = dead[victim].clone();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            flag.store(true, Ordering::SeqCst);
            store.died(victim);
        });
    }
    if rng.chance(300) && !long_only {
        let (store, at, pick, ids) = (
            store.clone(),
            rng.millis(0..ms(6.0)),
            rng.next_u64(),
            ids.clone(),
        );
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            store.evict_one(&ids, pick).await;
        });
    }

    // One client per operation, and now and then a second one: the same request (a proxy that
    // duplicated it, a user who clicked twice), or another under the same key (a client's bug).
    let seen = Arc::new(Mutex::new(client::Seen::default()));
    let mut plans = Vec::new();
    for op in 0..ops {
        let (tenant, key) = setup.tenant_and_key(op);
        let copies = if rng.chance(300) { 2 } else { 1 };
        for copy in 0..copies {
            let class = match (copy, rng.below(0..4)) {
                (0, _) | (_, 0 | 1) => BodyClass::Same,
                (_, 2) => BodyClass::Reordered,
                _ => BodyClass::Other,
            };
            let deadline = if rng.chance(200) {
                rng.millis(ms(0.25)..ms(2.0))
            } else {
                lease * 40
            };
            plans.push(Plan {
                op,
                client: plans.len(),
                class,
                tenant,
                scope: setup.scope(tenant),
                key: key.clone(),
                deadline,
                // Often less than the handler takes, so that retries meet the request in flight.
                attempt_timeout: rng.millis(ms(0.1)..ms(1.5)),
                latency: lease / 20,
            });
        }
    }
    let clients: Vec<_> = plans
        .iter()
        .map(|plan| {
            let run = client::client(
                plan.clone(),
                services.clone(),
                dead.clone(),
                rng.fork(),
                seen.clone(),
                bug,
            );
            tokio::spawn(run)
        })
        .collect();
    let mut finishes = Vec::new();
    for client in clients {
        finishes.push(client.await.expect("a client"));
    }
    // Every write the layer still retries lands (or is refused) once its faults pass; a dead
    // instance's work never finishes.
    for (shutdown, dead) in shutdowns.into_iter().zip(&dead) {
        if !dead.load(Ordering::SeqCst) {
            let _ = tokio::time::timeout(lease * 60, shutdown.wait()).await;
        }
    }
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }

    let seen = std::mem::take(&mut *seen.lock().expect("the answers' lock"));
    let settled = quiet + lease.mul_f64(SETTLE) + Duration::from_secs(2);
    let report = oracle.finish(|model| {
        let context = Context {
            canonical_json: setup.canonical_json,
            retry_after: setup.retry_after,
            behind: &behind,
            fuzz,
            sent: &seen.sent,
        };
        let mut violations = answers::judge(&seen.answers, &context, model);
        let (checked, late) = progress::judge(&finishes, settled, |finish, kind| {
            let plan = &plans[finish.client];
            let id = &ids[finish.op];
            match kind {
                ProblemKind::Mismatch => seen
                    .sent
                    .get(id)
                    .into_iter()
                    .flatten()
                    .any(|class| !class.identical(plan.class, setup.canonical_json)),
                ProblemKind::CommitRejected => store.hits(id).contains(&Fault::Rejected),
                ProblemKind::NotReplayable => {
                    behaviours[finish.op] == Behaviour::Oversize
                        && setup.response_limit == SMALL_RESPONSE_LIMIT
                }
                ProblemKind::QuotaExceeded => setup.quota.is_some(),
                _ => false,
            }
        });
        violations.extend(late);
        (seen.answers.len() as u64 + checked, violations)
    });

    let mut histories = Vec::new();
    for (op, id) in ids.iter().enumerate() {
        let record = store
            .record(id)
            .await
            .and_then(|completed| completed.plain().map(|stored| stored.body.clone()));
        let unwritten = ledger
            .runs(op)
            .into_iter()
            .filter(|(token, instance)| {
                let written = store.written(token);
                !written.landed && !written.refused && !dead[*instance].load(Ordering::SeqCst)
            })
            .count();
        let fences = store.fences(id);
        histories.push(OpHistory {
            op,
            mode: modes[op],
            behaviour: behaviours[op],
            answers: seen
                .answers
                .iter()
                .filter(|a| a.op == op)
                .cloned()
                .collect(),
            gave_up: finishes.iter().any(|f| f.op == op && f.last.is_err()),
            charges: ledger.charges(op),
            record,
            hits: store.hits(id),
            unwritten,
            // Within each stretch of the store's clock: a clock that went back gives smaller ones.
            fences_grew: fences
                .windows(2)
                .all(|pair| pair[0].0 < pair[1].0 || pair[0].1 < pair[1].1),
            fences_back: fences
                .windows(2)
                .filter(|pair| pair[0].1 >= pair[1].1)
                .count(),
            unprotected: ledger.ran_unprotected(op),
            window_passed: oracle.window_passed(id),
        });
    }
    History {
        start,
        setup,
        instances,
        ops: histories,
        faults: store.counts().into_iter().collect(),
        oracle: report,
    }
}
