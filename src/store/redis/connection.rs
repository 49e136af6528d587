//! Where the store's commands go: one Redis server, or a Redis Cluster.
//!
//! On one server the store shares one multiplexed connection from its pool between requests, and
//! pipelines the commands of concurrent requests (see `batch`). On a cluster it uses redis-rs's
//! cluster connection, which routes each command by its key's slot, follows `MOVED` and `ASK`
//! redirections, refreshes the slot map after a failover and reconnects to nodes by itself. It
//! is not batched: a pipeline must stay within one slot, and the cluster connection already
//! multiplexes the commands of concurrent requests on one connection per node.

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
    Single(Single),
    /// A Redis Cluster.
    Cluster(Box<Cluster>),
}

/// One server: the pool, the connection taken from it and shared, and the batch of queued
/// commands.
pub(super) struct Single {
    pub(super) pool: Pool,
    connection: Mutex<Option<MultiplexedConnection>>,
    pub(super) batch: Batch,
}

/// A cluster: the client made from the seed nodes, and its connection once made.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    connection: Mutex<Option<ClusterConnection>>,
    /// Held while a connection is made, so that concurrent requests make one, not one each.
    connecting: tokio::sync::Mutex<()>,
}

impl Single {
    pub(super) fn new(pool: Pool) -> Self {
        Self {
            pool,
            connection: Mutex::new(None),
            batch: Batch::default(),
        }
    }

    pub(super) fn cached(&self) -> MutexGuard<'_, Option<MultiplexedConnection>> {
        lock(&self.connection)
    }
}

impl Cluster {
    pub(super) fn new(client: ClusterClient) -> Self {
        Self {
            client,
            connection: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// The cluster connection, made the first time. It is kept for the store's life: it repairs
    /// itself (slot refreshes, reconnections to nodes), and one slow or paused node must not cost
    /// the connections to the others.
    pub(super) async fn connection(&self) -> deadpool_redis::redis::RedisResult<ClusterConnection> {
        if let Some(connection) = lock(&self.connection).clone() {
            return Ok(connection);
        }
        let _gate = self.connecting.lock().await;
        if let Some(connection) = lock(&self.connection).clone() {
            return Ok(connection);
        }
        let connection = self.client.get_async_connection().await?;
        *lock(&self.connection) = Some(connection.clone());
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
