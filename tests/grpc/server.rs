//! The gRPC mode (PROTOCOL.md §16) with a real tonic server and client over HTTP/2 on loopback:
//! `payments.v1.Payments` of `examples/grpc.rs`, its `CreateCharge` protected.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prost::Message;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tower::Layer;
use tower_idempotency::grpc::{problem_kind, retry_delay};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::Store;
use tower_idempotency::{Every4xxStorePolicy, IdempotencyLayer, MemoryStore};
use tower_idempotency_test::{Counting, Faulty};

use crate::support::Gated;
use grpc_payments::{
    CREATE_CHARGE, Charge, ChargeStream, CreateChargeRequest, LIST_CHARGES, Ledger,
    ListChargesRequest, Payments, PaymentsClient, PaymentsServer,
};

/// Serves `payments` behind `layer` on a free loopback port.
async fn serve<T: Payments, St: Store + Clone + Sync>(
    payments: T,
    layer: IdempotencyLayer<St>,
) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .add_service(layer.layer(PaymentsServer::new(payments)))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    addr
}

fn protected<St>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .single_tenant()
        .grpc([CREATE_CHARGE])
}

async fn client(addr: SocketAddr) -> PaymentsClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    PaymentsClient::new(channel)
}

fn charge(amount: i64) -> CreateChargeRequest {
    CreateChargeRequest {
        amount,
        currency: "EUR".into(),
        description: "order 42".into(),
    }
}

fn keyed<M>(message: M, key: &str) -> tonic::Request<M> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    request
}

/// One answer as it came over HTTP/2: headers, message bytes and trailers.
#[derive(Debug)]
struct Wire {
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Wire {
    /// The headers, every value in order, without those that differ per answer on purpose: the
    /// server's `date` and the replay marker.
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        (self.headers.iter())
            .filter(|(name, _)| !matches!(name.as_str(), "date" | "idempotent-replayed"))
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect()
    }

    fn trailers(&self) -> Option<Vec<(String, Vec<u8>)>> {
        self.trailers.as_ref().map(|trailers| {
            (trailers.iter())
                .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
                .collect()
        })
    }
}

/// `message` framed as gRPC sends it: a compression flag, the length, the bytes.
fn framed(message: &impl Message) -> Bytes {
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(encoded.len() as u32);
    framed.put_slice(&encoded);
    framed.freeze()
}

/// Sends one request over a raw HTTP/2 client, with any method, path (and query) and headers, as
/// a client that is not a gRPC client may; reads the answer as it came.
async fn raw(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> (StatusCode, Wire) {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body)).unwrap();
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let wire = Wire {
        headers: parts.headers,
        trailers: collected.trailers().cloned(),
        body: collected.to_bytes(),
    };
    (parts.status, wire)
}

/// Sends `message` as a unary call over a raw HTTP/2 client, and reads the answer as it came.
async fn raw_call(addr: SocketAddr, path: &str, key: &str, message: &impl Message) -> Wire {
    let headers = [
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("idempotency-key", key),
    ];
    let (status, wire) = raw(addr, Method::POST, path, &headers, framed(message)).await;
    assert_eq!(status, 200, "gRPC answers over HTTP 200");
    wire
}

#[tokio::test]
async fn a_retry_gets_the_same_charge_metadata_and_trailers_byte_for_byte() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;
    let mut payments = client(addr).await;

    let first = payments
        .create_charge(keyed(charge(1000), "order-42"))
        .await
        .unwrap();
    let retry = payments
        .create_charge(keyed(charge(1000), "order-42"))
        .await
        .unwrap();
    assert_eq!(
        retry.get_ref(),
        first.get_ref(),
        "§16.6: the same Charge, decoded"
    );
    assert_eq!(first.get_ref().id, "ch_1");
    assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert_eq!(
        retry.metadata().get("x-ledger-entries"),
        first.metadata().get("x-ledger-entries"),
        "§16.6: the handler's initial metadata"
    );

    // Byte for byte, over HTTP/2: headers, message and trailers.
    let wire_first = raw_call(addr, CREATE_CHARGE, "order-43", &charge(500)).await;
    let wire_retry = raw_call(addr, CREATE_CHARGE, "order-43", &charge(500)).await;
    assert_eq!(
        wire_retry.headers(),
        wire_first.headers(),
        "§16.6: initial metadata"
    );
    assert_eq!(wire_retry.headers["idempotent-replayed"], "true");
    assert!(
        !wire_first.headers.contains_key("content-length")
            && !wire_retry.headers.contains_key("content-length"),
        "no length that tonic does not send: {:?}",
        wire_first.headers
    );
    assert_eq!(wire_retry.body, wire_first.body, "§16.6: the message bytes");
    assert_eq!(
        Charge::decode(&wire_first.body[5..]).unwrap().id,
        "ch_2",
        "the second key's charge"
    );
    assert_eq!(
        wire_retry.trailers(),
        wire_first.trailers(),
        "§16.6: the trailers, byte for byte"
    );
    assert_eq!(
        wire_first.trailers.as_ref().unwrap()["grpc-status"],
        "0",
        "the status in the trailers"
    );
    assert_eq!(ledger.charges().len(), 2, "one charge per key");
}

