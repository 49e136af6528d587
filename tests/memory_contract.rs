//! The store contract on [`MemoryStore`], on paused tokio time, plus what only the memory store
//! does (it refuses new claims when full).

mod support;

use std::future::Future;
use std::time::Duration;

use support::contract::{Counting, Handler, Harness, created, post, send, service};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome, ProblemKind};

/// The memory store on paused tokio time: a 30 s lease and a 24 h dedup window.
#[derive(Debug)]
struct MemoryHarness {
    store: MemoryStore,
}

impl MemoryHarness {
    fn new() -> Self {
        Self {
            store: MemoryStore::new(),
        }
    }
}

impl Harness for MemoryHarness {
    type Store = MemoryStore;

    fn store(&self) -> MemoryStore {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }

    /// A sleep on paused time: instant, and (unlike one `tokio::time::advance` step) it lets every
    /// timer in between fire in order, so lease renewals happen when they are due.
    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(d)
    }
}

store_contract!(MemoryHarness::new(), start_paused = true);

/// A full memory store refuses new claims with 503 rather than evict a live record: earlier keys
/// still replay. Once records expire, new claims work again.
#[tokio::test(start_paused = true)]
async fn full_memory_store_refuses_new_claims_with_503() {
    let store = Counting::new(MemoryStore::with_capacity(2_000));
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let window = Duration::from_secs(60);
    let svc = service(
        IdempotencyLayer::new(store.clone()).dedup_window(window),
        handler.clone(),
    );

    let mut stored = Vec::new();
    let full = loop {
        let key = format!("key-{}", stored.len());
        let reply = send(&svc, post(&key, "x")).await;
        if reply.outcome != Some(Outcome::Executed) {
            break reply;
        }
        stored.push((key, reply));
        assert!(stored.len() < 100, "a 2 000-byte store never filled up");
    };
    full.assert_problem(
        ProblemKind::StoreUnavailable,
        http::StatusCode::SERVICE_UNAVAILABLE,
    );
    assert_eq!(full.outcome, Some(Outcome::StoreUnavailable));
    assert!(stored.len() >= 2, "only {} records fitted", stored.len());
    assert_eq!(
        handler.calls(),
        stored.len(),
        "the refused request did not run"
    );
    assert_eq!(store.inner().len(), stored.len(), "nothing was evicted");
    for (key, first) in &stored {
        let replay = send(&svc, post(key, "x")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{key}");
        assert_eq!(replay.body, first.body);
    }

    tokio::time::sleep(window + Duration::from_secs(1)).await;
    let reply = send(&svc, post("after-expiry", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed));
}
