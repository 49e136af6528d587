//! The layer on a Redis Cluster of three masters and three replicas, shared by this binary's
//! tests (each under a key prefix of its own): one execution per key however the requests are
//! spread over instances, and every master used.

use std::collections::BTreeSet;
use std::time::Duration;

use http::StatusCode;
use test_servers::redis_cluster::RedisCluster;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency_redis::RedisStore;
use tower_idempotency_test::{Handler, created, expect_one_execution, post, service, spawn_send};

fn store(prefix: &str) -> RedisStore {
    RedisStore::cluster(RedisCluster::shared().urls())
        .expect("a store")
        .with_prefix(prefix)
}

/// 200 concurrent requests with one key, alternating between two instances (two layers, each
/// with its own cluster connection): the handler runs once, every other request gets a 409 or
/// the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_run_a_key_once_under_200_concurrent_requests() {
    let handler = Handler::new(|call| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(created(format!("call {}", call.n)))
    });
    let instances = [
        service(IdempotencyLayer::new(store("once:")), handler.clone()),
        service(IdempotencyLayer::new(store("once:")), handler.clone()),
    ];
    let tasks: Vec<_> = (0..200)
        .map(|i| spawn_send(&instances[i % 2], post("one-key", "amount=2500")))
        .collect();
    let (in_flight, replayed) = expect_one_execution(tasks, "call 1").await;
    assert_eq!(in_flight + replayed, 199);
    assert_eq!(handler.calls(), 1);
}

/// Distinct keys land on every master, each runs once, and each replays from its own master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_spread_over_every_master_and_replay_from_it() {
    let cluster = RedisCluster::shared();
    let handler = Handler::new(|call| async move { Ok(created(call.body)) });
    let svc = service(IdempotencyLayer::new(store("spread:")), handler.clone());
    let keys: Vec<String> = (0..60).map(|i| format!("key-{i}")).collect();
    for round in ["first", "retry"] {
        let tasks: Vec<_> = keys
            .iter()
            .map(|key| spawn_send(&svc, post(key, format!("body of {key}"))))
            .collect();
        for (key, task) in keys.iter().zip(tasks) {
            let reply = task.await.expect("task");
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{round} {key}: {reply:?}"
            );
            assert_eq!(reply.text(), format!("body of {key}"));
            assert_eq!(reply.is_replay(), round == "retry", "{round} {key}");
        }
    }
    assert_eq!(handler.calls(), keys.len());
    let masters: BTreeSet<usize> = cluster
        .keys()
        .iter()
        .filter(|key| key.starts_with("spread:"))
        .map(|key| cluster.master_of_key(key))
        .collect();
    assert_eq!(masters.len(), 3, "the records live on every master");
}

/// `check` reaches every node and accepts Redis 7; an unreachable cluster fails it, in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_accepts_the_cluster_and_refuses_a_dead_one() {
    store("check:")
        .check()
        .await
        .expect("the cluster passes its check");
    let dead = RedisStore::cluster(["redis://127.0.0.1:1"]).expect("a valid URL");
    let started = std::time::Instant::now();
    assert!(dead.check().await.is_err());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}
