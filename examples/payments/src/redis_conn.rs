//! Connections to the Redis that holds the event stream and the balances: one server, or a Redis
//! Cluster (every key the example writes is hash-tagged, so that a script's keys and a stream's
//! group commands stay in one slot).
//!
//! Short commands (`XADD`, the balance script, `HGETALL`) share one multiplexed connection, as the
//! idempotency store does. A consumer's blocking read (`XREADGROUP ... BLOCK`) would hold up every
//! command queued behind it on a shared connection, so each consumer opens a dedicated connection
//! of its own for its reads, claims and acks.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::{ClusterClient, ClusterClientBuilder};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::{
    AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisFuture, Value,
};

/// The bound on one command on the shared connection, and on connecting.
pub const TIMEOUT: Duration = Duration::from_secs(1);

/// Redis failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisFailure {
    /// Redis answered with an error, or the connection failed.
    #[error("Redis failed")]
    Redis(#[from] RedisError),
    /// Redis did not answer in time.
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
}

/// A client and the shared connection; clones share them.
#[derive(Clone)]
pub struct RedisConn {
    client: Link,
    shared: Arc<Mutex<Option<Conn>>>,
}

/// Where the commands go.
#[derive(Clone)]
enum Link {
    Server(Client),
    /// The seed URLs: a dedicated connection needs a client with its own response timeout.
    Cluster(Vec<String>),
}

/// A connection to one server or to a cluster; commands run on either alike.
#[derive(Clone)]
pub enum Conn {
    /// To one server.
    Server(MultiplexedConnection),
    /// To a cluster: each command goes to its key's slot.
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// A client for `url`; nothing is connected until the first command.
    pub fn open(url: &str) -> Result<Self, RedisFailure> {
        Ok(Self {
            client: Link::Server(Client::open(url)?),
            shared: Arc::default(),
        })
    }

    /// A client for the Redis Cluster reached through `urls`; nothing is connected until the
    /// first command.
    pub fn cluster(urls: &[String]) -> Result<Self, RedisFailure> {
        cluster_client(urls, TIMEOUT)?;
        Ok(Self {
            client: Link::Cluster(urls.to_vec()),
            shared: Arc::default(),
        })
    }

    /// Runs `command` on the shared connection within [`TIMEOUT`]. A connection that failed or
    /// timed out is dropped, and the next command connects again.
    pub async fn run<T, F, Fut>(&self, command: F) -> Result<T, RedisFailure>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let attempt = async {
            let connection = self.shared_connection().await?;
            command(connection).await.inspect_err(|err| {
                if broken(err) {
                    self.cached().take();
                }
            })
        };
        match tokio::time::timeout(TIMEOUT, attempt).await {
            Ok(result) => Ok(result?),
            Err(_) => {
                self.cached().take();
                Err(RedisFailure::Timeout(TIMEOUT))
            }
        }
    }

    /// A new connection of its own, whose commands may take up to `response_timeout` (a blocking
    /// read's `BLOCK` plus a margin).
    pub async fn dedicated(&self, response_timeout: Duration) -> Result<Conn, RedisFailure> {
        Ok(match &self.client {
            Link::Server(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(TIMEOUT))
                    .set_response_timeout(Some(response_timeout));
                Conn::Server(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                )
            }
            Link::Cluster(urls) => Conn::Cluster(
                cluster_client(urls, response_timeout)?
                    .get_async_connection()
                    .await?,
            ),
        })
    }

    async fn shared_connection(&self) -> Result<Conn, RedisError> {
        if let Some(connection) = self.cached().clone() {
            return Ok(connection);
        }
        let connection = match &self.client {
            Link::Server(client) => Conn::Server(client.get_multiplexed_async_connection().await?),
            Link::Cluster(urls) => Conn::Cluster(
                cluster_client(urls, TIMEOUT)?
                    .get_async_connection()
                    .await?,
            ),
        };
        *self.cached() = Some(connection.clone());
        Ok(connection)
    }

    fn cached(&self) -> std::sync::MutexGuard<'_, Option<Conn>> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A cluster client whose commands may take up to `response_timeout`.
fn cluster_client(
    urls: &[String],
    response_timeout: Duration,
) -> Result<ClusterClient, RedisError> {
    ClusterClientBuilder::new(urls.to_vec())
        .connection_timeout(TIMEOUT)
        .response_timeout(response_timeout)
        .build()
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Server(connection) => connection.req_packed_command(cmd),
            Conn::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Server(connection) => connection.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Server(connection) => connection.get_db(),
            Conn::Cluster(connection) => connection.get_db(),
        }
    }
}

/// Whether `err` means the connection is no good any more.
pub fn broken(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || err.is_unrecoverable_error()
}

impl fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RedisConn");
        match &self.client {
            Link::Server(client) => debug.field("server", client.get_connection_info().addr()),
            Link::Cluster(urls) => debug.field("cluster", urls),
        };
        debug.finish_non_exhaustive()
    }
}
