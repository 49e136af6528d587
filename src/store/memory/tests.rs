//! The memory store's own cases: its byte budget and its expiry lanes.

use super::budget::ENTRY_OVERHEAD;
use super::expiry::LANES;
use super::*;
use crate::record::{Payload, StoredResponse};

fn completed(body: usize) -> Completed {
    Completed {
        fingerprint: Fingerprint::from_bytes([1; 32]),
        response: Some(Payload::Plain(Arc::new(StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from(vec![b'x'; body]),
            trailers: None,
        }))),
        origin: None,
    }
}

fn claim(store: &MemoryStore, n: u32) -> Result<Claim, StoreError> {
    store.claim_now(
        &RecordId::new(b"", &n.to_string()),
        &Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(30),
    )
}

/// With a share per scope, a record also costs its place in the scopes' accounts.
#[tokio::test(start_paused = true)]
async fn a_scoped_record_costs_its_scope_account_too() {
    let store = MemoryStore::with_capacity(1 << 20).with_scope_limit(1 << 16);
    assert!(matches!(claim(&store, 0), Ok(Claim::Claimed(_))));
    assert_eq!(
        store.used_bytes(),
        ENTRY_OVERHEAD + super::scopes::SCOPE_OVERHEAD
    );
}

#[tokio::test(start_paused = true)]
async fn full_store_refuses_new_claims_and_keeps_live_records() {
    let store = MemoryStore::with_capacity(ENTRY_OVERHEAD * 3);
    for n in 0..3 {
        assert!(matches!(claim(&store, n), Ok(Claim::Claimed(_))));
    }
    assert!(matches!(claim(&store, 3), Err(StoreError::Full { .. })));
    // The live records are all still there.
    for n in 0..3 {
        assert!(matches!(claim(&store, n), Ok(Claim::Existing(_))));
    }
    // Once their leases run out, their bytes are free again.
    tokio::time::advance(Duration::from_secs(31)).await;
    assert!(matches!(claim(&store, 3), Ok(Claim::Claimed(_))));
    assert_eq!((store.len(), store.is_empty()), (1, false));
    assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
}

#[tokio::test(start_paused = true)]
async fn a_completion_that_does_not_fit_is_a_tombstone() {
    let store = MemoryStore::with_capacity(ENTRY_OVERHEAD + 100);
    let id = RecordId::new(b"", "k");
    let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
        panic!()
    };
    assert!(
        store
            .complete_now(&id, &token, &completed(1000), Duration::from_secs(60))
            .unwrap()
    );
    let Ok(Claim::Existing(Record::Completed(c))) = claim_id(&store, &id) else {
        panic!()
    };
    assert!(c.response.is_none());
    assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
}

