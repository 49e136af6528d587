//! The store calls on Redis, and how each command travels: batched with other requests' commands
//! on one server, or on its own on a cluster and whenever a replication wait rides along.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::{self, Cmd, FromRedisValue, RedisError, RedisResult, Value};

use super::batch::{ClaimRef, ReleaseBehind};
use super::compression::decompress;
use super::connection::{Backend, Connection, Single, WAIT_LANES};
use super::replication::Replication;
use super::scripts::load_on;
use super::{RedisStore, RedisStoreError};
use tower_idempotency::record::{
    ClaimToken, Completed, Fence, Fingerprint, Record, RecordId, layout,
};
use tower_idempotency::store::{Claim, StoreError};

impl RedisStore {
    pub(super) async fn claim_call(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let key = self.redis_key(id);
        let lease_ms = millis(lease).to_string();
        // Redis numbers the claim: the script writes the fence into the token's first half.
        let claim = |token: &ClaimToken| {
            let value = layout::in_flight(token, fingerprint, SystemTime::now() + lease);
            let script = &self.inner.claim;
            // Sized up front: grown argument by argument, the command would be reallocated each time.
            let size = 7 + script.hash.len() + 1 + key.len() + value.len() + lease_ms.len();
            let mut cmd = Cmd::with_capacity(6, size);
            cmd.arg("EVALSHA")
                .arg(&script.hash)
                .arg(1)
                .arg(&key)
                .arg(value)
                .arg(&lease_ms);
            cmd
        };
        let (key, claim) = (&key, &claim);
        let send = |token: ClaimToken| async move {
            let cmd = claim(&token);
            match self.batched() {
                Some(single) => match single.batch.alone() {
                    Some(_on_the_way) => self.claim_alone(single, cmd, (key.clone(), token)).await,
                    None => self.claim_batched(single, cmd, (key.clone(), token)).await,
                },
                None => self.claim_direct(cmd, (key.clone(), token)).await,
            }
        };
        let mut token = ClaimToken::new(Fence::new(0));
        let record = match send(token).await {
            // Redis lost its scripts (a restart, `SCRIPT FLUSH`): nothing ran; load it, once. The
            // claim is sent again under a token of its own: the first one's release may still be
            // on its way (a claim answered with an error is released behind), and must not free
            // this one.
            Err(err) if is_no_script(&err) => {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(self.inner.claim.source);
                self.run(load_on(self, load, key)).await?;
                token = ClaimToken::new(Fence::new(0));
                send(token).await?
            }
            answer => answer?,
        };
        // The record under the key: this claim's (written now, or by an earlier sending of it
        // whose answer was lost: a cluster connection re-sends a command after a dropped
        // connection), with the fence Redis gave it, or another one's.
        match claimed_fence(&record, &token) {
            Some(fence) => Ok(Claim::Claimed(token.with_fence(fence))),
            None => {
                let record = decompress(record, self.inner.max_decompressed)
                    .map_err(|err| StoreError::Unreadable(err.into()))?;
                Record::decode(Bytes::from(record))
                    .map(|record| Claim::Existing(at_least_a_millisecond_left(record)))
                    .map_err(|err| StoreError::Codec(Box::new(err)))
            }
        }
    }

    /// A claim in the next pipeline: if this caller stops waiting, the pipeline releases the
    /// claim behind its `SET` (see `batch`).
    async fn claim_batched(
        &self,
        single: &Single,
        set: Cmd,
        claim: ClaimRef,
    ) -> Result<Vec<u8>, StoreError> {
        // The pipeline answers within the timeout, or fails.
        match self.queue(single, set, Some(claim)).await {
            Ok(Ok(record)) => Vec::<u8>::from_redis_value(record)
                .map_err(|err| self.redis_error(RedisError::from(err))),
            Ok(Err(err)) => Err(self.call_error(err)),
            Err(_) => Err(StoreError::Timeout(self.inner.timeout)),
        }
    }

