//! A record that a later release extended (PROTOCOL.md §5.4): its extensions of types this
//! release does not know, around the trace origin, are skipped, and the record replays from a
//! real `redis-server` as it was first answered, its origin read from among them.

use bytes::Bytes;
use deadpool_redis::redis;
use test_servers::redis_server::RedisServer;
use tower_idempotency::store::{Inspected, Store};
use tower_idempotency::{IdempotencyLayer, Outcome, Record, RecordId};
use tower_idempotency_redis::RedisStore;
use tower_idempotency_test::{Handler, created, post, send, service};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// An extension as any release writes it: its type, its value's length, its value.
fn extension(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut out = kind.to_le_bytes().to_vec();
    out.extend_from_slice(&u32::try_from(value.len()).expect("short").to_le_bytes());
    out.extend_from_slice(value);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_extensions_this_release_does_not_know_replays() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a valid url");
    let handler = Handler::ok(|call| created(format!("charge {}", call.n)));
    let layer = IdempotencyLayer::new(store.clone()).trace_origin(true);
    let svc = service(layer, handler.clone());
    let request = || {
        let mut request = post("extended", "amount=100");
        let traceparent = TRACEPARENT.parse().expect("a header value");
        request.headers_mut().insert("traceparent", traceparent);
        request
    };
    let first = send(&svc, request()).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));

    // What this release wrote: the record's fields, then its origin, extension type 1.
    let id = RecordId::new(b"", "extended");
    let key = format!("idempotency:{{{id}}}");
    let client = redis::Client::open(server.url()).expect("a valid url");
    let mut conn = client.get_connection().expect("a connection");
    let written: Vec<u8> = (redis::cmd("GET").arg(&key).query(&mut conn)).expect("the record");
    let Ok(Record::Completed(record)) = Record::decode(Bytes::from(written.clone())) else {
        panic!("a completed record")
    };
    let fields = record.with_origin(None).encode().expect("encodes");
    let (own, origin) = written.split_at(fields.len());
    assert_eq!(own, fields, "the fields first");
    assert_eq!(origin[..2], 1u16.to_le_bytes(), "then the origin, type 1");

    // As a later release might write it: extensions of its own before and after the origin.
    let extended = [
        own,
        &extension(0x7f01, b"written before the origin"),
        origin,
        &extension(0x7f02, b""),
        &extension(0x7f01, b"and after it"),
    ]
    .concat();
    let set: String = (redis::cmd("SET")
        .arg(&key)
        .arg(&extended)
        .arg("PX")
        .arg(60_000))
    .query(&mut conn)
    .expect("written");
    assert_eq!(set, "OK");

    let retry = send(&svc, request()).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{retry:?}");
    assert_eq!((retry.status, retry.body), (first.status, first.body));
    assert_eq!(handler.calls(), 1, "never run again");
    let Ok(Some(Inspected::Completed(view))) = store.inspect(&id).await else {
        panic!("a completed record")
    };
    let origin = view
        .completed
        .origin
        .expect("the origin, among the unknown extensions");
    assert_eq!(origin.to_string(), TRACEPARENT);
}
