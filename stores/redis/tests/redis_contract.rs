//! The store contract suite on `RedisStore`, each case on a `redis-server` of its own.
//!
//! Redis keeps its own clock, so these cases run on real time with a short lease and window
//! (the memory suite runs the same cases on paused time).
//!
//! The suites are the exported ones (crate `tower-idempotency-test`), run by a `store_contract!`
//! and a `layer_contract!` line over `support::RedisHarness`, as a store written outside this
//! repository runs them.

mod support;

use support::RedisHarness;
use test_servers::redis_server::RedisServer;
use tower_idempotency_redis::RedisStore;

fn harness() -> RedisHarness<RedisServer> {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a store");
    RedisHarness::new(server, store)
}

tower_idempotency_test::store_contract!(harness(), flavor = "multi_thread");
tower_idempotency_test::layer_contract!(harness(), flavor = "multi_thread");

/// The same cases with every completed record compressed (where that makes it smaller).
mod compressed {
    use super::*;

    fn harness() -> RedisHarness<RedisServer> {
        let server = RedisServer::start();
        let store = RedisStore::from_url(&server.url())
            .expect("a store")
            .with_compression(0);
        RedisHarness::new(server, store)
    }

    tower_idempotency_test::store_contract!(harness(), flavor = "multi_thread");
    tower_idempotency_test::layer_contract!(harness(), flavor = "multi_thread");
}
