//! Store-level cases: the rules of PROTOCOL.md §10.1 and §10.2, through the [`Store`] methods.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, LOCATION};
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::{Harness, margin, pattern};
use tower_idempotency::record::{
    ClaimToken, Completed, Fence, Fingerprint, InFlight, Payload, Record, RecordId, StoredResponse,
};
use tower_idempotency::store::{Claim, Store};

/// A store call of a case failed: every case runs on a reachable store, which answers.
pub(super) const ANSWERS: &str = "§10.1: every call on a reachable store answers Ok (a StoreError here is a \
                       failure of the store, not an answer)";

pub(super) fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn record_id(key: &str) -> RecordId {
    RecordId::new(b"contract", key)
}

pub(super) async fn claimed<St: Store>(
    store: &St,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> ClaimToken {
    match store.claim(id, fp, lease).await {
        Ok(Claim::Claimed(token)) => token,
        other => panic!(
            "§10.1 claim: a key with no live record (none, released, or past its expiry, §10.2) \
             is claimed, Claim::Claimed; {id:?} got {other:?}"
        ),
    }
}

async fn existing<St: Store>(
    store: &St,
    id: &RecordId,
    fp: &Fingerprint,
    lease: Duration,
) -> Record {
    match store.claim(id, fp, lease).await {
        Ok(Claim::Existing(record)) => record,
        other => panic!(
            "§10.1 claim: a key with a live record answers Claim::Existing and writes nothing; \
             {id:?} got {other:?}"
        ),
    }
}

pub(super) async fn existing_in_flight<St: Store>(
    store: &St,
    id: &RecordId,
    lease: Duration,
) -> InFlight {
    match existing(store, id, &fingerprint(0xee), lease).await {
        Record::InFlight(in_flight) => in_flight,
        other => panic!(
            "§10.1 claim: a key claimed and neither completed, released nor expired is in \
             flight; got {other:?}"
        ),
    }
}

async fn existing_completed<St: Store>(store: &St, id: &RecordId, lease: Duration) -> Completed {
    match existing(store, id, &fingerprint(0xee), lease).await {
        Record::Completed(completed) => completed,
        other => panic!(
            "§10.1 claim: a completed key answers its completed record for the whole window \
             (§5.2); got {other:?}"
        ),
    }
}

/// A completed record whose response has repeated, empty and non-UTF-8 header values and a
/// binary body.
pub(super) fn completed_with_response(fp: Fingerprint) -> Completed {
    let mut headers = HeaderMap::new();
    headers.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.append("x-multi", HeaderValue::from_static("first"));
    headers.append("x-multi", HeaderValue::from_static("second"));
    headers.append("x-empty", HeaderValue::from_static(""));
    headers.append(
        "x-bytes",
        HeaderValue::from_bytes(b"caf\xe9 \xff").expect("obs-text is a valid header value"),
    );
    headers.append("x-multi", HeaderValue::from_static("third"));
    headers.append(LOCATION, HeaderValue::from_static("/v1/charges/ch_1"));
    let mut body = b"{\"id\":\"ch_1\"}\x00\xff\r\n".to_vec();
    body.extend(pattern(1000));
    Completed {
        fingerprint: fp,
        response: Some(Payload::Plain(Arc::new(StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from(body),
            trailers: None,
        }))),
        origin: None,
    }
}

