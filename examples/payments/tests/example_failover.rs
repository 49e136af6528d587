//! The payments example on a Redis Cluster whose master freezes (SIGSTOP: a hung machine or a
//! partition, its connections open and silent) until its replica is elected, and stays frozen.
//! Every Redis path of a charge follows the failover within 10 s of the promoted replica's
//! `cluster_state:ok`: the idempotency record, the ledger, the provider's keys, the event stream,
//! the ledger consumer's blocking reads and the balance. (Waiting for the frozen master's
//! connections to fail would take the kernel's TCP timeouts: minutes.)
//!
//! The keys the test writes are chosen so that the frozen master holds the charge's record and
//! the account's balance besides the hash tag it is frozen for (`{ledger}`, or `{provider}` with
//! `{events}`).

#![cfg(unix)]

use example_payments as server;

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use test_servers::redis_cluster::RedisCluster;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{BoxStore, IdempotencyLayer, RecordId};
use tower_idempotency_redis::RedisStore;

use server::consumer::{self, LedgerConsumer, deduplicator};
use server::provider::{self, KeyTable};
use server::queue::{ConsumerConfig, Queue, RedisQueue};
use server::{AppState, Balances, Ledger, Provider, app};
use support::api::{Call, Reply, account, create_charge, visa};

/// How long a master may not answer before its replica is elected: short, so that the failover
/// takes about a second.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long after the promoted replica's `cluster_state:ok` a charge and its balance may take.
const FOLLOWED_WITHIN: Duration = Duration::from_secs(10);
/// How often a client sends its request again after a `409`, a `503` or a `504`.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// The idempotency records' prefix: the store's default.
const RECORDS_PREFIX: &str = "idempotency:";

/// The example on `cluster`, as `REDIS_CLUSTER_URLS` sets it up: the records, the charges, the
/// provider's keys, the events, the balances and the consumer's records in the cluster, and the
/// ledger consumer and the outbox relay running until `stop`.
async fn app_on(cluster: &RedisCluster, stop: &CancellationToken) -> Router {
    let records = RedisStore::cluster(cluster.urls()).expect("valid URLs");
    records.check().await.expect("the cluster answers");
    let conn = records.shared_connection();
    let queue = RedisQueue::connect(conn.clone(), server::STREAM, consumer::SCOPE)
        .await
        .expect("the stream's group");
    let keys = KeyTable::redis(conn.clone(), server::PROVIDER_PREFIX, provider::WINDOW);
    let state = AppState::new(Duration::ZERO)
        .with_events(
            Queue::Redis(queue),
            Balances::redis(conn.clone(), server::BALANCES_PREFIX),
        )
        .with_provider(Provider::with_keys(Duration::ZERO, keys))
        .with_ledger(Ledger::redis(conn));
    let dedup = records.clone().with_prefix(server::CONSUMER_PREFIX);
    let config = ConsumerConfig::default()
        .min_idle(Duration::from_millis(500))
        .block(Duration::from_millis(100));
    let reads = state
        .events
        .queue()
        .consumer("ledger-failover", config)
        .await
        .expect("a consumer of the stream");
    let consumer = LedgerConsumer::new(
        reads,
        state.balances.clone(),
        deduplicator(dedup, config.min_idle),
    );
    tokio::spawn(consumer.run(stop.clone()));
    // Events the stream refused wait in the outbox, which the relay sends on.
    tokio::spawn(state.events.clone().relay(stop.clone()));
    app(state, IdempotencyLayer::new(BoxStore::new(records)))
}

/// `count` of the names `make(0)`, `make(1)`, ... whose Redis key (`redis_key` of the name) the
/// master `master` holds.
fn on_master(
    cluster: &RedisCluster,
    master: usize,
    count: usize,
    make: impl Fn(usize) -> String,
    redis_key: impl Fn(&str) -> String,
) -> Vec<String> {
    let found: Vec<String> = (0..count * 50)
        .map(make)
        .filter(|name| cluster.master_of_key(&redis_key(name)) == master)
        .take(count)
        .collect();
    assert_eq!(found.len(), count, "names on master {master}");
    found
}

/// The Redis key of the idempotency record of `key`, sent with `api_key`.
fn record_key(api_key: &str, key: &str) -> String {
    let id = RecordId::new(account(api_key).as_bytes(), key);
    format!("{RECORDS_PREFIX}{{{id}}}")
}

/// The Redis key of the euro balance of the account of `api_key`.
fn balance_key(api_key: &str) -> String {
    format!(
        "{}{{{}}}:available",
        server::BALANCES_PREFIX,
        account(api_key)
    )
}

/// The account's euro balance, as `GET /v1/balance` shows it; `None` when it fails.
async fn balance(router: &Router, api_key: &str) -> Option<i64> {
    let reply = Call::get(router, "/v1/balance").auth(api_key).send().await;
    (reply.status == StatusCode::OK).then(|| {
        reply.json["available"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|available| available["currency"] == "eur")
            .filter_map(|available| available["amount"].as_i64())
            .sum()
    })
}

