//! Sealed records (feature `seal`): a [`SealedStore`] over the harness's store keeps no response
//! in clear, and a record that does not open (changed, moved, sealed under a retired key, or in
//! clear) is never replayed and never run over. The cases write records into the store beneath
//! the seal through its own [`Store`] methods, as anyone with write access to it could.

use std::time::Duration;

use axum::body::Body;
use http::{Method, StatusCode};

use super::layer::assert_replay_of;
use crate::{Handler, Harness, Reply, created, keyed, layer, post, send, service};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::record::{Completed, Payload, Record, RecordId};
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{Outcome, Scope};

fn keys(ids: &[&str]) -> SealKeys {
    SealKeys::new(ids.iter().map(|id| {
        // A key per id: the id's bytes, repeated.
        let key = std::array::from_fn(|n| id.as_bytes()[n % id.len()]);
        SealKey::new(id, key).expect("a valid key id")
    }))
    .expect("distinct ids")
}

/// The record under `id` as the store beneath the seal holds it (a claim that finds it).
async fn raw<St: Store>(store: &St, id: &RecordId, lease: Duration) -> Completed {
    let fingerprint = tower_idempotency::record::Fingerprint::from_bytes([0; 32]);
    match store.claim(id, &fingerprint, lease).await {
        Ok(Claim::Existing(Record::Completed(completed))) => completed,
        other => panic!("§10.1: a completed record is found under the key: {other:?}"),
    }
}

/// Writes `completed` under `id` in the store beneath the seal, where the key is free.
async fn plant<St: Store>(store: &St, id: &RecordId, completed: &Completed, h: &impl Harness) {
    let Ok(Claim::Claimed(token)) = store.claim(id, &completed.fingerprint, h.lease()).await else {
        panic!("§10.1: a free key is claimed");
    };
    assert!(
        matches!(
            store.complete(id, &token, completed, h.window()).await,
            Ok(true)
        ),
        "§10.1: the claim's completion is written"
    );
}

#[track_caller]
fn assert_unreadable(reply: &Reply, what: &str) {
    assert_eq!(
        reply.outcome,
        Some(Outcome::RecordUnreadable),
        "§15.3: {what}: never replayed, answered record-unreadable: {reply:?}"
    );
    reply.assert_problem(
        ProblemKind::RecordUnreadable,
        StatusCode::INTERNAL_SERVER_ERROR,
    );
}

/// Through a sealed store, a response replays byte for byte, and the store beneath holds it
/// sealed under the first key: no byte run of the body is in the record.
/// PROTOCOL.md §5.4, §15.2.
pub async fn sealed_records_replay_and_keep_no_response_in_clear<H: Harness>(h: H) {
    let secret = "card 4242 4242 4242 4242, token tok_a1b2c3d4e5f6";
    let handler = Handler::ok(move |_| created(secret));
    let sealed = SealedStore::new(h.store(), keys(&["k1"]));
    let svc = service(layer(&h, sealed), handler.clone());

    let first = send(&svc, post("sealed", "x")).await;
    assert_replay_of(&send(&svc, post("sealed", "x")).await, &first);
    assert_eq!(
        handler.calls(),
        1,
        "§6.2: a replay does not run the handler"
    );

    let stored = raw(&h.store(), &RecordId::new(b"", "sealed"), h.lease()).await;
    let Some(Payload::Sealed(response)) = &stored.response else {
        panic!("§15.2: a sealed store keeps the response sealed: {stored:?}");
    };
    assert_eq!(response.key_id, "k1", "§15.2: the first key seals");
    let encoded = stored.encode().expect("a sealed record encodes");
    for window in secret.as_bytes().windows(8) {
        assert!(
            !encoded.windows(8).any(|w| w == window),
            "§15.2: no part of the response is in clear in the record"
        );
    }
}

