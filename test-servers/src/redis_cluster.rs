//! Test fixture: a private Redis Cluster of three masters and three replicas.
//!
//! Six `redis-server` processes in cluster mode ([`RedisServer`]s, so each can be stopped,
//! paused and restarted), joined with `redis-cli --cluster create`. [`RedisCluster::start`]
//! returns once every node reports `cluster_state:ok`, every node agrees on the three masters and
//! every replica's link to its master is up. The fixture can fail a master over, pause one,
//! migrate a slot, and list every key.
//!
//! If `redis-server` or `redis-cli` is not on `PATH`, it panics: cluster tests never skip.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::redis_server::{RedisServer, RespValue};

/// How long the cluster may take to agree on its state after a change.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a master may be unreachable before its replica takes over (`cluster-node-timeout`).
pub const NODE_TIMEOUT: Duration = Duration::from_millis(1000);

/// Six cluster nodes: three masters, each with one replica.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes and joins them into a cluster of three masters with a replica each.
    ///
    /// # Panics
    /// If a binary is missing, or the cluster does not settle in time.
    pub fn start() -> RedisCluster {
        Self::start_with_node_timeout(NODE_TIMEOUT)
    }

    /// Like [`start`](Self::start), with `cluster-node-timeout` set to `node_timeout`: how long
    /// a master may not answer before it is marked failed and its replica elected.
    ///
    /// # Panics
    /// If a binary is missing, or the cluster does not settle in time.
    pub fn start_with_node_timeout(node_timeout: Duration) -> RedisCluster {
        let timeout = node_timeout.as_millis().to_string();
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
            // A replica may take over however long its link was down: the tests decide when.
            "--cluster-replica-validity-factor",
            "0",
        ];
        let nodes: Vec<RedisServer> = (0..6).map(|_| RedisServer::start_with(&args)).collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port()))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot run redis-cli (apt-get install redis-tools); cluster tests never \
                     skip: {err}"
                )
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_settled();
        cluster
    }

    /// One cluster for every test of a binary that asks for it, with each test under a key
    /// prefix of its own. Its processes are killed when the test binary exits.
    pub fn shared() -> &'static RedisCluster {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            let cluster = RedisCluster::start();
            let pids = cluster.nodes.iter().filter_map(RedisServer::pid).collect();
            let dirs = cluster
                .nodes
                .iter()
                .map(|node| node.dir().to_owned())
                .collect();
            crate::at_exit::kill(pids, dirs);
            cluster
        })
    }

    /// The seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// Node `i`, to stop or restart it.
    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// The indices of the nodes that are masters now (paused and stopped nodes left out).
    pub fn masters(&self) -> Vec<usize> {
        self.with_role("master")
    }

    /// The indices of the nodes that are replicas now.
    pub fn replicas(&self) -> Vec<usize> {
        self.with_role("slave")
    }

    fn with_role(&self, role: &str) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.role(i).as_deref() == Some(role))
            .collect()
    }

    /// Node `i`'s role (`master` or `slave`), unless it does not answer.
    pub fn role(&self, i: usize) -> Option<String> {
        let node = &self.nodes[i];
        node.pid()?;
        let reply = node
            .try_command(&["ROLE"], Duration::from_millis(300))
            .ok()?;
        match reply {
            RespValue::Array(items) => items.first()?.as_string(),
            _ => None,
        }
    }

    /// The replica of master `master`.
    pub fn replica_of(&self, master: usize) -> usize {
        let id = self.node_id(master);
        self.replicas()
            .into_iter()
            .find(|&i| {
                let info = self.nodes[i].command(&["CLUSTER", "NODES"]);
                let text = info.as_string().unwrap_or_default();
                text.lines()
                    .any(|line| line.contains("myself") && line.contains(&id))
            })
            .unwrap_or_else(|| panic!("master {master} has no replica"))
    }

    /// Node `i`'s cluster id.
    pub fn node_id(&self, i: usize) -> String {
        self.nodes[i]
            .command(&["CLUSTER", "MYID"])
            .as_string()
            .expect("CLUSTER MYID answers a string")
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        let reply = self.any_master().command(&["CLUSTER", "KEYSLOT", key]);
        u16::try_from(
            reply
                .as_integer()
                .expect("CLUSTER KEYSLOT answers a number"),
        )
        .expect("a slot")
    }

    /// The index of the master that serves `slot` now.
    pub fn master_of_slot(&self, slot: u16) -> usize {
        self.masters()
            .into_iter()
            .find(|&i| self.serves(i, slot))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
    }

    /// The index of the master that serves `key` now.
    pub fn master_of_key(&self, key: &str) -> usize {
        self.master_of_slot(self.slot(key))
    }

    /// Whether master `i` itself says it serves `slot`.
    fn serves(&self, i: usize, slot: u16) -> bool {
        let reply = self.nodes[i].command(&["CLUSTER", "SLOTS"]);
        let RespValue::Array(ranges) = reply else {
            return false;
        };
        let port = i64::from(self.nodes[i].port());
        ranges.iter().any(|range| {
            let RespValue::Array(fields) = range else {
                return false;
            };
            let (Some(start), Some(end)) = (
                fields.first().and_then(RespValue::as_integer),
                fields.get(1).and_then(RespValue::as_integer),
            ) else {
                return false;
            };
            let owner = match fields.get(2) {
                Some(RespValue::Array(owner)) => owner.get(1).and_then(RespValue::as_integer),
                _ => None,
            };
            (start..=end).contains(&i64::from(slot)) && owner == Some(port)
        })
    }

    /// A running master, to ask cluster-wide questions.
    fn any_master(&self) -> &RedisServer {
        let i = *self.masters().first().expect("a master answers");
        &self.nodes[i]
    }

    /// Promotes replica `replica` with `CLUSTER FAILOVER` (`mode`: "" for a coordinated
    /// failover, "FORCE" without its master's agreement, "TAKEOVER" without the cluster's), and
    /// waits until the cluster has settled with it as a master.
    pub fn failover(&self, replica: usize, mode: &str) {
        let mut args = vec!["CLUSTER", "FAILOVER"];
        if !mode.is_empty() {
            args.push(mode);
        }
        let reply = self.nodes[replica].command(&args);
        assert!(reply.is_ok(), "CLUSTER FAILOVER {mode} failed: {reply:?}");
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        while self.role(replica).as_deref() != Some("master") {
            assert!(
                Instant::now() < deadline,
                "node {replica} did not become a master"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_settled();
    }

    /// Waits until replica `replica` has been elected master (its master failed: killed, or
    /// frozen with [`RedisServer::freeze`]) and reports `cluster_state:ok`; returns when that was
    /// first seen.
    ///
    /// # Panics
    /// If that does not happen within 30 seconds.
    pub fn wait_promoted(&self, replica: usize) -> Instant {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let ok = self.role(replica).as_deref() == Some("master")
                && self.nodes[replica]
                    .try_command(&["CLUSTER", "INFO"], Duration::from_millis(300))
                    .ok()
                    .and_then(|info| info.as_string())
                    .is_some_and(|info| info.contains("cluster_state:ok"));
            if ok {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "node {replica} was not promoted in {SETTLE_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Moves `slot`, keys included, from master `from` to master `to`, as `redis-cli
    /// --cluster reshard` does: `IMPORTING`/`MIGRATING`, `MIGRATE` in batches, then
    /// `SETSLOT ... NODE` on both.
    pub fn migrate_slot(&self, slot: u16, from: usize, to: usize) {
        let slot_arg = slot.to_string();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let ok = |reply: RespValue, what: &str| assert!(reply.is_ok(), "{what}: {reply:?}");
        ok(
            self.nodes[to].command(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &from_id]),
            "IMPORTING",
        );
        ok(
            self.nodes[from].command(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &to_id]),
            "MIGRATING",
        );
        let port = self.nodes[to].port().to_string();
        loop {
            let reply = self.nodes[from].command(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "100"]);
            let RespValue::Array(keys) = reply else {
                panic!("GETKEYSINSLOT: {reply:?}")
            };
            if keys.is_empty() {
                break;
            }
            let keys: Vec<String> = keys.iter().filter_map(RespValue::as_string).collect();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let reply = self.nodes[from].command(&args);
            assert!(
                reply.is_ok() || matches!(&reply, RespValue::Simple(s) if s == "NOKEY"),
                "MIGRATE: {reply:?}"
            );
        }
        ok(
            self.nodes[to].command(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id]),
            "SETSLOT NODE on the target",
        );
        ok(
            self.nodes[from].command(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id]),
            "SETSLOT NODE on the source",
        );
        self.wait_settled();
    }

    /// Waits until every running node reports `cluster_state:ok`, every node sees the same three
    /// masters, and every replica's link to its master is up.
    pub fn wait_settled(&self) {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            match self.unsettled() {
                None => return,
                Some(why) if Instant::now() >= deadline => {
                    panic!("the cluster did not settle in {SETTLE_TIMEOUT:?}: {why}")
                }
                Some(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Why the cluster is not settled yet, if it is not.
    fn unsettled(&self) -> Option<String> {
        let running: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.role(i).is_some())
            .collect();
        let mut views = BTreeSet::new();
        for &i in &running {
            let node = &self.nodes[i];
            let info = node.command(&["CLUSTER", "INFO"]).as_string()?;
            if !info.contains("cluster_state:ok") {
                return Some(format!("node {i}: cluster_state not ok"));
            }
            let nodes = node.command(&["CLUSTER", "NODES"]).as_string()?;
            let masters: BTreeSet<String> = nodes
                .lines()
                .filter(|line| line.contains("master") && !line.contains("fail"))
                .filter_map(|line| line.split(' ').nth(1).map(str::to_owned))
                .collect();
            views.insert(masters);
            if self.role(i).as_deref() == Some("slave") {
                let replication = node.command(&["INFO", "replication"]).as_string()?;
                if !replication.contains("master_link_status:up") {
                    return Some(format!("node {i}: link to its master down"));
                }
            }
        }
        if views.len() != 1 {
            return Some(format!("nodes disagree on the masters: {views:?}"));
        }
        let masters = self.masters();
        if masters.len() != 3 {
            return Some(format!("{} masters answer", masters.len()));
        }
        None
    }

    /// Every key on every master.
    pub fn keys(&self) -> Vec<String> {
        self.masters()
            .into_iter()
            .flat_map(|i| self.nodes[i].keys())
            .collect()
    }

    /// Every key without a TTL on every master.
    pub fn keys_without_ttl(&self) -> Vec<String> {
        self.masters()
            .into_iter()
            .flat_map(|i| self.nodes[i].keys_without_ttl())
            .collect()
    }
}