fn header_pairs(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// A claim on a free key succeeds; a second claim, with the same or another fingerprint, gets
/// the in-flight record unchanged, and the first claimant still owns it.
/// PROTOCOL.md §10.1, §10.2.
pub async fn store_claim_is_exclusive<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("exclusive");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;

    for fp in [fingerprint(1), fingerprint(2)] {
        match existing(&store, &id, &fp, lease).await {
            Record::InFlight(in_flight) => {
                assert_eq!(
                    in_flight.fingerprint,
                    fingerprint(1),
                    "§10.1 claim: a second claim gets the in-flight record with the first \
                     claimant's fingerprint, whatever its own"
                );
                assert!(
                    in_flight.lease_remaining > Duration::ZERO
                        && in_flight.lease_remaining <= lease,
                    "§10.1 claim: an in-flight record's lease remaining is more than zero and at \
                     most the lease: {:?} of {lease:?}",
                    in_flight.lease_remaining
                );
            }
            other => panic!(
                "§10.1 claim: a second claim of a key in flight gets its in-flight record; got \
                 {other:?}"
            ),
        }
    }
    assert!(
        store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§10.1 renew: a second claim wrote nothing, so the first claim's token still renews"
    );
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, h.window())
            .await
            .expect(ANSWERS),
        "§10.1 complete: a second claim wrote nothing, so the first claimant still completes"
    );
}

/// Records of different ids (the same key in two scopes) are independent.
/// PROTOCOL.md §5.1, §5.3, §10.2.
pub async fn store_claims_are_per_record_id<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let a = RecordId::new(b"acct_a", "same-key");
    let b = RecordId::new(b"acct_b", "same-key");
    assert_ne!(a, b, "§5.1: one key in two scopes is two record ids");
    let token_a = claimed(&store, &a, &fingerprint(1), lease).await;
    let token_b = claimed(&store, &b, &fingerprint(2), lease).await;
    assert_ne!(
        token_a, token_b,
        "§5.3 claim: every claim gets a new, unique token"
    );
    // A token fences only its own record.
    assert!(
        !store.release(&b, &token_a).await.expect(ANSWERS),
        "§10.2 release: a token fences only its own record; another id's release answers Ok(false)"
    );
    assert!(
        !store.renew(&a, &token_b, lease).await.expect(ANSWERS),
        "§10.2 renew: a token fences only its own record; another id's renewal answers Ok(false)"
    );
    assert!(
        store.release(&a, &token_a).await.expect(ANSWERS),
        "§10.1 release: the in-flight record claimed with the token is deleted, Ok(true)"
    );
    assert_eq!(
        existing_in_flight(&store, &b, lease).await.fingerprint,
        fingerprint(2),
        "§10.2: records of different ids never affect each other; the other scope's claim stands"
    );
}

/// A completed record comes back exactly: status, every header value in order (repeated, empty
/// and non-UTF-8 values), and the body bytes; whatever fingerprint the later claim carries.
/// PROTOCOL.md §10.1.
pub async fn store_completed_record_is_returned_intact<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("intact");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, h.window())
            .await
            .expect(ANSWERS),
        "§10.1 complete: the in-flight record claimed with the token is completed, Ok(true)"
    );

    for fp in [fingerprint(1), fingerprint(9)] {
        let Record::Completed(got) = existing(&store, &id, &fp, lease).await else {
            panic!(
                "§10.1 claim: a completed key answers its completed record, whatever the \
                 claim's fingerprint ({fp:?})"
            );
        };
        assert_eq!(
            got, done,
            "§10.1: a completed record comes back exactly as it was written"
        );
        let (got, want) = (
            got.plain()
                .expect("§10.1: a completion with a response comes back with it"),
            done.plain().expect("the case's record has a response"),
        );
        assert_eq!(
            header_pairs(&got.headers),
            header_pairs(&want.headers),
            "§10.1: every header value comes back, in order (repeated, empty and non-UTF-8 \
             values included)"
        );
        assert_eq!(
            got.body, want.body,
            "§10.1: the body comes back byte for byte"
        );
    }
}

/// A tombstone (`Completed` without a response) is kept as such.
/// PROTOCOL.md §5.2, §10.1.
pub async fn store_tombstone_is_kept<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("tombstone");
    let token = claimed(&store, &id, &fingerprint(3), lease).await;
    let tombstone = Completed::tombstone(fingerprint(3));
    assert!(
        store
            .complete(&id, &token, &tombstone, h.window())
            .await
            .expect(ANSWERS),
        "§10.1 complete: a claim is completed with a tombstone like with a response, Ok(true)"
    );
    h.advance(h.lease() + margin(&h)).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        tombstone,
        "§5.2, §10.1: a tombstone (Completed without a response) is kept as such, past the lease"
    );
}