/// A call refused as it was sent (`INVALID_ARGUMENT`) is not stored by default, as HTTP's 400 is
/// not: its retry runs again, and the corrected call under the same key runs (§16.5, §8.1).
#[tokio::test]
async fn a_refused_call_is_not_stored_and_its_corrected_call_runs() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;
    let first = raw_call(addr, CREATE_CHARGE, "bad", &charge(-1)).await;
    let retry = raw_call(addr, CREATE_CHARGE, "bad", &charge(-1)).await;
    assert_eq!(
        first.headers["grpc-status"], "3",
        "INVALID_ARGUMENT, trailers-only"
    );
    assert_eq!(retry.headers["grpc-status"], "3");
    assert!(
        !retry.headers.contains_key("idempotent-replayed"),
        "§16.5: not stored, so run again"
    );
    let corrected = raw_call(addr, CREATE_CHARGE, "bad", &charge(5)).await;
    assert_eq!(corrected.grpc_status(), Some("0"), "the corrected call ran");
    assert_eq!(ledger.charges().len(), 1);
}

/// Under `Every4xxStorePolicy`, the refusal is stored, and replayed trailers-only as it was.
#[tokio::test]
async fn a_refused_call_stored_by_the_policy_is_replayed_trailers_only() {
    let ledger = Ledger::default();
    let layer = protected(MemoryStore::new()).store_policy(Every4xxStorePolicy);
    let addr = serve(ledger.clone(), layer).await;
    let first = raw_call(addr, CREATE_CHARGE, "bad", &charge(-1)).await;
    let retry = raw_call(addr, CREATE_CHARGE, "bad", &charge(-1)).await;
    assert_eq!(
        first.headers["grpc-status"], "3",
        "INVALID_ARGUMENT, trailers-only"
    );
    assert!(first.body.is_empty() && first.trailers.is_none());
    assert_eq!(
        retry.headers(),
        first.headers(),
        "§16.5: stored, and replayed as it was"
    );
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert!(
        retry.body.is_empty() && retry.trailers.is_none(),
        "§16.6: trailers-only"
    );
}

#[tokio::test]
async fn another_message_on_the_key_gets_failed_precondition() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;
    let mut payments = client(addr).await;
    payments
        .create_charge(keyed(charge(1000), "order-7"))
        .await
        .unwrap();
    let other = payments
        .create_charge(keyed(charge(2000), "order-7"))
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "§16.4: {other:?}");
    assert_eq!(problem_kind(&other), Some(ProblemKind::Mismatch));
    assert_eq!(
        retry_delay(&other),
        None,
        "§16.4: no RetryInfo: retrying will not help"
    );
    assert_eq!(ledger.charges().len(), 1, "the second message never ran");
}

#[tokio::test]
async fn missing_and_invalid_keys_get_invalid_argument() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;
    let mut payments = client(addr).await;
    let missing = payments.create_charge(charge(1)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(problem_kind(&missing), Some(ProblemKind::MissingKey));
    let invalid = payments
        .create_charge(keyed(charge(1), "a\"b"))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert_eq!(problem_kind(&invalid), Some(ProblemKind::InvalidKey));
    assert!(ledger.charges().is_empty());
}

