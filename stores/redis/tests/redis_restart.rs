//! `RedisStore` across a Redis restart (PROTOCOL.md §10.6): a connection the store keeps that
//! died while the store was idle costs no request.
//!
//! Each test starts its own `redis-server` (or cluster), lets every connection the store keeps
//! carry requests, restarts Redis while the store is idle, and then sends the next requests, one
//! after another and all at once: every claim and every completion must succeed. And a claim
//! that found its script lost is sent again beyond the reach of the first sending's release.

use std::time::{Duration, Instant};

use deadpool_redis::redis::AsyncConnectionConfig;
use deadpool_redis::{Manager, Pool, Runtime};
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::{RedisServer, RespValue};
use tower_idempotency::record::{ClaimToken, Completed, Fingerprint, RecordId};
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

/// A claim that Redis refused for want of its script (lost in a restart, `SCRIPT FLUSH`) is sent
/// again under a token of its own (PROTOCOL.md §10.6, §5.3). The first sending is released
/// behind its error, fenced by its token, by a task of its own: that release may reach Redis
/// after the claim sent again (on another connection, or a busy worker), and must not free it
/// while its handler runs, or a retry runs the handler a second time. Here the release, as Redis
/// logged it, is run again once the claim stands: the late arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_behind_a_claim_that_found_no_script_cannot_free_it_sent_again() {
    let server = RedisServer::start();
    let store = RedisStore::new(pool(&server)).with_timeout(TIMEOUT);
    assert_eq!(one_by_one(&store, "warm-up", 1).await, Vec::<String>::new());
    assert!(server.command(&["SCRIPT", "FLUSH"]).is_ok());
    // Every command from here is logged with its arguments (binary-safe, the token whole).
    assert!(
        server
            .command(&["CONFIG", "SET", "slowlog-log-slower-than", "0"])
            .is_ok()
    );
    assert!(server.command(&["SLOWLOG", "RESET"]).is_ok());

    let id = RecordId::new(b"", "no-script");
    let key = format!("idempotency:{{{id}}}");
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let lease = Duration::from_secs(30);
    let Ok(Claim::Claimed(token)) = store.claim(&id, &fingerprint, lease).await else {
        panic!("§10.6: the claim is sent again once its script is loaded");
    };
    let first = released_behind(&server, &key).await;
    assert!(
        !store.release(&id, &first).await.expect("release"),
        "§5.3: the first sending's release, landing late, fences nothing of the claim sent again"
    );
    assert!(
        store.renew(&id, &token, lease).await.expect("renew"),
        "the claim sent again stands"
    );
}

/// The token of the release the store sent behind a claim of `key` (an `EVAL` of the release
/// script: the store's only `EVAL`), from Redis's slow log, within 2 s.
async fn released_behind(server: &RedisServer, key: &str) -> ClaimToken {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let RespValue::Array(entries) = server.command(&["SLOWLOG", "GET", "-1"]) else {
            panic!("SLOWLOG GET answers an array");
        };
        // Each entry: id, time, duration, the arguments, the client's address and name.
        for entry in &entries {
            let RespValue::Array(fields) = entry else {
                continue;
            };
            let Some(RespValue::Array(args)) = fields.get(3) else {
                continue;
            };
            let args: Vec<&[u8]> = args.iter().filter_map(RespValue::as_bytes).collect();
            if let [b"EVAL", _, b"1", k, token] = args.as_slice()
                && *k == key.as_bytes()
                && let Ok(token) = <[u8; 16]>::try_from(*token)
            {
                return ClaimToken::from_bytes(token);
            }
        }
        assert!(
            Instant::now() < deadline,
            "§10.6: the sending Redis refused is released behind it"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
