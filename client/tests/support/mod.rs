//! The client tests' world: a server behind the server layer, and a link to it that injects
//! faults and records what every attempt sent.

// Each test binary uses its own part of it.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_client::{Attempts, IdempotentRetryLayer};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the link does to one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Fails before forwarding anything, as a refused connection does.
    Refuse,
    /// Forwards the request, lets the server answer, then fails: the answer is lost.
    LoseResponse,
    /// Never answers, as a link that went silent.
    Stall,
}

/// One attempt as it left the client.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub key: Option<HeaderValue>,
    pub body: Bytes,
    pub at: Instant,
}

/// A link to `S` that applies the queued faults, one per attempt, in order (then none).
#[derive(Clone)]
pub(crate) struct Link<S> {
    server: S,
    faults: Arc<Mutex<VecDeque<Fault>>>,
    sent: Arc<Mutex<Vec<Sent>>>,
}

impl<S> Link<S> {
    pub(crate) fn new(server: S, faults: impl IntoIterator<Item = Fault>) -> Self {
        Self {
            server,
            faults: Arc::new(Mutex::new(faults.into_iter().collect())),
            sent: Arc::default(),
        }
    }

    /// Every attempt so far.
    pub(crate) fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap().clone()
    }

    /// The times between consecutive attempts.
    pub(crate) fn gaps(&self) -> Vec<Duration> {
        let sent = self.sent();
        sent.windows(2).map(|w| w[1].at - w[0].at).collect()
    }
}

impl<S> Service<Request<Full<Bytes>>> for Link<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let fault = self.faults.lock().unwrap().pop_front();
        let sent = self.sent.clone();
        let server = self.server.clone();
        Box::pin(async move {
            let key = request.headers().get("idempotency-key").cloned();
            let body = request.body().clone().collect().await?.to_bytes();
            let at = Instant::now();
            sent.lock().unwrap().push(Sent { key, body, at });
            match fault {
                Some(Fault::Refuse) => Err(io_error(std::io::ErrorKind::ConnectionRefused)),
                Some(Fault::LoseResponse) => {
                    let _answered = server.oneshot(request).await?;
                    Err(io_error(std::io::ErrorKind::ConnectionReset))
                }
                Some(Fault::Stall) => std::future::pending().await,
                None => Ok(server.oneshot(request).await?),
            }
        })
    }
}

fn io_error(kind: std::io::ErrorKind) -> BoxError {
    Box::new(std::io::Error::from(kind))
}

/// What the server's handler answers to its `n`th run (from 1), given the request's body.
pub(crate) type Script = Arc<dyn Fn(usize, &Bytes) -> Response<Body> + Send + Sync>;

/// `POST /v1/charges` behind the server layer on a `MemoryStore`; the handler takes `latency`,
/// then answers as `script` says. Returns the router and the handler's run count.
pub(crate) fn server(latency: Duration, script: Script) -> (Router, Arc<AtomicUsize>) {
    server_with(IdempotencyLayer::new(MemoryStore::new()), latency, script)
}

/// [`server`], behind `layer`.
pub(crate) fn server_with(
    layer: IdempotencyLayer<MemoryStore>,
    latency: Duration,
    script: Script,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move |body: Bytes| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        let script = script.clone();
        async move {
            tokio::time::sleep(latency).await;
            script(n, &body)
        }
    };
    let router = Router::new()
        .route("/v1/charges", post(handler))
        .route_layer(layer);
    (router, runs)
}

/// A handler that creates charge number `n`.
pub(crate) fn charges() -> Script {
    Arc::new(|n, _| {
        Response::builder()
            .status(StatusCode::CREATED)
            .body(Body::from(format!("ch_{n}")))
            .unwrap()
    })
}

/// A handler that answers `status` with `headers` to every run.
pub(crate) fn always(status: u16, headers: HeaderMap) -> Script {
    Arc::new(move |_, _| {
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        *response.headers_mut() = headers.clone();
        response
    })
}

/// A handler that answers its first run 503 with `Retry-After: {retry_after}`, then 200.
pub(crate) fn unavailable_once(retry_after: String) -> Script {
    Arc::new(move |n, _| {
        if n == 1 {
            let mut response = Response::new(Body::empty());
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let value = HeaderValue::from_str(&retry_after).unwrap();
            response.headers_mut().insert(RETRY_AFTER, value);
            response
        } else {
            Response::new(Body::from("done"))
        }
    })
}

/// A charge request with `body`.
pub(crate) fn charge(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("/v1/charges").body(Full::from(body)).unwrap()
}

/// The body of a response, as text.
pub(crate) async fn text(response: Response<Body>) -> String {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The layer with waits that tests can predict: no backoff unless a test asks for one.
pub(crate) fn layer() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new().backoff(Duration::ZERO, Duration::ZERO)
}

/// What the layer reports about `response`.
pub(crate) fn attempts(response: &Response<Body>) -> Attempts {
    response.extensions().get::<Attempts>().unwrap().clone()
}
