//! Cases of responses that end with trailers (PROTOCOL.md §5.4, §8.4, §8.5) and, with the `grpc`
//! feature, of the gRPC mode (§16): stored whole and replayed byte for byte on every store.

use std::convert::Infallible;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{Service, ServiceExt};

use crate::*;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::{
    Completed, Fingerprint, Payload, Record, RecordId, StoredResponse,
};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{IDEMPOTENT_REPLAYED, Outcome};

/// A response as the client sees it, trailers included.
#[derive(Debug)]
struct Whole {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
    outcome: Option<Outcome>,
    problem: Option<ProblemKind>,
}

impl Whole {
    /// Every header, in order, except `Idempotent-Replayed`.
    fn header_list(&self) -> Vec<(String, Vec<u8>)> {
        (self.headers.iter())
            .filter(|(name, _)| **name != IDEMPOTENT_REPLAYED)
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect()
    }
}

async fn whole<S, B>(svc: &S, request: Request<Body>) -> Whole
where
    S: Service<Request<Body>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let response = svc
        .clone()
        .oneshot(request)
        .await
        .expect("the service answers");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("the body is read");
    let trailers = collected.trailers().cloned();
    Whole {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
        outcome: parts.extensions.get::<Outcome>().copied(),
        problem: parts.extensions.get::<ProblemKind>().copied(),
    }
}

/// A body of `data`, then `trailers`.
fn trailed(data: &'static [u8], trailers: HeaderMap) -> Body {
    let frames = [
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(data))),
        Ok(Frame::trailers(trailers)),
    ];
    Body::new(StreamBody::new(futures_util::stream::iter(frames)))
}

fn fields(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
    map
}

#[track_caller]
fn assert_whole_replay(replay: &Whole, first: &Whole) {
    assert_eq!(
        (first.outcome, replay.outcome),
        (Some(Outcome::Executed), Some(Outcome::Replayed)),
        "§6.2: the first request ran, the second is its replay: {first:?} {replay:?}"
    );
    assert_eq!(
        replay
            .headers
            .get(IDEMPOTENT_REPLAYED)
            .map(HeaderValue::as_bytes),
        Some(&b"true"[..]),
        "§6.4: a replay is marked"
    );
    assert_eq!(replay.status, first.status, "§6.4: the stored status");
    assert_eq!(
        replay.header_list(),
        first.header_list(),
        "§6.4: every stored header, in order"
    );
    assert_eq!(replay.body, first.body, "§6.4: the stored body bytes");
    let list = |t: &Option<HeaderMap>| {
        t.as_ref().map(|t| {
            t.iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(
        list(&replay.trailers),
        list(&first.trailers),
        "§6.4, §8.4: the stored trailers, every value in order"
    );
}

/// A store keeps a completed record's trailers, and gives them back exactly (§5.4, §8.5, §10.1).
pub async fn store_completed_record_keeps_its_trailers<H: Harness>(h: H) {
    let store = h.store();
    let id = RecordId::new(b"contract", "trailers");
    let fp = Fingerprint::from_bytes([0x75; 32]);
    let Ok(Claim::Claimed(token)) = store.claim(&id, &fp, h.lease()).await else {
        panic!("§10.1: a new key is claimed")
    };
    let response = StoredResponse {
        status: StatusCode::OK,
        headers: fields(&[("content-type", "application/grpc")]),
        body: Bytes::from_static(b"\0\0\0\0\x03\x0a\x01x"),
        trailers: Some(fields(&[
            ("grpc-status", "0"),
            ("x-checksum", "1"),
            ("x-checksum", "2"),
            ("x-sig-bin", "AAEC"),
        ])),
    };
    let done = Completed::with_response(fp, response.clone());
    assert_eq!(
        store.complete(&id, &token, &done, h.window()).await.ok(),
        Some(true),
        "§10.1: the claim's completion is written"
    );
    match store.claim(&id, &fp, h.lease()).await {
        Ok(Claim::Existing(Record::Completed(Completed {
            response: Some(Payload::Plain(stored)),
            ..
        }))) => assert_eq!(
            *stored, response,
            "§5.4, §8.5, §10.1: the record comes back with its trailers, every value in order"
        ),
        other => panic!("§10.1: the completed record, in clear; got {other:?}"),
    }
}

/// A response that ends with trailers is stored whole and replayed byte for byte (§6.4, §8.4).
pub async fn trailers_are_stored_and_replayed<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        Response::builder()
            .status(201)
            .header("x-call", call.n.to_string())
            .body(trailed(
                b"charged",
                fields(&[("x-checksum", "a"), ("x-checksum", "b"), ("x-done", "1")]),
            ))
            .expect("a response")
    });
    let svc = service(layer(&h, h.store()), handler.clone());
    let request = || post("with-trailers", "amount=100");
    let first = whole(&svc, request()).await;
    assert!(
        first.trailers.is_some(),
        "the handler's trailers reach the first client"
    );
    for _ in 0..2 {
        let replay = whole(&svc, request()).await;
        assert_whole_replay(&replay, &first);
    }
    assert_eq!(
        handler.calls(),
        1,
        "§8.4: a response with trailers runs once"
    );
}

