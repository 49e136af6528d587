//! The store's connection handling, for an application's own commands: [`SharedConnection`].

use std::fmt;
use std::time::Duration;

use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::cluster::ClusterConfig;
use deadpool_redis::redis::{Cmd, FromRedisValue, Pipeline, RedisError, RedisFuture, Value};

use super::calls::io_timeout;
use super::connection::{Backend, Connection};
use super::{RedisStore, RedisStoreError};

/// A connection to Redis (one server or a Redis Cluster) shared by its clones and healing by
/// itself, for an application's own commands (scripts, streams, hashes) beside its records: the
/// one [`RedisStore`] uses, from [`RedisStore::shared_connection`].
///
/// Each call is bounded by the store's timeout ([`RedisStore::with_timeout`], 1 s by default),
/// taking a connection included. After a broken connection or a timeout it heals as the store
/// does (PROTOCOL §10.6): on one server the next call takes a fresh connection from the pool; on
/// a Cluster a fresh cluster connection, with a fresh slot map, is built in the background, so
/// that a master that stopped answering without closing its connections (frozen, hung,
/// partitioned) is left for its promoted replica.
///
/// A blocking command (`XREADGROUP ... BLOCK`, `BLPOP`) would hold up every command behind it
/// on a shared connection, and outlast the timeout: give it a [`dedicated`](Self::dedicated)
/// connection.
///
/// ```no_run
/// use deadpool_redis::redis;
/// use tower_idempotency_redis::RedisStore;
///
/// # async fn run() -> Result<(), tower_idempotency_redis::RedisStoreError> {
/// let store = RedisStore::cluster(["redis://10.0.0.1:6379"])?;
/// let redis = store.shared_connection();
/// let mut add = redis::cmd("XADD");
/// add.arg("{payments}:events").arg("*").arg("event").arg("{}");
/// let id: String = redis.query(&add).await?;
/// // A script, a pipeline, anything that runs on a connection:
/// let script = redis::Script::new("return redis.call('HGETALL', KEYS[1])");
/// let balances: Vec<String> = redis
///     .run(|mut c| async move { script.key("{payments}:balances").invoke_async(&mut c).await })
///     .await?;
/// # let _ = (id, balances);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SharedConnection {
    store: RedisStore,
}

impl RedisStore {
    /// The store's connection to Redis, for the application's own commands: see
    /// [`SharedConnection`].
    pub fn shared_connection(&self) -> SharedConnection {
        SharedConnection {
            store: self.clone(),
        }
    }
}

impl SharedConnection {
    /// Sends `cmd` and reads its answer as `T`.
    ///
    /// # Errors
    /// [`RedisStoreError::Timeout`] past the store's timeout, [`RedisStoreError::Redis`] for
    /// Redis's errors and broken connections.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisStoreError> {
        self.run(|mut connection| async move { cmd.query_async(&mut connection).await })
            .await
    }

    /// Runs `call` on the shared connection (a pipeline, an `EVALSHA` through
    /// `redis::Script::invoke_async`, several commands in turn), within the store's timeout.
    ///
    /// # Errors
    /// As [`query`](Self::query).
    pub async fn run<T, F, Fut>(&self, call: F) -> Result<T, RedisStoreError>
    where
        F: FnOnce(RedisConnection) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let timeout = self.store.inner.timeout;
        self.store
            .on_a_lane(timeout, |connection| {
                call(RedisConnection {
                    connection,
                    response_timeout: None,
                })
            })
            .await
            .map_err(|err| {
                if err.is_timeout() {
                    RedisStoreError::Timeout(timeout)
                } else {
                    RedisStoreError::Redis(err)
                }
            })
    }

    /// A new connection of its own, not shared, for blocking commands: each of its commands may
    /// take up to `response_timeout` (a `BLOCK` and a margin), and fails past it. Made within the
    /// store's timeout; on a Cluster within the store's timeout plus `response_timeout`, as a
    /// seed node that does not answer (frozen, its replica promoted) holds the build that long
    /// before the nodes that answer are used. It does not heal: after an error, make another one.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use deadpool_redis::redis;
    /// use tower_idempotency_redis::RedisStore;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisStore::from_url("redis://127.0.0.1:6379")?;
    /// let mut reads = store.shared_connection().dedicated(Duration::from_secs(6)).await?;
    /// let mut read = redis::cmd("XREADGROUP");
    /// read.arg("GROUP").arg("workers").arg("w1").arg("BLOCK").arg(5000)
    ///     .arg("STREAMS").arg("{payments}:events").arg(">");
    /// let _entries: redis::Value = read.query_async(&mut reads).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`RedisStoreError::Timeout`] when no connection was made in time,
    /// [`RedisStoreError::Pool`] or [`RedisStoreError::Redis`] when it failed.
    pub async fn dedicated(
        &self,
        response_timeout: Duration,
    ) -> Result<RedisConnection, RedisStoreError> {
        let timeout = self.store.inner.timeout;
        let bound = if self.is_cluster() {
            timeout + response_timeout
        } else {
            timeout
        };
        let connect = async {
            match &*self.store.inner.backend {
                // Taken out of the pool for good: a blocking read must not hold a pooled one.
                Backend::Single(single) => single
                    .pool
                    .get()
                    .await
                    .map(|pooled| Connection::Single(deadpool_redis::Connection::take(pooled)))
                    .map_err(RedisStoreError::Pool),
                Backend::Cluster(cluster) => {
                    let config = ClusterConfig::new()
                        .set_connection_timeout(timeout)
                        .set_response_timeout(response_timeout);
                    cluster
                        .client()
                        .get_async_connection_with_config(config)
                        .await
                        .map(Connection::Cluster)
                        .map_err(RedisStoreError::Redis)
                }
            }
        };
        let connection = tokio::time::timeout(bound, connect)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(bound)))?;
        Ok(RedisConnection {
            connection,
            response_timeout: Some(response_timeout),
        })
    }

    /// Whether the connection is to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.store.is_cluster()
    }
}

impl fmt::Debug for SharedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedConnection")
            .field("cluster", &self.is_cluster())
            .field("timeout", &self.store.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// A connection to one server or a Cluster, on which redis-rs commands run alike
/// (`ConnectionLike`): handed to [`SharedConnection::run`]'s call, or made by
/// [`SharedConnection::dedicated`].
#[derive(Clone)]
pub struct RedisConnection {
    connection: Connection,
    /// A dedicated connection's bound on each command; a shared one's call is bounded as a whole.
    response_timeout: Option<Duration>,
}

impl RedisConnection {
    fn bounded<'a, T: Send + 'a>(
        response_timeout: Option<Duration>,
        answer: RedisFuture<'a, T>,
    ) -> RedisFuture<'a, T> {
        match response_timeout {
            None => answer,
            Some(bound) => Box::pin(async move {
                tokio::time::timeout(bound, answer)
                    .await
                    .unwrap_or_else(|_| Err(RedisError::from(io_timeout())))
            }),
        }
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let bound = self.response_timeout;
        Self::bounded(bound, self.connection.req_packed_command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let bound = self.response_timeout;
        Self::bounded(
            bound,
            self.connection.req_packed_commands(pipeline, offset, count),
        )
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

impl fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.connection {
            Connection::Single(_) => "server",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisConnection")
            .field("to", &kind)
            .field("response_timeout", &self.response_timeout)
            .finish()
    }
}
