//! Trace origins (PROTOCOL.md §5.6): a completed record keeps the trace context of the execution
//! that completed it, and gives it back with the record on every store, so that a replay points
//! at its first run.

use std::time::Duration;

use tower_idempotency::Outcome;
use tower_idempotency::record::{Completed, Fingerprint, Record, RecordId, TraceOrigin};
use tower_idempotency::store::{Claim, Store};

use super::store::{ANSWERS, completed_with_response};
use crate::{Handler, Harness, created, layer, post, send, service};

/// The first run's `traceparent` in these cases.
pub(super) const FIRST_RUN: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// Its `tracestate`.
pub(super) const FIRST_STATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
/// A retry's own `traceparent`.
const RETRY: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The completed record under `id` (a claim that finds it).
pub(super) async fn completed_under<St: Store>(
    store: &St,
    id: &RecordId,
    lease: Duration,
) -> Completed {
    match store
        .claim(id, &Fingerprint::from_bytes([0xee; 32]), lease)
        .await
    {
        Ok(Claim::Existing(Record::Completed(completed))) => completed,
        other => panic!("§10.1: a completed record is found under the key: {other:?}"),
    }
}

/// A completed record's trace origin (trace id, span id, flags and `tracestate`) comes back with
/// it, exactly as written; a record written without one comes back without one.
/// PROTOCOL.md §5.6, §10.1.
pub async fn store_completed_record_keeps_its_trace_origin<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let origin = TraceOrigin::parse(FIRST_RUN)
        .expect("a valid traceparent")
        .with_tracestate(FIRST_STATE);
    for (key, origin) in [("with-origin", Some(origin)), ("without-origin", None)] {
        let id = RecordId::new(b"contract", key);
        let fp = Fingerprint::from_bytes([4; 32]);
        let Ok(Claim::Claimed(token)) = store.claim(&id, &fp, lease).await else {
            panic!("§10.1 claim: a free key is claimed");
        };
        let done = completed_with_response(fp).with_origin(origin.clone());
        assert!(
            (store.complete(&id, &token, &done, h.window()).await).expect(ANSWERS),
            "§10.1 complete: the claim's completion is written, Ok(true)"
        );
        let got = completed_under(&store, &id, lease).await;
        assert_eq!(
            got.origin.as_deref(),
            origin.as_ref(),
            "§5.6: a completed record's trace origin comes back with it, as written"
        );
        assert_eq!(
            got, done,
            "§10.1: the record comes back exactly as it was written"
        );
    }
}

/// Through a layer that records origins, the record keeps the first run's `traceparent` and
/// `tracestate`: a retry (with a trace of its own) is replayed and changes nothing of it, and a
/// request whose `traceparent` is malformed runs and keeps none. PROTOCOL.md §5.6.
pub async fn the_record_keeps_the_first_runs_trace_origin<H: Harness>(h: H) {
    let store = h.store();
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(&h, h.store()).trace_origin(true), handler.clone());
    let traced = |key: &str, traceparent: &str| {
        let mut request = post(key, "amount=100");
        let headers = request.headers_mut();
        headers.insert("traceparent", traceparent.parse().expect("a header value"));
        headers.insert("tracestate", FIRST_STATE.parse().expect("a header value"));
        request
    };

    let first = send(&svc, traced("traced", FIRST_RUN)).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let retry = send(&svc, traced("traced", RETRY)).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(
        retry.body, first.body,
        "§6.4: the replay is the first response"
    );
    let record = completed_under(&store, &RecordId::new(b"", "traced"), h.lease()).await;
    let origin = record
        .origin
        .expect("§5.6: a record completed with trace_origin on keeps the first run's traceparent");
    assert_eq!(
        origin.to_string(),
        FIRST_RUN,
        "§5.6: the first run's, not the retry's"
    );
    assert_eq!(origin.tracestate(), Some(FIRST_STATE));

    let malformed = send(&svc, traced("malformed", &FIRST_RUN.to_uppercase())).await;
    assert_eq!(
        malformed.outcome,
        Some(Outcome::Executed),
        "§5.6: a malformed header is ignored"
    );
    let record = completed_under(&store, &RecordId::new(b"", "malformed"), h.lease()).await;
    assert_eq!(
        record.origin, None,
        "§5.6: a malformed traceparent is never stored"
    );

    // Off (the default): nothing is kept.
    let off = service(layer(&h, h.store()), handler.clone());
    assert_eq!(
        send(&off, traced("off", FIRST_RUN)).await.outcome,
        Some(Outcome::Executed)
    );
    let record = completed_under(&store, &RecordId::new(b"", "off"), h.lease()).await;
    assert_eq!(
        record.origin, None,
        "§5.6: a layer keeps origins only when told to"
    );
    assert_eq!(handler.calls(), 3);
}
