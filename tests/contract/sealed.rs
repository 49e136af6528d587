//! The whole store contract on a `SealedStore` (over `MemoryStore`, on paused time): sealing must
//! keep every rule a store keeps, not only the sealed-record cases (PROTOCOL.md §10.7, §15).

use std::time::Duration;

use tower_idempotency::MemoryStore;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency_test::Harness;

/// A sealed memory store on paused tokio time: a 30 s lease and a 24 h dedup window.
#[derive(Debug)]
struct SealedHarness {
    store: SealedStore<MemoryStore>,
}

impl SealedHarness {
    fn new() -> Self {
        let key = SealKey::new("2026-12", [42; 32]).expect("a key");
        let keys = SealKeys::new([key]).expect("keys");
        Self {
            store: SealedStore::new(MemoryStore::new(), keys),
        }
    }
}

impl Harness for SealedHarness {
    type Store = SealedStore<MemoryStore>;

    fn store(&self) -> SealedStore<MemoryStore> {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }
}

tower_idempotency_test::store_contract!(SealedHarness::new(), start_paused = true);
tower_idempotency_test::layer_contract!(sealed: SealedHarness::new(), start_paused = true);
