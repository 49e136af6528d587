//! The application's sealing keys: [`SealKey`] is one, [`SealKeys`] the set a store seals with
//! (the first) and opens with (every one).

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use chacha20poly1305::aead::{AeadInOut, KeyInit};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};

use crate::fingerprint::Fingerprint;
use crate::record::{
    RecordId, SealedResponse, StoredResponse, TraceOrigin, decode_sealed_plaintext,
    encode_sealed_header, encode_sealed_plaintext, is_key_id, sealed_plaintext_len,
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
    /// [`SealKeyError::InvalidId`] when `id` is empty, longer than 64 bytes, not visible ASCII
    /// without `:` and `,`, or a key itself (32 bytes in base64): an id is written in clear in
    /// every record it seals, and shown in logs. The error never quotes the id.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self, SealKeyError> {
        if !is_key_id(id) || is_key_text(id) {
            return Err(SealKeyError::InvalidId);
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
    /// [`SealKeyError::Empty`] without a key, [`SealKeyError::DuplicateId`] when two share an id
    /// (named by their positions, from 1).
    pub fn new(keys: impl IntoIterator<Item = SealKey>) -> Result<Self, SealKeyError> {
        let keys: Arc<[SealKey]> = keys.into_iter().collect();
        if keys.is_empty() {
            return Err(SealKeyError::Empty);
        }
        for (n, key) in keys.iter().enumerate() {
            if let Some(earlier) = keys[..n].iter().position(|earlier| earlier.id == key.id) {
                return Err(SealKeyError::DuplicateId {
                    entry: n + 1,
                    earlier: earlier + 1,
                });
            }
        }
        Ok(Self { keys })
    }

    /// The set written `id:key,id:key,...`, each key 32 bytes in standard base64 (padded, as
    /// `openssl rand -base64 32` prints it); the first seals. Spaces around entries are ignored.
    ///
    /// # Errors
    /// A [`SealKeyError`] naming the entry by its position and saying what is wrong with it:
    /// not `id:key`, written the wrong way round (`key:id`), an invalid id, a key that is not
    /// base64 or not 32 bytes, an id used twice; or [`SealKeyError::Empty`] for a blank list. It
    /// never quotes the list, so that no key is printed wherever it is reported, however the list
    /// was written.
    ///
    /// ```
    /// use tower_idempotency::seal::{SealKeyError, SealKeys};
    ///
    /// let key = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
    /// let err = SealKeys::parse(&format!("new:{key},{key}:old")).unwrap_err();
    /// assert_eq!(err, SealKeyError::Reversed { entry: 2 });
    /// assert!(!err.to_string().contains("AQEB"));
    /// ```
    pub fn parse(list: &str) -> Result<Self, SealKeyError> {
        if list.trim().is_empty() {
            return Err(SealKeyError::Empty);
        }
        let keys = list
            .split(',')
            .enumerate()
            .map(|(n, entry)| parse_entry(n + 1, entry));
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
    /// use tower_idempotency::record::{Fingerprint, RecordId, StoredResponse};
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
    /// the origin is in the ciphertext (the plaintext's extension area), never beside it
    /// (PROTOCOL.md §5.4, §5.6).
    pub(crate) fn seal_with_origin(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        origin: Option<&TraceOrigin>,
    ) -> Result<SealedResponse, crate::record::EncodeError> {
        let key = self.sealing();
        let aad = associated_data(id, fingerprint, &key.id)?;
        let mut buffer = Vec::with_capacity(sealed_plaintext_len(response, origin) + 16);
        encode_sealed_plaintext(response, origin, &mut buffer)?;
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
        decode_sealed_plaintext(buffer.into()).map_err(|_| OpenError::Forged)
    }
}

/// The entry at `entry` (from 1) of a key list: `id:key`. Its errors name the entry by position
/// alone: either half may be a key (written `key:id`, or a key pasted without its id).
fn parse_entry(entry: usize, text: &str) -> Result<SealKey, SealKeyError> {
    let (id, key) = (text.split_once(':')).ok_or(SealKeyError::Malformed { entry })?;
    let (id, key) = (id.trim(), key.trim());
    if is_key_text(id) {
        return Err(SealKeyError::Reversed { entry });
    }
    if !is_key_id(id) {
        return Err(SealKeyError::InvalidEntryId { entry });
    }
    let bytes = (base64::engine::general_purpose::STANDARD.decode(key))
        .map_err(|_| SealKeyError::NotBase64 { entry })?;
    let len = bytes.len();
    let key = <[u8; 32]>::try_from(bytes).map_err(|_| SealKeyError::WrongLength { entry, len })?;
    SealKey::new(id, key).map_err(|_| SealKeyError::InvalidEntryId { entry })
}

/// Whether `text` reads as a key: 32 bytes in base64, standard or URL-safe, padded or not.
fn is_key_text(text: &str) -> bool {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .any(|engine| engine.decode(text).is_ok_and(|bytes| bytes.len() == 32))
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

/// A set of sealing keys could not be made. It says which entry is wrong, by its position from 1,
/// and how, and never quotes an id or a key: a list written the wrong way round (`key:id`) has a
/// key where its id belongs, and an error is printed and logged where a key must not be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealKeyError {
    /// No key was given (an empty list, or an empty set).
    #[error("no sealing key was given")]
    Empty,
    /// The id given to [`SealKey::new`] is empty, longer than 64 bytes, not visible ASCII
    /// without `:` and `,`, or a key itself (32 bytes in base64).
    #[error(
        "a sealing key id must be 1 to 64 visible ASCII characters without ':' or ',', and not a \
         key"
    )]
    InvalidId,
    /// Two keys share an id: the key at `entry` has the id of the one at `earlier`.
    #[error("sealing keys {earlier} and {entry} have the same id")]
    DuplicateId {
        /// The position of the second key with the id, from 1.
        entry: usize,
        /// The position of the first, from 1.
        earlier: usize,
    },
    /// An entry of a key list is not `id:key`: it has no `:` (empty, or a key without its id).
    #[error("entry {entry} of the sealing key list is not `id:base64key`: it has no ':'")]
    Malformed {
        /// The entry's position, from 1.
        entry: usize,
    },
    /// An entry of a key list has a key (32 bytes in base64) where its id belongs: written
    /// `key:id`.
    #[error(
        "entry {entry} of the sealing key list has a key where its id belongs (written `key:id`?); \
         write `id:base64key`"
    )]
    Reversed {
        /// The entry's position, from 1.
        entry: usize,
    },
    /// An entry's id is empty, longer than 64 bytes, or not visible ASCII without `:` and `,`.
    #[error(
        "the id of entry {entry} of the sealing key list is not 1 to 64 visible ASCII characters \
         without ':' or ','"
    )]
    InvalidEntryId {
        /// The entry's position, from 1.
        entry: usize,
    },
    /// An entry's key is not standard base64.
    #[error("the key of entry {entry} of the sealing key list is not standard base64")]
    NotBase64 {
        /// The entry's position, from 1.
        entry: usize,
    },
    /// An entry's key is base64, of another length than 32 bytes.
    #[error("the key of entry {entry} of the sealing key list is {len} bytes, not 32")]
    WrongLength {
        /// The entry's position, from 1.
        entry: usize,
        /// The length of the decoded key, in bytes.
        len: usize,
    },
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

    /// Two keys of 32 bytes in standard base64, the first with a `+` and a `/` (which URL-safe
    /// base64 writes `-` and `_`).
    const KEY: &str = "X+zrZv/IbzjZUnhsbWlsecLbwjndTpG0ZynXOif7V+k=";
    const OTHER: &str = "Vm0weGQxSXhiRmRWV0doVVYwZDRWRll3WkRSV01WbDM=";

    /// Every run of 4 characters of `secret` that shows in `text`.
    fn quoted<'a>(secret: &'a str, text: &str) -> Vec<&'a str> {
        (0..=secret.len().saturating_sub(4))
            .map(|i| &secret[i..i + 4])
            .filter(|run| text.contains(run))
            .collect()
    }

    #[test]
    fn bad_key_lists_name_the_entry_and_never_quote_it() {
        let short = "c2hvcnQ="; // "short", 5 bytes
        let cases = [
            // Empty.
            (String::new(), SealKeyError::Empty, vec![]),
            (" , ".into(), SealKeyError::Malformed { entry: 1 }, vec![]),
            (
                format!("k1:{KEY},"),
                SealKeyError::Malformed { entry: 2 },
                vec![KEY],
            ),
            // Missing colon: a key pasted without its id.
            (
                format!("k1:{OTHER},{KEY}"),
                SealKeyError::Malformed { entry: 2 },
                vec![KEY, OTHER],
            ),
            // Written the wrong way round, padded or not, standard or URL-safe.
            (
                format!("k1:{OTHER},{KEY}:k2"),
                SealKeyError::Reversed { entry: 2 },
                vec![KEY, OTHER],
            ),
            (
                format!("{}:k1", KEY.trim_end_matches('=')),
                SealKeyError::Reversed { entry: 1 },
                vec![KEY],
            ),
            (
                format!("{}:k1", KEY.replace('+', "-").replace('/', "_")),
                SealKeyError::Reversed { entry: 1 },
                vec![KEY],
            ),
            // Both halves keys.
            (
                format!("{KEY}:{OTHER}"),
                SealKeyError::Reversed { entry: 1 },
                vec![KEY, OTHER],
            ),
            // Bad base64: a key with a character dropped, or with spaces in it.
            (
                format!("k1:{}", &KEY[1..]),
                SealKeyError::NotBase64 { entry: 1 },
                vec![KEY],
            ),
            (
                format!("k1:{} {}", &KEY[..20], &KEY[20..]),
                SealKeyError::NotBase64 { entry: 1 },
                vec![KEY],
            ),
            // Wrong length.
            (
                format!("k1:{short}"),
                SealKeyError::WrongLength { entry: 1, len: 5 },
                vec![short],
            ),
            (
                format!("k1:{OTHER},k2:{KEY}{KEY}"),
                SealKeyError::NotBase64 { entry: 2 },
                vec![KEY, OTHER],
            ),
            (
                format!("k1:{KEY}AAAA"),
                SealKeyError::NotBase64 { entry: 1 },
                vec![KEY],
            ),
            (
                format!("k1:{}", &OTHER[..40]),
                SealKeyError::WrongLength { entry: 1, len: 30 },
                vec![OTHER],
            ),
            // Invalid id.
            (
                format!(":{KEY}"),
                SealKeyError::InvalidEntryId { entry: 1 },
                vec![KEY],
            ),
            (
                format!("k 1:{KEY}"),
                SealKeyError::InvalidEntryId { entry: 1 },
                vec![KEY],
            ),
            // Duplicate ids.
            (
                format!("k1:{KEY},k2:{OTHER},k1:{OTHER}"),
                SealKeyError::DuplicateId {
                    entry: 3,
                    earlier: 1,
                },
                vec![KEY, OTHER],
            ),
        ];
        for (list, want, secrets) in cases {
            let err = SealKeys::parse(&list).expect_err(&list);
            assert_eq!(err, want, "{list:?}");
            for text in [err.to_string(), format!("{err:?}")] {
                for secret in &secrets {
                    assert_eq!(quoted(secret, &text), [""; 0], "{list:?}: {text}");
                }
                // Nor is the list quoted, whatever it holds.
                for id in ["k1", "k2"] {
                    assert!(!text.contains(id), "{list:?}: {text}");
                }
            }
        }
    }

    #[test]
    fn an_id_that_is_a_key_is_refused_without_quoting_it() {
        let key_like = KEY.trim_end_matches('=');
        let err = SealKey::new(key_like, [7; 32]).expect_err("a key as an id");
        assert_eq!(err, SealKeyError::InvalidId);
        for text in [err.to_string(), format!("{err:?}")] {
            assert_eq!(quoted(KEY, &text), [""; 0], "{text}");
        }
        let err = SealKey::new("has:colon", [7; 32]).expect_err("a colon");
        assert!(!err.to_string().contains("has:colon"));
    }

    #[test]
    fn key_lists_parse() {
        let keys = SealKeys::parse(&format!(" new:{KEY} , old : {OTHER} ")).expect("a list");
        assert_eq!(keys.ids().collect::<Vec<_>>(), ["new", "old"]);
        // Debug shows the ids, never a key's bytes.
        assert_eq!(format!("{keys:?}"), r#"["new", "old"]"#);
        assert_eq!(
            format!("{:?}", keys.sealing()),
            r#"SealKey { id: "new", .. }"#
        );
        // An id of 64 characters is not a key, nor is one that decodes to other than 32 bytes.
        let long = "a".repeat(64);
        assert!(SealKeys::parse(&format!("{long}:{KEY}")).is_ok());
        assert!(SealKeys::parse(&format!("{}:{KEY}", &OTHER[..40])).is_ok());
    }
}
