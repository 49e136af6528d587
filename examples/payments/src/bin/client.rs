//! The client's half: a charge sent through a link that loses the first answer, made safe by
//! `IdempotentRetryLayer`. Against the payments example:
//!
//! ```text
//! cargo run -p example-payments                 # one terminal
//! cargo run -p example-payments --bin client    # another
//! # attempt 1: POST /v1/charges, key 5b0c...: the server answered 201 Created, the link lost it
//! # attempt 2: POST /v1/charges, key 5b0c...: 201 Created (idempotent-replayed: true)
//! # charge ch_2ce06b3e55f8f917, after 2 attempts, replayed: true
//! ```
//!
//! Both attempts carry the same key and body, so the server charged once and replayed its answer.
//! The layer's retries end when a response's head arrives; a body cut off after it is sent again,
//! same key, until the whole answer is in or the deadline passes. An error names the key, to look
//! the charge up or send it again by hand. `SERVER` (default `http://127.0.0.1:3000`), `API_KEY`
//! (`sk_test_alice`), `DEADLINE_MS` for the whole charge (10000); `RUST_LOG=tower_idempotency=info`
//! shows the layer's retries.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::{Instant, timeout_at};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency_client::{Attempts, IdempotentRetryLayer};

type BoxError = Box<dyn Error + Send + Sync>;

/// A link that loses the first answer: the request reaches the server, the server does the work
/// and answers, and the answer never arrives (as when a connection drops, or a proxy times out).
/// It prints every attempt.
#[derive(Clone)]
struct FlakyLink {
    client: Client<HttpConnector, Full<Bytes>>,
    attempts: Arc<AtomicUsize>,
}

impl Service<Request<Full<Bytes>>> for FlakyLink {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Incoming>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.client.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let key = request.headers().get("idempotency-key");
        let key = key.and_then(|key| key.to_str().ok()).unwrap_or("none");
        let (method, path) = (request.method(), request.uri().path());
        let line = format!("attempt {attempt}: {method} {path}, key {key}");
        let sent = self.client.request(request);
        Box::pin(async move {
            let response = sent.await?;
            let status = response.status();
            if attempt == 1 {
                println!("{line}: the server answered {status}, the link lost it");
                return Err("connection reset (the link lost the answer)".into());
            }
            let replayed = response.headers().get("idempotent-replayed").is_some();
            println!("{line}: {status} (idempotent-replayed: {replayed})");
            Ok(response)
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let server = std::env::var("SERVER").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let api_key = std::env::var("API_KEY").unwrap_or_else(|_| "sk_test_alice".into());
    let deadline_ms: u64 = std::env::var("DEADLINE_MS").map_or(Ok(10_000), |ms| ms.parse())?;
    let deadline = Instant::now() + Duration::from_millis(deadline_ms);

    let link = FlakyLink {
        client: Client::builder(TokioExecutor::new()).build_http(),
        attempts: Arc::default(),
    };
    let client = IdempotentRetryLayer::new().layer(link);

    // The charge is named here, not by the layer: a send after a cut-off answer must carry the
    // same key, and an error must name it.
    let key = uuid::Uuid::new_v4().to_string();
    let form = "amount=2500&currency=eur&source=tok_visa";
    let charge = || {
        Request::post(format!("{}/v1/charges", server.trim_end_matches('/')))
            .header(header::AUTHORIZATION, format!("Bearer {api_key}"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header("idempotency-key", &key)
            .body(Full::<Bytes>::from(form))
    };
    let (mut attempts, mut pause) = (0, Duration::from_millis(100));
    let (status, replayed, body) = loop {
        let sent = async {
            let response = timeout_at(deadline, client.clone().oneshot(charge()?)).await??;
            let info = response.extensions().get::<Attempts>().cloned();
            let info = info.ok_or("the response carries no Attempts")?;
            let status = response.status();
            let body = timeout_at(deadline, response.into_body().collect()).await?;
            Ok::<_, BoxError>((status, info, body))
        };
        let (status, info, body) = sent.await.map_err(|err| failed(&key, err))?;
        attempts += info.count();
        // The head arrived and the body did not: the charge may be made, and the same request with
        // the same key gets its stored answer (the layer's retries end at the head).
        let cut = match body {
            Ok(body) => break (status, info.replayed(), body.to_bytes()),
            Err(cut) => cut,
        };
        // Each wait twice the last, and none that would end past the deadline.
        if Instant::now() + pause >= deadline {
            return Err(failed(&key, cut));
        }
        let why = causes(&cut);
        println!("the answer was cut off ({why}); sending it again, key {key}");
        tokio::time::sleep(pause).await;
        pause *= 2;
    };
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let Some(id) = json["id"].as_str() else {
        let body = String::from_utf8_lossy(&body);
        let answer = format!("the server answered {status}: {body}");
        return Err(failed(&key, answer));
    };
    println!("charge {id}, after {attempts} attempts, replayed: {replayed}");
    Ok(())
}

/// The error that ends the charge: it names the key, to look the charge up or send it again.
fn failed(key: &str, err: impl Into<BoxError>) -> BoxError {
    format!("charge with key {key} failed: {}", causes(&*err.into())).into()
}

/// `err` and its causes, on one line: hyper keeps why a body failed (a reset...) as the source.
fn causes(err: &(dyn Error + 'static)) -> String {
    let causes = std::iter::successors(Some(err), |&err| err.source());
    let causes: Vec<String> = causes.map(|err| err.to_string()).collect();
    causes.join(": ")
}
