//! The layer on a Redis Cluster whose shape changes under traffic: a slot migrated, masters
//! failed over by hand, a master paused until its replica takes over, and a master lost before
//! its replica had a claim. Each test starts a cluster of its own.
//!
//! Traffic: workers send new keys one after another; each key is sent until it gets its `201`
//! (a `503` or a `409` is retried a moment later, as a client does), then once more for the
//! replay. The handler counts its executions per key: a key that ran twice is a double charge.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use deadpool_redis::redis::cluster_routing::Slot;
use http::StatusCode;
use test_servers::redis_cluster::{NODE_TIMEOUT, RedisCluster};
use tower_idempotency::record::RecordId;
use tower_idempotency::{Idempotency, IdempotencyLayer};
use tower_idempotency_redis::RedisStore;
use tower_idempotency_test::{Handler, created, post, send, service};

/// The replication wait the "on" stores use: one replica, within 200 ms.
const WAIT: (u32, Duration) = (1, Duration::from_millis(200));

/// How long a test waits for one key to get its answer before it fails.
const KEY_DEADLINE: Duration = Duration::from_secs(30);

/// Each key's executions.
#[derive(Clone, Default)]
struct Executions(Arc<Mutex<HashMap<String, usize>>>);

impl Executions {
    fn handler(&self) -> Handler {
        let executions = self.clone();
        Handler::new(move |call| {
            let key = String::from_utf8_lossy(&call.body).into_owned();
            *executions.lock().entry(key).or_default() += 1;
            async move { Ok(created(call.body)) }
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn of(&self, key: &str) -> usize {
        self.lock().get(key).copied().unwrap_or(0)
    }

    /// The keys that ran more than once.
    fn doubles(&self) -> Vec<String> {
        let mut doubles: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(key, _)| key.clone())
            .collect();
        doubles.sort();
        doubles
    }
}

type Svc = Idempotency<Handler, RedisStore>;

/// A layer on the cluster. Its lease (10 s) outlasts a failover (about 3 s here): a completion
/// held up by the failover must land while its claim still stands, or a retry claims the key
/// again and runs it twice (with a 2 s lease, the paused-master test sees exactly that).
fn instance(cluster: &RedisCluster, prefix: &str, wait: bool, executions: &Executions) -> Svc {
    let mut store = RedisStore::cluster(cluster.urls())
        .expect("a store")
        .with_prefix(prefix);
    if wait {
        store = store.with_replication_wait(WAIT.0, WAIT.1);
    }
    let layer = IdempotencyLayer::new(store).lease(Duration::from_secs(10));
    service(layer, executions.handler())
}

/// Sends `key` (its body is the key) until it gets a `201`, then once more, which must be the
/// replay.
/// Returns how many `503`s and `409`s it met.
async fn settle(svc: &Svc, key: &str) -> usize {
    let started = Instant::now();
    let mut refused = 0;
    for round in ["first", "replay"] {
        loop {
            let reply = send(svc, post(key, key.to_owned())).await;
            match reply.status {
                StatusCode::CREATED => {
                    assert_eq!(reply.text(), key, "{key}'s own response");
                    assert!(reply.is_replay() || round == "first", "{key}: no replay");
                    break;
                }
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => refused += 1,
                other => panic!("{key}: {other} is never an answer here: {reply:?}"),
            }
            assert!(
                started.elapsed() < KEY_DEADLINE,
                "{key} got no answer in {KEY_DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    refused
}

/// Runs `workers` workers on `svc` until `stop`, each settling keys `<name>-<worker>-<n>` in turn.
/// Returns the keys settled and the refusals met.
fn traffic(
    svc: &Svc,
    name: &str,
    workers: usize,
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, usize)> {
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let (svc, stop, name) = (svc.clone(), stop.clone(), name.to_owned());
            tokio::spawn(async move {
                let (mut keys, mut refused) = (0, 0);
                while !stop.load(Ordering::SeqCst) {
                    refused += settle(&svc, &format!("{name}-{worker}-{keys}")).await;
                    keys += 1;
                }
                (keys, refused)
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut total = (0, 0);
        for task in tasks {
            let (keys, refused) = task.await.expect("a worker");
            total = (total.0 + keys, total.1 + refused);
        }
        total
    })
}

/// Runs a blocking fixture step (it sleeps and polls) off the runtime's workers.
async fn blocking<T: Send + 'static>(step: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(step).await.expect("the step")
}

/// A slot moved to another master while requests for its keys keep coming (`MOVED` and `ASK`
/// redirections, new keys claimed on the importing node): nothing worse than a 503 reaches a
/// client, no key runs twice, and every key replays from its new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrated_during_traffic_answers_nothing_worse_than_503() {
    // In an `Arc`, so blocking steps can use it from another thread.
    let cluster = Arc::new(RedisCluster::start());
    let executions = Executions::default();
    let svc = instance(&cluster, "moving:", false, &executions);
    // Keys whose records share one slot: the layer's record id (no scope) under the prefix.
    let slot_of =
        |key: &str| Slot::for_key(support::redis_key("moving:", &RecordId::new(b"", key)));
    let target = slot_of("moving-0");
    let keys: Vec<String> = (0..)
        .map(|n| format!("moving-{n}"))
        .filter(|key| slot_of(key) == target)
        .take(24)
        .collect();
    // Half the keys before the move; the other half, and every replay, around it.
    for key in &keys[..12] {
        let reply = send(&svc, post(key, key.clone())).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let slot = cluster.slot(&support::redis_key(
        "moving:",
        &RecordId::new(b"", &keys[0]),
    ));
    let from = cluster.master_of_slot(slot);
    let to = *cluster
        .masters()
        .iter()
        .find(|&&m| m != from)
        .expect("another master");
    let stop = Arc::new(AtomicBool::new(false));
    let background = traffic(&svc, "other", 2, &stop);
    let moving = {
        let cluster = cluster.clone();
        tokio::spawn(blocking(move || cluster.migrate_slot(slot, from, to)))
    };
    for key in &keys {
        settle(&svc, key).await;
    }
    moving.await.expect("the migration");
    for key in &keys {
        settle(&svc, key).await;
    }
    stop.store(true, Ordering::SeqCst);
    let (settled, _) = background.await.expect("the traffic");
    assert_eq!(cluster.master_of_slot(slot), to, "the slot moved");
    assert_eq!(
        executions.doubles(),
        Vec::<String>::new(),
        "keys that ran twice"
    );
    for key in &keys {
        assert_eq!(executions.of(key), 1, "{key}");
    }
    assert!(settled > 0, "the other traffic went on");
}

/// Every master failed over by hand (`CLUSTER FAILOVER`: the replica catches up first) during a
/// stream of requests, with the replication wait on and off: no key runs twice either way, since
/// a coordinated failover loses no acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_failovers_during_traffic_never_run_a_key_twice() {
    // In an `Arc`, so blocking steps can use it from another thread.
    let cluster = Arc::new(RedisCluster::start());
    let executions = Executions::default();
    let stop = Arc::new(AtomicBool::new(false));
    let off = traffic(
        &instance(&cluster, "off:", false, &executions),
        "off",
        2,
        &stop,
    );
    let on = traffic(
        &instance(&cluster, "on:", true, &executions),
        "on",
        2,
        &stop,
    );
    for master in cluster.masters() {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let replica = cluster.replica_of(master);
        let cluster = cluster.clone();
        blocking(move || cluster.failover(replica, "")).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let (off, on) = (off.await.expect("off"), on.await.expect("on"));
    eprintln!(
        "manual failovers: wait off {} keys ({} refusals), wait on {} keys ({} refusals)",
        off.0, off.1, on.0, on.1
    );
    assert_eq!(
        executions.doubles(),
        Vec::<String>::new(),
        "keys that ran twice"
    );
    assert!(off.0 > 0 && on.0 > 0, "traffic went on: {off:?} {on:?}");
}

/// A master paused (SIGSTOP) until its replica is elected in its place, under traffic with the
/// replication wait on: the paused master's keys answer 503 until the failover, and no key runs
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_master_is_replaced_without_running_a_key_twice() {
    // In an `Arc`, so blocking steps can use it from another thread.
    let cluster = Arc::new(RedisCluster::start());
    let executions = Executions::default();
    let stop = Arc::new(AtomicBool::new(false));
    let on = traffic(
        &instance(&cluster, "on:", true, &executions),
        "on",
        3,
        &stop,
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let master = cluster.masters()[0];
    let replica = cluster.replica_of(master);
    cluster.node(master).pause();
    let started = Instant::now();
    {
        let cluster = cluster.clone();
        blocking(move || {
            while cluster.role(replica).as_deref() != Some("master") {
                assert!(
                    started.elapsed() < NODE_TIMEOUT * 20,
                    "the replica was not elected"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        })
        .await;
    }
    eprintln!("replica elected {:?} after the pause", started.elapsed());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.node(master).resume();
    {
        let cluster = cluster.clone();
        blocking(move || cluster.wait_settled()).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let (keys, refused) = on.await.expect("traffic");
    eprintln!("paused master, wait on: {keys} keys, {refused} refusals");
    assert_eq!(
        executions.doubles(),
        Vec::<String>::new(),
        "keys that ran twice"
    );
    assert!(keys > 0);
}

/// The loss window, shown: a master acknowledges a claim its replica never received (the
/// replica is stalled and its link dropped), then dies, and the replica takes over. Without the replication wait the
/// claim is gone and the retry runs the handler a second time; with it, the claim was refused
/// (503, handler not run) and the retry runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_lost_before_replicating_runs_a_key_twice_only_without_the_wait() {
    let mut cluster = RedisCluster::start();
    let executions = Executions::default();
    let off = instance(&cluster, "off:", false, &executions);
    let on = instance(&cluster, "on:", true, &executions);
    // One key for each store, both on the same master.
    let probe = |prefix: &str, key: &str| {
        cluster.master_of_key(&support::redis_key(prefix, &RecordId::new(b"", key)))
    };
    let master = probe("off:", "lost-off");
    let on_key = (0..)
        .map(|n| format!("lost-on-{n}"))
        .find(|key| probe("on:", key) == master)
        .expect("a key on the same master");
    let replica = cluster.replica_of(master);
    // Connected before the stall: a new cluster connection waits for every node, the stalled
    // replica included (its connection timeout, 1 s, is the store's whole bound).
    settle(&off, "warm-off").await;
    settle(&on, "warm-on").await;

    // The replica stalls, and the master drops its link: what the master writes now reaches no
    // replica (a stall alone would not do: the replica's socket buffer keeps what was sent).
    cluster.node(replica).pause();
    let dropped = cluster
        .node(master)
        .command(&["CLIENT", "KILL", "TYPE", "replica"]);
    assert_eq!(dropped.as_integer(), Some(1), "the replica link dropped");
    let first = send(&off, post("lost-off", "lost-off")).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the master alone acknowledged"
    );
    let refused = send(&on, post(&on_key, on_key.clone())).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "no replica acknowledged the claim: {refused:?}"
    );
    assert_eq!(executions.of(&on_key), 0, "the refused claim never ran");

    cluster.node_mut(master).kill();
    cluster.node(replica).resume();
    cluster.failover(replica, "TAKEOVER");

    settle(&off, "lost-off").await;
    // With the wait on, a master without a replica refuses every claim (never unprotected):
    // the old master comes back, empty, as the new one's replica.
    cluster.node_mut(master).restart();
    cluster.wait_settled();
    settle(&on, &on_key).await;
    assert_eq!(
        executions.of("lost-off"),
        2,
        "without the wait, the lost claim let the retry run again"
    );
    assert_eq!(executions.of(&on_key), 1, "with the wait, once");
}

/// A master frozen (SIGSTOP: a hung machine, its connections open and silent) until its replica
/// is elected, and left frozen: the store follows the failover within 10 s of the promoted
/// replica's `cluster_state:ok`, and every master answers from then on. (Waiting for the frozen
/// master's connections to fail would take the kernel's TCP timeouts: minutes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_is_followed_to_its_promoted_replica() {
    use tower_idempotency::record::Fingerprint;
    use tower_idempotency::store::{Claim, Store};

    let cluster = Arc::new(RedisCluster::start_with_node_timeout(
        Duration::from_millis(500),
    ));
    let store = RedisStore::cluster(cluster.urls())
        .expect("a store")
        .with_prefix("frozen:");
    let master = cluster.masters()[0];
    let replica = cluster.replica_of(master);
    // Fresh keys on the frozen master's slots, and on the others'.
    let (mut frozen_keys, mut other_keys) = (Vec::new(), Vec::new());
    for n in 0..300 {
        let id = RecordId::new(b"", &format!("frozen-{n}"));
        if cluster.master_of_key(&support::redis_key("frozen:", &id)) == master {
            frozen_keys.push(id);
        } else {
            other_keys.push(id);
        }
    }
    let (mut frozen_keys, mut other_keys) = (frozen_keys.into_iter(), other_keys.into_iter());
    let fingerprint = Fingerprint::from_bytes([3; 32]);
    let lease = Duration::from_secs(30);
    let claim = |id: RecordId| {
        let store = store.clone();
        async move { store.claim(&id, &fingerprint, lease).await }
    };
    let claimed = |answer: &Result<Claim, _>| matches!(answer, Ok(Claim::Claimed(_)));
    // Connected to every node before the freeze, as a running service is.
    for keys in [&mut frozen_keys, &mut other_keys] {
        let answer = claim(keys.next().expect("a key")).await;
        assert!(claimed(&answer), "{answer:?}");
    }

    let frozen = cluster.node(master).freeze();
    let promotion = {
        let cluster = cluster.clone();
        tokio::spawn(blocking(move || cluster.wait_promoted(replica)))
    };
    // Claims meet the frozen master (timeouts) while the cluster elects its replica. (The other
    // masters' keys may time out too meanwhile: redis-rs refreshes its slot map under a lock,
    // asking the frozen node among others.)
    let frozen_at = Instant::now();
    let (mut timeouts, mut others_failed) = (0, 0);
    while !promotion.is_finished() {
        let answer = claim(frozen_keys.next().expect("a key")).await;
        timeouts += usize::from(!claimed(&answer));
        let other = claim(other_keys.next().expect("a key")).await;
        others_failed += usize::from(!claimed(&other));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let promoted_at = promotion.await.expect("the promotion");
    eprintln!(
        "replica promoted {:?} after the freeze; {timeouts} claims on the frozen master and \
         {others_failed} on the others failed meanwhile",
        promoted_at - frozen_at
    );
    assert!(timeouts > 0, "the claims met the frozen master");

    let followed = loop {
        let answer = claim(frozen_keys.next().expect("a key")).await;
        if claimed(&answer) {
            break promoted_at.elapsed();
        }
        assert!(
            promoted_at.elapsed() < Duration::from_secs(10),
            "claims still fail {:?} after the promotion: {answer:?}",
            promoted_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("claims reach the promoted replica {followed:?} after its cluster_state:ok");
    // Every claim from now on reaches it, and the other masters still answer.
    for _ in 0..10 {
        let answer = claim(frozen_keys.next().expect("a key")).await;
        assert!(claimed(&answer), "after the failover: {answer:?}");
        let other = claim(other_keys.next().expect("a key")).await;
        assert!(claimed(&other), "another master's key: {other:?}");
    }
    frozen.thaw();
}
