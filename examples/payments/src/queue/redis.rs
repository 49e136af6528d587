//! The queue on a Redis Stream (Redis 7 or newer, as the store requires; `XAUTOCLAIM` answers
//! three elements there).
//!
//! | step | command |
//! |---|---|
//! | publish | `XADD <stream> MAXLEN ~ 1000000 * event <json>` (shared connection) |
//! | start, and when the group is gone (`NOGROUP`: Redis restarted empty) | `XGROUP CREATE <stream> <group> 0 MKSTREAM` (from the start: nothing published before the group existed is missed) |
//! | take over the stale | `XAUTOCLAIM <stream> <group> <consumer> <min_idle> <cursor> COUNT <batch>` |
//! | receive new | `XREADGROUP GROUP <group> <consumer> COUNT <batch> BLOCK <block> STREAMS <stream> >` |
//! | done | `XACK <stream> <group> <id>` |
//! | graceful stop | `XGROUP DELCONSUMER`, only when nothing is pending for the consumer |
//!
//! Publishing and the group's bookkeeping go through the store's [`SharedConnection`], which
//! follows a failover. Each consumer reads, claims and acks on a dedicated connection of its own
//! ([`SharedConnection::dedicated`]): its `BLOCK` never holds up the shared one; after any error
//! it is dropped, and the next command makes another.
//!
//! Retention: the stream is trimmed to about [`MAX_LEN`] entries (`MAXLEN ~`). An entry trimmed
//! while still pending is reported as deleted and dropped; keep the stream far longer than the
//! group's backlog can grow.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_redis::redis::{self, Cmd, FromRedisValue};
use tower_idempotency_redis::{RedisConnection, RedisStoreError, SharedConnection};

use super::{ConsumerConfig, Delivery, Queue, QueueConsumer, QueueError};

/// About how many entries the stream keeps.
pub const MAX_LEN: usize = 1_000_000;

/// How long after its `BLOCK` a blocking read may answer before its connection is given up.
const MARGIN: Duration = Duration::from_secs(1);

/// The stream entry's field that carries the message.
const FIELD: &str = "event";

/// A stream entry as Redis returns it: the id and the flat field/value list (nil when deleted).
type Entry = (String, Option<Vec<String>>);

/// A Redis Stream and its consumer group; clones share the connection.
#[derive(Clone)]
pub struct RedisQueue {
    conn: SharedConnection,
    stream: Arc<str>,
    group: Arc<str>,
}

impl RedisQueue {
    /// The queue on `stream`, read by consumer group `group`, which is created if missing.
    pub async fn connect(
        conn: SharedConnection,
        stream: &str,
        group: &str,
    ) -> Result<Self, QueueError> {
        let queue = Self {
            conn,
            stream: stream.into(),
            group: group.into(),
        };
        queue.create_group().await?;
        Ok(queue)
    }

    /// Creates the consumer group, and the stream with it, unless the group exists. It reads from
    /// the start of the stream: nothing published before the group existed is missed.
    async fn create_group(&self) -> Result<(), RedisStoreError> {
        let mut create = redis::cmd("XGROUP");
        create
            .arg("CREATE")
            .arg(&*self.stream)
            .arg(&*self.group)
            .arg("0")
            .arg("MKSTREAM");
        match self.conn.query::<()>(&create).await {
            Err(RedisStoreError::Redis(err)) if err.code() == Some("BUSYGROUP") => Ok(()),
            created => created,
        }
    }
}

#[async_trait]
impl Queue for RedisQueue {
    async fn publish(&self, payload: &str) -> Result<String, QueueError> {
        let mut add = redis::cmd("XADD");
        add.arg(&*self.stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(MAX_LEN)
            .arg("*")
            .arg(FIELD)
            .arg(payload);
        Ok(self.conn.query(&add).await?)
    }

    async fn consumer(
        &self,
        name: &str,
        config: ConsumerConfig,
    ) -> Result<Box<dyn QueueConsumer>, QueueError> {
        let mut consumer = RedisConsumer {
            queue: self.clone(),
            name: name.to_owned(),
            config,
            connection: None,
            cursor: String::from("0-0"),
        };
        consumer.connection().await?;
        Ok(Box::new(consumer))
    }
}

/// A consumer of a [`RedisQueue`]'s group. Dropping it without [`RedisConsumer::close`] leaves its
/// pending entries for the others to take over.
struct RedisConsumer {
    queue: RedisQueue,
    name: String,
    config: ConsumerConfig,
    /// Dedicated: only this consumer's commands, one at a time.
    connection: Option<RedisConnection>,
    /// Where the next `XAUTOCLAIM` goes on scanning the group's pending entries.
    cursor: String,
}

#[async_trait]
impl QueueConsumer for RedisConsumer {
    /// Stale pending entries taken over (`XAUTOCLAIM`), or else new ones (`XREADGROUP`). When
    /// the group is gone (Redis restarted empty), creates it again and returns nothing: the next
    /// receive reads the stream from its start.
    async fn receive(&mut self) -> Result<Vec<Delivery>, QueueError> {
        match self.receive_in_group().await {
            Err(RedisStoreError::Redis(err)) if err.code() == Some("NOGROUP") => {
                tracing::warn!(
                    consumer = %self.name,
                    group = %self.queue.group,
                    "the consumer group is gone; creating it again"
                );
                self.queue.create_group().await?;
                self.cursor = String::from("0-0");
                Ok(Vec::new())
            }
            received => Ok(received?),
        }
    }

