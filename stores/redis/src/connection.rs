//! Where the store's commands go: one Redis server, or a Redis Cluster.
//!
//! On one server the store shares one multiplexed connection from its pool between requests, and
//! pipelines the commands of concurrent requests (see `batch`). On a cluster it uses redis-rs's
//! cluster connection, which routes each command by its key's slot, follows `MOVED` and `ASK`
//! redirections, refreshes the slot map after a failover and reconnects to nodes by itself. It
//! is not batched: a pipeline must stay within one slot, and the cluster connection already
//! multiplexes the commands of concurrent requests on one connection per node.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use deadpool_redis::Pool;
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::{Cmd, Pipeline, RedisFuture, Value};

use super::batch::Batch;

/// How the store reaches Redis.
pub(super) enum Backend {
    /// One server (a master, perhaps with replicas).
    Single(Box<Single>),
    /// A Redis Cluster.
    Cluster(Box<Cluster>),
}

/// How many connections the replication wait spreads its commands over. `WAIT` blocks its
/// connection on the server until the replicas answer, so on one shared connection every
/// request would queue behind the one waiting; lanes let that many wait at once.
pub(super) const WAIT_LANES: usize = 8;

/// Connections made on first use, one per lane: lane 0 for everything, the others only for the
/// replication wait.
pub(super) struct Lanes<T> {
    lanes: [Mutex<Option<T>>; WAIT_LANES],
    next: AtomicUsize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Self {
            lanes: std::array::from_fn(|_| Mutex::new(None)),
            next: AtomicUsize::new(0),
        }
    }
}

impl<T> Lanes<T> {
    /// Lane 0, or with `spread` the next of the first `limit` lanes in turn.
    pub(super) fn pick(&self, spread: bool, limit: usize) -> usize {
        let lanes = limit.clamp(1, WAIT_LANES);
        if spread && lanes > 1 {
            self.next.fetch_add(1, Ordering::Relaxed) % lanes
        } else {
            0
        }
    }

    /// Lane `i`'s connection, if made.
    pub(super) fn lane(&self, i: usize) -> MutexGuard<'_, Option<T>> {
        lock(&self.lanes[i % WAIT_LANES])
    }
}

/// One server: the pool, the connections taken from it and kept (each lane its own: returned to
/// the pool, a connection would be handed to the next lane again), and the batch of queued
/// commands (always on lane 0).
pub(super) struct Single {
    pub(super) pool: Pool,
    pub(super) lanes: Lanes<deadpool_redis::Connection>,
    pub(super) batch: Batch,
}

/// A cluster: the client made from the seed nodes, and its connections once made.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    lanes: Lanes<ClusterConnection>,
    /// Held while a connection is made, so that concurrent requests make one, not one each.
    connecting: tokio::sync::Mutex<()>,
}

impl Single {
    pub(super) fn new(pool: Pool) -> Self {
        Self {
            pool,
            lanes: Lanes::default(),
            batch: Batch::default(),
        }
    }

    /// The lane to send on next: never more lanes than the pool has connections.
    pub(super) fn pick(&self, spread: bool) -> usize {
        self.lanes.pick(spread, self.pool.status().max_size)
    }
}

impl Cluster {
    pub(super) fn new(client: ClusterClient) -> Self {
        Self {
            client,
            lanes: Lanes::default(),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// The lane to send on next (see [`Lanes::pick`]).
    pub(super) fn pick(&self, spread: bool) -> usize {
        self.lanes.pick(spread, WAIT_LANES)
    }

    /// Lane `lane`'s cluster connection, made the first time. It is kept for the store's life:
    /// it repairs itself (slot refreshes, reconnections to nodes), and one slow or paused node
    /// must not cost the connections to the others.
    pub(super) async fn connection(
        &self,
        lane: usize,
    ) -> deadpool_redis::redis::RedisResult<ClusterConnection> {
        if let Some(connection) = self.lanes.lane(lane).clone() {
            return Ok(connection);
        }
        let _gate = self.connecting.lock().await;
        if let Some(connection) = self.lanes.lane(lane).clone() {
            return Ok(connection);
        }
        let connection = self.client.get_async_connection().await?;
        *self.lanes.lane(lane) = Some(connection.clone());
        Ok(connection)
    }
}

/// A connection of either kind, for commands sent outside a batch.
#[derive(Clone)]
pub(super) enum Connection {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
