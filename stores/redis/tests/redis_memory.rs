//! Redis's memory limit: a Redis that may evict records is refused at start-up (on one server,
//! and on any master of a cluster) unless the application opts in, and a Redis full under
//! `noeviction` is told apart from one that cannot be reached.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower::ServiceExt;
use tower_idempotency::record::{Fingerprint, RecordId};
use tower_idempotency::store::{Store, StoreError};
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_redis::{RedisStore, RedisStoreError};
use tower_idempotency_test::assert_a_quota_keeps_a_flood_off_the_others;

/// Every policy Redis 7 knows that removes keys to make room: `volatile-*` included, since every
/// record has a TTL.
const EVICTING: [&str; 7] = [
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
];

fn set_policy(server: &RedisServer, policy: &str) {
    let reply = server.command(&["CONFIG", "SET", "maxmemory-policy", policy]);
    assert!(
        reply.is_ok(),
        "CONFIG SET maxmemory-policy {policy}: {reply:?}"
    );
}

#[tokio::test]
async fn check_refuses_every_evicting_policy_naming_it_and_the_fix() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a store");
    store
        .check()
        .await
        .expect("noeviction, Redis's default, passes");
    for policy in EVICTING {
        set_policy(&server, policy);
        let err = store.check().await.expect_err(policy);
        assert!(
            matches!(&err, RedisStoreError::Evicting { policy: named, .. } if named == policy),
            "{policy}: {err:?}"
        );
        let message = err.to_string();
        assert!(message.contains(policy), "{message}");
        assert!(
            message.contains("CONFIG SET maxmemory-policy noeviction"),
            "{message}"
        );
        assert!(message.contains("allow_eviction"), "{message}");
    }
    set_policy(&server, "noeviction");
    store.check().await.expect("noeviction again");
}

#[tokio::test]
async fn allow_eviction_accepts_an_evicting_redis() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url())
        .expect("a store")
        .allow_eviction();
    for policy in EVICTING {
        set_policy(&server, policy);
        store.check().await.expect(policy);
    }
}

/// One master of six nodes set to evict: `check` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_cluster_with_one_evicting_master() {
    let cluster = RedisCluster::start();
    let store = RedisStore::cluster(cluster.urls()).expect("a store");
    store.check().await.expect("every master under noeviction");
    let master = cluster.masters()[1];
    set_policy(cluster.node(master), "allkeys-lru");
    let err = store.check().await.expect_err("one master evicts");
    let port = cluster.node(master).port().to_string();
    match &err {
        RedisStoreError::Evicting { policy, node } => {
            assert_eq!(policy, "allkeys-lru");
            assert!(node.ends_with(&port), "the evicting master, {node}");
        }
        other => panic!("{other:?}"),
    }
    let opted_in = RedisStore::cluster(cluster.urls())
        .expect("a store")
        .allow_eviction();
    opted_in.check().await.expect("opted in");
}

/// Redis at `maxmemory` under `noeviction` refuses writes (`OOM command not allowed`): a claim
/// is `StoreError::Full` (the layer's 503, "no room", with `Retry-After`), not `Unavailable`, which
/// is what an unreachable server is; and once memory frees, claims go through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_is_full_not_unavailable() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a store");
    store.check().await.expect("noeviction");
    // Fill it: some data, then a limit below what it holds.
    let filler = "x".repeat(64 * 1024);
    for n in 0..16 {
        assert!(
            server
                .command(&["SET", &format!("filler:{n}"), &filler])
                .is_ok()
        );
    }
    assert!(
        server
            .command(&["CONFIG", "SET", "maxmemory", "1mb"])
            .is_ok()
    );

    let fingerprint = Fingerprint::from_bytes([5; 32]);
    let id = RecordId::new(b"", "full");
    let claim = store
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await;
    assert!(
        matches!(claim, Err(StoreError::Full { retry_after: None })),
        "{claim:?}"
    );

    // Through the layer: a 503 saying there is no room, with Retry-After; nothing ran.
    let app = Router::new()
        .route("/charges", post(|| async { StatusCode::CREATED }))
        .layer(IdempotencyLayer::new(store.clone()));
    let request = Request::post("/charges")
        .header("idempotency-key", "full")
        .body(Body::from("{}"))
        .expect("a request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response.extensions().get::<Outcome>(),
        Some(&Outcome::StoreUnavailable)
    );
    assert!(response.headers().contains_key("retry-after"));
    let body = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("no room"), "{body}");

    // Room again: the claim goes through.
    assert!(server.command(&["FLUSHALL"]).is_ok());
    assert!(server.command(&["CONFIG", "SET", "maxmemory", "0"]).is_ok());
    let claim = store
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await;
    assert!(claim.is_ok(), "{claim:?}");

    // An unreachable server is another error.
    drop(server);
    let claim = store
        .claim(
            &RecordId::new(b"", "gone"),
            &fingerprint,
            Duration::from_secs(30),
        )
        .await;
    assert!(
        matches!(
            claim,
            Err(StoreError::Unavailable(_) | StoreError::Timeout(_))
        ),
        "{claim:?}"
    );
}

/// One tenant writing 60 KB records as fast as it can into a Redis at `maxmemory`: without a quota
/// it fills Redis and every other tenant gets `503`; with a `ScopeQuota` it gets `429` long before,
/// and the other tenants' requests run (PROTOCOL.md §3.4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_keeps_one_tenant_from_filling_redis_for_the_others() {
    let server = RedisServer::start();
    assert!(
        server
            .command(&["CONFIG", "SET", "maxmemory", "8mb"])
            .is_ok()
    );
    let store = RedisStore::from_url(&server.url()).expect("a store");
    store.check().await.expect("noeviction");
    let fresh = || {
        server.flushall();
        store.clone()
    };
    assert_a_quota_keeps_a_flood_off_the_others(fresh, 2 << 20).await;
}
