//! The records' byte encoding (the table is in the [module docs](super)), for stores that keep
//! bytes. A store script fences on an in-flight record's kind and token, and renews its lease end,
//! without decoding the rest: those offsets are named in [`layout`] and fixed for version 1.
//!
//! A completed record ends with its extension area ([`super::extension`]): every byte after its
//! kind's last field. Without extensions a record is its kind's fields alone, byte for byte as
//! before the area existed, which is why the version stays 1. A seal's plaintext cannot end with
//! the area (the bytes after its body are its trailers), so there the area comes first, marked.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::extension::{area_len, read_area, read_origin_fields, write_area};
use super::id::ClaimToken;
use super::model::{Completed, InFlight, Payload, Record, SealedResponse, StoredResponse};
use super::reader::Reader;
use super::trace_origin::TraceOrigin;
use crate::fingerprint::Fingerprint;

/// The encoding version written by this crate.
const VERSION: u8 = 1;
const KIND_IN_FLIGHT: u8 = 1;
const KIND_COMPLETED: u8 = 2;
const KIND_TOMBSTONE: u8 = 3;
const KIND_SEALED: u8 = 4;
/// A completed record whose response ended with trailers: kind 2's fields, then the trailers.
/// Kind 2 stays the encoding of a response without them, so such records keep their bytes.
const KIND_COMPLETED_WITH_TRAILERS: u8 = 5;
/// The longest key id a sealed record names.
pub(crate) const MAX_KEY_ID_LEN: usize = 64;
/// Marks the extension area at the start of a seal's plaintext, where a response's status would
/// begin: no status is 65535 (they are 100 to 999).
#[cfg(feature = "seal")]
const SEALED_AREA_MARKER: [u8; 2] = [0xff, 0xff];
/// Marks the origin block of the builds before the extension area, where a response's status
/// would begin (no status is 0): read, never written, so that their records still replay.
const ORIGIN_BLOCK_MARKER: [u8; 2] = [0, 0];

/// Where the fields of an encoded record sit, for stores whose server-side scripts read or write
/// records in place (the table is in the [module docs](super)): a Redis script fences on an
/// in-flight record's kind and token, and renews its lease end, without decoding the rest. Every
/// record starts with the version and the kind; the rest is per kind. Fixed for version 1.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_idempotency::record::{ClaimToken, Fence, Fingerprint, Record, layout};
///
/// let token = ClaimToken::new(Fence::new(7));
/// let bytes = layout::in_flight(&token, &Fingerprint::from_bytes([1; 32]), SystemTime::now() + Duration::from_secs(30));
/// assert_eq!(bytes[layout::KIND], layout::IN_FLIGHT);
/// assert_eq!(&bytes[layout::TOKEN], token.as_bytes());
/// assert!(matches!(Record::decode(bytes.into()), Ok(Record::InFlight(_))));
/// ```
pub mod layout {
    use std::ops::Range;
    use std::time::SystemTime;

    use super::{ClaimToken, Fingerprint, KIND_IN_FLIGHT, VERSION, unix_millis};

    /// The encoding version's byte.
    pub const VERSION_BYTE: usize = 0;
    /// The record kind's byte: 1 in flight, 2 completed, 3 tombstone, 4 sealed, 5 completed with
    /// trailers.
    pub const KIND: usize = 1;
    /// An in-flight record's claim token.
    pub const TOKEN: Range<usize> = 2..18;
    /// An in-flight record's fingerprint.
    pub const IN_FLIGHT_FINGERPRINT: Range<usize> = TOKEN.end..TOKEN.end + 32;
    /// An in-flight record's lease end (unix ms, u64 little-endian), its last field.
    pub const LEASE_END: Range<usize> = IN_FLIGHT_FINGERPRINT.end..IN_FLIGHT_FINGERPRINT.end + 8;
    /// A completed record's (a tombstone's, a sealed record's) fingerprint.
    pub const COMPLETED_FINGERPRINT: Range<usize> = 2..34;

    /// The kind byte of an in-flight record.
    pub const IN_FLIGHT: u8 = KIND_IN_FLIGHT;

    /// The length of an in-flight record.
    pub const IN_FLIGHT_LEN: usize = LEASE_END.end;

    /// An in-flight record claimed with `token`, whose lease ends at `lease_end`.
    pub fn in_flight(
        token: &ClaimToken,
        fingerprint: &Fingerprint,
        lease_end: SystemTime,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(IN_FLIGHT_LEN);
        out.extend_from_slice(&[VERSION, KIND_IN_FLIGHT]);
        out.extend_from_slice(token.as_bytes());
        out.extend_from_slice(fingerprint.as_bytes());
        out.extend_from_slice(&lease_end_bytes(lease_end));
        out
    }

