//! One run of the world, from a seed: 2 to 4 instances of the layer over one faulty store, one
//! client per operation retrying as the crate's client layer does, handlers charging a ledger,
//! and faults injected on the store's calls and on the world (a restart, a failover, a death).
//! Everything runs on one thread on tokio's paused clock, so one seed makes one history.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{HeldClaim, IdempotencyLayer, RecordId, RequestBody};

use super::ledger::{Ledger, Mode, Staged};
use super::rng::Rng;
use super::store::{Backend, Fault, Profile, StoreControl};

/// The claim lease on the paused clock. Every other time of a run is in proportion to the lease:
/// a handler's work takes at most 45% of it, so a renewal always comes in time.
pub const LEASE: Duration = Duration::from_secs(2);

/// Bugs put back on purpose, to show that the checker catches them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bugs {
    /// The store answers a claim before a replica has it, so a failover loses acknowledged claims.
    pub no_replication_wait: bool,
    /// Fenced handlers charge without their guard.
    pub unguarded_effects: bool,
}

impl Bugs {
    /// The bug `SIM_BUG` names (`no-replication-wait` or `unguarded-effects`), or none.
    pub fn from_env() -> Self {
        match std::env::var("SIM_BUG").as_deref() {
            Ok("no-replication-wait") => Self {
                no_replication_wait: true,
                ..Self::default()
            },
            Ok("unguarded-effects") => Self {
                unguarded_effects: true,
                ..Self::default()
            },
            Ok(other) => panic!("unknown SIM_BUG {other:?}"),
            Err(_) => Self::default(),
        }
    }
}

/// What one operation's client saw, and what the world holds for it at the end.
#[derive(Debug)]
pub struct OpHistory {
    pub op: usize,
    pub mode: Mode,
    /// Each answer the client got: status and body.
    pub answers: Vec<(StatusCode, Bytes)>,
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
    /// Whether every claim of the key had a larger fence than the claim before it (the fences
    /// themselves come from clocks, and are left out of the digest).
    pub fences_grew: bool,
}

#[derive(Debug)]
pub struct History {
    pub instances: usize,
    pub ops: Vec<OpHistory>,
    pub faults: BTreeMap<Fault, u64>,
}

impl History {
    /// A digest of everything the run produced: two runs of one seed must agree on it.
    pub fn digest(&self) -> u64 {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut hasher = DefaultHasher::new();
        self.instances.hash(&mut hasher);
        for op in &self.ops {
            (op.op, op.mode, op.gave_up, op.unwritten, op.fences_grew).hash(&mut hasher);
            for (status, body) in &op.answers {
                (status.as_u16(), body).hash(&mut hasher);
            }
            (&op.charges, &op.record, &op.hits).hash(&mut hasher);
        }
        self.faults.hash(&mut hasher);
        hasher.finish()
    }
}

/// Runs the world of `seed` to its end, over a `MemoryStore`, on the paused clock.
pub fn run(seed: u64, bugs: Bugs) -> History {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(world(seed, bugs, Backend::memory(), LEASE))
}

/// `lease` scaled by `factor`.
fn times(lease: Duration, factor: f64) -> Duration {
    lease.mul_f64(factor)
}

type Body = RequestBody<Full<Bytes>>;

