//! What a store keeps under a key, and its compact, versioned binary encoding.
//!
//! A record is either [`InFlight`] (claimed, the handler is running) or [`Completed`] (the handler
//! ran; its response, if it could be stored). Stores that keep bytes (Redis) use [`encode_in_flight`],
//! [`Completed::encode`] and [`Record::decode`]; the memory store keeps the typed values.
//!
//! Encoding, version 1 (integers little-endian):
//!
//! | kind | layout |
//! |---|---|
//! | in flight | `01 01` token (16) fingerprint (32) lease end, unix ms (u64) |
//! | completed | `01 02` fingerprint (32) status (u16) header count (u32), per header: name length (u16) name, value length (u32) value; body length (u32) body |
//! | tombstone | `01 03` fingerprint (32) |
//!
//! The claim token sits at bytes 2..18 of an in-flight record, so a store script can fence on it
//! without decoding the rest.

use std::cell::Cell;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;

/// The encoding version written by this crate.
pub const VERSION: u8 = 1;
const KIND_IN_FLIGHT: u8 = 1;
const KIND_COMPLETED: u8 = 2;
const KIND_TOMBSTONE: u8 = 3;

/// The identity of a record: a 128-bit digest of the scope and the key.
///
/// Two scopes never share an id for the same key, and the id reveals neither.
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::{IdempotencyKey, RecordId};
///
/// let key = IdempotencyKey::parse(&HeaderValue::from_static("k")).unwrap();
/// assert_ne!(RecordId::new(b"acct_1", key.as_str()), RecordId::new(b"acct_2", key.as_str()));
/// assert_eq!(RecordId::new(b"acct_1", "k").to_string().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordId {
    id: [u8; 16],
    /// A tag of the scope alone, so that a store in this process can account records per scope
    /// (the memory store's per-scope limit). Not part of any stored key: the id alone names the
    /// record.
    scope: u64,
}

impl RecordId {
    /// The id of an HTTP request's `key` inside `scope`.
    pub fn new(scope: &[u8], key: &str) -> Self {
        static KEY: LazyLock<[u8; 32]> =
            LazyLock::new(|| blake3::derive_key("tower-idempotency record id v1", b""));
        Self::derive(&KEY, scope, key)
    }

    /// The id of a queue message's `message_id` inside `scope` (a consumer group). Ids of messages
    /// and of HTTP keys never collide, even with the same scope and text.
    pub fn for_message(scope: &[u8], message_id: &str) -> Self {
        static KEY: LazyLock<[u8; 32]> =
            LazyLock::new(|| blake3::derive_key("tower-idempotency message id v1", b""));
        Self::derive(&KEY, scope, message_id)
    }

    fn derive(domain: &[u8; 32], scope: &[u8], key: &str) -> Self {
        // The domain key is derived once per kind, not per record.
        let mut hasher = blake3::Hasher::new_keyed(domain);
        hasher.update(&(scope.len() as u64).to_le_bytes());
        hasher.update(scope);
        hasher.update(key.as_bytes());
        let mut id = [0; 16];
        id.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        // The tag never leaves the process: a keyed SipHash with a per-process random key is
        // cheaper than a second blake3 output, and no scope can be chosen to collide with another.
        static SCOPE_TAGS: LazyLock<RandomState> = LazyLock::new(RandomState::new);
        Self {
            id,
            scope: SCOPE_TAGS.hash_one(scope),
        }
    }

    /// The id of an [`IdempotencyKey`] inside `scope`.
    pub fn for_key(scope: &[u8], key: &IdempotencyKey) -> Self {
        Self::new(scope, key.as_str())
    }

    /// The id's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.id
    }

    /// A tag of the id's scope: ids of one scope share it (ids of different scopes almost never
    /// do). For per-scope accounting in a store.
    pub(crate) const fn scope_tag(&self) -> u64 {
        self.scope
    }

    /// A short, non-reversible tag of the id for logs (the first 8 hex characters).
    pub fn short(&self) -> String {
        self.tag().to_string()
    }

    /// [`RecordId::short`] without the allocation, for log fields.
    pub(crate) fn tag(&self) -> Hex<'_> {
        Hex(&self.id[..4])
    }
}

