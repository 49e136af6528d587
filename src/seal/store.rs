//! [`SealedStore`]: a store wrapper that seals responses on the way in and opens them on the way
//! out.

use std::sync::Arc;
use std::time::Duration;

use super::keys::{OpenError, SealKeys};
use crate::fingerprint::Fingerprint;
use crate::record::{ClaimToken, Completed, Payload, Record, RecordId};
use crate::store::{Claim, CompletedView, Inspected, OperatorStore, Store, StoreError};

/// A [`Store`] that keeps every response of `St` sealed: status, headers and body encrypted and
/// authenticated with XChaCha20-Poly1305 under the first of its [`SealKeys`], bound to the
/// record's id (its scope and key) and fingerprint. Works over any store, unchanged.
///
/// A claim that finds a completed record opens it with the key it names. One that does not open
/// (changed, moved from another key or scope, sealed under a key no longer in the set) or a
/// response in clear (written without sealing) is never replayed: the claim fails with
/// [`StoreError::Unreadable`], and the layer answers `500 record-unreadable` without running the
/// request (fail-open or not). Tombstones and in-flight records hold no response and pass as
/// they are, but for a tombstone's trace origin, which is not written: only a seal may hold one
/// (a response's is sealed with it).
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
/// use tower_idempotency::store::{Claim, Store};
/// use tower_idempotency::record::{Completed, Fingerprint, Record, RecordId, StoredResponse};
/// use tower_idempotency::MemoryStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let inner = MemoryStore::new();
/// let store = SealedStore::new(inner.clone(), SealKeys::new([SealKey::new("k1", [7; 32])?])?);
/// let (id, fp, lease) = (RecordId::new(b"acct_1", "order-42"), Fingerprint::from_bytes([1; 32]), Duration::from_secs(30));
/// let response = StoredResponse { status: StatusCode::CREATED, headers: HeaderMap::new(), body: Bytes::from("secret"), trailers: None };
///
/// let Claim::Claimed(token) = store.claim(&id, &fp, lease).await? else { unreachable!() };
/// store.complete(&id, &token, &Completed::with_response(fp, response.clone()), Duration::from_secs(60)).await?;
///
/// // Through the sealed store: the response.
/// let Claim::Existing(Record::Completed(done)) = store.claim(&id, &fp, lease).await? else { unreachable!() };
/// assert_eq!(**done.plain().unwrap(), response);
/// // In the store itself: no response in clear.
/// let Claim::Existing(Record::Completed(raw)) = inner.claim(&id, &fp, lease).await? else { unreachable!() };
/// assert!(raw.plain().is_none());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SealedStore<St> {
    inner: St,
    keys: SealKeys,
    accept_clear: bool,
}

impl<St> SealedStore<St> {
    /// Seals the records of `inner` under `keys`.
    pub fn new(inner: St, keys: SealKeys) -> Self {
        Self {
            inner,
            keys,
            accept_clear: false,
        }
    }

    /// Whether a response found in clear is replayed (`true`) or refused like a record that does
    /// not open (`false`). Default: `false`: anyone who can write the store could otherwise plant
    /// a response. Turn it on only while sealing is being introduced over a store that still holds
    /// records from before, for one dedup window, then off again.
    ///
    /// ```
    /// use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
    /// use tower_idempotency::MemoryStore;
    ///
    /// let keys = SealKeys::new([SealKey::new("k1", [7; 32])?])?;
    /// let store = SealedStore::new(MemoryStore::new(), keys).accept_clear(true);
    /// # let _ = store;
    /// # Ok::<(), tower_idempotency::seal::SealKeyError>(())
    /// ```
    pub fn accept_clear(mut self, accept: bool) -> Self {
        self.accept_clear = accept;
        self
    }

    /// The store the sealed records are kept in.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// The keys records are sealed and opened with.
    pub fn keys(&self) -> &SealKeys {
        &self.keys
    }

    /// `record` with its response opened, or why it cannot be replayed.
    fn open(&self, id: &RecordId, record: Record) -> Result<Record, StoreError> {
        match record {
            Record::Completed(completed) => {
                self.open_completed(id, completed).map(Record::Completed)
            }
            in_flight => Ok(in_flight),
        }
    }

    /// `completed` with its response opened, or why it cannot be replayed.
    fn open_completed(&self, id: &RecordId, completed: Completed) -> Result<Completed, StoreError> {
        let unreadable = |err: OpenError| StoreError::Unreadable(Box::new(err));
        let (response, origin) = match completed.response {
            None => (None, completed.origin),
            Some(Payload::Plain(_)) if !self.accept_clear => {
                return Err(unreadable(OpenError::NotSealed));
            }
            Some(Payload::Plain(plain)) => (Some(Payload::Plain(plain)), completed.origin),
            Some(Payload::Sealed(sealed)) => {
                let (opened, origin) = (self.keys)
                    .open_with_origin(id, &completed.fingerprint, &sealed)
                    .map_err(unreadable)?;
                (Some(Payload::Plain(Arc::new(opened))), origin.map(Arc::new))
            }
        };
        Ok(Completed {
            fingerprint: completed.fingerprint,
            response,
            origin,
        })
    }

    /// `completed` with its response sealed, and its trace context sealed with it: nothing of
    /// the origin is left beside the seal. A tombstone has no seal to keep an origin in, so its
    /// origin is not stored.
    fn seal(&self, id: &RecordId, completed: &Completed) -> Result<Completed, StoreError> {
        let response = match &completed.response {
            Some(Payload::Plain(plain)) => {
                let origin = completed.origin.as_deref();
                let sealed = (self.keys)
                    .seal_with_origin(id, &completed.fingerprint, plain, origin)
                    .map_err(|err| StoreError::Codec(Box::new(err)))?;
                Some(Payload::Sealed(Arc::new(sealed)))
            }
            other => other.clone(),
        };
        Ok(Completed {
            fingerprint: completed.fingerprint,
            response,
            origin: None,
        })
    }
}

impl<St: Store> Store for SealedStore<St> {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        match self.inner.claim(id, fingerprint, lease).await {
            Ok(Claim::Existing(record)) => self.open(id, record).map(Claim::Existing),
            // Bytes that do not even decode were changed, like a seal that does not open: not a
            // store failure that fail-open would run the request over.
            Err(StoreError::Codec(err)) => Err(StoreError::Unreadable(err)),
            other => other,
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let sealed = self.seal(id, completed)?;
        self.inner.complete(id, token, &sealed, ttl).await
    }

    crate::forward_store!(inner => renew, prepare, release, changed);
}

impl<St: OperatorStore> OperatorStore for SealedStore<St> {
    /// The record with its response opened, as a claim would replay it; one that does not open
    /// (or in clear, unless [`SealedStore::accept_clear`]) is [`StoreError::Unreadable`], never
    /// bytes taken for a response. Read through the inner store, without the keys, a sealed
    /// response stays sealed: [`CompletedView::sealed_under`] names its key.
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        match self.inner.inspect(id).await {
            Ok(Some(Inspected::Completed(view))) => {
                let completed = self.open_completed(id, view.completed)?;
                Ok(Some(Inspected::Completed(CompletedView {
                    completed,
                    ..view
                })))
            }
            Err(StoreError::Codec(err)) => Err(StoreError::Unreadable(err)),
            other => other,
        }
    }

    crate::forward_store!(inner => forget);
}
