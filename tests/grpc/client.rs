//! The client's half for gRPC (`tower_idempotency_client::GrpcRetryLayer`, PROTOCOL.md §16.7) over
//! tonic's `Channel`, against the example's `payments.v1.Payments` behind the layer in gRPC mode,
//! on loopback over HTTP/2.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Code;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tower::{Layer, Service, ServiceBuilder};
use tower_idempotency::store::Store;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_client::{Attempts, GrpcRetry, IdempotentRetryLayer};
use tower_idempotency_test::Faulty;

use crate::support::Gated;
use grpc_payments::{
    CREATE_CHARGE, CreateChargeRequest, LIST_CHARGES, Ledger, ListChargesRequest, Payments,
    PaymentsClient, PaymentsServer,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the link saw: each request's path and key.
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A flaky link, on the server's side of the wire: it lets the protected server answer in full
/// (so the call ran and its record is written), then resets the HTTP/2 stream of the first
/// `lose` answers of `CreateCharge` before their message reaches the client.
#[derive(Clone)]
struct Lossy<S> {
    inner: S,
    lose: Arc<Mutex<usize>>,
    seen: Seen,
}

impl<S: NamedService> NamedService for Lossy<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, ResBody> Service<Request<B>> for Lossy<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<UnsyncBoxBody<Bytes, BoxError>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let path = request.uri().path().to_owned();
        let key =
            (request.headers().get("idempotency-key")).map(|key| key.to_str().unwrap().to_owned());
        self.seen.lock().unwrap().push((path.clone(), key));
        let lose = path == CREATE_CHARGE && {
            let mut lose = self.lose.lock().unwrap();
            let now = *lose > 0;
            *lose = lose.saturating_sub(1);
            now
        };
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await?;
            let (parts, body) = response.into_parts();
            if !lose {
                return Ok(Response::from_parts(
                    parts,
                    body.map_err(Into::into).boxed_unsync(),
                ));
            }
            // The whole answer was made; the client gets its head and then a reset stream.
            let _ = body.collect().await;
            let reset = futures_util::stream::once(async {
                Err::<http_body::Frame<Bytes>, BoxError>(
                    std::io::Error::from(std::io::ErrorKind::ConnectionReset).into(),
                )
            });
            Ok(Response::from_parts(
                parts,
                StreamBody::new(reset).boxed_unsync(),
            ))
        })
    }
}

struct Server_ {
    addr: SocketAddr,
    lose: Arc<Mutex<usize>>,
    seen: Seen,
}

impl Server_ {
    /// The keys the link saw for `path`, in order.
    fn keys(&self, path: &str) -> Vec<Option<String>> {
        (self.seen.lock().unwrap().iter())
            .filter(|(p, _)| p == path)
            .map(|(_, key)| key.clone())
            .collect()
    }
}

async fn serve<T: Payments, St: Store + Clone + Sync>(payments: T, store: St) -> Server_ {
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .grpc([CREATE_CHARGE]);
    let (lose, seen) = (Arc::new(Mutex::new(0)), Seen::default());
    let lossy = Lossy {
        inner: layer.layer(PaymentsServer::new(payments)),
        lose: lose.clone(),
        seen: seen.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .add_service(lossy)
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    Server_ { addr, lose, seen }
}

fn retrying() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new()
        .max_attempts(5)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .attempt_timeout(Duration::from_secs(5))
        .deadline(Duration::from_secs(20))
}

async fn client(
    server: &Server_,
    layer: IdempotentRetryLayer,
) -> PaymentsClient<GrpcRetry<Channel>> {
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let channel = ServiceBuilder::new()
        .layer(layer.grpc([CREATE_CHARGE]))
        .service(channel);
    PaymentsClient::new(channel)
}

fn charge(amount: i64) -> CreateChargeRequest {
    CreateChargeRequest {
        amount,
        currency: "EUR".into(),
        description: String::new(),
    }
}

#[tokio::test]
async fn one_charge_per_key_over_a_flaky_link() {
    let ledger = Ledger::default();
    let server = serve(ledger.clone(), MemoryStore::new()).await;
    let mut payments = client(&server, retrying()).await;
    let mut charges = Vec::new();
    for amount in 1..=5 {
        // Every other operation loses its first answer, or its first two.
        *server.lose.lock().unwrap() = (amount % 3) as usize;
        let response = payments.create_charge(charge(amount)).await.unwrap();
        let attempts = response.extensions().get::<Attempts>().unwrap().clone();
        let lost = (amount % 3) as u32;
        assert_eq!(
            (attempts.count(), attempts.replayed()),
            (lost + 1, lost > 0),
            "§14.3: a reset stream is retried, and the retry is the replay: charge {amount}"
        );
        charges.push(response.into_inner());
    }
    assert_eq!(
        ledger.charges(),
        charges,
        "§16.7: one charge per operation, each the one the caller got"
    );
    let keys = server.keys(CREATE_CHARGE);
    // Answers lost: 1, 2, 0, 1 and 2; each operation's attempts are one more.
    assert_eq!(
        keys.len(),
        2 + 3 + 1 + 2 + 3,
        "every attempt reached the server"
    );
    let mut distinct = keys.clone();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        5,
        "§14.1: one key per operation, the same on every attempt: {keys:?}"
    );
    assert!(keys.iter().all(Option::is_some));
}

