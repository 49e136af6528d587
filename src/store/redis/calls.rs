//! The store calls on Redis, and how each command travels: batched with other requests' commands
//! on one server, or on its own on a cluster and whenever a replication wait rides along.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::{self, Cmd, FromRedisValue, RedisError, RedisResult, Value};

use super::batch::ClaimRef;
use super::connection::{Backend, Connection, Single};
use super::replication::{ReleaseOnDrop, Replication};
use super::{RedisStore, RedisStoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{
    ClaimToken, Completed, Record, RecordId, encode_in_flight, layout, unix_millis,
};
use crate::store::{Claim, StoreError};

impl RedisStore {
    pub(super) async fn claim_call(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let token = ClaimToken::generate();
        let value = encode_in_flight(&token, fingerprint, SystemTime::now() + lease);
        let key = self.redis_key(id);
        // Sized up front: grown argument by argument, the command would be reallocated each time.
        let mut set = Cmd::with_capacity(7, 3 + key.len() + value.len() + 2 + 2 + 20 + 3);
        set.arg("SET")
            .arg(&key)
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease))
            .arg("GET");
        let existing = match self.batched() {
            Some(single) => self.claim_batched(single, set, (key, token)).await?,
            None => self.claim_direct(set, (key, token)).await?,
        };
        match existing {
            None => Ok(Claim::Claimed(token)),
            // A claim the client sent again (a cluster connection re-sends a command after a
            // dropped connection) finds the record its first sending wrote: it is this claim's.
            Some(bytes) if is_claim_of(&bytes, &token) => Ok(Claim::Claimed(token)),
            Some(bytes) => Record::decode(Bytes::from(bytes))
                .map(Claim::Existing)
                .map_err(|err| StoreError::Codec(Box::new(err))),
        }
    }

    /// A claim in the next pipeline: if this caller stops waiting, the pipeline releases the
    /// claim behind its `SET` (see `batch`).
    async fn claim_batched(
        &self,
        single: &Single,
        set: Cmd,
        claim: ClaimRef,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        // The pipeline answers within the timeout, or fails.
        match self.queue(single, set, Some(claim)).await {
            Ok(Ok(existing)) => Option::<Vec<u8>>::from_redis_value(existing)
                .map_err(|err| self.redis_error(RedisError::from(err))),
            Ok(Err(err)) => Err(self.claim_error(err)),
            Err(_) => Err(StoreError::Timeout(self.inner.timeout)),
        }
    }

    /// A claim on its own, released behind if its caller stops waiting or too few replicas
    /// acknowledged it.
    async fn claim_direct(&self, set: Cmd, claim: ClaimRef) -> Result<Option<Vec<u8>>, StoreError> {
        let token = claim.1;
        let release = ReleaseOnDrop::new(self, claim);
        let (answer, acks) = match &self.inner.replication {
            Some(replication) => {
                let (answer, acked) = self
                    .replicated(replication, set)
                    .await
                    .map_err(|err| self.claim_error(err))?;
                (answer, Some((acked, replication.replicas)))
            }
            None => {
                let answer = self
                    .direct::<Value>(set)
                    .await
                    .map_err(|err| self.claim_error(err))?;
                (answer, None)
            }
        };
        let existing = Option::<Vec<u8>>::from_redis_value(answer)
            .map_err(|err| self.redis_error(RedisError::from(err)))?;
        let claimed = existing
            .as_deref()
            .is_none_or(|bytes| is_claim_of(bytes, &token));
        if claimed
            && let Some((acked, wanted)) = acks
            && acked < wanted
        {
            // `release` frees the key as it drops: the handler must not run on this claim.
            return Err(StoreError::Unavailable(Box::new(
                RedisStoreError::NotReplicated { acked, wanted },
            )));
        }
        release.disarm();
        Ok(existing)
    }

    pub(super) async fn complete_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let value = completed
            .encode()
            .map_err(|err| StoreError::Codec(Box::new(err)))?;
        let ttl = millis(ttl).to_string();
        let replication = self.inner.replication.as_ref();
        self.fenced(
            &self.inner.complete,
            id,
            token,
            &[&value, ttl.as_bytes()],
            replication,
        )
        .await
    }

    pub(super) async fn renew_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease_end = unix_millis(SystemTime::now() + lease).to_le_bytes();
        let lease = millis(lease).to_string();
        let args: [&[u8]; 2] = [&lease_end, lease.as_bytes()];
        self.fenced(&self.inner.renew, id, token, &args, None).await
    }

    pub(super) async fn release_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> Result<bool, StoreError> {
        self.fenced(&self.inner.release, id, token, &[], None).await
    }

    /// The one server, when its commands go in batches: not on a cluster (a pipeline must stay
    /// in one slot), and not with a replication wait (its `WAIT` goes with its own write).
    fn batched(&self) -> Option<&Single> {
        match &*self.inner.backend {
            Backend::Single(single) if self.inner.replication.is_none() => Some(single),
            _ => None,
        }
    }

    /// The lane for a command sent on its own: lane 0, or with the replication wait the next
    /// lane in turn.
    fn pick_lane(&self) -> usize {
        let spread = self.inner.replication.is_some();
        match &*self.inner.backend {
            Backend::Single(single) => single.pick(spread),
            Backend::Cluster(cluster) => cluster.pick(spread),
        }
    }

    /// A connection for a command sent on its own.
    pub(super) async fn connection(&self) -> RedisResult<Connection> {
        self.connection_on(self.pick_lane()).await
    }

    async fn connection_on(&self, lane: usize) -> RedisResult<Connection> {
        match &*self.inner.backend {
            Backend::Single(single) => Ok(Connection::Single(
                self.single_connection(single, lane).await?,
            )),
            Backend::Cluster(cluster) => Ok(Connection::Cluster(cluster.connection(lane).await?)),
        }
    }

    /// Lane `lane`'s multiplexed connection, taken from the pool the first time and after a
    /// failure.
    async fn single_connection(
        &self,
        single: &Single,
        lane: usize,
    ) -> RedisResult<MultiplexedConnection> {
        if let Some(pooled) = &*single.lanes.lane(lane) {
            return Ok(MultiplexedConnection::clone(pooled));
        }
        // Boxed: the pool's future is large (about 7 KiB, as it may connect), and every request
        // future that awaits a store call would otherwise carry it, and copy it, for this rare path.
        Box::pin(async {
            let pooled = single.pool.get().await.map_err(|err| {
                RedisError::from(std::io::Error::other(RedisStoreError::Pool(err)))
            })?;
            let connection = MultiplexedConnection::clone(&pooled);
            *single.lanes.lane(lane) = Some(pooled);
            Ok(connection)
        })
        .await
    }

    /// Runs one call, mapping its error to the store's.
    pub(super) async fn run<T>(
        &self,
        call: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, StoreError> {
        call.await.map_err(|err| {
            if err.is_timeout() {
                StoreError::Timeout(self.inner.timeout)
            } else {
                self.redis_error(err)
            }
        })
    }

    pub(super) fn redis_error(&self, err: RedisError) -> StoreError {
        self.forget_if_broken(0, &err);
        StoreError::Unavailable(Box::new(RedisStoreError::Redis(err)))
    }

    /// Drops lane `lane`'s connection to one server when `err` says it is broken, so that the
    /// next call takes a fresh one from the pool. A cluster connection repairs itself.
    fn forget_if_broken(&self, lane: usize, err: &RedisError) {
        if let Backend::Single(single) = &*self.inner.backend
            && (err.is_io_error()
                || err.is_connection_dropped()
                || err.is_connection_refusal()
                || err.is_timeout()
                || err.is_unrecoverable_error())
        {
            single.lanes.lane(lane).take();
        }
    }

    fn claim_error(&self, err: RedisError) -> StoreError {
        if err.is_timeout() {
            StoreError::Timeout(self.inner.timeout)
        } else {
            too_old(self.redis_error(err))
        }
    }

    /// Sends `cmd` and returns its answer: in the next batch on one server, on its own
    /// otherwise.
    pub(super) async fn send<T: FromRedisValue>(&self, cmd: Cmd) -> RedisResult<T> {
        let answer = match self.batched() {
            Some(single) => self
                .queue(single, cmd, None)
                .await
                .unwrap_or_else(|_| Err(dropped()))?,
            None => self.direct::<Value>(cmd).await?,
        };
        T::from_redis_value(answer).map_err(RedisError::from)
    }

    /// Sends `cmd` on its own, bounded by the store's timeout.
    pub(super) async fn direct<T: FromRedisValue>(&self, cmd: Cmd) -> RedisResult<T> {
        self.on_a_lane(self.inner.timeout, |mut connection| async move {
            cmd.query_async::<T>(&mut connection).await
        })
        .await
    }

    /// Runs `call` on a connection (see [`RedisStore::pick_lane`]) within `bound`, dropping the
    /// connection of one server when it broke or timed out.
    pub(super) async fn on_a_lane<T, F, Fut>(&self, bound: Duration, call: F) -> RedisResult<T>
    where
        F: FnOnce(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let lane = self.pick_lane();
        let attempt = async { call(self.connection_on(lane).await?).await };
        let answer = tokio::time::timeout(bound, attempt)
            .await
            .unwrap_or_else(|_| Err(RedisError::from(io_timeout())));
        if let Err(err) = &answer {
            self.forget_if_broken(lane, err);
        }
        answer
    }

    /// Sends `cmd` with the replication wait: its answer, and how many replicas acknowledged.
    /// Bounded by the store's timeout plus the wait's.
    pub(super) async fn replicated(
        &self,
        replication: &Replication,
        cmd: Cmd,
    ) -> RedisResult<(Value, u32)> {
        let pipe = replication.pipeline(cmd);
        let bound = self.inner.timeout + replication.timeout;
        let (answer, acked) = self
            .on_a_lane(bound, |mut connection| async move {
                pipe.query_async::<(Value, Value)>(&mut connection).await
            })
            .await?;
        Ok((answer, Replication::acked(&acked)))
    }

    /// Queues `cmd` for the next pipeline; `claim` names the claim a `SET ... NX` makes, for the
    /// pipeline to release if its caller stops waiting. The first command of a batch starts the
    /// task that sends it, once the requests that are ready now have queued theirs.
    fn queue(
        &self,
        single: &Single,
        cmd: Cmd,
        claim: Option<ClaimRef>,
    ) -> tokio::sync::oneshot::Receiver<RedisResult<Value>> {
        let (answer, first) = single.batch.push(cmd, claim);
        if first {
            let store = self.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let Backend::Single(single) = &*store.inner.backend else {
                    return;
                };
                let pipeline = single.batch.take();
                // One bound for taking a connection and the round trip: every caller gets its
                // answer, or an error, within the store's timeout.
                let deadline = tokio::time::Instant::now() + store.inner.timeout;
                let connection = store.single_connection(single, 0);
                let failure = match tokio::time::timeout_at(deadline, connection).await {
                    Ok(Ok(connection)) => {
                        pipeline
                            .send(connection, deadline, store.inner.release.source)
                            .await
                    }
                    Ok(Err(err)) => Some(pipeline.fail(&err)),
                    Err(_) => Some(pipeline.fail(&io_timeout())),
                };
                if let Some(err) = failure {
                    // Drops the shared connection when the error says it is broken.
                    store.redis_error(err);
                }
            });
        }
        answer
    }
}