    /// A claim sent on its own to the one server, nothing else being on its way: like a claim in
    /// a batch, released behind its `SET` on the same connection if its caller stops waiting or
    /// it fails, within the same deadline for the connection and the round trip.
    async fn claim_alone(
        &self,
        single: &Single,
        set: Cmd,
        claim: ClaimRef,
    ) -> Result<Vec<u8>, StoreError> {
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        let connection = tokio::time::timeout_at(deadline, self.single_connection(single, 0));
        let mut connection = match connection.await {
            Ok(Ok(connection)) => connection,
            Ok(Err(err)) => return Err(self.redis_error(err)),
            Err(_) => return Err(self.redis_error(RedisError::from(io_timeout()))),
        };
        let behind = ReleaseBehind::new(&connection, claim, self.inner.release.source);
        let answer = tokio::time::timeout_at(deadline, set.query_async::<Value>(&mut connection))
            .await
            .unwrap_or_else(|_| Err(RedisError::from(io_timeout())));
        // An error leaves `behind` armed: whether the `SET` ran is not known, and the fenced
        // release does nothing where it did not claim.
        let answer = answer.map_err(|err| {
            self.forget_if_broken(0, &err);
            self.call_error(err)
        })?;
        behind.disarm();
        Vec::<u8>::from_redis_value(answer).map_err(|err| self.redis_error(RedisError::from(err)))
    }

