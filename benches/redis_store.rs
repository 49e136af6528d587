//! What a Redis deployment costs the store, call by call: one server, one server with a
//! replica, with the replication wait, a Redis Cluster, and a cluster with the wait.
//!
//! ```sh
//! cargo bench -p benches --bench redis_store
//! # knobs (defaults shown)
//! BENCH_SECONDS=3 BENCH_ROUNDS=3 BENCH_CONCURRENCY=64 cargo bench -p benches --bench redis_store
//! ```
//!
//! Needs `redis-server` and `redis-cli` (for the cluster) on `PATH`; it starts its own servers
//! on free ports (the test fixtures). Per set-up it measures, through `RedisStore` in this
//! process:
//!
//! - latency: 2,000 requests one at a time, p50 and p99, of a new key (claim, then complete) and
//!   of a replay (one claim that finds the completed record);
//! - throughput: new keys per second with `BENCH_CONCURRENCY` requests in flight, over
//!   `BENCH_SECONDS`, as a range over `BENCH_ROUNDS` rounds;
//! - commands per request, from `INFO commandstats` on every master (scripts' inner `GET`/`SET`
//!   and replicas' `REPLCONF` left out). Without the wait, each command is one round trip; with
//!   it, each write and its `WAIT` travel in one pipeline, so round trips are half the commands.
//!
//! A run started by `cargo test --benches` (no `--bench` argument) does nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency::record::{Completed, Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency_redis::RedisStore;

const LEASE: Duration = Duration::from_secs(30);
const WINDOW: Duration = Duration::from_secs(600);
const WAIT: (u32, Duration) = (1, Duration::from_millis(100));

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where a set-up's commands are counted.
enum Counted<'a> {
    Server(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

impl Counted<'_> {
    fn masters(&self) -> Vec<&RedisServer> {
        match self {
            Counted::Server(server) => vec![server],
            Counted::Cluster(cluster) => cluster
                .masters()
                .into_iter()
                .map(|i| cluster.node(i))
                .collect(),
        }
    }

    fn reset(&self) {
        self.masters().iter().for_each(|m| m.config_resetstat());
    }

    /// Commands sent by the client, not run by scripts: every call but the scripts' own (`GET`,
    /// `SET`, `TIME`, `DEL`: each store call is a script) and the replicas' `REPLCONF ACK`s.
    fn sent(&self) -> u64 {
        let mut total = 0;
        for master in self.masters() {
            let stats = master.info_commandstats();
            total += stats
                .iter()
                .filter(|(name, _)| {
                    !matches!(name.as_str(), "get" | "set" | "time" | "del" | "replconf")
                })
                .map(|(_, calls)| calls)
                .sum::<u64>();
        }
        total
    }
}

static KEYS: AtomicU64 = AtomicU64::new(0);

fn fresh_id() -> RecordId {
    RecordId::new(
        b"bench",
        &format!("k{}", KEYS.fetch_add(1, Ordering::Relaxed)),
    )
}

async fn new_key(store: &RedisStore) -> RecordId {
    let id = fresh_id();
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let Claim::Claimed(token) = store.claim(&id, &fingerprint, LEASE).await.expect("claim") else {
        panic!("a new key is claimed")
    };
    let done = Completed::tombstone(fingerprint);
    assert!(
        store
            .complete(&id, &token, &done, WINDOW)
            .await
            .expect("complete")
    );
    id
}

async fn replay(store: &RedisStore, id: &RecordId) {
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let claim = store.claim(id, &fingerprint, LEASE).await.expect("claim");
    assert!(
        matches!(claim, Claim::Existing(_)),
        "a replay finds the record"
    );
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p) as usize]
}

async fn measure(name: &str, store: RedisStore, counted: Counted<'_>) {
    let (seconds, rounds, concurrency) = (
        env("BENCH_SECONDS", 3),
        env("BENCH_ROUNDS", 3),
        env("BENCH_CONCURRENCY", 64),
    );
    // Warm the connections.
    for _ in 0..200 {
        new_key(&store).await;
    }
    counted.reset();
    let (mut new_lat, mut replay_lat) = (Vec::new(), Vec::new());
    let mut ids = Vec::new();
    for _ in 0..2000 {
        let started = Instant::now();
        ids.push(new_key(&store).await);
        new_lat.push(started.elapsed());
    }
    let new_commands = counted.sent() as f64 / 2000.0;
    counted.reset();
    for id in &ids {
        let started = Instant::now();
        replay(&store, id).await;
        replay_lat.push(started.elapsed());
    }
    let replay_commands = counted.sent() as f64 / 2000.0;
    new_lat.sort();
    replay_lat.sort();

    let mut rates = Vec::new();
    for _ in 0..rounds {
        let done = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                let (store, done) = (store.clone(), done.clone());
                tokio::spawn(async move {
                    while Instant::now() < deadline {
                        new_key(&store).await;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await.expect("a worker");
        }
        rates.push(done.load(Ordering::Relaxed) as f64 / seconds as f64);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "{name:<24} new key p50 {:>4} µs p99 {:>5} µs, {new_commands:.2} commands | replay p50 {:>4} \
         µs p99 {:>5} µs, {replay_commands:.2} commands | new keys/s @{concurrency}: {:.0} ({:.0}..{:.0})",
        percentile(&new_lat, 0.5).as_micros(),
        percentile(&new_lat, 0.99).as_micros(),
        percentile(&replay_lat, 0.5).as_micros(),
        percentile(&replay_lat, 0.99).as_micros(),
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1],
    );
}

/// Waits until `replica` reports its link to the master up.
fn wait_linked(replica: &RedisServer) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = replica.command(&["INFO", "replication"]).as_string();
        if info.is_some_and(|i| i.contains("master_link_status:up")) {
            return;
        }
        assert!(Instant::now() < deadline, "the replica did not link up");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let single = RedisServer::start();
    measure(
        "one server",
        RedisStore::from_url(&single.url()).expect("a store"),
        Counted::Server(&single),
    )
    .await;
    drop(single);

    let master = RedisServer::start();
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    wait_linked(&replica);
    let store = RedisStore::from_url(&master.url()).expect("a store");
    measure("server + replica", store.clone(), Counted::Server(&master)).await;
    measure(
        "server + replica, wait",
        store.with_replication_wait(WAIT.0, WAIT.1),
        Counted::Server(&master),
    )
    .await;
    drop((replica, master));

    let cluster = RedisCluster::start();
    let store = RedisStore::cluster(cluster.urls()).expect("a store");
    measure("cluster", store.clone(), Counted::Cluster(&cluster)).await;
    measure(
        "cluster, wait",
        store.with_replication_wait(WAIT.0, WAIT.1),
        Counted::Cluster(&cluster),
    )
    .await;
}
