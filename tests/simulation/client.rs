//! The clients: the crate's own client layer (`IdempotentRetryLayer`) over a link to the
//! instances. The link picks an instance per attempt, adds a little latency, and records every
//! answer that reaches the client. The client layer's backoff draws from a generator the run
//! does not seed, so it is set to zero (every wait then comes from `Retry-After` or the link's
//! seeded latency), and the key is the client's own: one seed stays one history.

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::RecordId;
use tower_idempotency::{Outcome, ResponseBody};
use tower_idempotency_client::IdempotentRetryLayer;

use super::bugs::Bug;
use super::handler::CLASS;
use super::oracle::answers::{Answer, BodyClass};
use super::oracle::progress::Finish;
use super::rng::Rng;
use super::setup::TENANT;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One client's operation.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub op: usize,
    pub client: usize,
    pub class: BodyClass,
    pub tenant: usize,
    pub scope: Vec<u8>,
    pub key: String,
    pub deadline: Duration,
    pub attempt_timeout: Duration,
    pub latency: Duration,
}

/// What the clients saw: every answer, and the bodies sent under each record id.
#[derive(Default)]
pub(crate) struct Seen {
    pub answers: Vec<Answer>,
    pub sent: HashMap<RecordId, BTreeSet<BodyClass>>,
}

/// The client's way to the instances: one instance per attempt, picked at random.
struct Link<S> {
    plan: Arc<Plan>,
    services: Arc<Vec<S>>,
    dead: Arc<Vec<Arc<AtomicBool>>>,
    rng: Arc<Mutex<Rng>>,
    seen: Arc<Mutex<Seen>>,
    bug: Bug,
    attempts: Arc<AtomicU32>,
}

impl<S> Clone for Link<S> {
    fn clone(&self) -> Self {
        Self {
            plan: self.plan.clone(),
            services: self.services.clone(),
            dead: self.dead.clone(),
            rng: self.rng.clone(),
            seen: self.seen.clone(),
            bug: self.bug,
            attempts: self.attempts.clone(),
        }
    }
}

type LinkFuture = Pin<Box<dyn Future<Output = Result<Response<Full<Bytes>>, BoxError>> + Send>>;

impl<S> tower::Service<Request<Full<Bytes>>> for Link<S>
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = LinkFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> LinkFuture {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst);
        Box::pin(self.clone().attempt(attempt, request))
    }
}

impl<S> Link<S>
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    async fn attempt(
        self,
        attempt: u32,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<Full<Bytes>>, BoxError> {
        let Link {
            plan,
            services,
            dead,
            rng,
            seen,
            bug,
            ..
        } = self;
        let mut key = plan.key.clone();
        if bug == Bug::NewKeyPerRetry && attempt > 0 {
            key = format!("{key}-{attempt}");
            let value = HeaderValue::from_str(&key).expect("a key");
            request.headers_mut().insert("idempotency-key", value);
        }
        let id = RecordId::new(&plan.scope, &key);
        let (instance, latency) = {
            let mut rng = rng.lock().expect("the rng's lock");
            let most = plan.latency.as_millis() as u64;
            (
                rng.below(0..services.len() as u64) as usize,
                rng.millis(1..most.max(2)),
            )
        };
        seen.lock()
            .expect("the answers' lock")
            .sent
            .entry(id)
            .or_default()
            .insert(plan.class);
        tokio::time::sleep(latency).await;
        if dead[instance].load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let response = services[instance]
            .clone()
            .oneshot(request)
            .await
            .expect("infallible");
        let (parts, body) = response.into_parts();
        let body = match body.collect().await {
            Ok(body) => body.to_bytes(),
            Err(err) => return Err(format!("the response body failed: {err}").into()),
        };
        seen.lock()
            .expect("the answers' lock")
            .answers
            .push(Answer {
                op: plan.op,
                client: plan.client,
                instance,
                id,
                class: plan.class,
                answered: Instant::now(),
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
                outcome: parts.extensions.get::<Outcome>().copied(),
                problem: parts.extensions.get::<ProblemKind>().copied(),
            });
        Ok(Response::from_parts(parts, Full::new(body)))
    }
}

/// Runs one client's operation to its end.
pub(crate) async fn client<S>(
    plan: Plan,
    services: Vec<S>,
    dead: Vec<Arc<AtomicBool>>,
    rng: Rng,
    seen: Arc<Mutex<Seen>>,
    bug: Bug,
) -> Finish
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<ResponseBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    let started = Instant::now();
    let link = Link {
        plan: Arc::new(plan.clone()),
        services: Arc::new(services),
        dead: Arc::new(dead),
        rng: Arc::new(Mutex::new(rng)),
        seen: seen.clone(),
        bug,
        attempts: Arc::new(AtomicU32::new(0)),
    };
    let client = ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .backoff(Duration::ZERO, Duration::ZERO)
                .max_attempts(u32::MAX)
                .attempt_timeout(plan.attempt_timeout)
                .deadline(plan.deadline),
        )
        .service(link);
    let request = Request::post(format!("/ops/{}", plan.op))
        .header("idempotency-key", &plan.key)
        .header(TENANT, format!("t{}", plan.tenant))
        .header(CLASS, plan.class.name())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(plan.class.body(plan.op)))
        .expect("a request");
    let last = match client.oneshot(request).await {
        Ok(response) => Ok((
            response.status(),
            response.extensions().get::<ProblemKind>().copied(),
        )),
        Err(err) => Err(err.to_string()),
    };
    let last_seen = seen
        .lock()
        .expect("the answers' lock")
        .answers
        .iter()
        .rev()
        .find(|answer| answer.client == plan.client)
        .map(|answer| (answer.status, answer.problem));
    Finish {
        op: plan.op,
        client: plan.client,
        deadline: started + plan.deadline,
        last,
        last_seen,
    }
}
