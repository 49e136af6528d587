//! The application's sealing keys: [`SealKey`] is one, [`SealKeys`] the set a store seals with
//! (the first) and opens with (every one).

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use chacha20poly1305::aead::{AeadInOut, KeyInit};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};

use crate::fingerprint::Fingerprint;
use crate::record::{
    RecordId, SealedResponse, StoredResponse, TraceOrigin, decode_response, encode_origin,
    encode_response, encode_sealed_header, is_key_id, origin_len, response_len,
};

/// One sealing key: 32 secret bytes, and the id that names it in the records it seals.
///
/// Its `Debug` shows the id alone: the key's bytes are never printed or logged.
///
/// ```
/// use tower_idempotency::seal::SealKey;
///
/// let key = SealKey::new("2025-01", [7; 32]).unwrap();
/// assert_eq!(key.id(), "2025-01");
/// assert!(!format!("{key:?}").contains('7'));
/// assert!(SealKey::new("has:colon", [7; 32]).is_err());
/// ```
#[derive(Clone)]
pub struct SealKey {
    id: Arc<str>,
    cipher: XChaCha20Poly1305,
    /// Keys the nonce, derived from the key: a nonce is a hash of what it seals (see `seal`).
    nonce_key: [u8; 32],
}

impl SealKey {
    /// The key `key` under the id `id`.
    ///
    /// # Errors
    /// [`SealKeyError::InvalidId`] when `id` is empty, longer than 64 bytes, or not visible
    /// ASCII without `:` and `,`.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self, SealKeyError> {
        if !is_key_id(id) {
            return Err(SealKeyError::InvalidId(id.to_owned()));
        }
        Ok(Self {
            id: id.into(),
            cipher: XChaCha20Poly1305::new(&Key::from(key)),
            nonce_key: blake3::derive_key("tower-idempotency seal nonce v1", &key),
        })
    }

    /// The key's id, as records name it.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// The keys a [`SealedStore`](super::SealedStore) seals and opens records with: the first seals
/// every new record, and every one opens the records sealed under it. To rotate, put a new key
/// first and keep the old ones until the records they sealed have expired (one dedup window);
/// a key taken out of the set is retired, and the records it sealed no longer open.
///
/// ```
/// use tower_idempotency::seal::{SealKey, SealKeys};
///
/// let keys = SealKeys::new([SealKey::new("new", [2; 32])?, SealKey::new("old", [1; 32])?])?;
/// assert_eq!(keys.sealing().id(), "new");
///
/// // The same set from a list, `id:base64` separated by commas (an environment variable).
/// let keys = SealKeys::parse(
///     "new:AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=,old:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=",
/// )?;
/// assert_eq!(keys.ids().collect::<Vec<_>>(), ["new", "old"]);
/// # Ok::<(), tower_idempotency::seal::SealKeyError>(())
/// ```
#[derive(Clone)]
pub struct SealKeys {
    keys: Arc<[SealKey]>,
}

impl SealKeys {
    /// The set `keys`, the first of which seals.
    ///
    /// # Errors
    /// [`SealKeyError::Empty`] without a key, [`SealKeyError::DuplicateId`] when two share an id.
    pub fn new(keys: impl IntoIterator<Item = SealKey>) -> Result<Self, SealKeyError> {
        let keys: Arc<[SealKey]> = keys.into_iter().collect();
        if keys.is_empty() {
            return Err(SealKeyError::Empty);
        }
        for (n, key) in keys.iter().enumerate() {
            if keys[..n].iter().any(|earlier| earlier.id == key.id) {
                return Err(SealKeyError::DuplicateId(key.id.to_string()));
            }
        }
        Ok(Self { keys })
    }

    /// The set written `id:key,id:key,...`, each key 32 bytes in standard base64 (padded, as
    /// `openssl rand -base64 32` prints it); the first seals. Spaces around entries are ignored.
    ///
    /// # Errors
    /// A [`SealKeyError`] naming the entry (by position and id, never by its key) that is not
    /// `id:key`, has an invalid id, or a key that is not 32 bytes of base64.
    pub fn parse(list: &str) -> Result<Self, SealKeyError> {
        let keys = list
            .split(',')
            .map(str::trim)
            .enumerate()
            .map(|(n, entry)| {
                let (id, key) = entry
                    .split_once(':')
                    .ok_or(SealKeyError::Malformed { entry: n + 1 })?;
                let key = base64::engine::general_purpose::STANDARD
                    .decode(key.trim())
                    .ok()
                    .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
                    .ok_or_else(|| SealKeyError::InvalidKey(id.trim().to_owned()))?;
                SealKey::new(id.trim(), key)
            });
        Self::new(keys.collect::<Result<Vec<_>, _>>()?)
    }