/// Hashes the id alone: it already names the record (and so its scope), and the memory store's
/// maps hash one per request.
impl std::hash::Hash for RecordId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Hex(&self.id).fmt(f)
    }
}

/// Bytes displayed in lowercase hex.
pub(crate) struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write as _;
        for b in self.0 {
            f.write_char(char::from(HEX_DIGITS[usize::from(b >> 4)]))?;
            f.write_char(char::from(HEX_DIGITS[usize::from(b & 0x0f)]))?;
        }
        Ok(())
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({self})")
    }
}

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends `bytes` to `out` in lowercase hex.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        out.push(char::from(HEX_DIGITS[usize::from(b >> 4)]));
        out.push(char::from(HEX_DIGITS[usize::from(b & 0x0f)]));
    }
}

/// A claim's fencing token: unique per claim. Complete, renew and release do nothing unless the
/// record still carries the token of the claim that makes them.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimToken([u8; 16]);

impl ClaimToken {
    /// A new token, unique in this process and (with overwhelming probability) across processes:
    /// a random per-process prefix and a counter.
    pub fn generate() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let seed = *SEED.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u128(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos(),
            );
            hasher.write_u32(std::process::id());
            hasher.finish()
        });
        // Each thread takes a block of counter values at a time, so that threads claiming at once
        // do not all contend on one atomic; values stay unique in the process.
        const BLOCK: u64 = 1 << 16;
        thread_local! {
            static NEXT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        }
        let count = NEXT.with(|next| {
            let (mut count, mut end) = next.get();
            if count == end {
                count = COUNTER.fetch_add(BLOCK, Ordering::Relaxed);
                end = count + BLOCK;
            }
            next.set((count + 1, end));
            count
        });
        let mut token = [0; 16];
        token[..8].copy_from_slice(&seed.to_le_bytes());
        token[8..].copy_from_slice(&count.to_le_bytes());
        Self(token)
    }

    /// Rebuilds a token from its bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The token's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClaimToken({})", Hex(&self.0))
    }
}

/// A stored response: status, headers (every value, in order) and body.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers, already stripped of what must not be replayed.
    pub headers: HeaderMap,
    /// The body bytes.
    pub body: Bytes,
}

impl StoredResponse {
    /// The bytes this response holds in a store, roughly: body, header names and values.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len() + 8)
                .sum::<usize>()
    }
}

/// A record whose handler is running.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// How long the claim's lease has left (the owner renews it while its handler runs).
    pub lease_remaining: Duration,
}

/// A record whose handler has finished.
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    /// The fingerprint of the request that ran.
    pub fingerprint: Fingerprint,
    /// The response to replay, or `None` for a tombstone: the operation ran, but its response could
    /// not be stored (larger than the response limit, with trailers, or failing while it was read),
    /// so it cannot be replayed.
    pub response: Option<Arc<StoredResponse>>,
}

/// What a store holds under a key.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Claimed; the handler is running.
    InFlight(InFlight),
    /// The handler has finished.
    Completed(Completed),
}

