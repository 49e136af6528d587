//! An operator's store calls: reading a key ([`OperatorStore::inspect`]) and forgetting it
//! ([`OperatorStore::forget`]), PROTOCOL.md §10.9.

use std::time::{Duration, SystemTime};

use super::store::{ANSWERS, claimed, completed_with_response, existing_in_flight, fingerprint};
use crate::{Harness, margin};
use tower_idempotency::record::{ClaimToken, Completed, RecordId};
use tower_idempotency::store::{ForgetOutcome, Inspected, OperatorStore, Store};

fn record_id(key: &str) -> RecordId {
    RecordId::new(b"operator", key)
}

async fn inspected<St: OperatorStore>(store: &St, id: &RecordId) -> Option<Inspected> {
    store
        .inspect(id)
        .await
        .expect("§10.9 inspect: answers Ok on a reachable store")
}

async fn forget<St: OperatorStore>(store: &St, id: &RecordId, force: bool) -> ForgetOutcome {
    store
        .forget(id, force)
        .await
        .expect("§10.9 forget: answers Ok on a reachable store")
}

/// Whether `at` lies within `slack` of `from..=to`: the store's clock against this process's.
fn within(at: SystemTime, from: SystemTime, to: SystemTime, slack: Duration) -> bool {
    at + slack >= from && at <= to + slack
}

/// Inspect answers each state as it is, with the claim's fence and the store's times, and writes
/// nothing: no record, in flight, completed with its response intact, a tombstone, and no record
/// again once it expired. PROTOCOL.md §10.9.
pub async fn store_inspect_reads_each_state<H: Harness>(h: H) {
    let (store, lease, window) = (h.store(), h.lease(), h.window());
    let slack = margin(&h);
    let id = record_id("inspect");
    assert_eq!(
        inspected(&store, &id).await,
        None,
        "§10.9 inspect: a key never claimed has no record"
    );

    let before = SystemTime::now();
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let Some(Inspected::InFlight(view)) = inspected(&store, &id).await else {
        panic!("§10.9 inspect: a claimed key is in flight");
    };
    assert_eq!(
        view.fingerprint,
        fingerprint(1),
        "§10.9: the claim's fingerprint"
    );
    assert_eq!(
        view.fence,
        token.fence(),
        "§10.9 inspect: an in-flight record's fence is its claim's"
    );
    assert!(
        within(view.lease_ends, before, SystemTime::now() + lease, slack),
        "§10.9 inspect: the lease ends a lease after the claim: {:?} for a claim at {before:?}",
        view.lease_ends
    );
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(1),
        "§10.9 inspect writes nothing: the claim still stands"
    );

    let done = completed_with_response(fingerprint(1));
    let completing = SystemTime::now();
    assert!(
        store
            .complete(&id, &token, &done, window)
            .await
            .expect(ANSWERS)
    );
    let Some(Inspected::Completed(view)) = inspected(&store, &id).await else {
        panic!("§10.9 inspect: a completed key is completed");
    };
    assert_eq!(
        view.completed, done,
        "§10.9 inspect: the completed record comes back exactly as it was written"
    );
    assert!(
        view.fence.is_none_or(|fence| fence == token.fence()),
        "§10.9 inspect: a completed record's fence, where the store keeps it, is the claim's \
         that completed it: {:?}, not {:?}",
        view.fence,
        token.fence()
    );
    assert!(
        within(view.expires, completing, SystemTime::now() + window, slack),
        "§10.9 inspect: a completed record expires a window after its completion: {:?}",
        view.expires
    );
    assert_eq!(Inspected::Completed(view.clone()).state(), "completed");

    let tombstone_id = record_id("inspect-tombstone");
    let token = claimed(&store, &tombstone_id, &fingerprint(2), lease).await;
    let tombstone = Completed::tombstone(fingerprint(2));
    assert!(
        store
            .complete(&tombstone_id, &token, &tombstone, window)
            .await
            .expect(ANSWERS)
    );
    let found = inspected(&store, &tombstone_id).await;
    assert_eq!(
        found.as_ref().map(Inspected::state),
        Some("tombstone"),
        "§10.9 inspect: a completion without a response is a tombstone: {found:?}"
    );

    let expiring = record_id("inspect-expired");
    claimed(&store, &expiring, &fingerprint(3), lease).await;
    h.advance(lease + margin(&h)).await;
    assert_eq!(
        inspected(&store, &expiring).await,
        None,
        "§10.2, §10.9 inspect: a record past its expiry is gone"
    );
}