    /// The key that seals new records: the first.
    pub fn sealing(&self) -> &SealKey {
        &self.keys[0]
    }

    /// The ids of the keys, the sealing key's first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(SealKey::id)
    }

    /// Seals `response` for the record `id` with `fingerprint`, under the sealing key.
    ///
    /// The nonce is a keyed hash of everything sealed (the associated data and the plaintext),
    /// not a random draw: the same completion sealed twice is the same bytes, as a store expects
    /// of a completion sent again, and two different plaintexts never share a nonce under a key.
    /// [`SealedStore`](super::SealedStore) calls it on every completion; [`SealKeys::open`]
    /// undoes it.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::seal::{SealKey, SealKeys};
    /// use tower_idempotency::{Fingerprint, RecordId, StoredResponse};
    ///
    /// let keys = SealKeys::new([SealKey::new("k1", [7; 32])?])?;
    /// let id = RecordId::new(b"acct_1", "order-42");
    /// let fingerprint = Fingerprint::from_bytes([1; 32]);
    /// let response = StoredResponse {
    ///     status: StatusCode::CREATED,
    ///     headers: HeaderMap::new(),
    ///     body: Bytes::from_static(b"charged"),
    ///     trailers: None,
    /// };
    /// let sealed = keys.seal(&id, &fingerprint, &response)?;
    /// assert_eq!(keys.open(&id, &fingerprint, &sealed)?, response);
    /// // Bound to its record: it opens under no other id.
    /// assert!(keys.open(&RecordId::new(b"acct_2", "order-42"), &fingerprint, &sealed).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn seal(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
    ) -> Result<SealedResponse, crate::record::EncodeError> {
        self.seal_with_origin(id, fingerprint, response, None)
    }

    /// Seals `response` and the trace context of the execution that wrote it, `origin`, together:
    /// the origin is in the ciphertext, never beside it (PROTOCOL.md §5.6).
    pub(crate) fn seal_with_origin(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        origin: Option<&TraceOrigin>,
    ) -> Result<SealedResponse, crate::record::EncodeError> {
        let key = self.sealing();
        let aad = associated_data(id, fingerprint, &key.id)?;
        let mut buffer = Vec::with_capacity(origin_len(origin) + response_len(response) + 16);
        encode_origin(origin, &mut buffer)?;
        encode_response(response, &mut buffer)?;
        let mut hasher = blake3::Hasher::new_keyed(&key.nonce_key);
        hasher.update(&(aad.len() as u64).to_le_bytes());
        hasher.update(&aad);
        hasher.update(&buffer);
        let mut nonce = [0; 24];
        nonce.copy_from_slice(&hasher.finalize().as_bytes()[..24]);
        key.cipher
            .encrypt_in_place(&XNonce::from(nonce), &aad, &mut buffer)
            .map_err(|_| crate::record::EncodeError::TooLarge)?;
        Ok(SealedResponse {
            key_id: key.id.to_string(),
            nonce,
            ciphertext: buffer.into(),
        })
    }

    /// Opens `sealed`, the response of the record `id` with `fingerprint`: the response, or why
    /// it cannot be trusted ([`SealKeys::seal`] has an example). The trace context sealed with
    /// it, if any, is left out: [`SealedStore`](super::SealedStore) returns it in the record.
    pub fn open(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        sealed: &SealedResponse,
    ) -> Result<StoredResponse, OpenError> {
        self.open_with_origin(id, fingerprint, sealed)
            .map(|(response, _)| response)
    }

    /// Opens `sealed`: the response and the trace context sealed with it.
    pub(crate) fn open_with_origin(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        sealed: &SealedResponse,
    ) -> Result<(StoredResponse, Option<TraceOrigin>), OpenError> {
        let key = (self.keys.iter())
            .find(|key| *key.id == *sealed.key_id)
            .ok_or_else(|| OpenError::UnknownKey(sealed.key_id.clone()))?;
        let aad = associated_data(id, fingerprint, &key.id).map_err(|_| OpenError::Forged)?;
        let mut buffer = sealed.ciphertext.to_vec();
        key.cipher
            .decrypt_in_place(&XNonce::from(sealed.nonce), &aad, &mut buffer)
            .map_err(|_| OpenError::Forged)?;
        // Authentic, so written by this crate: a plaintext that does not decode is a bug, and is
        // refused like a forgery rather than replayed in part.
        decode_response(buffer.into()).map_err(|_| OpenError::Forged)
    }
}

