//! The store contract suite on `RedisStore` over a Redis Cluster of three masters and three
//! replicas.
//!
//! One cluster serves every case of this binary (starting six nodes per case would take
//! minutes); each case writes under a key prefix of its own, so no case sees another's records.
//! Record ids are hashes, so each case's keys spread over all three masters.

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::contract::Harness;
use support::redis_cluster::RedisCluster;
use tower_idempotency::RedisStore;

#[derive(Debug)]
struct ClusterHarness {
    cluster: &'static RedisCluster,
    store: RedisStore,
}

impl ClusterHarness {
    fn start() -> Self {
        static CASE: AtomicU64 = AtomicU64::new(0);
        let cluster = RedisCluster::shared();
        let prefix = format!("case{}:", CASE.fetch_add(1, Ordering::Relaxed));
        let store = RedisStore::cluster(cluster.urls())
            .expect("a store")
            .with_prefix(prefix);
        Self { cluster, store }
    }
}

impl Drop for ClusterHarness {
    /// Whatever the case did, no key may be left without a TTL, on any master.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert_eq!(
                self.cluster.keys_without_ttl(),
                Vec::<String>::new(),
                "keys without a TTL"
            );
        }
    }
}

impl Harness for ClusterHarness {
    type Store = RedisStore;

    fn store(&self) -> RedisStore {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(3)
    }

    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(d)
    }
}

store_contract!(ClusterHarness::start(), flavor = "multi_thread");
