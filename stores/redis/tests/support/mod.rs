#![allow(dead_code)]
//! The contract suite's harness for `RedisStore`, on one `redis-server` or on a cluster.
//!
//! Redis keeps its own clock, so the cases run on real time with a short lease and window (the
//! memory suite runs the same cases on paused time). After each case, no key may be left without
//! a TTL.

use std::fmt;

use std::time::Duration;

use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency_redis::RedisStore;
use tower_idempotency_test::Harness;

/// Where a harness's keys live, to look for keys without a TTL.
pub(crate) trait Keys: fmt::Debug + Send + Sync + 'static {
    /// Every key without a TTL.
    fn keys_without_ttl(&self) -> Vec<String>;
}

impl Keys for RedisServer {
    fn keys_without_ttl(&self) -> Vec<String> {
        RedisServer::keys_without_ttl(self)
    }
}

impl Keys for &'static RedisCluster {
    fn keys_without_ttl(&self) -> Vec<String> {
        RedisCluster::keys_without_ttl(self)
    }
}

/// A store and where its keys live.
#[derive(Debug)]
pub(crate) struct RedisHarness<K: Keys> {
    keys: K,
    store: RedisStore,
}

impl<K: Keys> RedisHarness<K> {
    /// A harness on `store`, whose keys live in `keys`.
    pub(crate) fn new(keys: K, store: RedisStore) -> Self {
        Self { keys, store }
    }
}

impl<K: Keys> Drop for RedisHarness<K> {
    /// Whatever the case did, no key may be left without a TTL.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert_eq!(
                self.keys.keys_without_ttl(),
                Vec::<String>::new(),
                "keys without a TTL"
            );
        }
    }
}

impl<K: Keys> Harness for RedisHarness<K> {
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
}

/// The Redis key `RedisStore` keeps `id` under with `prefix`: `<prefix>{<record id>}`.
pub(crate) fn redis_key(prefix: &str, id: &tower_idempotency::record::RecordId) -> String {
    format!("{prefix}{{{id}}}")
}