/// Trailers count against the response limit: a response whose body and trailers are over it is
/// delivered whole and leaves a tombstone; one of exactly the limit is stored (§8.4).
pub async fn trailers_count_against_the_response_limit<H: Harness>(h: H) {
    // A 6-byte body and `x-t: <n bytes>`: 6 + 3 + n bytes against a limit of 16.
    let handler = Handler::ok(|call| {
        let value = match call.header("x-trailer-len") {
            Some("7") => "1234567",
            _ => "12345678",
        };
        Response::new(trailed(b"sixsix", fields(&[("x-t", value)])))
    });
    let svc = service(
        layer(&h, h.store()).response_body_limit(16),
        handler.clone(),
    );
    let request = |key: &str, len: &str| {
        keyed(Method::POST, "/", key)
            .header("x-trailer-len", len)
            .body(Body::empty())
            .expect("a request")
    };
    let over = whole(&svc, request("over", "8")).await;
    assert_eq!(
        (over.outcome, over.body.as_ref()),
        (Some(Outcome::Executed), &b"sixsix"[..]),
        "§8.4: a response over the limit is delivered"
    );
    assert_eq!(
        over.trailers.as_ref().map(|t| t["x-t"].clone()),
        Some(HeaderValue::from_static("12345678")),
        "§8.4: with its trailers"
    );
    let retry = whole(&svc, request("over", "8")).await;
    assert_eq!(
        (retry.outcome, retry.problem),
        (
            Some(Outcome::NotReplayable),
            Some(ProblemKind::NotReplayable)
        ),
        "§8.4: the body and trailers were over the limit: a tombstone"
    );
    let exact = whole(&svc, request("exact", "7")).await;
    let replay = whole(&svc, request("exact", "7")).await;
    assert_whole_replay(&replay, &exact);
    assert_eq!(handler.calls(), 2, "§8.4: each key ran once");
}

/// The gRPC mode over the store (§16): a unary answer with initial metadata, a message and
/// trailers is replayed byte for byte; a trailers-only answer of a stored status is replayed; an
/// answer whose status a retry may change releases the claim, in the trailers or trailers-only.
#[cfg(feature = "grpc")]
pub async fn grpc_answers_replay_with_their_trailers<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        let grpc = |status: &'static str| {
            Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", status)
                .body(Body::empty())
                .expect("a response")
        };
        match call.parts.uri.path() {
            "/t.Pay/Declined" => grpc("9"),
            "/t.Pay/NotFound" => grpc("5"),
            "/t.Pay/Busy" => grpc("10"),
            "/t.Pay/Down" => Response::builder()
                .header("content-type", "application/grpc")
                .body(trailed(b"", fields(&[("grpc-status", "14")])))
                .expect("a response"),
            _ => Response::builder()
                .header("content-type", "application/grpc")
                .header("x-call", call.n.to_string())
                .body(trailed(
                    b"\0\0\0\0\x04\x0a\x02ch",
                    fields(&[
                        ("grpc-status", "0"),
                        ("grpc-message", ""),
                        ("x-ledger", "1"),
                        ("x-ledger", "2"),
                    ]),
                ))
                .expect("a response"),
        }
    });
    let svc = service(
        layer(&h, h.store()).grpc([
            "/t.Pay/Charge",
            "/t.Pay/Declined",
            "/t.Pay/NotFound",
            "/t.Pay/Busy",
            "/t.Pay/Down",
        ]),
        handler.clone(),
    );
    let call = |path: &str, key: &str| {
        keyed(Method::POST, path, key)
            .header("content-type", "application/grpc")
            .body(Body::from(&b"\0\0\0\0\x02\x08\x64"[..]))
            .expect("a request")
    };

    let first = whole(&svc, call("/t.Pay/Charge", "g1")).await;
    assert_eq!(
        first.trailers.as_ref().map(|t| t["grpc-status"].clone()),
        Some(HeaderValue::from_static("0")),
        "the handler's status reaches the first client in the trailers"
    );
    let replay = whole(&svc, call("/t.Pay/Charge", "g1")).await;
    assert_whole_replay(&replay, &first);

    let declined = whole(&svc, call("/t.Pay/Declined", "g2")).await;
    let again = whole(&svc, call("/t.Pay/Declined", "g2")).await;
    assert_whole_replay(&again, &declined);
    assert_eq!(
        again.headers["grpc-status"], "9",
        "§16.5: a trailers-only FAILED_PRECONDITION, decided by the call's state, is stored"
    );

    // NOT_FOUND refuses the call as it was sent: as the default policy stores no 404, it is not
    // stored; ABORTED and UNAVAILABLE are for a retry.
    for (path, key) in [
        ("/t.Pay/NotFound", "g5"),
        ("/t.Pay/Busy", "g3"),
        ("/t.Pay/Down", "g4"),
    ] {
        for _ in 0..2 {
            let answer = whole(&svc, call(path, key)).await;
            assert_eq!(
                answer.outcome,
                Some(Outcome::NotStored),
                "§16.5: NOT_FOUND, ABORTED and UNAVAILABLE release the claim: {path}"
            );
        }
    }
    assert_eq!(
        handler.calls(),
        1 + 1 + 2 + 2 + 2,
        "§16.5: stored answers ran once, released ones every time"
    );

    // A request message that differs: the layer's own answer, a trailers-only status.
    let other = keyed(Method::POST, "/t.Pay/Charge", "g1")
        .header("content-type", "application/grpc")
        .body(Body::from(&b"\0\0\0\0\x02\x08\x65"[..]))
        .expect("a request");
    let mismatch = whole(&svc, other).await;
    assert_eq!(
        (mismatch.status, mismatch.problem),
        (StatusCode::OK, Some(ProblemKind::Mismatch)),
        "§16.4: the layer answers over HTTP 200"
    );
    assert_eq!(
        mismatch.headers["grpc-status"], "9",
        "§16.4: FAILED_PRECONDITION"
    );
    assert!(mismatch.body.is_empty(), "§16.4: trailers-only");
}