    async fn ack(&mut self, id: &str) -> Result<(), QueueError> {
        let mut ack = redis::cmd("XACK");
        ack.arg(&*self.queue.stream).arg(&*self.queue.group).arg(id);
        self.query::<i64>(&ack).await?;
        Ok(())
    }

    async fn close(mut self: Box<Self>) {
        let mut pending = redis::cmd("XPENDING");
        pending
            .arg(&*self.queue.stream)
            .arg(&*self.queue.group)
            .arg("-")
            .arg("+")
            .arg(1)
            .arg(&self.name);
        match self
            .query::<Vec<(String, String, u64, u64)>>(&pending)
            .await
        {
            Ok(entries) if entries.is_empty() => {
                let mut delete = redis::cmd("XGROUP");
                delete
                    .arg("DELCONSUMER")
                    .arg(&*self.queue.stream)
                    .arg(&*self.queue.group)
                    .arg(&self.name);
                if let Err(err) = self.query::<i64>(&delete).await {
                    tracing::debug!(error = %crate::report(&err), "could not leave the group");
                }
            }
            Ok(_) => tracing::info!(
                consumer = %self.name,
                "stopping with messages pending; another consumer takes them over"
            ),
            Err(err) => {
                tracing::debug!(error = %crate::report(&err), "could not leave the group")
            }
        }
    }
}

impl RedisConsumer {
    async fn receive_in_group(&mut self) -> Result<Vec<Delivery>, RedisStoreError> {
        let min_idle = u64::try_from(self.config.min_idle.as_millis()).unwrap_or(u64::MAX);
        let mut claim = redis::cmd("XAUTOCLAIM");
        claim
            .arg(&*self.queue.stream)
            .arg(&*self.queue.group)
            .arg(&self.name)
            .arg(min_idle)
            .arg(&self.cursor)
            .arg("COUNT")
            .arg(self.config.batch);
        // Redis 7 lists entries deleted while pending apart (and forgets them).
        let (cursor, claimed, _deleted): (String, Vec<Entry>, Vec<String>) =
            self.query(&claim).await?;
        self.cursor = cursor;
        if !claimed.is_empty() {
            tracing::info!(
                consumer = %self.name,
                messages = claimed.len(),
                "took over messages another consumer left pending"
            );
            return Ok(claimed.into_iter().map(delivery).collect());
        }

        // `BLOCK 0` would wait forever.
        let block = u64::try_from(self.config.block.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg(&*self.queue.group)
            .arg(&self.name)
            .arg("COUNT")
            .arg(self.config.batch)
            .arg("BLOCK")
            .arg(block)
            .arg("STREAMS")
            .arg(&*self.queue.stream)
            .arg(">");
        let streams: Option<Vec<(String, Vec<Entry>)>> = self.query(&read).await?;
        Ok(streams
            .into_iter()
            .flatten()
            .flat_map(|(_, entries)| entries)
            .map(delivery)
            .collect())
    }

    async fn connection(&mut self) -> Result<&mut RedisConnection, RedisStoreError> {
        let connection = match self.connection.take() {
            Some(connection) => connection,
            None => {
                let bound = self.config.block + MARGIN;
                self.queue.conn.dedicated(bound).await?
            }
        };
        Ok(self.connection.insert(connection))
    }

    /// Runs `command` on the dedicated connection, each command bounded by its `BLOCK` and
    /// [`MARGIN`]. After any error the connection is dropped: one that timed out may be stuck on
    /// a frozen node, and a fresh one finds the cluster as it is now.
    async fn query<T: FromRedisValue>(&mut self, command: &Cmd) -> Result<T, RedisStoreError> {
        let connection = self.connection().await?;
        let answer = command.query_async(connection).await;
        if answer.is_err() {
            self.connection = None;
        }
        answer.map_err(RedisStoreError::Redis)
    }
}

fn delivery((id, fields): Entry) -> Delivery {
    let payload = fields.and_then(|fields| {
        fields
            .chunks_exact(2)
            .find(|pair| pair[0] == FIELD)
            .map(|pair| pair[1].clone())
    });
    Delivery { id, payload }
}

impl fmt::Debug for RedisQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisQueue")
            .field("conn", &self.conn)
            .field("stream", &self.stream)
            .field("group", &self.group)
            .finish()
    }
}

impl fmt::Debug for RedisConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConsumer")
            .field("queue", &self.queue)
            .field("name", &self.name)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
