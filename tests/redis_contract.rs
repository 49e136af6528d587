//! The store contract suite on `RedisStore`, each case on a `redis-server` of its own.
//!
//! Redis keeps its own clock, so these cases run on real time with a short lease and window
//! (the memory suite runs the same cases on paused time).
//!
//! The suite is the exported one (`tower_idempotency::testing`, feature `test-util`);
//! `support::contract` names it beside the `redis-server` fixture, as a store test of this
//! repository does.

mod support;

use std::future::Future;
use std::time::Duration;

use support::contract::Harness;
use support::redis_server::RedisServer;
use tower_idempotency::RedisStore;

#[derive(Debug)]
struct RedisHarness {
    server: RedisServer,
    store: RedisStore,
}

impl RedisHarness {
    fn start() -> Self {
        let server = RedisServer::start();
        let store = RedisStore::from_url(&server.url()).expect("a store");
        Self { server, store }
    }
}

impl Drop for RedisHarness {
    /// Whatever the case did, no key may be left without a TTL.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert_eq!(
                self.server.keys_without_ttl(),
                Vec::<String>::new(),
                "keys without a TTL"
            );
        }
    }
}

impl Harness for RedisHarness {
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

store_contract!(RedisHarness::start(), flavor = "multi_thread");
