//! The handlers: each operation behaves one way for the whole run. Most charge and answer `201`;
//! some decline with a `402` (stored and replayed), fail before acting (a panic or a `503`, so a
//! retry runs them again), answer a body over the response limit (a tombstone), or run for
//! several leases and ask `still_held()` on the way. A run without a claim (fail-open) charges
//! unguarded. A dead instance's handler stops where it is.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::time::Instant;
use tower_idempotency::record::RecordId;
use tower_idempotency::{HeldClaim, RequestBody};

use super::ledger::{Ledger, Mode, Staged};
use super::oracle::Oracle;
use super::oracle::answers::RAN_FOR;
use super::rng::Rng;
use super::setup::{OVERSIZE, TENANT};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Behaviour {
    Charge,
    /// A `402`, before any effect: stored, and replayed to every retry.
    Decline,
    /// Half its runs fail before any effect: a panic, or a `503` (not stored).
    Flaky,
    /// A body over a small response limit: a tombstone, and `409 not-replayable` to retries.
    Oversize,
    /// Runs for up to three leases, asking `still_held()` halfway.
    Long,
}

impl Behaviour {
    pub(crate) fn draw(rng: &mut Rng) -> Self {
        match rng.below(0..20) {
            0 => Behaviour::Decline,
            1 | 2 => Behaviour::Flaky,
            3 => Behaviour::Oversize,
            4..=6 => Behaviour::Long,
            _ => Behaviour::Charge,
        }
    }
}

/// The request header where the client names which of the operation's bodies it sends.
pub(crate) const CLASS: &str = "x-class";
/// The message of a flaky handler's panic: the world's panic hook keeps it quiet.
pub(crate) const FLAKY_PANIC: &str = "a flaky handler panicked";

pub(crate) type Body = RequestBody<Full<Bytes>>;

/// What every instance's handler shares.
#[derive(Clone)]
pub(crate) struct Handlers {
    pub ledger: Arc<Ledger>,
    pub oracle: Arc<Oracle>,
    pub behaviours: Arc<Vec<Behaviour>>,
    pub lease: Duration,
    pub scoped: bool,
}

/// The handler of instance `instance`.
pub(crate) fn handler(
    handlers: Handlers,
    instance: usize,
    dead: Arc<AtomicBool>,
    rng: Rng,
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
        let (handlers, dead, rng) = (handlers.clone(), dead.clone(), rng.clone());
        async move { Ok(run(handlers, instance, dead, rng, request).await) }
    })
}

async fn run(
    handlers: Handlers,
    instance: usize,
    dead: Arc<AtomicBool>,
    rng: Arc<Mutex<Rng>>,
    request: Request<Body>,
) -> Response<Full<Bytes>> {
    let op: usize = request
        .uri()
        .path()
        .trim_start_matches("/ops/")
        .parse()
        .expect("an operation number");
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .map(|v| v.as_bytes().to_vec())
            .unwrap_or_default()
    };
    let class = String::from_utf8(header(CLASS)).expect("a class");
    let scope = if handlers.scoped {
        header(TENANT)
    } else {
        Vec::new()
    };
    let key = String::from_utf8(header("idempotency-key")).expect("a key");
    let id = RecordId::new(&scope, &key);
    let claim = request.extensions().get::<HeldClaim>().cloned();
    let staged = request.extensions().get::<Staged>().cloned();
    let behaviour = handlers.behaviours[op];
    let ms = |f: f64| handlers.lease.mul_f64(f).as_millis() as u64;
    let (before, after, fails) = {
        let mut rng = rng.lock().expect("the rng's lock");
        let (before, after) = match behaviour {
            Behaviour::Long => (rng.millis(0..ms(1.5)), rng.millis(0..ms(1.5))),
            _ => (rng.millis(0..ms(0.3)), rng.millis(0..ms(0.15))),
        };
        let fails = (behaviour == Behaviour::Flaky && rng.chance(500)).then(|| rng.chance(500));
        (before, after, fails)
    };
    let alive = || async {
        if dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    };
    let answer = |status: StatusCode, body: Bytes| {
        let mut response = Response::new(Full::new(body));
        *response.status_mut() = status;
        let class = http::HeaderValue::from_str(&class).expect("a class header");
        response.headers_mut().insert(RAN_FOR, class);
        response
    };
    tokio::time::sleep(before).await;
    alive().await;
    match (behaviour, fails) {
        (Behaviour::Decline, _) => {
            return answer(StatusCode::PAYMENT_REQUIRED, Bytes::from("declined"));
        }
        (_, Some(true)) => std::panic::panic_any(FLAKY_PANIC),
        (_, Some(false)) => {
            return answer(StatusCode::SERVICE_UNAVAILABLE, Bytes::from("try later"));
        }
        _ => {}
    }
    let ledger = &handlers.ledger;
    let charge = match (&claim, &staged) {
        (Some(claim), Some(staged)) => match ledger.mode(op) {
            Mode::Unfenced => ledger.charge(op),
            Mode::Fenced => match ledger.charge_fenced(op, claim.fence()) {
                Ok(charge) => charge,
                Err(_) => return answer(StatusCode::CONFLICT, Bytes::from("superseded")),
            },
            Mode::Transactional => ledger.stage(op, staged),
        },
        // Fail-open: no claim, nothing guards the effect.
        _ => ledger.unprotected(op),
    };
    if behaviour == Behaviour::Long
        && let Some(claim) = &claim
    {
        let asked = Instant::now();
        if let Ok(true) = claim.still_held().await {
            handlers.oracle.held(&id, claim.fence(), asked);
        }
    }
    tokio::time::sleep(after).await;
    alive().await;
    if let (Some(claim), Some(staged)) = (&claim, &staged) {
        if ledger.mode(op) == Mode::Fenced && !ledger.owns(op, claim.fence()) {
            return answer(StatusCode::CONFLICT, Bytes::from("superseded"));
        }
        ledger.finished(op, staged.token(), instance);
    }
    let body = if behaviour == Behaviour::Oversize {
        format!("{charge}#{}", "x".repeat(OVERSIZE))
    } else {
        charge
    };
    answer(StatusCode::CREATED, Bytes::from(body))
}

/// The charge a `201`'s body names.
pub(crate) fn charge_of(body: &[u8]) -> &[u8] {
    body.split(|b| *b == b'#').next().unwrap_or(body)
}

/// The flaky handlers' panics are part of the workload: caught by the layer (§9.4), and not
/// worth a line each. Every other panic is reported as usual.
pub(crate) fn quiet_flaky_panics() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&FLAKY_PANIC) {
            report(info);
        }
    }));
}
