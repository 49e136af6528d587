//! The store contract suite on `RedisStore` over a Redis Cluster of three masters and three
//! replicas.
//!
//! One cluster serves every case of this binary (starting six nodes per case would take
//! minutes); each case writes under a key prefix of its own, so no case sees another's records.
//! Record ids are hashes, so each case's keys spread over all three masters.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};

use support::RedisHarness;
use test_servers::redis_cluster::RedisCluster;
use tower_idempotency_redis::RedisStore;

fn harness() -> RedisHarness<&'static RedisCluster> {
    static CASE: AtomicU64 = AtomicU64::new(0);
    let cluster = RedisCluster::shared();
    let prefix = format!("case{}:", CASE.fetch_add(1, Ordering::Relaxed));
    let store = RedisStore::cluster(cluster.urls())
        .expect("a store")
        .with_prefix(prefix);
    RedisHarness::new(cluster, store)
}

tower_idempotency_test::store_contract!(harness(), flavor = "multi_thread");
tower_idempotency_test::layer_contract!(harness(), flavor = "multi_thread");