/// Runs the world of `seed` over `backend`, with `lease` setting the pace of everything.
pub async fn world(seed: u64, bugs: Bugs, backend: Backend, lease: Duration) -> History {
    let ms = |factor: f64| times(lease, factor).as_millis() as u64;
    let mut rng = Rng::new(seed);
    let instances = rng.below(2..5) as usize;
    let ops = rng.below(3..9) as usize;
    let modes: Vec<Mode> = (0..ops)
        .map(|_| Mode::ALL[rng.below(0..3) as usize])
        .collect();
    // Each fault class is on in about half the runs, so that some runs meet short faults only.
    let profile = Profile {
        delay: if rng.chance(500) { 150 } else { 0 },
        lost_call: if rng.chance(500) { 40 } else { 0 },
        lost_reply: if rng.chance(500) { 40 } else { 0 },
        stall: if rng.chance(300) { 50 } else { 0 },
    };
    let ledger = Arc::new(Ledger::new(modes.clone(), bugs.unguarded_effects));
    let real_time = backend.real_time;
    let store = StoreControl::new(
        backend,
        rng.fork(),
        profile,
        lease,
        !bugs.no_replication_wait,
        ledger.clone(),
    );

    let dead: Vec<Arc<AtomicBool>> = (0..instances).map(|_| Arc::default()).collect();
    let mut shutdowns = Vec::new();
    let services: Vec<_> = (0..instances)
        .map(|i| {
            let layer = IdempotencyLayer::new(store.handle(i, dead[i].clone()))
                .lease(lease)
                .dedup_window(Duration::from_secs(3600));
            shutdowns.push(layer.shutdown_handle());
            let work = (ms(0.3), ms(0.15));
            let handler = handler(i, dead[i].clone(), ledger.clone(), rng.fork(), work);
            ServiceBuilder::new().layer(layer).service(handler)
        })
        .collect();

    // On real time, a watchdog: a tick that comes late by more than the longest injected delay
    // means the machine stalled the run, and the stall is recorded as the fault it is.
    let watchdog = real_time.then(|| {
        let (store, tick, bound) = (store.clone(), lease / 40, lease / 10);
        tokio::spawn(async move {
            loop {
                let before = tokio::time::Instant::now();
                tokio::time::sleep(tick).await;
                if before.elapsed() > tick + bound {
                    store.starved();
                }
            }
        })
    });

    // The world's own faults, each in about a third of the runs, in the first two leases.
    if rng.chance(300) {
        let (store, at) = (store.clone(), rng.millis(0..ms(2.0)));
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            store.restart().await;
        });
    }
    if rng.chance(300) {
        // While the first claims are made: a failover later finds nothing unreplicated.
        let (store, at) = (store.clone(), rng.millis(0..ms(0.5)));
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            store.fail_over().await;
        });
    }
    if rng.chance(300) {
        let (store, at) = (store.clone(), rng.millis(0..ms(2.0)));
        let victim = rng.below(0..instances as u64) as usize;
        let flag = dead[victim].clone();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            flag.store(true, Ordering::SeqCst);
            store.died(victim);
        });
    }

    // One client per operation, and now and then a second one sending the same request (a
    // request a proxy duplicated, or a user who clicked twice).
    let mut clients = Vec::new();
    for op in 0..ops {
        let copies = if rng.chance(300) { 2 } else { 1 };
        for _ in 0..copies {
            let (services, dead, rng) = (services.clone(), dead.clone(), rng.fork());
            let client = client(op, services, dead, rng, lease);
            clients.push((op, tokio::spawn(client)));
        }
    }
    let mut seen: Vec<(Vec<(StatusCode, Bytes)>, bool)> =
        (0..ops).map(|_| Default::default()).collect();
    for (op, client) in clients {
        let (answers, gave_up) = client.await.expect("a client");
        seen[op].0.extend(answers);
        seen[op].1 |= gave_up;
    }
    // Every write the layer still retries lands (or is refused) once its faults pass; a dead
    // instance's work never finishes.
    for (shutdown, dead) in shutdowns.into_iter().zip(&dead) {
        if !dead.load(Ordering::SeqCst) {
            let _ = tokio::time::timeout(times(lease, 60.0), shutdown.wait()).await;
        }
    }

    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }

    let mut histories = Vec::new();
    for (op, (answers, gave_up)) in seen.into_iter().enumerate() {
        let id = RecordId::new(b"", &key(op));
        let record = store
            .record(&id)
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
        let fences = store.fences(&id);
        histories.push(OpHistory {
            op,
            mode: modes[op],
            answers,
            gave_up,
            charges: ledger.charges(op),
            record,
            hits: store.hits(&id),
            unwritten,
            fences_grew: fences.windows(2).all(|pair| pair[0] < pair[1]),
        });
    }
    History {
        instances,
        ops: histories,
        faults: store.counts().into_iter().collect(),
    }
}

fn key(op: usize) -> String {
    format!("op-{op}")
}