/// What a seal authenticates beside its plaintext: the record's clear header (version, kind,
/// fingerprint, key id) and its id, a hash of the scope and the key, so that a sealed response
/// opens under no other key, scope or fingerprint.
fn associated_data(
    id: &RecordId,
    fingerprint: &Fingerprint,
    key_id: &str,
) -> Result<Vec<u8>, crate::record::EncodeError> {
    let mut aad = Vec::with_capacity(2 + 32 + 1 + key_id.len() + 16);
    encode_sealed_header(fingerprint, key_id, &mut aad)?;
    aad.extend_from_slice(id.as_bytes());
    Ok(aad)
}

impl fmt::Debug for SealKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.ids()).finish()
    }
}

/// A set of sealing keys could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealKeyError {
    /// No key was given.
    #[error("no sealing key was given")]
    Empty,
    /// A key id is empty, longer than 64 bytes, or not visible ASCII without `:` and `,`.
    #[error("sealing key id {0:?} is not 1 to 64 visible ASCII characters without ':' or ','")]
    InvalidId(String),
    /// Two keys share an id.
    #[error("two sealing keys have the id {0:?}")]
    DuplicateId(String),
    /// An entry of a key list is not `id:key`.
    #[error("entry {entry} of the sealing key list is not `id:base64key`")]
    Malformed {
        /// The entry's position, from 1.
        entry: usize,
    },
    /// The key of the entry with this id is not 32 bytes in standard base64.
    #[error("the sealing key {0:?} is not 32 bytes in standard base64")]
    InvalidKey(String),
}

/// Why a sealed response did not open. It never holds the response or a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The record was sealed under a key that is not in the set (retired, or never known here).
    #[error("the record was sealed under the key {0:?}, which is not among the keys")]
    UnknownKey(String),
    /// The record does not authenticate: its bytes were changed, or it was copied from another
    /// key, scope or request.
    #[error("the sealed record does not authenticate: changed, or moved from another key")]
    Forged,
    /// A response in clear, where every response is expected sealed: written before sealing was
    /// turned on, or by a writer without the keys.
    #[error("the record holds a response in clear where a sealed one is required")]
    NotSealed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_key_lists_are_errors_that_never_show_a_key() {
        let key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
        let cases = [
            ("", SealKeyError::Malformed { entry: 1 }),
            ("no-colon", SealKeyError::Malformed { entry: 1 }),
            ("k1:c2hvcnQ=", SealKeyError::InvalidKey("k1".into())),
            ("k1:not base64!", SealKeyError::InvalidKey("k1".into())),
            (&*format!(":{key}"), SealKeyError::InvalidId(String::new())),
            (
                &*format!("k1:{key},k1:{key}"),
                SealKeyError::DuplicateId("k1".into()),
            ),
        ];
        for (list, want) in cases {
            let err = SealKeys::parse(list).err();
            assert_eq!(err.as_ref(), Some(&want), "{list:?}");
            assert!(!err.unwrap().to_string().contains("AQEB"), "{list:?}");
        }
        let keys = SealKeys::parse(&format!(" new:{key} , old:{key}")).expect("a list");
        assert_eq!(keys.ids().collect::<Vec<_>>(), ["new", "old"]);
        // Debug shows the ids, never a key's bytes.
        assert_eq!(format!("{keys:?}"), r#"["new", "old"]"#);
        assert_eq!(
            format!("{:?}", keys.sealing()),
            r#"SealKey { id: "new", .. }"#
        );
    }
}