#[tokio::test]
async fn a_call_in_flight_gets_aborted_with_retry_info_then_the_replay() {
    let gated = Gated {
        ledger: Ledger::default(),
        started: Arc::default(),
        gate: Arc::default(),
    };
    let addr = serve(gated.clone(), protected(MemoryStore::new())).await;
    let mut payments = client(addr).await;
    let first = {
        let mut payments = payments.clone();
        tokio::spawn(async move { payments.create_charge(keyed(charge(9), "slow")).await })
    };
    gated.started.notified().await;
    let during = payments
        .create_charge(keyed(charge(9), "slow"))
        .await
        .unwrap_err();
    assert_eq!(during.code(), Code::Aborted, "§16.4: in flight: {during:?}");
    assert_eq!(problem_kind(&during), Some(ProblemKind::InFlight));
    assert_eq!(
        retry_delay(&during),
        Some(Duration::from_secs(1)),
        "§16.4, §6.3: RetryInfo carries the wait"
    );
    gated.gate.notify_one();
    let first = first.await.unwrap().unwrap();
    let after = payments
        .create_charge(keyed(charge(9), "slow"))
        .await
        .unwrap();
    assert_eq!(after.get_ref(), first.get_ref(), "then the replay");
    assert_eq!(gated.ledger.charges().len(), 1);
}

#[tokio::test]
async fn the_store_away_gets_unavailable_with_retry_info() {
    let store = Faulty::new(MemoryStore::new());
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(store.clone())).await;
    let mut payments = client(addr).await;
    store.fail(true);
    let away = payments
        .create_charge(keyed(charge(5), "k"))
        .await
        .unwrap_err();
    assert_eq!(away.code(), Code::Unavailable, "§16.4: {away:?}");
    assert_eq!(problem_kind(&away), Some(ProblemKind::StoreUnavailable));
    assert_eq!(retry_delay(&away), Some(Duration::from_secs(1)));
    assert!(ledger.charges().is_empty(), "§9.7: fail closed: not run");
    store.fail(false);
    payments.create_charge(keyed(charge(5), "k")).await.unwrap();
    assert_eq!(
        ledger.charges().len(),
        1,
        "the same key works once the store is back"
    );
}

/// Payments whose first `CreateCharge` panics.
#[derive(Clone, Default)]
struct PanicsOnce {
    ledger: Ledger,
    calls: Arc<AtomicUsize>,
}

impl Payments for PanicsOnce {
    async fn create_charge(
        &self,
        request: tonic::Request<CreateChargeRequest>,
    ) -> Result<tonic::Response<Charge>, Status> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("the ledger is broken");
        }
        self.ledger.create_charge(request).await
    }

    async fn list_charges(
        &self,
        request: tonic::Request<ListChargesRequest>,
    ) -> Result<tonic::Response<ChargeStream>, Status> {
        self.ledger.list_charges(request).await
    }
}

