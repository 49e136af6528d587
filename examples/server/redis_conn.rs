//! Connections to the Redis that holds the event stream and the balances.
//!
//! Short commands (`XADD`, the balance script, `HGETALL`) share one multiplexed connection, as the
//! idempotency store does. A consumer's blocking read (`XREADGROUP ... BLOCK`) would hold up every
//! command queued behind it on a shared connection, so each consumer opens a dedicated connection
//! of its own for its reads, claims and acks.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tower_idempotency::deadpool_redis::redis::aio::MultiplexedConnection;
use tower_idempotency::deadpool_redis::redis::{AsyncConnectionConfig, Client, RedisError};

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
    client: Client,
    shared: Arc<Mutex<Option<MultiplexedConnection>>>,
}

impl RedisConn {
    /// A client for `url`; nothing is connected until the first command.
    pub fn open(url: &str) -> Result<Self, RedisFailure> {
        Ok(Self {
            client: Client::open(url)?,
            shared: Arc::default(),
        })
    }

    /// Runs `command` on the shared connection within [`TIMEOUT`]. A connection that failed or
    /// timed out is dropped, and the next command connects again.
    pub async fn run<T, F, Fut>(&self, command: F) -> Result<T, RedisFailure>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
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
    pub async fn dedicated(
        &self,
        response_timeout: Duration,
    ) -> Result<MultiplexedConnection, RedisFailure> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(response_timeout));
        Ok(self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }

    async fn shared_connection(&self) -> Result<MultiplexedConnection, RedisError> {
        if let Some(connection) = self.cached().clone() {
            return Ok(connection);
        }
        let connection = self.client.get_multiplexed_async_connection().await?;
        *self.cached() = Some(connection.clone());
        Ok(connection)
    }

    fn cached(&self) -> std::sync::MutexGuard<'_, Option<MultiplexedConnection>> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
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
        f.debug_struct("RedisConn")
            .field("server", &self.client.get_connection_info().addr())
            .finish_non_exhaustive()
    }
}
