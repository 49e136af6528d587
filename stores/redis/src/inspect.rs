//! An operator's calls: reading one record ([`OperatorStore::inspect`]) and forgetting it
//! ([`OperatorStore::forget`]), each one `EVAL` of a short script (rare calls: no script cache to keep).
//!
//! [`OperatorStore::inspect`]: tower_idempotency::store::OperatorStore::inspect
//! [`OperatorStore::forget`]: tower_idempotency::store::OperatorStore::forget

use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use deadpool_redis::redis;

use super::RedisStore;
use super::compression::decompress;
use tower_idempotency::record::{ClaimToken, Fingerprint, Record, RecordId, layout};
use tower_idempotency::store::{CompletedView, ForgetOutcome, InFlightView, Inspected, StoreError};

/// Reads the record under KEYS[1], with its time left and Redis's clock.
const INSPECT: &str = include_str!("inspect.lua");
/// Deletes the record under KEYS[1] (an in-flight one only when ARGV[1] is `1`).
const FORGET: &str = include_str!("forget.lua");

/// A record as the scripts return it: its bytes, its key's milliseconds left, Redis's clock.
type Found = (Vec<u8>, i64, u64, u64);

impl RedisStore {
    pub(super) async fn inspect_call(
        &self,
        id: &RecordId,
    ) -> Result<Option<Inspected>, StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(INSPECT).arg(1).arg(self.redis_key(id));
        let found: Option<Found> = self.run(self.direct(cmd)).await?;
        found.map(|found| self.view(found)).transpose()
    }

    pub(super) async fn forget_call(
        &self,
        id: &RecordId,
        force: bool,
    ) -> Result<ForgetOutcome, StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(FORGET)
            .arg(1)
            .arg(self.redis_key(id))
            .arg(if force { "1" } else { "0" });
        let found: Option<(i64, Vec<u8>, i64, u64, u64)> = self.run(self.direct(cmd)).await?;
        let Some((forgotten, record, ttl, seconds, micros)) = found else {
            return Ok(ForgetOutcome::Absent);
        };
        match (forgotten, self.view((record, ttl, seconds, micros))?) {
            (1, was) => Ok(ForgetOutcome::Forgotten(was)),
            (_, Inspected::InFlight(view)) => Ok(ForgetOutcome::Refused(view)),
            (_, _) => Err(StoreError::Codec(
                "forget.lua kept a record that is not in flight".into(),
            )),
        }
    }

    /// The record's view: an in-flight record read in place (its fence and lease end, as the
    /// claim script stamped them), a completed one decompressed and decoded. Redis keeps no
    /// fence once completed.
    fn view(&self, (record, ttl, seconds, micros): Found) -> Result<Inspected, StoreError> {
        let codec = |what: &'static str| StoreError::Codec(what.into());
        if record.get(layout::KIND) == Some(&layout::IN_FLIGHT) {
            if record.len() != layout::IN_FLIGHT_LEN {
                return Err(codec("an in-flight record of the wrong length"));
            }
            let token = ClaimToken::from_bytes(
                record[layout::TOKEN]
                    .try_into()
                    .map_err(|_| codec("a token of the wrong length"))?,
            );
            let fingerprint = Fingerprint::from_bytes(
                record[layout::IN_FLIGHT_FINGERPRINT]
                    .try_into()
                    .map_err(|_| codec("a fingerprint of the wrong length"))?,
            );
            let lease_end = u64::from_le_bytes(
                record[layout::LEASE_END]
                    .try_into()
                    .map_err(|_| codec("a lease end of the wrong length"))?,
            );
            return Ok(Inspected::InFlight(InFlightView {
                fingerprint,
                fence: token.fence(),
                lease_ends: UNIX_EPOCH + Duration::from_millis(lease_end),
            }));
        }
        // -1: a key without an expiry, which no call of the store writes.
        let ttl = u64::try_from(ttl).map_err(|_| codec("a record without an expiry"))?;
        let now = UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros);
        let record = decompress(record, self.inner.max_decompressed)
            .map_err(|err| StoreError::Unreadable(err.into()))?;
        match Record::decode(Bytes::from(record)) {
            Ok(Record::Completed(completed)) => Ok(Inspected::Completed(CompletedView {
                completed,
                fence: None,
                expires: now + Duration::from_millis(ttl),
            })),
            Ok(Record::InFlight(_)) => Err(codec("a compressed in-flight record")),
            Err(err) => Err(StoreError::Codec(Box::new(err))),
        }
    }
}
