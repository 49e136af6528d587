//! The layer over a plain hyper service (no axum), built with `tower::ServiceBuilder` and served by
//! a real hyper HTTP/1 server on loopback, driven by a hyper client.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::ServiceBuilder;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};

async fn post(
    addr: std::net::SocketAddr,
    key: &str,
    body: &'static str,
) -> (StatusCode, Option<String>, Bytes) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::post("/charges")
        .header("host", "localhost")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

#[tokio::test]
async fn a_plain_hyper_service_is_protected_end_to_end() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = tower::service_fn(move |request: Request<RequestBody<Incoming>>| {
        let counter = counter.clone();
        async move {
            let Ok(body) = request.into_body().collect().await else {
                let mut response = Response::new(Full::new(Bytes::new()));
                *response.status_mut() = StatusCode::BAD_REQUEST;
                return Ok(response);
            };
            let body = body.to_bytes();
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            let reply = format!("charge {n}: {}", String::from_utf8_lossy(&body));
            let mut response = Response::new(Full::new(Bytes::from(reply)));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }
    });
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(handler);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });

    let first = post(addr, "k1", "100 EUR").await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::CREATED, None));
    assert_eq!(first.2, "charge 1: 100 EUR");
    let retry = post(addr, "k1", "100 EUR").await;
    assert_eq!(
        (retry.0, retry.1.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(retry.2, first.2);
    assert_eq!(
        post(addr, "k1", "200 EUR").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
