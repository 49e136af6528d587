//! The memory store's own cases: its byte budget and its expiry lanes.

use super::budget::ENTRY_OVERHEAD;
use super::expiry::LANES;
use super::*;
use crate::record::StoredResponse;

fn completed(body: usize) -> Completed {
    Completed {
        fingerprint: Fingerprint::from_bytes([1; 32]),
        response: Some(Arc::new(StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::from(vec![b'x'; body]),
        })),
    }
}

fn claim(store: &MemoryStore, n: u32) -> Result<Claim, StoreError> {
    store.claim_now(
        &RecordId::new(b"", &n.to_string()),
        &Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(30),
    )
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
    assert_eq!(store.len(), 1);
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
    assert_eq!(
        store.used_bytes(),
        ENTRY_OVERHEAD + done.response.as_ref().unwrap().size()
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(store.len(), 0);
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

fn claim_id(store: &MemoryStore, id: &RecordId) -> Result<Claim, StoreError> {
    store.claim_now(
        id,
        &Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(30),
    )
}