#[tokio::test]
async fn a_handler_panic_gets_internal_and_a_retry_runs_again() {
    let payments_impl = PanicsOnce::default();
    let addr = serve(payments_impl.clone(), protected(MemoryStore::new())).await;
    let mut payments = client(addr).await;
    let failed = payments
        .create_charge(keyed(charge(3), "p"))
        .await
        .unwrap_err();
    assert_eq!(failed.code(), Code::Internal, "§16.4: {failed:?}");
    assert_eq!(problem_kind(&failed), Some(ProblemKind::HandlerFailed));
    assert!(
        !failed.message().contains("broken"),
        "§7.1: never the handler's own text"
    );
    let retry = payments.create_charge(keyed(charge(3), "p")).await.unwrap();
    assert_eq!(
        retry.get_ref().id,
        "ch_1",
        "§9.4: released, so the retry runs"
    );
    assert!(retry.metadata().get("idempotent-replayed").is_none());
    assert_eq!(payments_impl.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn streaming_passes_through_untouched() {
    let store = Counting::new(MemoryStore::new());
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(store.clone())).await;
    let mut payments = client(addr).await;
    payments.create_charge(keyed(charge(1), "a")).await.unwrap();
    payments.create_charge(keyed(charge(2), "b")).await.unwrap();
    let calls_before = store.calls().total();
    for key in [None, Some("a"), Some("not a \"valid\" key")] {
        let mut request = tonic::Request::new(ListChargesRequest {});
        if let Some(key) = key {
            request
                .metadata_mut()
                .insert("idempotency-key", key.parse().unwrap());
        }
        let response = payments.list_charges(request.into_inner()).await.unwrap();
        assert!(response.metadata().get("idempotent-replayed").is_none());
        let charges: Vec<Charge> = response
            .into_inner()
            .map(|charge| charge.unwrap())
            .collect()
            .await;
        assert_eq!(
            charges.iter().map(|c| c.amount).collect::<Vec<_>>(),
            [1, 2],
            "§16.1: every message of the stream, as the handler sent it"
        );
    }
    // A stream sent with a key over a raw client: still not covered.
    let wire = raw_call(addr, LIST_CHARGES, "a", &ListChargesRequest {}).await;
    assert!(!wire.headers.contains_key("idempotent-replayed"));
    assert_eq!(
        store.calls().total(),
        calls_before,
        "§1.2, §16.1: no store call for a method not named"
    );
}

impl Wire {
    /// The answer's `grpc-status`: in the headers of a trailers-only answer, else in the trailers.
    fn grpc_status(&self) -> Option<&str> {
        let status = (self.headers.get("grpc-status"))
            .or_else(|| self.trailers.as_ref()?.get("grpc-status"))?;
        status.to_str().ok()
    }
}

/// The HTTP methods other than `POST`, an extension method among them: none is gRPC, and tonic
/// routes every one by its path alone.
const NOT_POST: [&str; 7] = ["GET", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "CHARGE"];

/// A call's headers, as a raw client sends them, with the key if any.
fn grpc_headers(key: Option<&str>) -> Vec<(&str, &str)> {
    let mut headers = vec![("content-type", "application/grpc"), ("te", "trailers")];
    headers.extend(key.map(|key| ("idempotency-key", key)));
    headers
}

#[tokio::test]
async fn a_named_method_sent_with_any_http_method_but_post_is_refused_before_the_handler() {
    let store = Counting::new(MemoryStore::new());
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(store.clone())).await;
    for method in NOT_POST {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        for key in [Some("side-door"), None, Some("not a \"valid\" key")] {
            let headers = grpc_headers(key);
            let body = framed(&charge(100));
            let (status, wire) = raw(addr, method.clone(), CREATE_CHARGE, &headers, body).await;
            assert_eq!(
                ledger.charges().len(),
                0,
                "§16.1: {method} {key:?} never reaches the handler"
            );
            assert_eq!(status, 405, "§16.1: {method} {key:?}: {wire:?}");
            assert_eq!(wire.headers["allow"], "POST");
            assert_eq!(wire.headers["content-type"], "application/grpc");
            assert_eq!(
                wire.grpc_status(),
                Some("13"),
                "INTERNAL, as gRPC servers answer"
            );
            assert!(wire.headers.contains_key("grpc-message"));
            assert!(!wire.headers.contains_key("idempotent-replayed"));
            assert!(
                wire.body.is_empty() && wire.trailers.is_none(),
                "trailers-only"
            );
        }
    }
    assert_eq!(
        store.calls().total(),
        0,
        "§16.1: refused before any store call"
    );
    // The call itself, sent as gRPC sends it, is protected as ever.
    let first = raw_call(addr, CREATE_CHARGE, "side-door", &charge(100)).await;
    let retry = raw_call(addr, CREATE_CHARGE, "side-door", &charge(100)).await;
    assert_eq!(first.grpc_status(), Some("0"));
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(ledger.charges().len(), 1);
}

#[tokio::test]
async fn the_same_key_sent_twice_with_put_never_charges_twice() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;
    for _ in 0..2 {
        let headers = grpc_headers(Some("order-99"));
        raw(
            addr,
            Method::PUT,
            CREATE_CHARGE,
            &headers,
            framed(&charge(4200)),
        )
        .await;
    }
    assert_eq!(
        ledger.charges().len(),
        0,
        "§16.1: a PUT to a named method is not a gRPC call: it never runs, so never twice"
    );
}