    /// The bytes of a lease end, as [`LEASE_END`] holds them.
    pub fn lease_end_bytes(lease_end: SystemTime) -> [u8; 8] {
        unix_millis(lease_end).to_le_bytes()
    }
}

/// Encodes a tombstone: a completed record without a response. Unlike a response, it always fits.
pub(crate) fn encode_tombstone(fingerprint: &Fingerprint) -> Vec<u8> {
    let mut out = Vec::with_capacity(layout::COMPLETED_FINGERPRINT.end);
    out.extend_from_slice(&[VERSION, KIND_TOMBSTONE]);
    out.extend_from_slice(fingerprint.as_bytes());
    out
}

impl Completed {
    /// Encodes the record: its kind's fields, then its extension area (its trace origin, if it
    /// has one). A record without an origin is its kind's fields alone.
    ///
    /// # Errors
    /// [`EncodeError`] when a field is too large for the encoding (a body over 4 GiB) or a sealed
    /// response's key id is not a valid one.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let origin = self.origin.as_deref();
        match &self.response {
            None if origin.is_none() => Ok(encode_tombstone(&self.fingerprint)),
            None => {
                let len = layout::COMPLETED_FINGERPRINT.end + area_len(origin);
                let mut out = Vec::with_capacity(len);
                out.extend_from_slice(&[VERSION, KIND_TOMBSTONE]);
                out.extend_from_slice(self.fingerprint.as_bytes());
                write_area(origin, &mut out)?;
                debug_assert_eq!(out.len(), len, "the encoded length is computed exactly");
                Ok(out)
            }
            Some(Payload::Plain(response)) => {
                // Sized exactly: a store that keeps the bytes (`MemoryStore`) then holds one
                // allocation with no slack, and `Bytes::from` takes it over without a second one.
                let len =
                    layout::COMPLETED_FINGERPRINT.end + response_len(response) + area_len(origin);
                let mut out = Vec::with_capacity(len);
                let kind = match response.trailers {
                    None => KIND_COMPLETED,
                    Some(_) => KIND_COMPLETED_WITH_TRAILERS,
                };
                out.extend_from_slice(&[VERSION, kind]);
                out.extend_from_slice(self.fingerprint.as_bytes());
                encode_response(response, &mut out)?;
                write_area(origin, &mut out)?;
                debug_assert_eq!(out.len(), len, "the encoded length is computed exactly");
                Ok(out)
            }
            // A sealed record's origin is inside its seal: none is written beside it.
            Some(Payload::Sealed(sealed)) => {
                let ciphertext_len = len_u32(sealed.ciphertext.len())?;
                let len = sealed_header_len(&sealed.key_id) + 24 + 4 + sealed.ciphertext.len();
                let mut out = Vec::with_capacity(len);
                encode_sealed_header(&self.fingerprint, &sealed.key_id, &mut out)?;
                out.extend_from_slice(&sealed.nonce);
                out.extend_from_slice(&ciphertext_len.to_le_bytes());
                out.extend_from_slice(&sealed.ciphertext);
                debug_assert_eq!(out.len(), len, "the encoded length is computed exactly");
                Ok(out)
            }
        }
    }
}

/// Reads the origin block the builds before the extension area wrote, if the next bytes begin
/// one: its marker, then the origin's fields as its extension holds them.
fn read_origin_block(r: &mut Reader<'_>) -> Result<Option<TraceOrigin>, DecodeError> {
    if !r.starts_with(&ORIGIN_BLOCK_MARKER) {
        return Ok(None);
    }
    r.take(ORIGIN_BLOCK_MARKER.len())?;
    read_origin_fields(r).map(Some)
}

/// The one origin of a record that may hold an origin block and an extension area: two are
/// malformed (no writer puts one in each).
fn one_origin(
    block: Option<TraceOrigin>,
    extension: Option<TraceOrigin>,
) -> Result<Option<Arc<TraceOrigin>>, DecodeError> {
    match (block, extension) {
        (Some(_), Some(_)) => Err(DecodeError::Malformed("two trace origins")),
        (origin, None) | (None, origin) => Ok(origin.map(Arc::new)),
    }
}

/// The length of a seal's plaintext by [`encode_sealed_plaintext`].
#[cfg(feature = "seal")]
pub(crate) fn sealed_plaintext_len(
    response: &StoredResponse,
    origin: Option<&TraceOrigin>,
) -> usize {
    let marked_area = match area_len(origin) {
        0 => 0,
        area => SEALED_AREA_MARKER.len() + 4 + area,
    };
    marked_area + response_len(response)
}