impl Record {
    /// The fingerprint of the request that made the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InFlight(r) => &r.fingerprint,
            Record::Completed(r) => &r.fingerprint,
        }
    }

    /// Decodes a record written by [`encode_in_flight`] or [`Completed::encode`], sharing the
    /// buffer for the body and header values. The lease of an
    /// in-flight record is measured against the current wall clock.
    ///
    /// # Errors
    /// A [`DecodeError`] when the bytes are not a record of a known version.
    pub fn decode(bytes: Bytes) -> Result<Self, DecodeError> {
        let mut r = Reader(&bytes);
        // Header values and the body are slices of `bytes`, not copies.
        let shared = |r: &mut Reader<'_>, n: usize| {
            let start = bytes.len() - r.0.len();
            r.take(n)?;
            Ok::<_, DecodeError>(bytes.slice(start..start + n))
        };
        let version = r.u8()?;
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let record = match r.u8()? {
            KIND_IN_FLIGHT => {
                let _token = r.take(16)?;
                let fingerprint = r.fingerprint()?;
                let lease_end = r.u64()?;
                let lease_remaining =
                    Duration::from_millis(lease_end.saturating_sub(unix_millis(SystemTime::now())));
                Record::InFlight(InFlight {
                    fingerprint,
                    lease_remaining,
                })
            }
            KIND_COMPLETED => {
                let fingerprint = r.fingerprint()?;
                let status =
                    StatusCode::from_u16(r.u16()?).map_err(|_| DecodeError::Malformed("status"))?;
                let count = r.u32()? as usize;
                // One more than stored: room for the marker a replay adds.
                let mut headers = HeaderMap::with_capacity(count.min(64) + 1);
                for _ in 0..count {
                    let name_len = r.u16()? as usize;
                    let name = HeaderName::from_bytes(r.take(name_len)?)
                        .map_err(|_| DecodeError::Malformed("header name"))?;
                    let value_len = r.u32()? as usize;
                    let value = HeaderValue::from_maybe_shared(shared(&mut r, value_len)?)
                        .map_err(|_| DecodeError::Malformed("header value"))?;
                    headers.append(name, value);
                }
                let body_len = r.u32()? as usize;
                let body = shared(&mut r, body_len)?;
                Record::Completed(Completed {
                    fingerprint,
                    response: Some(Arc::new(StoredResponse {
                        status,
                        headers,
                        body,
                    })),
                })
            }
            KIND_TOMBSTONE => Record::Completed(Completed {
                fingerprint: r.fingerprint()?,
                response: None,
            }),
            other => return Err(DecodeError::Kind(other)),
        };
        if !r.0.is_empty() {
            return Err(DecodeError::Malformed("trailing bytes"));
        }
        Ok(record)
    }
}

/// Encodes an in-flight record whose lease ends at `lease_end`.
pub fn encode_in_flight(
    token: &ClaimToken,
    fingerprint: &Fingerprint,
    lease_end: SystemTime,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + 16 + 32 + 8);
    out.extend_from_slice(&[VERSION, KIND_IN_FLIGHT]);
    out.extend_from_slice(token.as_bytes());
    out.extend_from_slice(fingerprint.as_bytes());
    out.extend_from_slice(&unix_millis(lease_end).to_le_bytes());
    out
}

impl Completed {
    /// Encodes the record.
    ///
    /// # Errors
    /// [`EncodeError`] when a field is too large for the encoding (a body over 4 GiB).
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let Some(response) = &self.response else {
            let mut out = Vec::with_capacity(2 + 32);
            out.extend_from_slice(&[VERSION, KIND_TOMBSTONE]);
            out.extend_from_slice(self.fingerprint.as_bytes());
            return Ok(out);
        };
        let mut out = Vec::with_capacity(64 + response.size());
        out.extend_from_slice(&[VERSION, KIND_COMPLETED]);
        out.extend_from_slice(self.fingerprint.as_bytes());
        out.extend_from_slice(&response.status.as_u16().to_le_bytes());
        out.extend_from_slice(&len_u32(response.headers.len())?.to_le_bytes());
        for (name, value) in &response.headers {
            let name = name.as_str().as_bytes();
            // Header names are far shorter than 64 KiB in every HTTP implementation.
            let name_len = u16::try_from(name.len()).map_err(|_| EncodeError::TooLarge)?;
            out.extend_from_slice(&name_len.to_le_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(&len_u32(value.len())?.to_le_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&len_u32(response.body.len())?.to_le_bytes());
        out.extend_from_slice(&response.body);
        Ok(out)
    }
}

fn len_u32(len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLarge)
}

/// Milliseconds since the Unix epoch (0 before it).
pub fn unix_millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A record could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A field is larger than the encoding allows.
    #[error("a record field is too large to encode")]
    TooLarge,
}