#[tokio::test]
async fn the_methods_setting_never_opens_a_named_method() {
    let layers = [
        protected(MemoryStore::new()).methods([Method::PUT]),
        protected(MemoryStore::new()).methods([]),
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .methods([Method::GET, Method::PUT])
            .grpc([CREATE_CHARGE]),
    ];
    for (case, layer) in layers.into_iter().enumerate() {
        let ledger = Ledger::default();
        let addr = serve(ledger.clone(), layer).await;
        let mut payments = client(addr).await;
        let missing = payments.create_charge(charge(1)).await.unwrap_err();
        assert_eq!(
            missing.code(),
            Code::InvalidArgument,
            "case {case}: {missing:?}"
        );
        payments.create_charge(keyed(charge(1), "k")).await.unwrap();
        let retry = payments.create_charge(keyed(charge(1), "k")).await.unwrap();
        assert_eq!(retry.metadata().get("idempotent-replayed").unwrap(), "true");
        for method in [Method::PUT, Method::GET] {
            let headers = grpc_headers(Some("k2"));
            let (status, _) = raw(addr, method, CREATE_CHARGE, &headers, framed(&charge(1))).await;
            assert_eq!(status, 405, "case {case}");
        }
        assert_eq!(
            ledger.charges().len(),
            1,
            "case {case}: §16.1: POST alone, once"
        );
    }
}

#[tokio::test]
async fn whatever_tonic_routes_to_a_named_method_is_covered() {
    let ledger = Ledger::default();
    let addr = serve(ledger.clone(), protected(MemoryStore::new())).await;

    // tonic routes on the path alone, without the query, and so does the layer.
    let with_query = format!("{CREATE_CHARGE}?attempt=2");
    let first = raw_call(addr, &with_query, "q", &charge(7)).await;
    let retry = raw_call(addr, &with_query, "q", &charge(7)).await;
    assert_eq!(first.grpc_status(), Some("0"));
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    let (_, missing) = raw(
        addr,
        Method::POST,
        &with_query,
        &grpc_headers(None),
        framed(&charge(7)),
    )
    .await;
    assert_eq!(missing.grpc_status(), Some("3"), "§1.4: no key, refused");
    assert_eq!(ledger.charges().len(), 1);

    // tonic does not read the content type; neither does the layer.
    for (n, content_type) in [
        "application/grpc+proto",
        "application/json",
        "text/plain",
        "",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("ct-{n}");
        let mut headers = vec![("te", "trailers")];
        if !content_type.is_empty() {
            headers.push(("content-type", content_type));
        }
        let (_, missing) = raw(
            addr,
            Method::POST,
            CREATE_CHARGE,
            &headers,
            framed(&charge(8)),
        )
        .await;
        assert_eq!(
            missing.grpc_status(),
            Some("3"),
            "{content_type:?}: no key, refused"
        );
        headers.push(("idempotency-key", &key));
        let (_, first) = raw(
            addr,
            Method::POST,
            CREATE_CHARGE,
            &headers,
            framed(&charge(8)),
        )
        .await;
        let (_, retry) = raw(
            addr,
            Method::POST,
            CREATE_CHARGE,
            &headers,
            framed(&charge(8)),
        )
        .await;
        assert_eq!(first.grpc_status(), Some("0"), "{content_type:?}");
        assert_eq!(
            retry.headers["idempotent-replayed"], "true",
            "{content_type:?}"
        );
    }
    assert_eq!(ledger.charges().len(), 5, "one charge per key");

    // A path that is not the name exactly is not the method to tonic either: it never runs.
    for path in [
        "/payments.v1.Payments/CreateCharge/",
        "/payments.v1.Payments/createcharge",
        "/PAYMENTS.V1.PAYMENTS/CREATECHARGE",
        "/payments.v1.Payments/Create%43harge",
        "/payments%2Ev1.Payments/CreateCharge",
        "//payments.v1.Payments/CreateCharge",
        "/payments.v1.Payments//CreateCharge",
    ] {
        let (_, wire) = raw(
            addr,
            Method::POST,
            path,
            &grpc_headers(None),
            framed(&charge(9)),
        )
        .await;
        assert_eq!(
            wire.grpc_status(),
            Some("12"),
            "{path}: UNIMPLEMENTED, from tonic"
        );
    }
    assert_eq!(
        ledger.charges().len(),
        5,
        "no other path reached the handler"
    );
}