    /// A claim on its own (on a cluster, or with the replication wait), released behind its `SET`
    /// on the connection it went out on if its caller stops waiting, it fails, or too few
    /// replicas acknowledged it: on another lane the release could run first (while the claim
    /// waits behind another claim's `WAIT`), find nothing, and leave the key claimed by nobody.
    async fn claim_direct(&self, set: Cmd, claim: ClaimRef) -> Result<Vec<u8>, StoreError> {
        let token = claim.1;
        let replication = self.inner.replication.as_ref();
        let bound = self.inner.timeout + replication.map_or(Duration::ZERO, |r| r.timeout);
        let deadline = tokio::time::Instant::now() + bound;
        let lane = self.pick_lane();
        let failed = |err: RedisError| {
            self.forget_if_broken(lane, &err);
            self.call_error(err)
        };
        let mut connection = match tokio::time::timeout_at(deadline, self.connection_on(lane)).await
        {
            Ok(Ok(connection)) => connection,
            Ok(Err(err)) => return Err(failed(err)),
            Err(_) => return Err(failed(RedisError::from(io_timeout()))),
        };
        let behind = ReleaseBehind::new(&connection, claim, self.inner.release.source);
        let answer = async {
            match replication {
                Some(replication) => {
                    let pipe = replication.pipeline(set);
                    let (answer, acked) =
                        pipe.query_async::<(Value, Value)>(&mut connection).await?;
                    Ok((
                        answer,
                        Some((Replication::acked(&acked), replication.replicas)),
                    ))
                }
                None => Ok((set.query_async::<Value>(&mut connection).await?, None)),
            }
        };
        let (answer, acks) = tokio::time::timeout_at(deadline, answer)
            .await
            .unwrap_or_else(|_| Err(RedisError::from(io_timeout())))
            .map_err(failed)?;
        let record = Vec::<u8>::from_redis_value(answer)
            .map_err(|err| self.redis_error(RedisError::from(err)))?;
        if claimed_fence(&record, &token).is_some()
            && let Some((acked, wanted)) = acks
            && acked < wanted
        {
            // `behind` frees the key as it drops: the handler must not run on this claim.
            return Err(StoreError::Unavailable(Box::new(
                RedisStoreError::NotReplicated { acked, wanted },
            )));
        }
        behind.disarm();
        Ok(record)
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
        let value = match self.inner.compression {
            Some(compression) => compression.compress(value, self.inner.max_decompressed),
            None => value,
        };
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
        // Redis stamps the new lease end from its clock (renew.lua).
        let lease = millis(lease).to_string();
        self.fenced(&self.inner.renew, id, token, &[lease.as_bytes()], None)
            .await
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

    /// Lane `lane`'s multiplexed connection, taken from the pool the first time, after a
    /// failure, and when the kept one died while it was quiet ([`Single::checked`]).
    async fn single_connection(
        &self,
        single: &Single,
        lane: usize,
    ) -> RedisResult<MultiplexedConnection> {
        if let Some(kept) = single.checked(lane).await {
            return Ok(kept);
        }
        // Boxed: the pool's future is large (about 7 KiB, as it may connect), and every request
        // future that awaits a store call would otherwise carry it, and copy it, for this rare path.
        Box::pin(async {
            let _taking = single.taking[lane % WAIT_LANES].lock().await;
            // Another call took one for this lane meanwhile.
            if let Some(kept) = &*single.lanes.lane(lane) {
                single.used_now(lane);
                return Ok(MultiplexedConnection::clone(kept));
            }
            // The pool checks a connection it kept idle (`PING`) before handing it out, and
            // discards it if it is dead.
            let pooled = single.pool.get().await.map_err(pool_error)?;
            let connection = MultiplexedConnection::clone(&pooled);
            *single.lanes.lane(lane) = Some(pooled);
            single.used_now(lane);
            Ok(connection)
        })
        .await
    }

    /// Runs one call, mapping its error to the store's.
    pub(super) async fn run<T>(
        &self,
        call: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, StoreError> {
        call.await.map_err(|err| self.call_error(err))
    }

    pub(super) fn redis_error(&self, err: RedisError) -> StoreError {
        if err.code() == Some("OOM") {
            // Redis is reachable and full (`maxmemory` under `noeviction`): no room for the
            // record, as the store contract names it, not an outage (§10.6).
            self.inner.full.warn(&err);
            return StoreError::Full { retry_after: None };
        }
        self.forget_if_broken(0, &err);
        StoreError::Unavailable(Box::new(RedisStoreError::Redis(err)))
    }

    /// Drops lane `lane`'s connection when `err` says it is broken or timed out (see
    /// [`Backend::forget_if_broken`]).
    fn forget_if_broken(&self, lane: usize, err: &RedisError) {
        self.inner.backend.forget_if_broken(lane, err);
    }

    /// A call's error: a timeout as such, anything else a Redis failure.
    fn call_error(&self, err: RedisError) -> StoreError {
        if err.is_timeout() {
            StoreError::Timeout(self.inner.timeout)
        } else {
            self.redis_error(err)
        }
    }

    /// Sends `cmd` and returns its answer: in the next batch on one server, on its own
    /// otherwise.
    pub(super) async fn send<T: FromRedisValue>(&self, cmd: Cmd) -> RedisResult<T> {
        let answer = match self.batched() {
            Some(single) => match single.batch.alone() {
                Some(_on_the_way) => self.direct::<Value>(cmd).await?,
                None => self
                    .queue(single, cmd, None)
                    .await
                    .unwrap_or_else(|_| Err(dropped()))?,
            },
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

    /// Queues `cmd` for the next pipeline; `claim` names the claim the claim script makes, for the
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
                let Backend::Single(single) = &*store.inner.backend else {
                    return;
                };
                let _on_the_way = single.batch.started();
                tokio::task::yield_now().await;
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
                    Ok(Err(err)) => Some(pipeline.fail(err)),
                    Err(_) => Some(pipeline.fail(RedisError::from(io_timeout()))),
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

/// The fence of the claim with `token` if `record` is the in-flight record it wrote (matched by
/// the token's unique half: the caller learns the fence from the record).
pub(super) fn claimed_fence(record: &[u8], token: &ClaimToken) -> Option<Fence> {
    if record.get(layout::KIND) != Some(&layout::IN_FLIGHT) {
        return None;
    }
    let stored = ClaimToken::from_bytes(record.get(layout::TOKEN)?.try_into().ok()?);
    (stored.unique_half() == token.unique_half()).then(|| stored.fence())
}

/// Whether a call failed because Redis did not know the script it named.
fn is_no_script(err: &StoreError) -> bool {
    if let StoreError::Unavailable(source) = err
        && let Some(RedisStoreError::Redis(redis)) = source.downcast_ref::<RedisStoreError>()
    {
        return redis.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
    }
    false
}

/// The error of a call that did not get a connection or an answer in time.
pub(super) fn io_timeout() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "Redis did not answer within the store's timeout",
    )
}

/// A connection the pool could not give, as the error of the call that needed it. When the pool
/// could not connect, Redis's own error (connection refused, authentication failed), so that the
/// call's error names its cause once and is classified as a lone call's would be; the pool's other
/// failures (its wait timed out, it was closed) wrapped as [`RedisStoreError::Pool`].
pub(super) fn pool_error(err: deadpool_redis::PoolError) -> RedisError {
    match err {
        deadpool_redis::PoolError::Backend(err) => err,
        other => RedisError::from(std::io::Error::other(RedisStoreError::Pool(other))),
    }
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

/// An in-flight record read from the key has not expired, so more than zero of its lease is left
/// (§10.1); its lease end, in whole milliseconds, can read as none left while the key still lives
/// for the rest of that millisecond.
fn at_least_a_millisecond_left(record: Record) -> Record {
    match record {
        Record::InFlight(mut in_flight) => {
            in_flight.lease_remaining = in_flight.lease_remaining.max(Duration::from_millis(1));
            Record::InFlight(in_flight)
        }
        completed => completed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_knows_its_own_record_and_its_fence_and_no_other() {
        let token = ClaimToken::new(Fence::new(0));
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        // As the claim script writes it: the fence Redis gave, over the zero one.
        let mine = layout::in_flight(
            &token.with_fence(Fence::new(42)),
            &fingerprint,
            SystemTime::now(),
        );
        let theirs = layout::in_flight(
            &ClaimToken::new(Fence::new(42)),
            &fingerprint,
            SystemTime::now(),
        );
        assert_eq!(claimed_fence(&mine, &token), Some(Fence::new(42)));
        assert_eq!(claimed_fence(&theirs, &token), None);
        assert_eq!(
            claimed_fence(&mine[..10], &token),
            None,
            "a short value is not a claim"
        );
    }

    /// A pool that could not connect fails the call with Redis's own error, named once and
    /// classified as a refused connection (the lane is dropped, the call is `Unavailable`).
    #[test]
    fn a_pool_that_could_not_connect_fails_with_redis_s_own_error() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let err = pool_error(deadpool_redis::PoolError::Backend(refused));
        assert!(err.is_connection_refusal());
        assert_eq!(err.to_string(), "connection refused");
        let closed = pool_error(deadpool_redis::PoolError::Closed);
        assert_eq!(
            closed.to_string(),
            "could not take a Redis connection from the pool"
        );
    }

    #[test]
    fn an_in_flight_record_read_at_its_lease_end_has_a_millisecond_left() {
        let record = layout::in_flight(
            &ClaimToken::new(Fence::new(42)),
            &Fingerprint::from_bytes([1; 32]),
            SystemTime::now(),
        );
        let Ok(Record::InFlight(read)) = Record::decode(Bytes::from(record.to_vec())) else {
            panic!("an in-flight record");
        };
        assert_eq!(
            read.lease_remaining,
            Duration::ZERO,
            "the lease end, read as it is"
        );
        let Record::InFlight(answered) = at_least_a_millisecond_left(Record::InFlight(read)) else {
            panic!("an in-flight record");
        };
        assert_eq!(answered.lease_remaining, Duration::from_millis(1));
    }
}