/// Whether a client sends its request again after `reply`.
fn retries_after(reply: &Reply) -> bool {
    matches!(
        reply.status,
        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
    )
}

/// Freezes the master that holds `frozen_key`'s slot (and the slots of `with`, which the test
/// checks) until its replica is elected, and leaves it frozen: a new charge, whose record and
/// balance that master held too, is created and credited within [`FOLLOWED_WITHIN`] of the
/// promoted replica's `cluster_state:ok`.
async fn a_frozen_master_is_followed(frozen_key: &str, with: &[&str]) {
    let cluster = Arc::new(RedisCluster::start_with_node_timeout(NODE_TIMEOUT));
    let master = cluster.master_of_key(frozen_key);
    for key in with {
        assert_eq!(
            cluster.master_of_key(key),
            master,
            "{key} and {frozen_key} are on one master with redis-cli's slot layout"
        );
    }
    let replica = cluster.replica_of(master);
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let router = app_on(&cluster, &stop).await;

    // The account whose balance, and the keys whose records, the frozen master holds.
    let api_key = on_master(
        &cluster,
        master,
        1,
        |n| format!("sk_test_frozen_{n}"),
        balance_key,
    )
    .remove(0);
    let keys = on_master(
        &cluster,
        master,
        2,
        |n| format!("frozen-{n}"),
        |key| record_key(&api_key, key),
    );
    // Charges sent while the master is frozen, on another account: their fate is not asserted.
    let during_key = "sk_test_during_the_freeze";
    let mut during_keys = on_master(
        &cluster,
        master,
        30,
        |n| format!("during-{n}"),
        |key| record_key(during_key, key),
    )
    .into_iter();

    // A charge before the freeze, as a running service has made: connected to every node.
    let before = create_charge(&router, &api_key, &keys[0], &visa(1000))
        .send()
        .await;
    assert_eq!(before.status, StatusCode::CREATED, "{}", before.text());
    assert!(
        cluster.keys().contains(&record_key(&api_key, &keys[0])),
        "the record is where the test looks for it"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while balance(&router, &api_key).await != Some(1000) {
        assert!(
            Instant::now() < deadline,
            "the first charge is never credited"
        );
        tokio::time::sleep(RETRY_EVERY).await;
    }

    let frozen = cluster.node(master).freeze();
    let frozen_at = Instant::now();
    let promotion = {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.wait_promoted(replica))
    };
    // Charges meet the frozen master while the cluster elects its replica.
    let mut failed = 0;
    while !promotion.is_finished() {
        let key = during_keys
            .next()
            .expect("a key for a charge during the freeze");
        let reply = create_charge(&router, during_key, &key, &visa(700))
            .send()
            .await;
        failed += usize::from(reply.status != StatusCode::CREATED);
        tokio::time::sleep(RETRY_EVERY).await;
    }
    let promoted_at = promotion.await.expect("the promotion");
    eprintln!(
        "replica promoted {:?} after the freeze; {failed} charges failed meanwhile",
        promoted_at - frozen_at
    );
    assert!(failed > 0, "the charges met the frozen master");

    // A client's charge, sent again with its key until it is answered.
    let mut reply = create_charge(&router, &api_key, &keys[1], &visa(2500))
        .send()
        .await;
    while retries_after(&reply) {
        assert!(
            promoted_at.elapsed() < FOLLOWED_WITHIN,
            "charges still fail {:?} after the promotion: {} {}",
            promoted_at.elapsed(),
            reply.status,
            reply.text()
        );
        tokio::time::sleep(RETRY_EVERY).await;
        reply = create_charge(&router, &api_key, &keys[1], &visa(2500))
            .send()
            .await;
    }
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let charged = promoted_at.elapsed();
    let mut shown = balance(&router, &api_key).await;
    while shown != Some(3500) {
        assert!(
            promoted_at.elapsed() < FOLLOWED_WITHIN,
            "the balance is {shown:?}, not 3500, {:?} after the promotion",
            promoted_at.elapsed()
        );
        tokio::time::sleep(RETRY_EVERY).await;
        shown = balance(&router, &api_key).await;
    }
    eprintln!(
        "charged {charged:?} and credited {:?} after the promoted replica's cluster_state:ok",
        promoted_at.elapsed()
    );
    assert!(
        cluster
            .node(master)
            .try_command(&["PING"], Duration::from_millis(300))
            .is_err(),
        "the old master is still frozen"
    );
    drop(frozen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_path_follows_a_frozen_master_of_the_ledger() {
    let ledger = format!("{}seq", server::ledger::LEDGER_PREFIX);
    a_frozen_master_is_followed(&ledger, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_path_follows_a_frozen_master_of_the_provider_and_the_stream() {
    let provider = format!("{}payments", server::PROVIDER_PREFIX);
    a_frozen_master_is_followed(&provider, &[server::STREAM]).await;
}