/// Appends what a seal encrypts to `out`: the extension area when there are extensions (its
/// marker, its length as a `u32`, the area), then the response's fields. The area goes first,
/// where a status would begin, because the bytes after a sealed response's body are its
/// trailers: the plaintext's length alone says whether it has them.
#[cfg(feature = "seal")]
pub(crate) fn encode_sealed_plaintext(
    response: &StoredResponse,
    origin: Option<&TraceOrigin>,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let area = area_len(origin);
    if area > 0 {
        out.extend_from_slice(&SEALED_AREA_MARKER);
        out.extend_from_slice(&len_u32(area)?.to_le_bytes());
        write_area(origin, out)?;
    }
    encode_response(response, out)
}

/// Reads the marked extension area at the start of a seal's plaintext, if there is one.
#[cfg(feature = "seal")]
fn read_sealed_area(r: &mut Reader<'_>) -> Result<Option<TraceOrigin>, DecodeError> {
    if !r.starts_with(&SEALED_AREA_MARKER) {
        return Ok(None);
    }
    r.take(SEALED_AREA_MARKER.len())?;
    let len = r.u32()? as usize;
    let known = read_area(&mut Reader(r.take(len)?))?;
    Ok(known.origin)
}

/// The length of a response's encoding by [`encode_response`].
fn response_len(response: &StoredResponse) -> usize {
    let fields = |map: &HeaderMap| -> usize {
        let entries: usize = (map.iter())
            .map(|(name, value)| 2 + name.as_str().len() + 4 + value.len())
            .sum();
        4 + entries
    };
    let trailers = response.trailers.as_ref().map_or(0, fields);
    2 + fields(&response.headers) + 4 + response.body.len() + trailers
}

/// Appends a response's fields to `out`: status, headers, body, and the trailers when it has
/// them. A completed record's bytes after its fingerprint, and a sealed record's plaintext.
fn encode_response(response: &StoredResponse, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.extend_from_slice(&response.status.as_u16().to_le_bytes());
    encode_fields(&response.headers, out)?;
    out.extend_from_slice(&len_u32(response.body.len())?.to_le_bytes());
    out.extend_from_slice(&response.body);
    if let Some(trailers) = &response.trailers {
        encode_fields(trailers, out)?;
    }
    Ok(())
}