/// A completed record lives for the TTL given to `complete` (the dedup window), not for the
/// claim's lease; after it, the key is free.
/// PROTOCOL.md §5.2, §10.1.
pub async fn store_completed_record_lives_for_its_ttl_not_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window, m) = (h.lease(), h.window(), margin(&h));
    let id = record_id("ttl");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect(ANSWERS),
        "§10.1 complete: the in-flight record claimed with the token is completed, Ok(true)"
    );

    h.advance(lease + m).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§5.2, §10.1 complete: a completed record lives for the TTL given to complete, not for \
         the claim's lease: still there past the lease"
    );
    h.advance(window - lease - m - m).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§5.2, §10.1 complete: a completed record lives for the TTL given to complete: still \
         there just inside the window"
    );
    h.advance(m + m).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// An in-flight record without renewal lives for its lease, then the key is free.
/// PROTOCOL.md §5.2, §10.2.
pub async fn store_lease_expires_without_renewal<H: Harness>(h: H) {
    let store = h.store();
    let (lease, m) = (h.lease(), margin(&h));
    let id = record_id("lease");
    claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease - m).await;
    let in_flight = existing_in_flight(&store, &id, lease).await;
    assert!(
        in_flight.lease_remaining <= m + m / 2,
        "§10.1 claim: the lease remaining of an in-flight record counts down from the lease: \
         {:?} left after {:?} of a {lease:?} lease",
        in_flight.lease_remaining,
        lease - m
    );
    h.advance(m + m).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// A record in flight has more than zero of its lease left for as long as a claim finds it:
/// claims sent a moment apart as its lease runs out read a lease left that counts down and never
/// reaches zero, and then claim the key. (A store that reads its expiry in whole milliseconds,
/// rounded down or to the nearest, answers zero in the last one.)
/// PROTOCOL.md §10.1 (claim).
pub async fn store_lease_left_is_more_than_zero_to_its_end<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let (before, step) = (Duration::from_millis(20), Duration::from_micros(250));
    for round in 0..5 {
        let id = record_id(&format!("lease-left-{round}"));
        claimed(&store, &id, &fingerprint(1), lease).await;
        h.advance(lease - before).await;
        let mut read = 0;
        loop {
            match store
                .claim(&id, &fingerprint(2), lease)
                .await
                .expect(ANSWERS)
            {
                Claim::Claimed(_) => break,
                Claim::Existing(Record::InFlight(in_flight)) => {
                    read += 1;
                    assert!(
                        in_flight.lease_remaining > Duration::ZERO,
                        "§10.1 claim: a record in flight has more than zero of its lease left \
                         until it expires; claim {read} near its end read {:?}",
                        in_flight.lease_remaining
                    );
                }
                other => {
                    panic!("§10.1 claim: a key in flight, or free once it expired; got {other:?}")
                }
            }
            assert!(
                read < 10_000,
                "§10.2: a claim not renewed expires with its lease"
            );
            h.advance(step).await;
        }
    }
}

/// `renew` extends the lease to a full lease from now.
/// PROTOCOL.md §10.1 (renew).
pub async fn store_renew_extends_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let (lease, m) = (h.lease(), margin(&h));
    let id = record_id("renew");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease - m).await;
    assert!(
        store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§10.1 renew: the in-flight record claimed with the token is renewed, Ok(true)"
    );
    let in_flight = existing_in_flight(&store, &id, lease).await;
    assert!(
        in_flight.lease_remaining > lease - m,
        "§10.1 renew: the expiry becomes a full lease from now; a renewed lease has {:?} left",
        in_flight.lease_remaining
    );
    // Past the first lease's end, the claim holds.
    h.advance(m + m).await;
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(1),
        "§10.1 renew: past the first lease's end, the renewed claim still holds the key"
    );
    // Past the renewed lease's end, the key is free.
    h.advance(lease).await;
    claimed(&store, &id, &fingerprint(2), lease).await;
}

