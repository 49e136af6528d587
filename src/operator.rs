//! An operator's way into the store: what happened to one key of one scope ([`lookup`]), and
//! forgetting it ([`forget`]), over any [`OperatorStore`] (`docs/PROTOCOL.md` §10.9).
//!
//! Both take the scope's bytes, as the application's scope function makes them (§3; empty when
//! the layer has none), and the key as the client sent it in its header, bare or quoted: they
//! derive the [`RecordId`] as the layer does, so an operator never handles digests. The
//! command-line tool (crate `tower-idempotency-cli`) is these two functions over the Redis and
//! PostgreSQL stores.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{ForgetOutcome, Inspected, Store};
//! use tower_idempotency::record::{Fingerprint, RecordId};
//! use tower_idempotency::{MemoryStore, operator};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), operator::OperatorError> {
//! let store = MemoryStore::new();
//! // A request of account acct_1 with the key order-42 is running.
//! let id = RecordId::new(b"acct_1", "order-42");
//! store.claim(&id, &Fingerprint::from_bytes([1; 32]), Duration::from_secs(30)).await?;
//!
//! let found = operator::lookup(&store, b"acct_1", "order-42").await?;
//! assert!(matches!(found, Some(Inspected::InFlight(_))));
//!
//! // Refused while in flight, unless forced.
//! let refused = operator::forget(&store, b"acct_1", "order-42", "stuck worker", false).await?;
//! assert!(matches!(refused, ForgetOutcome::Refused(_)));
//! let forced = operator::forget(&store, b"acct_1", "order-42", "stuck worker", true).await?;
//! assert!(forced.forgotten());
//! assert_eq!(operator::lookup(&store, b"acct_1", "order-42").await?, None);
//! # Ok(())
//! # }
//! ```

use http::HeaderValue;

use crate::hex::Hex;
use crate::key::{IdempotencyKey, KeyError};
use crate::record::RecordId;
use crate::store::{ForgetOutcome, Inspected, OperatorStore, StoreError};

/// Why [`lookup`] or [`forget`] did not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// The key is not one the layer would accept (§2), so no request can have it.
    #[error("not a valid idempotency key")]
    InvalidKey(#[source] KeyError),
    /// [`forget`] was given no reason: the log line must say why a record was forgotten.
    #[error("a reason is required to forget a key")]
    NoReason,
    /// The store failed.
    #[error("the store call failed")]
    Store(#[from] StoreError),
}

/// The record id of `key` in `scope`, as the layer derives it: the key parsed as its header
/// value is (bare or quoted, surrounding spaces ignored, §2), then [`RecordId::new`].
///
/// # Errors
/// [`OperatorError::InvalidKey`] when the layer would refuse the key.
///
/// ```
/// use tower_idempotency::record::RecordId;
/// use tower_idempotency::operator;
///
/// let id = operator::record_id(b"acct_1", "\"order-42\"")?;
/// assert_eq!(id, RecordId::new(b"acct_1", "order-42"));
/// assert!(operator::record_id(b"acct_1", "two, keys").is_err());
/// # Ok::<(), operator::OperatorError>(())
/// ```
pub fn record_id(scope: &[u8], key: &str) -> Result<RecordId, OperatorError> {
    let value = HeaderValue::from_str(key)
        .map_err(|_| OperatorError::InvalidKey(KeyError::InvalidCharacter))?;
    let key = IdempotencyKey::parse(&value).map_err(OperatorError::InvalidKey)?;
    Ok(RecordId::new(scope, key.as_str()))
}

/// What `store` holds under `key` of `scope`, writing nothing: `None` for no live record, else
/// the record in flight (fence, lease end) or completed (its response or tombstone, fence where
/// kept, expiry). See [`OperatorStore::inspect`].
///
/// # Errors
/// [`OperatorError::InvalidKey`], or the store's error.
pub async fn lookup<St: OperatorStore>(
    store: &St,
    scope: &[u8],
    key: &str,
) -> Result<Option<Inspected>, OperatorError> {
    let id = record_id(scope, key)?;
    Ok(store.inspect(&id).await?)
}

/// A short, non-reversible tag of `scope` for logs, as the layer's log lines name a scope (their
/// `scope` field): the first 8 hex characters of its BLAKE3 digest.
///
/// ```
/// use tower_idempotency::operator;
///
/// assert_eq!(operator::scope_tag(b"acct_1").to_string().len(), 8);
/// ```
pub fn scope_tag(scope: &[u8]) -> impl std::fmt::Display + use<> {
    let digest = blake3::hash(scope);
    let mut tag = [0; 4];
    tag.copy_from_slice(&digest.as_bytes()[..4]);
    ScopeTag(tag)
}

/// The tag [`scope_tag`] writes.
struct ScopeTag([u8; 4]);

impl std::fmt::Display for ScopeTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Hex(&self.0).fmt(f)
    }
}

