//! Cases on fence numbers: every claim of a key carries a larger fence than every earlier claim of
//! it, and a displaced holder learns that it is displaced (PROTOCOL.md §5.3).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::store::ANSWERS;
use crate::*;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{HeldClaim, Outcome};

async fn claim_of<St: Store>(store: &St, id: &RecordId, lease: Duration, rule: &str) -> ClaimToken {
    match store
        .claim(id, &Fingerprint::from_bytes([1; 32]), lease)
        .await
    {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("§10.1 claim: {rule}: the key is free and is claimed, got {other:?}"),
    }
}

/// Fences grow with every claim of a key: a takeover after the lease ran out, a claim after a
/// release, and a claim after the completed record expired each get a larger fence than the
/// claim before, whichever handle on the store makes them (an instance restarted).
/// PROTOCOL.md §5.3.
pub async fn store_fences_grow_with_every_claim_of_a_key<H: Harness>(h: H) {
    let (lease, window) = (h.lease(), h.window());
    let id = RecordId::new(b"contract", "fences");
    let first_instance = h.store();
    let first = claim_of(&first_instance, &id, lease, "a new key").await;

    h.advance(lease + margin(&h)).await;
    // Another instance (or this one, restarted) takes the key over.
    let second_instance = h.store();
    let taken_over = claim_of(&second_instance, &id, lease, "after the lease ran out").await;
    assert!(
        taken_over.fence() > first.fence(),
        "§5.3: a takeover after the lease ran out gets a larger fence: {:?} after {:?}",
        taken_over.fence(),
        first.fence()
    );

    assert!(
        second_instance
            .release(&id, &taken_over)
            .await
            .expect(ANSWERS),
        "§10.1 release: the claim's own release frees the key"
    );
    let after_release = claim_of(&first_instance, &id, lease, "after a release").await;
    assert!(
        after_release.fence() > taken_over.fence(),
        "§5.3: a claim after a release gets a larger fence: {:?} after {:?}",
        after_release.fence(),
        taken_over.fence()
    );

    let done = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
    assert!(
        first_instance
            .complete(&id, &after_release, &done, window)
            .await
            .expect(ANSWERS),
        "§10.1 complete: the claim's own completion is written"
    );
    h.advance(window + margin(&h)).await;
    let new_operation = claim_of(&second_instance, &id, lease, "after the window").await;
    assert!(
        new_operation.fence() > after_release.fence(),
        "§5.3: a claim after the completed record expired gets a larger fence: {:?} after {:?}",
        new_operation.fence(),
        after_release.fence()
    );
}

/// Fences grow across keys claimed one after another too, never going back: each key's first
/// claim is numbered from the store's clock, not from a counter of that key alone that a store
/// which forgot the key would restart.
/// PROTOCOL.md §5.3.
pub async fn store_first_claims_are_numbered_by_the_clock<H: Harness>(h: H) {
    let store = h.store();
    let lease = h.lease();
    let mut last = Fence::new(0);
    for n in 0..20 {
        let id = RecordId::new(b"contract", &format!("clock-{n}"));
        let token = claim_of(&store, &id, lease, "a new key").await;
        assert!(
            token.fence() >= last,
            "§5.3: the first claim of a new key is numbered from the store's clock, which does \
             not go back: {:?} after {:?}",
            token.fence(),
            last
        );
        last = token.fence();
    }
    assert!(
        last > Fence::new(1_000_000_000_000_000),
        "§5.3: a fence is the store's clock in microseconds since the Unix epoch (after 2001): \
         {last:?}"
    );
}

/// The handler finds its [`HeldClaim`] in the request's extensions. A handler stalled past its
/// lease (its renewals failing) is displaced by a retry through another instance: the retry's
/// handler has a larger fence, the displaced handler's `still_held` answers `false`, its
/// completion is refused, and every later retry gets the second run's response.
/// PROTOCOL.md §5.3, §9.6.
pub async fn a_displaced_handler_learns_it_and_has_the_smaller_fence<H: Harness>(h: H) {
    let lease = h.lease();
    let seen: Arc<Mutex<Vec<HeldClaim>>> = Arc::default();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (seen, started, gate) = (seen.clone(), started.clone(), gate.clone());
        Handler::new(move |call| {
            let (seen, started, gate) = (seen.clone(), started.clone(), gate.clone());
            async move {
                let claim = call
                    .parts
                    .extensions
                    .get::<HeldClaim>()
                    .cloned()
                    .expect("§5.3: a claimed request's handler finds its HeldClaim");
                let fence = claim.fence();
                seen.lock().expect("seen").push(claim);
                if call.n == 1 {
                    started.notify_one();
                    gate.notified().await;
                }
                Ok(created(format!("run {} with fence {fence}", call.n)))
            }
        })
    };
    // The first instance's store loses its writes (its renewals fail), as a stalled process
    // does; the second instance's works.
    let stalled = Faulty::new(h.store());
    let first = service(layer(&h, stalled.clone()), handler.clone());
    let second = service(layer(&h, h.store()), handler.clone());

    let first_run = spawn_send(&first, post("fenced", "100"));
    started.notified().await;
    stalled.fail_writes(true);
    h.advance(lease + margin(&h)).await;

    let retry = send(&second, post("fenced", "100")).await;
    assert_eq!(
        retry.outcome,
        Some(Outcome::Executed),
        "§9.6: a retry after the lease ran out takes the key over and runs: {retry:?}"
    );
    let claims = seen.lock().expect("seen").clone();
    let [displaced, current] = claims.as_slice() else {
        panic!("§9.6: two runs, each with its claim: {claims:?}");
    };
    assert!(
        current.fence() > displaced.fence(),
        "§5.3: the run that took the key over has the larger fence: {current:?} after {displaced:?}"
    );
    stalled.fail_writes(false);
    assert!(
        !displaced.still_held().await.expect(ANSWERS),
        "§5.3: the displaced handler's claim is no longer held"
    );
    gate.notify_one();
    let late = first_run.await.expect("the first run's task");
    assert_eq!(
        late.outcome,
        Some(Outcome::Executed),
        "§9.5: the displaced run still answers its own client (its completion refused and logged): {late:?}"
    );
    let again = send(&second, post("fenced", "100")).await;
    assert_eq!(
        (again.outcome, again.text()),
        (Some(Outcome::Replayed), retry.text()),
        "§5.3, §10.1: the displaced run's completion is refused; retries get the second run's \
         response"
    );
    assert_eq!(handler.calls(), 2, "§9.6: one run each, and no third");
}

/// A handler's `still_held` answers `true` while its claim stands (and renews the lease as it
/// asks).
/// PROTOCOL.md §5.3.
pub async fn a_running_handler_still_holds_its_claim<H: Harness>(h: H) {
    let handler = Handler::new(|call| async move {
        let claim = call
            .parts
            .extensions
            .get::<HeldClaim>()
            .cloned()
            .expect("§5.3: a claimed request's handler finds its HeldClaim");
        let held = claim.still_held().await?;
        Ok(created(format!("held: {held}")))
    });
    let app = service(layer(&h, h.store()), handler);
    let reply = send(&app, post("held", "100")).await;
    assert_eq!(
        reply.text(),
        "held: true",
        "§5.3: the running claim is still held: {reply:?}"
    );
}
