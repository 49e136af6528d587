//! The store's calls: the `Store` implementation, each call one statement run by `PgStore::run`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use tokio::time::Instant;

use super::tx::Taken;
use super::{CLAIM_RUNS, PgStore, PgStoreError, is_connection_failure, millis};
use tower_idempotency::record::{
    ClaimToken, Completed, DecodeError, Fence, Fingerprint, InFlight, Record, RecordId,
};
use tower_idempotency::store::{Claim, ForgetOutcome, Inspected, OperatorStore, Store, StoreError};

impl PgStore {
    /// Runs the completion statement for the claim `token` on `conn`, in whatever transaction
    /// `conn` is in, so that the record commits or rolls back with the caller's own writes. The
    /// caller bounds it (a transaction is the caller's to time out). `bytes` is
    /// [`Completed::encode`]'s output, `fingerprint` the completed record's.
    pub(crate) async fn complete_on(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: &ClaimToken,
        fingerprint: &Fingerprint,
        bytes: &[u8],
        ttl: Duration,
    ) -> Result<bool, sqlx::Error> {
        // Nearly always the claim's own in-flight row is there: one update. Otherwise (the row
        // was swept, taken over after its lease, or this completion was written before), the
        // whole statement decides.
        for sql in self.inner.complete_sql() {
            let done = sqlx::query(sql)
                .bind(id.as_bytes().as_slice())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(token.as_bytes().as_slice())
                .bind(bytes)
                .bind(millis(ttl))
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() == 1 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A fenced statement (renew or release): whether it changed the claim's row.
    async fn fenced(
        &self,
        sql: &str,
        id: &RecordId,
        token: &ClaimToken,
        lease: Option<Duration>,
    ) -> Result<bool, StoreError> {
        self.run(move |mut conn| async move {
            let mut query = sqlx::query(sql)
                .bind(id.as_bytes().as_slice())
                .bind(token.as_bytes().as_slice());
            if let Some(lease) = lease {
                query = query.bind(millis(lease));
            }
            Ok(query.execute(&mut *conn).await?.rows_affected() == 1)
        })
        .await
    }

    /// Releases a claim whose statement was sent but whose answer never reached its caller (a
    /// timeout, a broken connection, or the request dropped), in the background. The statement
    /// may still be waiting in the server (on a lock, say) and commit later, so a release that
    /// finds nothing is tried again, with backoff, until the claim's lease would have run out
    /// anyway.
    fn release_behind(&self, id: RecordId, token: ClaimToken, lease: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.clone();
        runtime.spawn(async move {
            let deadline = Instant::now() + lease;
            let mut backoff = Duration::from_millis(100);
            while !matches!(store.release_call(&id, &token).await, Ok(true)) {
                if Instant::now() + backoff >= deadline {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            tracing::debug!(
                target: "tower_idempotency",
                record = %id.tag(),
                "released a claim whose answer was lost"
            );
        });
    }
}

// Each call is boxed, as in `RedisStore`: a call's future holds the pool's and the query's, and
// would otherwise be carried, and copied, inside every request future that awaits it.
impl Store for PgStore {
    fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        Box::pin(self.claim_call(id, fingerprint, lease))
    }

    fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.complete_call(id, token, completed, ttl))
    }

    fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.fenced(&self.inner.statements.renew, id, token, Some(lease)))
    }

    fn release(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        Box::pin(self.release_call(id, token))
    }

    /// With [`PgStore::with_notifications`]: a completion or release of `id` by any instance.
    fn changed(&self, id: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        let inner = &self.inner;
        inner.notifies.then(|| {
            inner
                .notifier
                .changed(&inner.pool, &inner.statements.channel, id)
        })
    }

    fn prepare(&self, _id: &RecordId, token: &ClaimToken, extensions: &mut http::Extensions) {
        self.prepare_call(token, extensions);
    }
}

impl OperatorStore for PgStore {
    fn inspect(
        &self,
        id: &RecordId,
    ) -> impl Future<Output = Result<Option<Inspected>, StoreError>> + Send {
        Box::pin(self.inspect_call(id))
    }

    fn forget(
        &self,
        id: &RecordId,
        force: bool,
    ) -> impl Future<Output = Result<ForgetOutcome, StoreError>> + Send {
        Box::pin(self.forget_call(id, force))
    }
}

/// A claim's row: the claim's own token, or another claim's live record.
struct ClaimRow {
    token: Vec<u8>,
    fingerprint: Option<Vec<u8>>,
    completed: Option<Vec<u8>>,
    remaining_ms: Option<i64>,
}