/// Forgets `key` of `scope` in `store` ([`OperatorStore::forget`]): a completed record or tombstone
/// always, an in-flight one only with `force`. Logged at WARN (target `tower_idempotency`,
/// message `record forgotten by an operator`) with `reason`, the record id, the key and scope
/// tags of §12.1, the state it was in and whether it was forced; a refusal is logged at INFO.
///
/// # Errors
/// [`OperatorError::InvalidKey`], [`OperatorError::NoReason`] for a blank `reason`, or the
/// store's error.
pub async fn forget<St: OperatorStore>(
    store: &St,
    scope: &[u8],
    key: &str,
    reason: &str,
    force: bool,
) -> Result<ForgetOutcome, OperatorError> {
    let id = record_id(scope, key)?;
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(OperatorError::NoReason);
    }
    let outcome = store.forget(&id, force).await?;
    let scope = scope_tag(scope);
    match &outcome {
        ForgetOutcome::Forgotten(was) => tracing::warn!(
            target: "tower_idempotency",
            record = %id,
            key = %id.tag(),
            scope = %scope,
            state = was.state(),
            forced = force,
            reason,
            "record forgotten by an operator"
        ),
        ForgetOutcome::Refused(_) => tracing::info!(
            target: "tower_idempotency",
            record = %id,
            key = %id.tag(),
            scope = %scope,
            state = "in_flight",
            reason,
            "forget refused: the key is in flight (force it to forget it all the same)"
        ),
        ForgetOutcome::Absent => {}
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemoryStore;
    use crate::record::Fingerprint;
    use crate::store::Store;

    #[tokio::test]
    async fn lookup_finds_the_key_of_its_scope_only() {
        let store = MemoryStore::new();
        let id = RecordId::new(b"acct_1", "order-42");
        store
            .claim(
                &id,
                &Fingerprint::from_bytes([1; 32]),
                Duration::from_secs(30),
            )
            .await
            .expect("claimed");
        let found = lookup(&store, b"acct_1", "\"order-42\"")
            .await
            .expect("read");
        assert!(matches!(found, Some(Inspected::InFlight(_))), "{found:?}");
        assert_eq!(
            lookup(&store, b"acct_2", "order-42").await.expect("read"),
            None
        );
        assert!(matches!(
            lookup(&store, b"acct_1", "").await,
            Err(OperatorError::InvalidKey(_))
        ));
    }

    /// A blank reason is refused before the store is touched: the record, here a run in flight
    /// that a forced forget would free, is still there.
    #[tokio::test]
    async fn forget_needs_a_reason() {
        let store = MemoryStore::new();
        let id = record_id(b"acct_1", "order-42").expect("a key");
        store
            .claim(
                &id,
                &Fingerprint::from_bytes([1; 32]),
                Duration::from_secs(30),
            )
            .await
            .expect("claimed");
        for reason in ["", "  \t"] {
            assert!(matches!(
                forget(&store, b"acct_1", "order-42", reason, true).await,
                Err(OperatorError::NoReason)
            ));
        }
        let found = lookup(&store, b"acct_1", "order-42").await.expect("read");
        assert!(matches!(found, Some(Inspected::InFlight(_))), "{found:?}");
    }
}