/// Appends header (or trailer) fields: their count, then each name and value.
fn encode_fields(fields: &HeaderMap, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    out.extend_from_slice(&len_u32(fields.len())?.to_le_bytes());
    for (name, value) in fields {
        let name = name.as_str().as_bytes();
        // Header names are far shorter than 64 KiB in every HTTP implementation.
        let name_len = u16::try_from(name.len()).map_err(|_| EncodeError::TooLarge)?;
        out.extend_from_slice(&name_len.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&len_u32(value.len())?.to_le_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    Ok(())
}

/// Decodes a seal's plaintext written by [`encode_sealed_plaintext`] (or by the builds before the
/// extension area, with an origin block), sharing `bytes` for the body and the header values: the
/// response, with trailers when fields follow the body (one sealed before trailers were kept has
/// none), and the origin of its extension area.
#[cfg(feature = "seal")]
pub(crate) fn decode_sealed_plaintext(
    bytes: Bytes,
) -> Result<(StoredResponse, Option<TraceOrigin>), DecodeError> {
    let mut r = Reader(&bytes);
    let origin = match read_origin_block(&mut r)? {
        Some(origin) => Some(origin),
        None => read_sealed_area(&mut r)?,
    };
    let mut response = read_response(&mut r, &bytes)?;
    if !r.is_empty() {
        response.trailers = Some(read_fields(&mut r, &bytes, 0)?);
    }
    if !r.is_empty() {
        return Err(DecodeError::Malformed("trailing bytes"));
    }
    Ok((response, origin))
}

/// The length of a sealed record's clear header.
fn sealed_header_len(key_id: &str) -> usize {
    layout::COMPLETED_FINGERPRINT.end + 1 + key_id.len()
}

/// Appends a sealed record's clear header to `out`: version, kind, fingerprint and key id. What a
/// seal authenticates as its associated data, with the record id.
pub(crate) fn encode_sealed_header(
    fingerprint: &Fingerprint,
    key_id: &str,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if !is_key_id(key_id) {
        return Err(EncodeError::KeyId);
    }
    out.extend_from_slice(&[VERSION, KIND_SEALED]);
    out.extend_from_slice(fingerprint.as_bytes());
    // At most 64 bytes: checked above.
    out.push(key_id.len() as u8);
    out.extend_from_slice(key_id.as_bytes());
    Ok(())
}

/// A key id names a sealing key in a record: 1 to 64 bytes of visible ASCII, without the `:` and
/// `,` that separate ids from keys in a list.
pub(crate) fn is_key_id(key_id: &str) -> bool {
    (1..=MAX_KEY_ID_LEN).contains(&key_id.len())
        && key_id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b',')
}

/// Reads a response's status, headers and body; its trailers, if any, are the caller's to read.
fn read_response(r: &mut Reader<'_>, bytes: &Bytes) -> Result<StoredResponse, DecodeError> {
    let status = StatusCode::from_u16(r.u16()?).map_err(|_| DecodeError::Malformed("status"))?;
    // One more than stored: room for the marker a replay adds.
    let headers = read_fields(r, bytes, 1)?;
    let body_len = r.u32()? as usize;
    let body = shared(r, bytes, body_len)?;
    Ok(StoredResponse {
        status,
        headers,
        body,
        trailers: None,
    })
}

/// The next `n` bytes, as a slice of `bytes` (not a copy): header values and the body.
fn shared(r: &mut Reader<'_>, bytes: &Bytes, n: usize) -> Result<Bytes, DecodeError> {
    let start = bytes.len() - r.0.len();
    r.take(n)?;
    Ok(bytes.slice(start..start + n))
}

/// Reads header (or trailer) fields written by `encode_fields`, with room for `spare` more.
fn read_fields(r: &mut Reader<'_>, bytes: &Bytes, spare: usize) -> Result<HeaderMap, DecodeError> {
    let count = r.u32()? as usize;
    let mut fields = HeaderMap::with_capacity(count.min(64) + spare);
    for _ in 0..count {
        let name_len = r.u16()? as usize;
        let name = HeaderName::from_bytes(r.take(name_len)?)
            .map_err(|_| DecodeError::Malformed("header name"))?;
        let value_len = r.u32()? as usize;
        let value = HeaderValue::from_maybe_shared(shared(r, bytes, value_len)?)
            .map_err(|_| DecodeError::Malformed("header value"))?;
        fields.append(name, value);
    }
    Ok(fields)
}

impl Record {
    /// Decodes a record written by [`layout::in_flight`] or [`Completed::encode`], sharing the
    /// buffer for the body and header values. The lease of an
    /// in-flight record is measured against the current wall clock.
    ///
    /// A completed record's extensions of a type this release does not know (written by a later
    /// one) are skipped: the record decodes, and replays, as it would without them. They are not
    /// kept: encoded again, it has none.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::record::{Completed, Fingerprint, Record};
    ///
    /// let tombstone = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
    /// let mut bytes = tombstone.encode()?;
    /// // An extension of type 0x7f00, unknown here: its type, its length, its value.
    /// bytes.extend_from_slice(&0x7f00u16.to_le_bytes());
    /// bytes.extend_from_slice(&3u32.to_le_bytes());
    /// bytes.extend_from_slice(b"new");
    /// assert_eq!(Record::decode(Bytes::from(bytes))?, Record::Completed(tombstone));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// A [`DecodeError`] when the bytes are not a record of a known version, or are damaged: an
    /// extension that runs past the record's end, for one.
    pub fn decode(bytes: Bytes) -> Result<Self, DecodeError> {
        let mut r = Reader(&bytes);
        let version = r.u8()?;
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let record = match r.u8()? {
            KIND_IN_FLIGHT => {
                let _token = r.take(layout::TOKEN.len())?;
                let fingerprint = r.fingerprint()?;
                let lease_end = r.u64()?;
                let lease_remaining =
                    Duration::from_millis(lease_end.saturating_sub(unix_millis(SystemTime::now())));
                Record::InFlight(InFlight {
                    fingerprint,
                    lease_remaining,
                })
            }
            kind @ (KIND_COMPLETED | KIND_COMPLETED_WITH_TRAILERS) => {
                let fingerprint = r.fingerprint()?;
                let block = read_origin_block(&mut r)?;
                let mut response = read_response(&mut r, &bytes)?;
                if kind == KIND_COMPLETED_WITH_TRAILERS {
                    response.trailers = Some(read_fields(&mut r, &bytes, 0)?);
                }
                let extensions = read_area(&mut r)?;
                Record::Completed(Completed {
                    fingerprint,
                    response: Some(Payload::Plain(Arc::new(response))),
                    origin: one_origin(block, extensions.origin)?,
                })
            }
            KIND_SEALED => {
                let fingerprint = r.fingerprint()?;
                let key_id_len = r.u8()? as usize;
                let key_id = std::str::from_utf8(r.take(key_id_len)?)
                    .ok()
                    .filter(|id| is_key_id(id))
                    .ok_or(DecodeError::Malformed("key id"))?
                    .to_owned();
                let nonce = r.array()?;
                let ciphertext_len = r.u32()? as usize;
                let start = bytes.len() - r.0.len();
                r.take(ciphertext_len)?;
                // Extensions in clear are read and checked like any record's, but an origin is
                // never beside a seal: it is sealed with the response.
                if read_area(&mut r)?.origin.is_some() {
                    return Err(DecodeError::Malformed("a trace origin beside a seal"));
                }
                Record::Completed(Completed {
                    fingerprint,
                    response: Some(Payload::Sealed(Arc::new(SealedResponse {
                        key_id,
                        nonce,
                        ciphertext: bytes.slice(start..start + ciphertext_len),
                    }))),
                    origin: None,
                })
            }
            KIND_TOMBSTONE => {
                let fingerprint = r.fingerprint()?;
                // An area's first type is never 0, so `00 00` here can only begin an origin block.
                let block = read_origin_block(&mut r)?;
                let extensions = read_area(&mut r)?;
                Record::Completed(Completed {
                    fingerprint,
                    response: None,
                    origin: one_origin(block, extensions.origin)?,
                })
            }
            other => return Err(DecodeError::Kind(other)),
        };
        // Every completed kind read its area to the end; an in-flight record has none (the Redis
        // scripts write and renew it whole, at fixed offsets).
        if !r.is_empty() {
            return Err(DecodeError::Malformed("trailing bytes"));
        }
        Ok(record)
    }
}

fn len_u32(len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLarge)
}

