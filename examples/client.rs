//! The client's half: a charge sent through a link that loses the first answer, made safe by
//! `IdempotentRetryLayer`. Against the payments example:
//!
//! ```text
//! cargo run --example server                        # one terminal
//! cargo run --features client --example client      # another
//! # attempt 1: POST /v1/charges, key 5b0c...: the server answered 201 Created, the link lost it
//! # attempt 2: POST /v1/charges, key 5b0c...: 201 Created (idempotent-replayed: true)
//! # charge ch_2ce06b3e55f8f917, after 2 attempts, replayed: true
//! ```
//!
//! Both attempts carry the same key and body, so the server ran the charge once and answered the
//! retry with the stored response. `SERVER` names the server (default `http://127.0.0.1:3000`),
//! `API_KEY` the account (default `sk_test_alice`). `RUST_LOG=tower_idempotency=info` shows the
//! layer's retry events.

use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{Attempts, IdempotentRetryLayer};

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
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|key| key.to_str().ok())
            .unwrap_or("none")
            .to_owned();
        let line = format!(
            "attempt {attempt}: {} {}, key {key}",
            request.method(),
            request.uri().path()
        );
        let sent = self.client.request(request);
        Box::pin(async move {
            let response = sent.await?;
            if attempt == 1 {
                println!(
                    "{line}: the server answered {}, the link lost it",
                    response.status()
                );
                return Err("connection reset (the link lost the answer)".into());
            }
            let replayed = response.headers().get("idempotent-replayed").is_some();
            println!(
                "{line}: {} (idempotent-replayed: {replayed})",
                response.status()
            );
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

    let link = FlakyLink {
        client: Client::builder(TokioExecutor::new()).build_http(),
        attempts: Arc::default(),
    };
    let client = ServiceBuilder::new()
        .layer(IdempotentRetryLayer::new())
        .service(link);

    // No key set: the layer names the charge with a fresh one, the same on every attempt.
    let charge = Request::post(format!("{}/v1/charges", server.trim_end_matches('/')))
        .header(header::AUTHORIZATION, format!("Bearer {api_key}"))
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Full::<Bytes>::from(
            "amount=2500&currency=eur&source=tok_visa",
        ))?;
    let response = client.oneshot(charge).await?;

    let status = response.status();
    let attempts = response.extensions().get::<Attempts>().cloned();
    let body = response.into_body().collect().await?.to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|err| format!("the server answered {status} with no JSON ({err})"))?;
    let Some(id) = json["id"].as_str() else {
        return Err(format!("the server answered {status}: {json}").into());
    };
    match attempts {
        Some(attempts) => println!(
            "charge {id}, after {} attempts, replayed: {}",
            attempts.count(),
            attempts.replayed()
        ),
        None => println!("charge {id}"),
    }
    Ok(())
}