/// Forgetting a completed record (or tombstone) frees its key: the record is gone for every
/// call, and the next claim is a new claim with a larger fence than the forgotten one's.
/// PROTOCOL.md §10.9, §5.3.
pub async fn store_forget_frees_a_completed_key<H: Harness>(h: H) {
    let (store, lease, window) = (h.store(), h.lease(), h.window());
    let id = record_id("forget-completed");
    assert_eq!(
        forget(&store, &id, true).await,
        ForgetOutcome::Absent,
        "§10.9 forget: a key without a record answers Absent"
    );
    for (round, response) in [true, false].into_iter().enumerate() {
        let token = claimed(&store, &id, &fingerprint(1), lease).await;
        let done = if response {
            completed_with_response(fingerprint(1))
        } else {
            Completed::tombstone(fingerprint(1))
        };
        assert!(
            store
                .complete(&id, &token, &done, window)
                .await
                .expect(ANSWERS)
        );
        let ForgetOutcome::Forgotten(Inspected::Completed(was)) = forget(&store, &id, false).await
        else {
            panic!("§10.9 forget: a completed record is forgotten, unforced (round {round})");
        };
        assert_eq!(
            was.completed.fingerprint,
            fingerprint(1),
            "§10.9 forget: it answers the record it forgot"
        );
        assert_eq!(
            inspected(&store, &id).await,
            None,
            "§10.9 forget: a forgotten record is gone (round {round})"
        );
        let again = claimed(&store, &id, &fingerprint(2), lease).await;
        assert!(
            again.fence() > token.fence(),
            "§5.3, §10.9: a claim after a forget gets a larger fence than the forgotten claim: \
             {:?} after {:?}",
            again.fence(),
            token.fence()
        );
        assert!(
            !store
                .complete(&id, &token, &done, window)
                .await
                .expect(ANSWERS),
            "§5.3: the forgotten claim's token does not complete the new claim's record"
        );
        assert!(store.release(&id, &again).await.expect(ANSWERS));
    }
}

/// A key in flight is not forgotten unless forced: refused, the claim untouched; forced, the
/// claim is gone, its token fences nothing once the key is claimed again, and the new claim's
/// fence is larger. PROTOCOL.md §10.9, §5.3.
pub async fn store_forget_refuses_a_key_in_flight_unless_forced<H: Harness>(h: H) {
    let (store, lease) = (h.store(), h.lease());
    let id = record_id("forget-in-flight");
    let token = claimed(&store, &id, &fingerprint(1), lease).await;
    let ForgetOutcome::Refused(view) = forget(&store, &id, false).await else {
        panic!("§10.9 forget: a key in flight is refused unless forced");
    };
    assert_eq!(
        view.fence,
        token.fence(),
        "§10.9: the refused record, as it is"
    );
    assert!(
        store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§10.9 forget: a refusal writes nothing; the claim still holds the key"
    );

    let ForgetOutcome::Forgotten(Inspected::InFlight(was)) = forget(&store, &id, true).await else {
        panic!("§10.9 forget: a key in flight is forgotten when forced");
    };
    assert_eq!(
        was.fence,
        token.fence(),
        "§10.9: the forgotten record, as it was"
    );
    assert_eq!(inspected(&store, &id).await, None, "§10.9: forgotten");
    assert!(
        !store.renew(&id, &token, lease).await.expect(ANSWERS),
        "§10.1 renew: a forgotten claim renews nothing"
    );
    let again = claimed(&store, &id, &fingerprint(2), lease).await;
    assert!(
        again.fence() > token.fence(),
        "§5.3, §10.9: a claim after a forced forget gets a larger fence than the forgotten \
         claim: {:?} after {:?}",
        again.fence(),
        token.fence()
    );
    assert_tokens_fence_nothing(&store, &id, &token, lease).await;
    assert_eq!(
        existing_in_flight(&store, &id, lease).await.fingerprint,
        fingerprint(2),
        "§5.3: the forgotten claim's calls wrote nothing; the new claim's record stands"
    );
}

/// The forgotten claim's token cannot complete, renew or release the new claim's record.
async fn assert_tokens_fence_nothing<St: Store>(
    store: &St,
    id: &RecordId,
    token: &ClaimToken,
    lease: Duration,
) {
    let done = completed_with_response(fingerprint(1));
    assert!(
        !store
            .complete(id, token, &done, lease)
            .await
            .expect(ANSWERS),
        "§5.3: a forgotten claim's completion does not replace the new claim's record"
    );
    assert!(!store.renew(id, token, lease).await.expect(ANSWERS));
    assert!(!store.release(id, token).await.expect(ANSWERS));
}
