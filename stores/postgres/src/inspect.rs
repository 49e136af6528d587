//! An operator's calls: reading one row ([`OperatorStore::inspect`]) and forgetting it
//! ([`OperatorStore::forget`]), one statement each.
//!
//! [`OperatorStore::inspect`]: tower_idempotency::store::OperatorStore::inspect
//! [`OperatorStore::forget`]: tower_idempotency::store::OperatorStore::forget

use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::PgStore;
use tower_idempotency::record::{ClaimToken, DecodeError, Fingerprint, Record, RecordId};
use tower_idempotency::store::{CompletedView, ForgetOutcome, InFlightView, Inspected, StoreError};

impl PgStore {
    pub(super) async fn inspect_call(
        &self,
        id: &RecordId,
    ) -> Result<Option<Inspected>, StoreError> {
        let sql = self.inner.statements.inspect.as_str();
        let row = self
            .run(move |mut conn| async move {
                sqlx::query(sql)
                    .bind(id.as_bytes().as_slice())
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await?;
        row.map(|row| view(&row)).transpose()
    }

    pub(super) async fn forget_call(
        &self,
        id: &RecordId,
        force: bool,
    ) -> Result<ForgetOutcome, StoreError> {
        let sql = self.inner.statements.forget.as_str();
        let row = self
            .run(move |mut conn| async move {
                sqlx::query(sql)
                    .bind(id.as_bytes().as_slice())
                    .bind(force)
                    .fetch_optional(&mut *conn)
                    .await
            })
            .await?;
        let Some(row) = row else {
            return Ok(ForgetOutcome::Absent);
        };
        let forgotten: bool = row.try_get(4).map_err(codec)?;
        match (forgotten, view(&row)?) {
            (true, was) => Ok(ForgetOutcome::Forgotten(was)),
            (false, Inspected::InFlight(view)) => Ok(ForgetOutcome::Refused(view)),
            (false, _) => Err(StoreError::Codec(
                "the forget statement kept a row that is not in flight".into(),
            )),
        }
    }
}

/// The row's record: in flight (NULL `completed`) with its token's fence and lease end, or
/// completed, with the fence of the claim that completed it (the token is kept).
fn view(row: &PgRow) -> Result<Inspected, StoreError> {
    let token: Vec<u8> = row.try_get(0).map_err(codec)?;
    let fingerprint: Vec<u8> = row.try_get(1).map_err(codec)?;
    let completed: Option<Vec<u8>> = row.try_get(2).map_err(codec)?;
    let expires_us: i64 = row.try_get(3).map_err(codec)?;
    let malformed = |what| StoreError::Codec(Box::new(DecodeError::Malformed(what)));
    let token = ClaimToken::from_bytes(token.try_into().map_err(|_| malformed("claim token"))?);
    let at = UNIX_EPOCH + Duration::from_micros(u64::try_from(expires_us).unwrap_or(0));
    let Some(completed) = completed else {
        let fingerprint = fingerprint
            .try_into()
            .map_err(|_| malformed("fingerprint"))?;
        return Ok(Inspected::InFlight(InFlightView {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            fence: token.fence(),
            lease_ends: at,
        }));
    };
    match Record::decode(Bytes::from(completed)) {
        Ok(Record::Completed(completed)) => Ok(Inspected::Completed(CompletedView {
            completed,
            fence: Some(token.fence()),
            expires: at,
        })),
        Ok(Record::InFlight(_)) => Err(malformed("an in-flight completed record")),
        Err(err) => Err(StoreError::Codec(Box::new(err))),
    }
}

fn codec(err: sqlx::Error) -> StoreError {
    StoreError::Codec(Box::new(err))
}
