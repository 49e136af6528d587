//! A record that a later release extended (PROTOCOL.md §5.4), for a store's own test: it needs the
//! store's raw bytes, which only the store's test can read and write.

use bytes::Bytes;
use tower_idempotency::record::{Record, RecordId};
use tower_idempotency::store::{Inspected, OperatorStore};
use tower_idempotency::{IdempotencyLayer, Outcome};

use crate::{Handler, created, post, send, service};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// An extension as any release writes it: its type, its value's length, its value.
fn extension(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut out = kind.to_le_bytes().to_vec();
    out.extend_from_slice(&u32::try_from(value.len()).expect("short").to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// Asserts that a record carrying extensions this release does not know, around its trace
/// origin, is skipped past and replayed as it was first answered, its origin read from among
/// them. A request with a `traceparent` runs on a layer over `store` that records origins; then
/// `read` gives the bytes the store keeps for the record, and `write` puts back the same record as
/// a later release might write it: unknown extensions before and after the origin.
///
/// ```no_run
/// # async fn check(store: tower_idempotency::MemoryStore) {
/// use tower_idempotency::record::RecordId;
///
/// let raw = std::sync::Mutex::new(Vec::new());
/// tower_idempotency_test::assert_extensions_a_release_does_not_know_are_skipped(
///     store,
///     async |_id: &RecordId| raw.lock().unwrap().clone(),
///     async |_id: &RecordId, bytes: Vec<u8>| *raw.lock().unwrap() = bytes,
/// )
/// .await;
/// # }
/// ```
pub async fn assert_extensions_a_release_does_not_know_are_skipped<St>(
    store: St,
    read: impl AsyncFn(&RecordId) -> Vec<u8>,
    write: impl AsyncFn(&RecordId, Vec<u8>),
) where
    St: OperatorStore + Clone,
{
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
    let written = read(&id).await;
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
    write(&id, extended).await;

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