#[tokio::test]
async fn a_call_in_flight_is_retried_after_its_retry_info_until_the_replay() {
    let gated = Gated::default();
    let server = serve(gated.clone(), MemoryStore::new()).await;
    // The first attempt gives up before the handler answers; the second finds it in flight.
    let layer = retrying().attempt_timeout(Duration::from_millis(300));
    let mut payments = client(&server, layer).await;
    let gate = gated.clone();
    tokio::spawn(async move {
        gate.started.notified().await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        gate.gate.notify_one();
    });
    let started = tokio::time::Instant::now();
    let response = payments.create_charge(charge(7)).await.unwrap();
    let attempts = response.extensions().get::<Attempts>().unwrap();
    assert_eq!(
        (attempts.count(), attempts.replayed()),
        (3, true),
        "timed out, ABORTED in flight, then the replay"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300 + 1000),
        "§16.7: the retry after ABORTED waited for its RetryInfo (1 s): {:?}",
        started.elapsed()
    );
    assert_eq!(gated.ledger.charges().len(), 1, "charged once");
}

#[tokio::test]
async fn a_store_away_is_retried_after_its_retry_info() {
    let store = Faulty::new(MemoryStore::new());
    let ledger = Ledger::default();
    let server = serve(ledger.clone(), store.clone()).await;
    let mut payments = client(&server, retrying()).await;
    store.fail(true);
    let back = store.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        back.fail(false);
    });
    let started = tokio::time::Instant::now();
    let response = payments.create_charge(charge(8)).await.unwrap();
    let attempts = response.extensions().get::<Attempts>().unwrap();
    assert_eq!(attempts.count(), 2, "UNAVAILABLE, then the charge");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "§16.7: after the RetryInfo's second, not the 10 ms backoff"
    );
    assert_eq!(ledger.charges().len(), 1);
}

#[tokio::test]
async fn answers_are_never_retried() {
    let ledger = Ledger::default();
    let server = serve(ledger.clone(), MemoryStore::new()).await;
    let mut payments = client(&server, retrying()).await;

    let invalid = payments.create_charge(charge(-1)).await.unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert_eq!(
        server.keys(CREATE_CHARGE).len(),
        1,
        "§16.7: INVALID_ARGUMENT is an answer"
    );

    let mut first = tonic::Request::new(charge(1));
    first
        .metadata_mut()
        .insert("idempotency-key", "mine".parse().unwrap());
    let response = payments.create_charge(first).await.unwrap();
    assert_eq!(
        response
            .extensions()
            .get::<Attempts>()
            .unwrap()
            .key()
            .unwrap(),
        "mine",
        "§14.1: the caller's key is kept"
    );
    let mut other = tonic::Request::new(charge(2));
    other
        .metadata_mut()
        .insert("idempotency-key", "mine".parse().unwrap());
    let mismatch = payments.create_charge(other).await.unwrap_err();
    assert_eq!(mismatch.code(), Code::FailedPrecondition);
    assert_eq!(
        server.keys(CREATE_CHARGE).len(),
        3,
        "§16.7: FAILED_PRECONDITION is an answer: sent once"
    );
    assert_eq!(ledger.charges().len(), 1);
}

#[tokio::test]
async fn streaming_calls_go_through_untouched() {
    let ledger = Ledger::default();
    let server = serve(ledger.clone(), MemoryStore::new()).await;
    let mut payments = client(&server, retrying()).await;
    payments.create_charge(charge(1)).await.unwrap();
    let response = payments.list_charges(ListChargesRequest {}).await.unwrap();
    assert!(
        response.extensions().get::<Attempts>().is_none(),
        "not through the retries"
    );
    let charges: Vec<_> = response.into_inner().map(Result::unwrap).collect().await;
    assert_eq!(charges, ledger.charges());
    assert_eq!(
        server.keys(LIST_CHARGES),
        [None],
        "§16.7: no key for a method not named"
    );
}