/// The handler of instance `instance`: some work, the charge in the operation's mode, some more
/// work, the answer. A dead instance's handler stops where it is.
fn handler(
    instance: usize,
    dead: Arc<AtomicBool>,
    ledger: Arc<Ledger>,
    rng: Rng,
    (before, after): (u64, u64),
) -> impl tower::Service<
    Request<Body>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
+ Send
+ 'static {
    let rng = Arc::new(Mutex::new(rng));
    tower::service_fn(move |request: Request<Body>| {
        let (dead, ledger, rng) = (dead.clone(), ledger.clone(), rng.clone());
        async move {
            let op: usize = request
                .uri()
                .path()
                .trim_start_matches("/ops/")
                .parse()
                .expect("an operation number");
            let claim = request.extensions().get::<HeldClaim>().cloned();
            let staged = request.extensions().get::<Staged>().cloned();
            let (Some(claim), Some(staged)) = (claim, staged) else {
                return Ok(answer(StatusCode::INTERNAL_SERVER_ERROR, "no claim"));
            };
            let (before, after) = {
                let mut rng = rng.lock().unwrap();
                (rng.millis(0..before), rng.millis(0..after))
            };
            let alive = || async {
                if dead.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
            };
            tokio::time::sleep(before).await;
            alive().await;
            let charge = match ledger.mode(op) {
                Mode::Unfenced => ledger.charge(op),
                Mode::Fenced => match ledger.charge_fenced(op, claim.fence()) {
                    Ok(charge) => charge,
                    Err(_) => return Ok(answer(StatusCode::CONFLICT, "superseded")),
                },
                Mode::Transactional => ledger.stage(op, &staged),
            };
            tokio::time::sleep(after).await;
            alive().await;
            if ledger.mode(op) == Mode::Fenced && !ledger.owns(op, claim.fence()) {
                return Ok(answer(StatusCode::CONFLICT, "superseded"));
            }
            ledger.finished(op, staged.token(), instance);
            Ok(answer(StatusCode::CREATED, &charge))
        }
    })
}

fn answer(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::copy_from_slice(body.as_bytes())));
    *response.status_mut() = status;
    response
}

/// One operation's client, as the crate's client layer retries: the same key and body on every
/// attempt, to an instance picked at random; after `Retry-After` on a 409, with capped backoff
/// otherwise; until a 201 or its deadline (some give up early).
async fn client<S>(
    op: usize,
    services: Vec<S>,
    dead: Vec<Arc<AtomicBool>>,
    mut rng: Rng,
    lease: Duration,
) -> (Vec<(StatusCode, Bytes)>, bool)
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone,
{
    let ms = |factor: f64| times(lease, factor).as_millis() as u64;
    let deadline = Instant::now()
        + if rng.chance(200) {
            rng.millis(ms(0.25)..ms(2.0))
        } else {
            times(lease, 30.0)
        };
    // How long the client waits for one attempt before it sends another: often less than the
    // handler takes, so that retries meet the request in flight.
    let attempt_timeout = rng.millis(ms(0.1)..ms(1.5));
    let mut answers = Vec::new();
    let first_backoff = times(lease, 0.05);
    let most = times(lease, 1.0);
    let mut backoff = first_backoff;
    while Instant::now() < deadline {
        let instance = rng.below(0..services.len() as u64) as usize;
        let request = Request::post(format!("/ops/{op}"))
            .header("idempotency-key", key(op))
            .body(Full::new(Bytes::from(key(op))))
            .expect("a request");
        let service = services[instance].clone();
        let dead = dead[instance].clone();
        let attempt = tokio::time::timeout(attempt_timeout, async move {
            if dead.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            let response = service.oneshot(request).await.expect("infallible");
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (parts, body)
        })
        .await;
        let pause = match attempt {
            Ok((parts, body)) => {
                let status = parts.status;
                answers.push((status, body));
                if status.is_success() {
                    return (answers, false);
                }
                let retry_after = parts
                    .headers
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(Duration::from_secs);
                if status == StatusCode::UNPROCESSABLE_ENTITY {
                    // Never the same request again: nothing a retry can fix.
                    return (answers, false);
                }
                retry_after.unwrap_or(backoff)
            }
            Err(_) => backoff,
        };
        backoff = (backoff * 2).min(most);
        tokio::time::sleep(pause.min(most)).await;
    }
    (answers, true)
}