/// A sealed record keeps its trace origin inside the seal: the record beneath it holds none, and
/// no part of the `traceparent` or `tracestate` is in its bytes; through the sealed store, the
/// record comes back with it. PROTOCOL.md §5.6, §15.2.
pub async fn a_sealed_record_keeps_its_trace_origin_inside_the_seal<H: Harness>(h: H) {
    use super::origin::{FIRST_RUN, FIRST_STATE, completed_under};
    let sealed = SealedStore::new(h.store(), keys(&["k1"]));
    let svc = service(
        layer(&h, sealed.clone()).trace_origin(true),
        Handler::ok(|_| created("charged")),
    );
    let mut request = post("traced", "x");
    (request.headers_mut()).insert("traceparent", FIRST_RUN.parse().expect("a value"));
    (request.headers_mut()).insert("tracestate", FIRST_STATE.parse().expect("a value"));
    assert_eq!(send(&svc, request).await.outcome, Some(Outcome::Executed));

    let id = RecordId::new(b"", "traced");
    let stored = raw(&h.store(), &id, h.lease()).await;
    assert_eq!(stored.origin, None, "§15.2: no origin beside the seal");
    let encoded = stored.encode().expect("a sealed record encodes");
    let trace_id = &FIRST_RUN.as_bytes()[3..35];
    let binary = tower_idempotency::record::TraceOrigin::parse(FIRST_RUN).expect("valid");
    for needle in [
        &binary.trace_id()[..],
        &binary.span_id()[..],
        trace_id,
        b"congo=t61r",
    ] {
        assert!(
            !encoded.windows(needle.len()).any(|w| w == needle),
            "§15.2: no part of the trace origin is in clear in the record"
        );
    }
    let opened = completed_under(&sealed, &id, h.lease()).await;
    let origin = opened
        .origin
        .expect("§5.6: the origin comes back once the seal opens");
    assert_eq!(origin.to_string(), FIRST_RUN);
    assert_eq!(origin.tracestate(), Some(FIRST_STATE));
}

/// A sealed record with any one byte changed, in its header, nonce, ciphertext or tag, is never
/// replayed, and its request is not run: 500 record-unreadable. The same record unchanged
/// replays (the planting is sound).
/// PROTOCOL.md §5.4, §7.2, §15.3.
pub async fn a_sealed_record_with_a_changed_byte_is_never_replayed<H: Harness>(h: H) {
    let keys = keys(&["k1"]);
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let store = h.store();
    let svc = service(
        layer(&h, SealedStore::new(store.clone(), keys.clone())),
        handler.clone(),
    );
    let first = send(&svc, post("original", "x")).await;
    let original = raw(&store, &RecordId::new(b"", "original"), h.lease()).await;
    let Some(Payload::Sealed(sealed)) = &original.response else {
        panic!("§15.2: sealed: {original:?}");
    };
    let response = (keys.open(
        &RecordId::new(b"", "original"),
        &original.fingerprint,
        sealed,
    ))
    .expect("§15.2: a record opens with its key, id and fingerprint");

    // The same response sealed honestly for another key of the same request replays.
    let honest = |key: &str| Completed {
        fingerprint: original.fingerprint,
        response: Some(Payload::Sealed(
            keys.seal(&RecordId::new(b"", key), &original.fingerprint, &response)
                .expect("sealed")
                .into(),
        )),
        origin: None,
    };
    plant(&store, &RecordId::new(b"", "honest"), &honest("honest"), &h).await;
    let replay = send(&svc, post("honest", "x")).await;
    assert_eq!(
        (replay.outcome, &replay.body),
        (Some(Outcome::Replayed), &first.body),
        "§15.2: a record sealed for its key replays"
    );

    let bytes = honest("changed").encode().expect("encodes");
    for at in 0..bytes.len() {
        let key = format!("changed-{at}");
        let mut changed = honest(&key).encode().expect("encodes");
        changed[at] ^= 0x01;
        // Planted as bytes the store's own decoding reads back: a record kind the decoding
        // refuses never reaches a store that keeps typed values, so it is skipped there.
        let Ok(Record::Completed(record)) = Record::decode(changed.into()) else {
            continue;
        };
        plant(&store, &RecordId::new(b"", &key), &record, &h).await;
        let reply = send(&svc, post(&key, "x")).await;
        assert_unreadable(&reply, &format!("byte {at} of {} changed", bytes.len()));
    }
    assert_eq!(
        handler.calls(),
        1,
        "§15.3: no changed record ran its request"
    );
}

/// A sealed record copied under another key of its scope, or under its key in another scope, does
/// not open there: 500, not the other request's response. Where it was written it still replays.
/// PROTOCOL.md §5.1, §15.3.
pub async fn a_sealed_record_moved_to_another_key_or_scope_does_not_open<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let store = h.store();
    let sealed = SealedStore::new(store.clone(), keys(&["k1"]));
    let scoped = layer(&h, sealed).scope(|parts: &http::request::Parts| {
        Ok(Scope::from(parts.uri.path().trim_start_matches('/')))
    });
    let svc = service(scoped, handler.clone());
    let request = |tenant: &str, key: &str| {
        keyed(Method::POST, &format!("/{tenant}"), key)
            .body(Body::from("x"))
            .expect("a request")
    };

    let first = send(&svc, request("acct_a", "k-1")).await;
    let record = raw(&store, &RecordId::new(b"acct_a", "k-1"), h.lease()).await;
    plant(&store, &RecordId::new(b"acct_a", "k-2"), &record, &h).await;
    plant(&store, &RecordId::new(b"acct_b", "k-1"), &record, &h).await;

    let other_key = send(&svc, request("acct_a", "k-2")).await;
    assert_unreadable(&other_key, "a record moved to another key of its scope");
    let other_scope = send(&svc, request("acct_b", "k-1")).await;
    assert_unreadable(&other_scope, "a record moved to its key in another scope");
    assert_replay_of(&send(&svc, request("acct_a", "k-1")).await, &first);
    assert_eq!(handler.calls(), 1, "§15.3: a moved record runs nothing");
}