/// `release` deletes the owner's in-flight record; the key can be claimed again, and the old token
/// no longer works.
/// PROTOCOL.md §5.3, §10.1 (release).
pub async fn store_release_frees_the_key<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("release");
    let first = claimed(&store, &id, &fingerprint(1), lease).await;
    assert!(
        store.release(&id, &first).await.expect(ANSWERS),
        "§10.1 release: the in-flight record claimed with the token is deleted, Ok(true)"
    );
    let second = claimed(&store, &id, &fingerprint(2), lease).await;
    assert_ne!(
        first, second,
        "§5.3 claim: every claim gets a new, unique token"
    );
    assert!(
        !store.release(&id, &first).await.expect(ANSWERS),
        "§5.3, §10.1 release: a released token fences nothing; its release answers Ok(false)"
    );
    assert!(
        !store.renew(&id, &first, lease).await.expect(ANSWERS),
        "§5.3, §10.1 renew: a released token fences nothing; its renewal answers Ok(false)"
    );
    let done = completed_with_response(fingerprint(1));
    assert!(
        !store
            .complete(&id, &first, &done, h.window())
            .await
            .expect(ANSWERS),
        "§5.3, §10.1 complete: a released token cannot complete another claim's record: Ok(false)"
    );
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(2),
        "§5.3: the old token's calls wrote nothing; the new claim's record stands"
    );
}

/// An owner whose lease ran out, and whose key was claimed again, can neither complete, renew nor
/// release the new owner's record.
/// PROTOCOL.md §5.3, §10.2.
pub async fn store_fencing_stops_an_owner_whose_lease_was_lost<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("fencing");
    let old = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease + margin(&h)).await;
    let new = claimed(&store, &id, &fingerprint(2), lease).await;
    assert_ne!(old, new, "§5.3 claim: every claim gets a new, unique token");

    let stale = completed_with_response(fingerprint(1));
    assert!(
        !store
            .complete(&id, &old, &stale, window)
            .await
            .expect(ANSWERS),
        "§5.3, §10.1 complete: an owner whose lease ran out cannot complete the new owner's \
         record: Ok(false)"
    );
    assert!(
        !store.release(&id, &old).await.expect(ANSWERS),
        "§5.3, §10.1 release: an owner whose lease ran out cannot free the new owner's record: \
         Ok(false)"
    );
    assert!(
        !store.renew(&id, &old, lease).await.expect(ANSWERS),
        "§5.3, §10.1 renew: an owner whose lease ran out cannot renew the new owner's record: \
         Ok(false)"
    );
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(2),
        "§5.3: the fenced calls wrote nothing; the record is still the new owner's claim"
    );

    let done = Completed {
        fingerprint: fingerprint(2),
        response: completed_with_response(fingerprint(2)).response,
        origin: None,
    };
    assert!(
        store
            .complete(&id, &new, &done, window)
            .await
            .expect(ANSWERS),
        "§10.1 complete: the new owner completes its own claim, Ok(true)"
    );
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§10.1 complete: the new owner's completion is the record"
    );
}

/// Once completed, a record is final: the claim's token can no longer complete, renew or release
/// it.
/// PROTOCOL.md §5.2, §5.3.
pub async fn store_completed_record_is_final<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("final");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect(ANSWERS),
        "§10.1 complete: the in-flight record claimed with the token is completed, Ok(true)"
    );

    let other = Completed::tombstone(fingerprint(1));
    assert!(
        !store
            .complete(&id, &token, &other, window)
            .await
            .expect(ANSWERS),
        "§5.2, §10.1 complete: a completed record is final; another record (here a tombstone), \
         even with the claim's own token, answers Ok(false)"
    );
    assert!(
        !store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§5.2, §10.1 renew: a completed record is final; its own token's renewal answers Ok(false)"
    );
    assert!(
        !store.release(&id, &token).await.expect(ANSWERS),
        "§5.2, §10.1 release: a completed record is final; its own token's release answers \
         Ok(false)"
    );
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§5.2: a completed record is final; the refused calls changed nothing"
    );
}