/// Whether `bytes` is the in-flight record that the claim with `token` wrote.
fn is_claim_of(bytes: &[u8], token: &ClaimToken) -> bool {
    bytes.get(layout::KIND) == Some(&layout::IN_FLIGHT)
        && bytes.get(layout::TOKEN) == Some(token.as_bytes().as_slice())
}

/// The error of a call that did not get a connection or an answer in time.
pub(super) fn io_timeout() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "Redis did not answer within the store's timeout",
    )
}

/// The error of a command whose pipeline went away without answering it.
fn dropped() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Io,
        "Redis did not answer the pipeline carrying this command",
    ))
}

/// Milliseconds for `PX` and `WAIT`: at least 1 (Redis refuses a `PX` of 0, and a `WAIT` of 0
/// waits for ever).
pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A server older than 7.0 rejects `SET` with both `NX` and `GET` as a syntax error.
fn too_old(err: StoreError) -> StoreError {
    if let StoreError::Unavailable(source) = &err
        && let Some(RedisStoreError::Redis(redis)) = source.downcast_ref::<RedisStoreError>()
        && redis
            .to_string()
            .to_ascii_lowercase()
            .contains("syntax error")
    {
        return StoreError::Unavailable(Box::new(RedisStoreError::ServerTooOld(String::from(
            "< 7.0",
        ))));
    }
    err
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_older_than_7_gets_a_clear_error() {
        // Redis 6.2 answers `SET key value NX PX 1000 GET` with "ERR syntax error".
        let reply = redis::make_extension_error("ERR".into(), Some("syntax error".into()));
        let err = too_old(StoreError::Unavailable(Box::new(RedisStoreError::Redis(
            reply,
        ))));
        let StoreError::Unavailable(source) = err else {
            panic!("still a store failure")
        };
        let message = source.to_string();
        assert!(message.contains("7.0 or newer"), "{message}");
    }

    #[test]
    fn other_errors_are_left_alone() {
        let reply = redis::make_extension_error("OOM".into(), Some("out of memory".into()));
        let err = too_old(StoreError::Unavailable(Box::new(RedisStoreError::Redis(
            reply,
        ))));
        let StoreError::Unavailable(source) = err else {
            panic!("still a store failure")
        };
        assert!(!source.to_string().contains("7.0"), "{source}");
    }

    #[test]
    fn a_claim_knows_its_own_record_and_no_other() {
        let token = ClaimToken::generate();
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let mine = encode_in_flight(&token, &fingerprint, SystemTime::now());
        let theirs = encode_in_flight(&ClaimToken::generate(), &fingerprint, SystemTime::now());
        assert!(is_claim_of(&mine, &token));
        assert!(!is_claim_of(&theirs, &token));
        assert!(
            !is_claim_of(&mine[..10], &token),
            "a short value is not a claim"
        );
    }
}
