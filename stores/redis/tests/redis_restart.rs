//! `RedisStore` across a Redis restart (PROTOCOL.md §10.6): a connection the store keeps that
//! died while the store was idle costs no request.
//!
//! Each test starts its own `redis-server` (or cluster), lets every connection the store keeps
//! carry requests, restarts Redis while the store is idle, and then sends the next requests, one
//! after another and all at once: every claim and every completion must succeed.

use std::time::{Duration, Instant};

use deadpool_redis::redis::AsyncConnectionConfig;
use deadpool_redis::{Manager, Pool, Runtime};
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency::record::{Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency_redis::RedisStore;

/// The pool's size: with the replication wait, the store keeps one connection per lane, up to
/// the pool's size.
const POOL: usize = 4;

/// How long the store is left idle across the restart: longer than it goes without checking a
/// connection it keeps (100 ms, §10.6), as any instance idle for a moment is.
const IDLE: Duration = Duration::from_millis(200);

/// Each call's bound: generous, since a dead connection fails a call at once, and the cluster's
/// start-up may hold the machine's cores for a moment.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A pool of [`POOL`] connections, made as `RedisStore::from_url` makes its own.
fn pool(server: &RedisServer) -> Pool {
    let config = AsyncConnectionConfig::new().set_response_timeout(None);
    let manager = Manager::new_with_config(server.url(), config).expect("a valid url");
    Pool::builder(manager)
        .max_size(POOL)
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool")
}

/// What a request does to the store: the claim of a new key, then its completion.
async fn claim_and_complete(store: &RedisStore, key: &str) -> Result<(), String> {
    let id = RecordId::new(b"", key);
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let token = match store
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await
    {
        Ok(Claim::Claimed(token)) => token,
        other => return Err(format!("{key}: the claim: {other:?}")),
    };
    let completed = Completed::tombstone(fingerprint);
    match store
        .complete(&id, &token, &completed, Duration::from_secs(60))
        .await
    {
        Ok(true) => Ok(()),
        other => Err(format!("{key}: the completion: {other:?}")),
    }
}

/// `count` requests one after another; the failures.
async fn one_by_one(store: &RedisStore, name: &str, count: usize) -> Vec<String> {
    let mut failures = Vec::new();
    for n in 0..count {
        if let Err(err) = claim_and_complete(store, &format!("{name}-one-by-one-{n}")).await {
            failures.push(err);
        }
    }
    failures
}

/// `count` requests at once; the failures.
async fn at_once(store: &RedisStore, name: &str, count: usize) -> Vec<String> {
    let requests: Vec<_> = (0..count)
        .map(|n| {
            let store = store.clone();
            let key = format!("{name}-at-once-{n}");
            tokio::spawn(async move { claim_and_complete(&store, &key).await })
        })
        .collect();
    let mut failures = Vec::new();
    for request in requests {
        if let Err(err) = request.await.expect("a request") {
            failures.push(err);
        }
    }
    failures
}

/// Requests on every connection `store` keeps; then twice a restart while it is idle, followed
/// by `count` requests one after another the first time, and `count` at once the second.
async fn the_next_requests_after_a_restart_succeed(
    store: &RedisStore,
    mut restart: impl FnMut(),
    count: usize,
) {
    let mut failures = one_by_one(store, "before", count).await;
    failures.extend(at_once(store, "before", count).await);
    assert_eq!(failures, Vec::<String>::new(), "before the restarts");
    let mut restart_while_idle = async || {
        let idle = Instant::now();
        restart();
        tokio::time::sleep(IDLE.saturating_sub(idle.elapsed())).await;
    };
    restart_while_idle().await;
    let mut failures = one_by_one(store, "after", count).await;
    restart_while_idle().await;
    failures.extend(at_once(store, "after", count).await);
    assert_eq!(
        failures,
        Vec::<String>::new(),
        "§10.6: no request fails because a connection died while the store was idle"
    );
}

/// One connection kept: a request alone goes out at once on it, requests at once in one pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_idle_fails_no_request() {
    let mut server = RedisServer::start();
    let store = RedisStore::new(pool(&server)).with_timeout(TIMEOUT);
    the_next_requests_after_a_restart_succeed(&store, || server.restart(), POOL).await;
}

/// With the replication wait, each command goes on the next of the pool's connections in turn
/// (`WAIT 0` on a server without replicas answers at once): every one of them died in the
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_idle_fails_no_request_on_any_pooled_connection() {
    let mut server = RedisServer::start();
    let store = RedisStore::new(pool(&server))
        .with_timeout(TIMEOUT)
        .with_replication_wait(0, Duration::from_millis(100));
    let pool = store.pool().expect("one server").clone();
    assert_eq!(
        one_by_one(&store, "warm-up", POOL).await,
        Vec::<String>::new()
    );
    assert_eq!(
        pool.status().size,
        POOL,
        "the store keeps every connection of the pool"
    );
    the_next_requests_after_a_restart_succeed(&store, || server.restart(), POOL).await;
}

/// On a cluster, redis-rs's connection reconnects to a node that closed its connections, and
/// sends again what was on its way (the claim then finds its own record, §10.6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_restarted_while_idle_fails_no_request() {
    let mut cluster = RedisCluster::start();
    let store = RedisStore::cluster(cluster.urls())
        .expect("a cluster store")
        .with_timeout(TIMEOUT);
    // Enough keys that each master holds some.
    let count = 12;
    the_next_requests_after_a_restart_succeed(
        &store,
        || {
            for master in cluster.masters() {
                cluster.node_mut(master).restart();
            }
            cluster.wait_settled();
        },
        count,
    )
    .await;
}

/// The check costs nothing on a connection in use: requests one after another, each well within
/// 100 ms of the one before, carry no `PING` (a few may, if the machine stalls the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_in_use_is_not_checked() {
    let server = RedisServer::start();
    let store = RedisStore::new(pool(&server)).with_timeout(TIMEOUT);
    assert_eq!(one_by_one(&store, "warm-up", 1).await, Vec::<String>::new());
    server.config_resetstat();
    let requests = 50;
    assert_eq!(
        one_by_one(&store, "busy", requests).await,
        Vec::<String>::new()
    );
    let pings = server.info_commandstats().get("ping").copied().unwrap_or(0);
    assert!(
        pings < requests as u64 / 5,
        "{pings} PINGs for {requests} requests"
    );
}