impl ClaimRow {
    fn read(row: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            token: row.try_get(0)?,
            fingerprint: row.try_get(1)?,
            completed: row.try_get(2)?,
            remaining_ms: row.try_get(3)?,
        })
    }

    /// What the claim found. Its own token's unique half means it claimed the key (in this run
    /// of the statement or in an earlier one whose answer was lost).
    fn into_claim(self, token: ClaimToken) -> Result<Claim, DecodeError> {
        if let Some(bytes) = self.completed {
            return match Record::decode(Bytes::from(bytes))? {
                Record::Completed(completed) => Ok(Claim::Existing(Record::Completed(completed))),
                Record::InFlight(_) => Err(DecodeError::Malformed("an in-flight completed record")),
            };
        }
        if self.token.get(8..) == Some(token.unique_half()) {
            // With the fence the database gave it.
            let bytes = <[u8; 16]>::try_from(self.token.as_slice())
                .map_err(|_| DecodeError::Malformed("claim token"))?;
            return Ok(Claim::Claimed(ClaimToken::from_bytes(bytes)));
        }
        let fingerprint = self
            .fingerprint
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .ok_or(DecodeError::Malformed("fingerprint"))?;
        let remaining = u64::try_from(self.remaining_ms.unwrap_or(0)).unwrap_or(0);
        Ok(Claim::Existing(Record::InFlight(InFlight {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            lease_remaining: Duration::from_millis(remaining),
        })))
    }
}

impl PgStore {
    async fn claim_call(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        // The database numbers the claim: its fence is filled in by the statement.
        let token = ClaimToken::new(Fence::new(0));
        // Armed once the statement may have been sent, until its answer arrives: a claim whose
        // answer is lost may still land.
        let sent = AtomicBool::new(false);
        let mut abandoned = Abandoned {
            store: self,
            sent: &sent,
            claim: Some((*id, token, lease)),
        };
        let (sql, sent) = (self.inner.statements.claim.as_str(), &sent);
        let lease_ms = millis(lease);
        let row = self
            .run(move |mut conn| async move {
                sent.store(true, Ordering::Relaxed);
                for _ in 0..CLAIM_RUNS {
                    let row = sqlx::query(sql)
                        .bind(id.as_bytes().as_slice())
                        .bind(fingerprint.as_bytes().as_slice())
                        .bind(token.as_bytes().as_slice())
                        .bind(lease_ms)
                        .fetch_optional(&mut *conn)
                        .await
                        .inspect_err(|err| {
                            // The server answered with an error: the statement rolled back.
                            if !is_connection_failure(err) {
                                sent.store(false, Ordering::Relaxed);
                            }
                        })?;
                    if let Some(row) = row {
                        return ClaimRow::read(&row).map(Some);
                    }
                }
                Ok(None)
            })
            .await?;
        abandoned.claim = None;
        row.ok_or_else(|| StoreError::Unavailable(Box::new(PgStoreError::Contended)))?
            .into_claim(token)
            .map_err(|err| StoreError::Codec(Box::new(err)))
    }

    async fn complete_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let bytes = completed
            .encode()
            .map_err(|err| StoreError::Codec(Box::new(err)))?;
        let (bytes, fingerprint) = (bytes.as_slice(), &completed.fingerprint);
        match self.inner.open.take(token) {
            Some(Taken::Begun(tx)) => {
                return self
                    .commit_with(tx, id, token, fingerprint, bytes, ttl)
                    .await;
            }
            Some(Taken::StillHeld) => {
                let _ = self.release_call(id, token).await;
                return Err(StoreError::Aborted(
                    "the handler still held its transaction when it returned, so it could not \
                     commit; it rolls back when dropped"
                        .into(),
                ));
            }
            // The handler took no transaction: the record is written on its own.
            None => {}
        }
        self.run(move |mut conn| async move {
            self.complete_on(&mut conn, id, token, fingerprint, bytes, ttl)
                .await
        })
        .await
    }

    pub(super) async fn release_call(
        &self,
        id: &RecordId,
        token: &ClaimToken,
    ) -> Result<bool, StoreError> {
        if let Some(Taken::Begun(tx)) = self.inner.open.take(token) {
            // Dropped, it would roll back too, but only once its connection is next used.
            let _ = tokio::time::timeout(self.inner.timeout, tx.rollback()).await;
        }
        self.fenced(self.inner.release_sql(), id, token, None).await
    }
}

/// A claim in progress: dropped before its answer arrived, once its statement may have been sent,
/// it releases the claim behind it.
struct Abandoned<'a> {
    store: &'a PgStore,
    sent: &'a AtomicBool,
    claim: Option<(RecordId, ClaimToken, Duration)>,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some((id, token, lease)) = self.claim.take()
            && self.sent.load(Ordering::Relaxed)
        {
            self.store.release_behind(id, token, lease);
        }
    }
}