/// A new key put first seals new records, and the old key, kept behind it, still opens the
/// records it sealed: rotation loses no live record.
/// PROTOCOL.md §15.2.
pub async fn rotated_keys_open_old_records_and_seal_new_ones<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let store = h.store();
    let before = service(
        layer(&h, SealedStore::new(store.clone(), keys(&["old"]))),
        handler.clone(),
    );
    let old = send(&before, post("before-rotation", "x")).await;

    let after = service(
        layer(&h, SealedStore::new(store.clone(), keys(&["new", "old"]))),
        handler.clone(),
    );
    assert_replay_of(&send(&after, post("before-rotation", "x")).await, &old);
    let new = send(&after, post("after-rotation", "x")).await;
    assert_replay_of(&send(&after, post("after-rotation", "x")).await, &new);
    assert_eq!(handler.calls(), 2, "§6.2: each key ran once");

    for (key, kid) in [("before-rotation", "old"), ("after-rotation", "new")] {
        let record = raw(&store, &RecordId::new(b"", key), h.lease()).await;
        let Some(Payload::Sealed(sealed)) = &record.response else {
            panic!("§15.2: sealed: {record:?}");
        };
        assert_eq!(
            sealed.key_id, kid,
            "§15.2: {key} is sealed under the key that was first"
        );
    }
}

/// Once the key that sealed a record is taken out of the set, the record no longer opens: 500
/// record-unreadable, the request not run again (fail-open or not). Records of the remaining keys
/// still replay.
/// PROTOCOL.md §9.7, §15.2, §15.3.
pub async fn a_record_sealed_under_a_retired_key_is_never_replayed<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let store = h.store();
    let both = service(
        layer(&h, SealedStore::new(store.clone(), keys(&["new", "old"]))),
        handler.clone(),
    );
    let kept = send(&both, post("kept", "x")).await;
    let old_only = service(
        layer(&h, SealedStore::new(store.clone(), keys(&["old"]))),
        handler.clone(),
    );
    send(&old_only, post("retired", "x")).await;

    let retired = SealedStore::new(store.clone(), keys(&["new"]));
    for fail_open in [false, true] {
        let svc = service(
            layer(&h, retired.clone()).fail_open(fail_open),
            handler.clone(),
        );
        let reply = send(&svc, post("retired", "x")).await;
        assert_unreadable(
            &reply,
            &format!("sealed under a retired key (fail-open {fail_open})"),
        );
        assert_replay_of(&send(&svc, post("kept", "x")).await, &kept);
    }
    assert_eq!(
        handler.calls(),
        2,
        "§15.3: a record that does not open runs nothing"
    );
}

/// A response in clear is refused by a sealed store (anyone who can write the store could plant
/// one), unless it is told to accept them while sealing is introduced; a sealed record reaching a
/// layer without the keys is not replayed either.
/// PROTOCOL.md §15.2, §15.3.
pub async fn records_in_clear_and_sealed_records_without_keys_are_not_replayed<H: Harness>(h: H) {
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let store = h.store();
    let plain = service(layer(&h, store.clone()), handler.clone());
    let in_clear = send(&plain, post("in-clear", "x")).await;

    let sealed = SealedStore::new(store.clone(), keys(&["k1"]));
    let strict = service(layer(&h, sealed.clone()), handler.clone());
    assert_unreadable(
        &send(&strict, post("in-clear", "x")).await,
        "a response in clear under a sealed store",
    );
    let migrating = service(layer(&h, sealed.accept_clear(true)), handler.clone());
    assert_replay_of(&send(&migrating, post("in-clear", "x")).await, &in_clear);

    send(&strict, post("sealed", "x")).await;
    assert_unreadable(
        &send(&plain, post("sealed", "x")).await,
        "a sealed record reaching a layer without the keys",
    );
    assert_eq!(handler.calls(), 2, "§15.3: neither ran its request again");
}