#[tokio::test(start_paused = true)]
async fn bytes_are_accounted_through_complete_and_expiry() {
    let store = MemoryStore::new();
    let id = RecordId::new(b"", "k");
    let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
        panic!()
    };
    let done = completed(1000);
    assert!(
        store
            .complete_now(&id, &token, &done, Duration::from_secs(60))
            .unwrap()
    );
    // A record holds its encoding: the response's bytes, and its fields' lengths.
    assert_eq!(
        store.used_bytes(),
        ENTRY_OVERHEAD + done.encode().unwrap().len()
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!((store.len(), store.is_empty()), (0, true));
    assert_eq!(store.used_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn records_with_many_durations_all_expire() {
    // More distinct durations than lanes: the rest go through the shared heap.
    let store = MemoryStore::new();
    let durations = (1..=LANES as u64 * 2).map(Duration::from_secs);
    for (n, lease) in durations.clone().enumerate() {
        let id = RecordId::new(b"", &n.to_string());
        let claimed = store.claim_now(&id, &Fingerprint::from_bytes([1; 32]), lease);
        assert!(matches!(claimed, Ok(Claim::Claimed(_))));
    }
    for (n, lease) in durations.enumerate() {
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(store.len(), LANES * 2 - n - 1, "after {lease:?}");
    }
    assert_eq!(store.used_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_completed_claim_leaves_no_lease_item_behind() {
    let store = MemoryStore::new();
    let id = RecordId::new(b"", "k");
    let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
        panic!()
    };
    assert!(
        store
            .complete_now(&id, &token, &completed(10), Duration::from_secs(60))
            .unwrap()
    );
    // The lease item was cancelled, and the next call on the shard drops it, long before the
    // lease would have run out: only the completion's item is left.
    store.len();
    let queued: usize = {
        let shard = store.shard(&id);
        shard.expiry.lanes.iter().map(|lane| lane.queue.len()).sum()
    };
    assert_eq!(queued, 1);
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(store.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_entry_due_but_not_yet_collected_counts_as_gone() {
    let store = MemoryStore::new();
    let id = RecordId::new(b"", "k");
    let Ok(Claim::Claimed(old)) = claim_id(&store, &id) else {
        panic!()
    };
    // Make the entry due without its queue item coming due: nothing collects it.
    {
        let mut shard = store.shard(&id);
        shard.map.get_mut(&id).unwrap().expires_at = Instant::now();
    }
    // Its owner can no longer complete, renew or release it...
    assert!(!store.renew_now(&id, &old, Duration::from_secs(30)));
    assert!(!store.release_now(&id, &old));
    // ...and a new claim takes its place, with its bytes counted once.
    let Ok(Claim::Claimed(new)) = claim_id(&store, &id) else {
        panic!("the due entry was served as live")
    };
    assert_ne!(new, old);
    assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
    assert!(
        store
            .complete_now(&id, &new, &completed(10), Duration::from_secs(60))
            .unwrap()
    );
}

/// `n` record ids that all fall in the shard of `RecordId::new(b"", "0")`.
fn ids_in_one_shard(n: usize) -> Vec<RecordId> {
    let shard_of = |id: &RecordId| usize::from(id.as_bytes()[0]) % SHARDS;
    let first = shard_of(&RecordId::new(b"", "0"));
    (0..)
        .map(|i: u32| RecordId::new(b"", &i.to_string()))
        .filter(|id| shard_of(id) == first)
        .take(n)
        .collect()
}

fn shard_entries(store: &MemoryStore, id: &RecordId) -> usize {
    store.shard(id).map.len()
}

#[tokio::test(start_paused = true)]
async fn records_that_come_due_together_are_collected_a_few_per_call() {
    let store = MemoryStore::new();
    let ids = ids_in_one_shard(200);
    for id in &ids {
        claim_id(&store, id).unwrap();
    }
    tokio::time::advance(Duration::from_secs(31)).await;
    // Each call collects a few of the due records, never the whole backlog at once...
    let fresh = &ids_in_one_shard(203)[200..];
    for (calls, id) in (1..).zip(fresh) {
        assert!(matches!(claim_id(&store, id), Ok(Claim::Claimed(_))));
        assert_eq!(
            shard_entries(&store, id),
            ids.len() - calls * COLLECT_PER_CALL + calls
        );
    }
    // ...while the due ones already count as gone: their keys can be claimed again.
    assert!(matches!(claim_id(&store, &ids[199]), Ok(Claim::Claimed(_))));
    // Asking for the size collects everything due, and the bytes come back.
    assert_eq!(store.len(), 4);
    assert_eq!(store.used_bytes(), 4 * ENTRY_OVERHEAD);
}

#[tokio::test(start_paused = true)]
async fn a_full_store_collects_every_due_record_before_refusing() {
    let ids = ids_in_one_shard(COLLECT_PER_HOLD * 2 + 10);
    let store = MemoryStore::with_capacity(ids.len() * ENTRY_OVERHEAD);
    for id in &ids {
        claim_id(&store, id).unwrap();
    }
    assert!(matches!(
        claim_id(&store, &RecordId::new(b"", "one more")),
        Err(StoreError::Full { .. })
    ));
    tokio::time::advance(Duration::from_secs(31)).await;
    // The claim finds the store full of due records: it collects them all (over several holds
    // of the lock), then fits.
    assert!(matches!(
        claim_id(&store, &RecordId::new(b"", "one more")),
        Ok(Claim::Claimed(_))
    ));
    assert_eq!(store.used_bytes(), ENTRY_OVERHEAD);
    assert_eq!(store.len(), 1);
}

fn claim_id(store: &MemoryStore, id: &RecordId) -> Result<Claim, StoreError> {
    store.claim_now(
        id,
        &Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(30),
    )
}

/// A record an operator forgets gives its bytes back, to the store and to its scope: its tenant
/// can store as much again.
#[tokio::test(start_paused = true)]
async fn a_forgotten_record_gives_its_bytes_back() {
    let done = completed(1000);
    let one_record = ENTRY_OVERHEAD + super::scopes::SCOPE_OVERHEAD + done.encode().unwrap().len();
    let store = MemoryStore::with_capacity(1 << 20).with_scope_limit(one_record);
    for key in ["k1", "k2", "k3"] {
        let id = RecordId::new(b"acct", key);
        let Ok(Claim::Claimed(token)) = claim_id(&store, &id) else {
            panic!("{key}: the scope's room was given back")
        };
        assert!(
            store
                .complete_now(&id, &token, &done, Duration::from_secs(60))
                .unwrap()
        );
        assert_eq!(store.used_bytes(), one_record);
        let forgotten = store.forget(&id, false).await;
        assert!(
            matches!(forgotten, Ok(ForgetOutcome::Forgotten(_))),
            "{forgotten:?}"
        );
        assert_eq!(store.used_bytes(), 0, "{key}: forgetting frees its bytes");
    }
}

/// A claim refused because the whole store is full costs its scope nothing: once the store has
/// room again, that tenant claims within its share as before.
#[tokio::test(start_paused = true)]
async fn a_claim_the_full_store_refuses_costs_its_scope_nothing() {
    let record = ENTRY_OVERHEAD + super::scopes::SCOPE_OVERHEAD;
    let store = MemoryStore::with_capacity(2 * record).with_scope_limit(2 * record);
    for key in ["a1", "a2"] {
        assert!(matches!(
            claim_id(&store, &RecordId::new(b"a", key)),
            Ok(Claim::Claimed(_))
        ));
    }
    for key in ["b1", "b2", "b3"] {
        let refused = claim_id(&store, &RecordId::new(b"b", key));
        assert!(
            matches!(refused, Err(StoreError::Full { .. })),
            "{refused:?}"
        );
    }
    tokio::time::advance(Duration::from_secs(31)).await;
    for key in ["b1", "b2"] {
        let claimed = claim_id(&store, &RecordId::new(b"b", key));
        assert!(
            matches!(claimed, Ok(Claim::Claimed(_))),
            "{key}: {claimed:?}"
        );
    }
}

/// Expiry items queued in one lane come due in order, each no earlier than its record: a record
/// claimed after another with the same lease is collected once its own lease has run out.
#[tokio::test(start_paused = true)]
async fn a_later_record_in_a_lane_is_collected_when_it_expires() {
    let store = MemoryStore::new();
    // In one shard, so that one lane holds both items.
    let ids = ids_in_one_shard(2);
    assert!(matches!(claim_id(&store, &ids[0]), Ok(Claim::Claimed(_))));
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(matches!(claim_id(&store, &ids[1]), Ok(Claim::Claimed(_))));
    tokio::time::advance(Duration::from_secs(21)).await;
    assert_eq!(
        store.len(),
        1,
        "the first record's lease ran out; the second's has not"
    );
    assert!(
        matches!(claim_id(&store, &ids[1]), Ok(Claim::Existing(_))),
        "the second is live"
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(
        (store.len(), store.used_bytes()),
        (0, 0),
        "both leases ran out: both records are collected and their bytes freed"
    );
}