/// A completion sent again by its claim (its first answer was lost with a dropped connection,
/// and the client sent it again) finds its own record and succeeds: the caller must not retry it
/// for ever, nor report the work as lost. The record is unchanged.
/// PROTOCOL.md §10.1.
pub async fn store_complete_sent_again_by_its_claim_is_written<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("sent-again");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let done = completed_with_response(fingerprint(1));
    for sending in ["first", "second"] {
        assert!(
            store
                .complete(&id, &token, &done, window)
                .await
                .expect(ANSWERS),
            "§10.1 complete: a completion sent again with its token and the same bytes answers \
             Ok(true) (the {sending} sending)"
        );
    }
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§10.1 complete: a completion sent again leaves the record unchanged"
    );
}

/// Renew and release on a key without a record do nothing and create nothing; complete writes
/// the record, since the work it records did run.
/// PROTOCOL.md §10.1, §9.5.
pub async fn store_complete_writes_a_missing_record_and_nothing_else_does<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("missing");
    let token = ClaimToken::new(Fence::new(1));
    assert!(
        !store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§10.1 renew: on a key with no record, renew answers Ok(false) and creates nothing"
    );
    assert!(
        !store.release(&id, &token).await.expect(ANSWERS),
        "§10.1 release: on a key with no record, release answers Ok(false)"
    );
    claimed(&store, &id, &fingerprint(1), lease).await;

    let other = record_id("missing-then-completed");
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&other, &token, &done, window)
            .await
            .expect(ANSWERS),
        "§10.1 complete: on a key with no live record, complete writes the record (the work did \
         run) and answers Ok(true)"
    );
    assert_eq!(
        existing_completed(&store, &other, lease).await,
        done,
        "§10.1 complete: the completion written where no record was is the record"
    );
}

/// An owner whose lease ran out while nobody claimed the key since still completes it: the record
/// vanished, but the work ran, and a retry must get its result rather than run it again.
/// PROTOCOL.md §10.1, §9.6.
pub async fn store_complete_after_the_lease_ran_out_writes_the_record<H: Harness>(h: H) {
    let store = h.store();
    let (lease, window) = (h.lease(), h.window());
    let id = record_id("late");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    h.advance(lease + margin(&h)).await;
    let done = completed_with_response(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect(ANSWERS),
        "§9.6, §10.1 complete: an owner whose lease ran out, with nobody claiming the key since, \
         still completes it: Ok(true)"
    );
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§10.1 complete: the late completion is the record"
    );
    // Kept for the window, like any completion.
    h.advance(lease + margin(&h)).await;
    assert_eq!(
        existing_completed(&store, &id, lease).await,
        done,
        "§5.2, §10.1 complete: the late completion is kept for the window given, not the lease"
    );
}

/// Of many concurrent claims of one key, exactly one wins.
/// PROTOCOL.md §10.2.
pub async fn store_concurrent_claims_have_one_winner<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let id = record_id("race");
    let tasks: Vec<_> = (0..100u8)
        .map(|n| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&id, &fingerprint(n), lease).await })
        })
        .collect();
    let mut winners = Vec::new();
    let mut in_flight = 0;
    for task in tasks {
        match task.await.expect("the claiming task").expect(ANSWERS) {
            Claim::Claimed(token) => winners.push(token),
            Claim::Existing(Record::InFlight(_)) => in_flight += 1,
            other => panic!(
                "§10.2: of concurrent claims of a free id, each either claims it or gets the \
                 in-flight record; got {other:?}"
            ),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "§10.2: of any number of concurrent claims of a free id, exactly one gets Claimed"
    );
    assert_eq!(
        in_flight, 99,
        "§10.2: every other concurrent claim gets the winner's in-flight record"
    );
    assert!(
        store.release(&id, &winners[0]).await.expect(ANSWERS),
        "§10.1 release: the winner's token releases its in-flight record, Ok(true)"
    );
}