/// Stored bytes are not a record this version understands.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// An unknown encoding version (written by a newer release).
    #[error("unknown record encoding version {0}")]
    Version(u8),
    /// An unknown record kind.
    #[error("unknown record kind {0}")]
    Kind(u8),
    /// The record ends early.
    #[error("record truncated")]
    Truncated,
    /// A field is invalid.
    #[error("malformed record: {0}")]
    Malformed(&'static str),
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn fingerprint(&mut self) -> Result<Fingerprint, DecodeError> {
        Ok(Fingerprint::from_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint() -> Fingerprint {
        Fingerprint::from_bytes([7; 32])
    }

    #[test]
    fn completed_round_trips_with_repeated_headers_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("x-b", HeaderValue::from_static("2"));
        headers.append("x-a", HeaderValue::from_static("first"));
        headers.append("x-a", HeaderValue::from_static("second"));
        headers.append("content-type", HeaderValue::from_static("application/json"));
        let record = Completed {
            fingerprint: fingerprint(),
            response: Some(Arc::new(StoredResponse {
                status: StatusCode::CREATED,
                headers,
                body: Bytes::from_static(b"{\"id\":1}\xff\x00"),
            })),
        };
        let bytes = record.encode().unwrap();
        let Record::Completed(decoded) = Record::decode(Bytes::from(bytes.clone())).unwrap() else {
            panic!("not completed")
        };
        assert_eq!(decoded, record);
        let values: Vec<_> = decoded
            .response
            .unwrap()
            .headers
            .get_all("x-a")
            .iter()
            .cloned()
            .collect();
        assert_eq!(values, ["first", "second"]);
    }

    #[test]
    fn tombstone_round_trips() {
        let record = Completed {
            fingerprint: fingerprint(),
            response: None,
        };
        let bytes = record.encode().unwrap();
        assert_eq!(bytes.len(), 34);
        assert_eq!(
            Record::decode(Bytes::from(bytes.clone())).unwrap(),
            Record::Completed(record)
        );
    }

    #[test]
    fn in_flight_round_trips_with_the_token_at_a_fixed_offset() {
        let token = ClaimToken::generate();
        let end = SystemTime::now() + Duration::from_secs(30);
        let bytes = encode_in_flight(&token, &fingerprint(), end);
        assert_eq!(&bytes[2..18], token.as_bytes());
        let Record::InFlight(r) = Record::decode(Bytes::from(bytes.clone())).unwrap() else {
            panic!("not in flight")
        };
        assert_eq!(r.fingerprint, fingerprint());
        assert!(
            r.lease_remaining > Duration::from_secs(28)
                && r.lease_remaining <= Duration::from_secs(30)
        );
    }

    #[test]
    fn bad_bytes_are_errors_not_panics() {
        let good = Completed {
            fingerprint: fingerprint(),
            response: Some(Arc::new(StoredResponse {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::from_static(b"abc"),
            })),
        }
        .encode()
        .unwrap();
        for n in 0..good.len() {
            assert!(
                Record::decode(Bytes::copy_from_slice(&good[..n])).is_err(),
                "prefix of {n} bytes"
            );
        }
        assert!(matches!(
            Record::decode(Bytes::from_static(&[2, 2])),
            Err(DecodeError::Version(2))
        ));
        assert!(matches!(
            Record::decode(Bytes::from_static(&[1, 9])),
            Err(DecodeError::Kind(9))
        ));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(Record::decode(Bytes::from(trailing)).is_err());
    }

    #[test]
    fn message_ids_never_collide_with_http_keys() {
        assert_ne!(
            RecordId::new(b"ledger", "evt_1"),
            RecordId::for_message(b"ledger", "evt_1")
        );
        assert_eq!(
            RecordId::for_message(b"ledger", "evt_1"),
            RecordId::for_message(b"ledger", "evt_1")
        );
    }

    #[test]
    fn tokens_are_unique_across_threads() {
        // More than one counter block per thread, from threads running at once.
        const PER_THREAD: usize = 150_000;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..PER_THREAD)
                        .map(|_| ClaimToken::generate())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let tokens: std::collections::HashSet<_> = threads
            .into_iter()
            .flat_map(|thread| thread.join().unwrap())
            .collect();
        assert_eq!(tokens.len(), 4 * PER_THREAD);
    }
}