/// Milliseconds since the Unix epoch (0 before it).
fn unix_millis(time: SystemTime) -> u64 {
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
    /// A sealed response's key id is empty, longer than 64 bytes, or not visible ASCII without
    /// `:` and `,`.
    #[error("a sealed record's key id is not valid")]
    KeyId,
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::record::Fence;

    pub(in crate::record) fn fingerprint() -> Fingerprint {
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
            response: Some(Payload::Plain(Arc::new(StoredResponse {
                status: StatusCode::CREATED,
                headers,
                body: Bytes::from_static(b"{\"id\":1}\xff\x00"),
                trailers: None,
            }))),
            origin: None,
        };
        let bytes = record.encode().unwrap();
        assert_eq!(bytes[layout::KIND], KIND_COMPLETED);
        assert_eq!(
            &bytes[layout::COMPLETED_FINGERPRINT],
            fingerprint().as_bytes()
        );
        let Record::Completed(decoded) = Record::decode(Bytes::from(bytes.clone())).unwrap() else {
            panic!("not completed")
        };
        assert_eq!(decoded, record);
        let values: Vec<_> = decoded
            .plain()
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
            origin: None,
        };
        let bytes = record.encode().unwrap();
        assert_eq!(bytes.len(), layout::COMPLETED_FINGERPRINT.end);
        assert_eq!(
            &bytes[layout::COMPLETED_FINGERPRINT],
            fingerprint().as_bytes()
        );
        assert_eq!(
            Record::decode(Bytes::from(bytes.clone())).unwrap(),
            Record::Completed(record)
        );
    }

    #[test]
    fn in_flight_round_trips_with_the_token_at_a_fixed_offset() {
        let token = ClaimToken::new(Fence::new(1));
        let end = SystemTime::now() + Duration::from_secs(30);
        let bytes = layout::in_flight(&token, &fingerprint(), end);
        assert_eq!(bytes.len(), layout::IN_FLIGHT_LEN);
        assert_eq!(bytes[layout::VERSION_BYTE], VERSION);
        assert_eq!(bytes[layout::KIND], layout::IN_FLIGHT);
        assert_eq!(&bytes[layout::TOKEN], token.as_bytes());
        assert_eq!(
            &bytes[layout::IN_FLIGHT_FINGERPRINT],
            fingerprint().as_bytes()
        );
        assert_eq!(
            bytes[layout::LEASE_END],
            unix_millis(end).to_le_bytes(),
            "the lease end is the last field, where a renewal rewrites it"
        );
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
    fn sealed_round_trips_and_its_prefixes_are_errors() {
        let record = Completed {
            fingerprint: fingerprint(),
            response: Some(Payload::Sealed(Arc::new(SealedResponse {
                key_id: "2025-01".into(),
                nonce: [9; 24],
                ciphertext: Bytes::from_static(&[5; 40]),
            }))),
            origin: None,
        };
        let bytes = record.encode().unwrap();
        assert_eq!(bytes[layout::KIND], KIND_SEALED);
        assert_eq!(
            &bytes[layout::COMPLETED_FINGERPRINT],
            fingerprint().as_bytes()
        );
        assert_eq!(bytes.len(), 63 + 7 + 40, "the layout of PROTOCOL §5.4");
        assert_eq!(
            Record::decode(Bytes::from(bytes.clone())).unwrap(),
            Record::Completed(record)
        );
        for n in 0..bytes.len() {
            assert!(
                Record::decode(Bytes::copy_from_slice(&bytes[..n])).is_err(),
                "prefix {n}"
            );
        }
        let mut bad_id = bytes.clone();
        bad_id[35] = b':';
        assert!(matches!(
            Record::decode(Bytes::from(bad_id)),
            Err(DecodeError::Malformed("key id"))
        ));
    }

    #[test]
    fn bad_bytes_are_errors_not_panics() {
        let good = Completed {
            fingerprint: fingerprint(),
            response: Some(Payload::Plain(Arc::new(StoredResponse {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::from_static(b"abc"),
                trailers: None,
            }))),
            origin: None,
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

    pub(in crate::record) fn grpc_trailers() -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        trailers.append("x-trace", HeaderValue::from_static("a"));
        trailers.append("x-trace", HeaderValue::from_static("b"));
        trailers.append("x-sig-bin", HeaderValue::from_static("AAEC"));
        trailers
    }

    #[test]
    fn trailers_round_trip_in_a_kind_of_their_own() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/grpc"));
        let response = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::from_static(b"\x00\x00\x00\x00\x02\x08\x01"),
            trailers: Some(grpc_trailers()),
        };
        let record = Completed::with_response(fingerprint(), response.clone());
        let bytes = record.encode().unwrap();
        assert_eq!(bytes[layout::KIND], KIND_COMPLETED_WITH_TRAILERS);
        assert_eq!(
            bytes.len(),
            layout::COMPLETED_FINGERPRINT.end + response_len(&response)
        );
        let Record::Completed(decoded) = Record::decode(Bytes::from(bytes.clone())).unwrap() else {
            panic!("not completed")
        };
        assert_eq!(decoded, record);
        let trailers = decoded.plain().unwrap().trailers.clone().unwrap();
        let names: Vec<_> = trailers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(
            names,
            [
                ("grpc-status", &b"0"[..]),
                ("x-trace", b"a"),
                ("x-trace", b"b"),
                ("x-sig-bin", b"AAEC")
            ],
            "every value, in order"
        );
        for n in 0..bytes.len() {
            assert!(
                Record::decode(Bytes::copy_from_slice(&bytes[..n])).is_err(),
                "prefix {n}"
            );
        }

        // An empty trailers frame is kept as one: it is not "no trailers".
        let empty = Completed::with_response(
            fingerprint(),
            StoredResponse {
                trailers: Some(HeaderMap::new()),
                ..response
            },
        );
        let bytes = empty.encode().unwrap();
        assert_eq!(bytes[layout::KIND], KIND_COMPLETED_WITH_TRAILERS);
        assert_eq!(
            Record::decode(Bytes::from(bytes)).unwrap(),
            Record::Completed(empty)
        );
    }

    #[test]
    fn a_record_written_before_trailers_were_kept_still_decodes() {
        // Kind 2 as every earlier release wrote it: status 201, one header, a 2-byte body.
        let mut old = vec![1, 2];
        old.extend_from_slice(&[7; 32]);
        old.extend_from_slice(&201u16.to_le_bytes());
        old.extend_from_slice(&1u32.to_le_bytes());
        old.extend_from_slice(&1u16.to_le_bytes());
        old.extend_from_slice(b"a");
        old.extend_from_slice(&1u32.to_le_bytes());
        old.extend_from_slice(b"b");
        old.extend_from_slice(&2u32.to_le_bytes());
        old.extend_from_slice(b"ok");
        let Record::Completed(done) = Record::decode(Bytes::from(old.clone())).unwrap() else {
            panic!("not completed")
        };
        let response = done.plain().unwrap();
        assert_eq!(response.status, StatusCode::CREATED);
        assert_eq!(response.headers["a"], "b");
        assert_eq!(response.body, "ok");
        assert_eq!(response.trailers, None);
        // And a response without trailers is still written so, byte for byte.
        assert_eq!(done.encode().unwrap(), old);
    }

    #[cfg(feature = "seal")]
    #[test]
    fn a_sealed_plaintext_has_trailers_only_when_they_follow_the_body() {
        let without = StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"abc"),
            trailers: None,
        };
        let with = StoredResponse {
            trailers: Some(grpc_trailers()),
            ..without.clone()
        };
        for response in [without, with] {
            let mut plaintext = Vec::new();
            encode_sealed_plaintext(&response, None, &mut plaintext).unwrap();
            assert_eq!(plaintext.len(), sealed_plaintext_len(&response, None));
            assert_eq!(
                plaintext.len(),
                response_len(&response),
                "no extensions, no area"
            );
            let decoded = decode_sealed_plaintext(Bytes::from(plaintext.clone())).unwrap();
            assert_eq!(decoded, (response.clone(), None));
            for n in 0..plaintext.len() {
                let prefix = decode_sealed_plaintext(Bytes::copy_from_slice(&plaintext[..n]));
                if let Ok((prefix, _)) = prefix {
                    // Only the plaintext without its trailer block reads as a response.
                    assert_eq!(prefix.trailers, None, "prefix {n}");
                    assert!(response.trailers.is_some(), "prefix {n}");
                }
            }
        }
    }

    pub(in crate::record) fn origin() -> TraceOrigin {
        TraceOrigin::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("a valid traceparent")
            .with_tracestate("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    }

    /// [`origin`]'s fields: trace id, span id, flags, tracestate length and tracestate.
    pub(in crate::record) fn origin_fields() -> Vec<u8> {
        let origin = origin();
        let state = origin.tracestate().expect("a tracestate").as_bytes();
        let mut fields = Vec::new();
        fields.extend_from_slice(&origin.trace_id());
        fields.extend_from_slice(&origin.span_id());
        fields.push(origin.flags());
        fields.extend_from_slice(&(state.len() as u16).to_le_bytes());
        fields.extend_from_slice(state);
        fields
    }

    /// An extension as any release writes it: its type, its value's length, its value.
    pub(in crate::record) fn extension(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = kind.to_le_bytes().to_vec();
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value);
        out
    }

    /// A response, a response with trailers and a tombstone, each with its kind.
    pub(in crate::record) fn completed_records() -> [(Completed, u8); 3] {
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"{}"),
            trailers: None,
        };
        let with_trailers = StoredResponse {
            trailers: Some(grpc_trailers()),
            ..response.clone()
        };
        [
            (
                Completed::with_response(fingerprint(), response),
                KIND_COMPLETED,
            ),
            (
                Completed::with_response(fingerprint(), with_trailers),
                KIND_COMPLETED_WITH_TRAILERS,
            ),
            (Completed::tombstone(fingerprint()), KIND_TOMBSTONE),
        ]
    }

    #[test]
    fn an_origin_is_an_extension_after_the_last_field_of_every_completed_kind() {
        for (plain, kind) in completed_records() {
            let without = plain.encode().unwrap();
            let record = plain.clone().with_origin(Some(origin()));
            let bytes = record.encode().unwrap();
            assert_eq!(bytes[layout::KIND], kind, "an origin changes no kind");
            assert_eq!(
                bytes[..without.len()],
                without[..],
                "the record's own fields first, unchanged"
            );
            assert_eq!(
                bytes[without.len()..],
                extension(1, &origin_fields())[..],
                "then the origin, type 1"
            );
            assert_eq!(
                Record::decode(Bytes::from(bytes.clone())).unwrap(),
                Record::Completed(record),
            );
            for n in 0..bytes.len() {
                let prefix = Record::decode(Bytes::copy_from_slice(&bytes[..n]));
                if n == without.len() {
                    // Cut where its area begins: the record, without an origin.
                    assert_eq!(prefix.unwrap(), Record::Completed(plain.clone()));
                    continue;
                }
                assert!(prefix.is_err(), "prefix {n} of kind {kind}");
            }
        }
    }

    #[test]
    fn a_record_without_extensions_keeps_its_exact_bytes() {
        // Each as 0.1.0 wrote and reads it (kind 5 as the release that added trailers does),
        // spelt out byte for byte: an extension area that is empty adds nothing.
        let fingerprint_bytes = [7; 32];
        let bytes = |head: &[u8], tail: &[&[u8]]| {
            let mut out = head.to_vec();
            out.extend_from_slice(&fingerprint_bytes);
            tail.iter().for_each(|part| out.extend_from_slice(part));
            out
        };
        let mut headers = HeaderMap::new();
        headers.append("a", HeaderValue::from_static("b"));
        let response = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::from_static(b"abc"),
            trailers: None,
        };
        let status_headers_body: &[&[u8]] = &[
            &[200, 0],                       // status
            &[1, 0, 0, 0],                   // one header
            &[1, 0, b'a'],                   // its name
            &[1, 0, 0, 0, b'b'],             // its value
            &[3, 0, 0, 0, b'a', b'b', b'c'], // the body
        ];
        let completed = Completed::with_response(fingerprint(), response.clone());
        assert_eq!(
            completed.encode().unwrap(),
            bytes(&[1, 2], status_headers_body)
        );

        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        let with_trailers = Completed::with_response(
            fingerprint(),
            StoredResponse {
                trailers: Some(trailers),
                ..response
            },
        );
        let mut trailer_fields: Vec<&[u8]> = status_headers_body.to_vec();
        trailer_fields.extend_from_slice(&[
            &[1, 0, 0, 0], // one trailer
            &[11, 0],      // its name's length
            b"grpc-status",
            &[1, 0, 0, 0, b'0'], // its value
        ]);
        assert_eq!(
            with_trailers.encode().unwrap(),
            bytes(&[1, 5], &trailer_fields)
        );

        let tombstone = Completed::tombstone(fingerprint());
        assert_eq!(tombstone.encode().unwrap(), bytes(&[1, 3], &[]));

        let sealed = Completed {
            fingerprint: fingerprint(),
            response: Some(Payload::Sealed(Arc::new(SealedResponse {
                key_id: "k1".into(),
                nonce: [9; 24],
                ciphertext: Bytes::from_static(&[5; 3]),
            }))),
            origin: None,
        };
        assert_eq!(
            sealed.encode().unwrap(),
            bytes(
                &[1, 4],
                &[&[2, b'k', b'1'], &[9; 24], &[3, 0, 0, 0], &[5; 3]]
            )
        );
        for record in [completed, with_trailers, tombstone, sealed] {
            let bytes = record.encode().unwrap();
            assert_eq!(
                Record::decode(Bytes::from(bytes)).unwrap(),
                Record::Completed(record)
            );
        }
    }

    #[test]
    fn a_damaged_origin_is_an_error_not_an_origin() {
        let record = Completed::tombstone(fingerprint()).with_origin(Some(origin()));
        let good = record.encode().unwrap();
        // The tombstone's fingerprint, the extension's type and length, then the origin's fields.
        let at = layout::COMPLETED_FINGERPRINT.end + 6;
        let cases: [(usize, &[u8]); 4] = [
            (at, &[0; 16]),           // an all-zero trace id
            (at + 16, &[0; 8]),       // an all-zero span id
            (at + 27, b"C"),          // an uppercase tracestate key
            (at + 25, &[0xff, 0xff]), // a tracestate longer than its extension
        ];
        for (offset, bytes) in cases {
            let mut bad = good.clone();
            bad[offset..offset + bytes.len()].copy_from_slice(bytes);
            assert!(Record::decode(Bytes::from(bad)).is_err(), "at {offset}");
        }
    }

    #[test]
    fn the_origin_block_of_earlier_builds_still_decodes() {
        // Before extensions, origins were a block marked `00 00` right after the fingerprint.
        let block = [&ORIGIN_BLOCK_MARKER[..], &origin_fields()].concat();
        for (plain, kind) in completed_records() {
            let fields = plain.encode().unwrap();
            let (head, tail) = fields.split_at(layout::COMPLETED_FINGERPRINT.end);
            let old = [head, &block, tail].concat();
            let Record::Completed(decoded) = Record::decode(Bytes::from(old)).unwrap() else {
                panic!("not completed")
            };
            let with_origin = plain.with_origin(Some(origin()));
            assert_eq!(decoded, with_origin, "kind {kind}");
            // Written again, the origin is an extension.
            assert_eq!(
                decoded.encode().unwrap(),
                [&fields[..], &extension(1, &origin_fields())].concat()
            );
            // A block and an extension: two origins, which no writer makes.
            let both = [head, &block, tail, &extension(1, &origin_fields())].concat();
            assert!(matches!(
                Record::decode(Bytes::from(both)),
                Err(DecodeError::Malformed("two trace origins"))
            ));
        }
    }

    #[cfg(feature = "seal")]
    #[test]
    fn a_sealed_plaintext_keeps_its_extensions_first_in_a_marked_area() {
        let response = StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"abc"),
            trailers: Some(grpc_trailers()),
        };
        let mut plaintext = Vec::new();
        encode_sealed_plaintext(&response, Some(&origin()), &mut plaintext).unwrap();
        assert_eq!(
            plaintext.len(),
            sealed_plaintext_len(&response, Some(&origin()))
        );
        let area = extension(1, &origin_fields());
        assert_eq!(
            plaintext[..2],
            SEALED_AREA_MARKER,
            "where a status would begin"
        );
        assert_eq!(plaintext[2..6], (area.len() as u32).to_le_bytes());
        assert_eq!(plaintext[6..6 + area.len()], area[..]);
        let mut fields = Vec::new();
        encode_response(&response, &mut fields).unwrap();
        assert_eq!(plaintext[6 + area.len()..], fields[..], "then the response");
        let decoded = decode_sealed_plaintext(Bytes::from(plaintext)).unwrap();
        assert_eq!(decoded, (response.clone(), Some(origin())));

        // As the builds before extensions sealed it: the origin block, then the response.
        let old = [&ORIGIN_BLOCK_MARKER[..], &origin_fields(), &fields].concat();
        let decoded = decode_sealed_plaintext(Bytes::from(old)).unwrap();
        assert_eq!(decoded, (response, Some(origin())));
    }
}
