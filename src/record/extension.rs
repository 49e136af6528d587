//! A completed record's extension area (`docs/PROTOCOL.md` §5.4): what an option adds to a record
//! goes here, each addition an extension of its own, so that the option never changes the
//! encoding of the records it does not touch, and a release that does not know an extension skips
//! it and still decodes and replays the record.
//!
//! An extension is its type (`u16`), the length of its value (`u32`), then its value. The type is
//! the extension's version as well: a different layout of the same data is a new type, which a
//! release that knows the old one skips. A `u16` type leaves room for every option there will be
//! at one byte more than a `u8`; a `u32` length is the width of every other length in a record
//! (a header value, a body), so an extension can hold whatever a record can. Type 0 is never
//! written, so that zeroed bytes never read as an extension (and a tombstone's area cannot be
//! taken for the origin block of the builds before the area).
//!
//! Where the area is: after a clear record's last field, to the record's end; in a seal's
//! plaintext, marked and sized before the response (see [`super::codec`]).

use super::codec::{DecodeError, EncodeError};
use super::reader::Reader;
use super::trace_origin::TraceOrigin;

/// Never written: zeroed bytes are not an extension.
const RESERVED: u16 = 0;
/// The trace origin of the run that completed the record (§5.6): its fields as
/// [`write_origin_fields`] writes them.
pub(super) const TRACE_ORIGIN: u16 = 1;

/// An extension's type and length, before its value.
const HEADER_LEN: usize = 2 + 4;

/// The extensions of an area that this release knows; it skipped the others.
#[derive(Debug, Default)]
pub(super) struct KnownExtensions {
    /// The trace origin (type 1).
    pub(super) origin: Option<TraceOrigin>,
}

/// The length of the area [`write_area`] writes: 0 without an extension.
pub(super) fn area_len(origin: Option<&TraceOrigin>) -> usize {
    origin.map_or(0, |origin| HEADER_LEN + origin.encoded_len())
}

/// Appends the extensions of a record to `out`, in ascending type order, so that a record always
/// encodes to the same bytes (a store recognises a completion sent again by its bytes).
pub(super) fn write_area(
    origin: Option<&TraceOrigin>,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if let Some(origin) = origin {
        let len = u32::try_from(origin.encoded_len()).map_err(|_| EncodeError::TooLarge)?;
        out.extend_from_slice(&TRACE_ORIGIN.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        write_origin_fields(origin, out)?;
    }
    Ok(())
}

/// Reads every extension left in `r`: the known ones, checked, and the others skipped by their
/// length. An extension that runs past the end, or an origin whose fields run past its value, is
/// [`DecodeError::Truncated`]; type 0, two origins, or bytes after an origin's fields are
/// [`DecodeError::Malformed`].
pub(super) fn read_area(r: &mut Reader<'_>) -> Result<KnownExtensions, DecodeError> {
    let mut known = KnownExtensions::default();
    while !r.is_empty() {
        let kind = r.u16()?;
        let len = r.u32()? as usize;
        let mut value = Reader(r.take(len)?);
        match kind {
            RESERVED => return Err(DecodeError::Malformed("extension type 0")),
            TRACE_ORIGIN if known.origin.is_some() => {
                return Err(DecodeError::Malformed("two trace origins"));
            }
            TRACE_ORIGIN => {
                known.origin = Some(read_origin_fields(&mut value)?);
                if !value.is_empty() {
                    return Err(DecodeError::Malformed("trace origin"));
                }
            }
            // A later release's: skipped by its length, and not kept.
            _unknown => {}
        }
    }
    Ok(known)
}

/// Appends an origin's fields: the trace id, the span id, the flags, and the tracestate's length
/// (`u16`) and bytes.
fn write_origin_fields(origin: &TraceOrigin, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let state = origin.tracestate().unwrap_or_default();
    let state_len = u16::try_from(state.len()).map_err(|_| EncodeError::TooLarge)?;
    out.extend_from_slice(&origin.trace_id());
    out.extend_from_slice(&origin.span_id());
    out.push(origin.flags());
    out.extend_from_slice(&state_len.to_le_bytes());
    out.extend_from_slice(state.as_bytes());
    Ok(())
}

/// Reads an origin's fields as [`write_origin_fields`] writes them, checked as
/// [`TraceOrigin`] keeps them: a zero id or a tracestate it would not keep is malformed.
pub(super) fn read_origin_fields(r: &mut Reader<'_>) -> Result<TraceOrigin, DecodeError> {
    let trace_id = r.array()?;
    let span_id = r.array()?;
    let flags = r.u8()?;
    let state_len = r.u16()? as usize;
    let state = r.take(state_len)?;
    TraceOrigin::from_parts(trace_id, span_id, flags, state)
        .ok_or(DecodeError::Malformed("trace origin"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::record::codec::layout;
    use crate::record::codec::tests::{
        completed_records, extension, fingerprint, origin, origin_fields,
    };
    use crate::record::{Completed, Payload, Record, SealedResponse};

    /// A type no release knows yet.
    const LATER: u16 = 0x7f01;

    fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        Record::decode(Bytes::copy_from_slice(bytes))
    }

    fn sealed() -> Completed {
        Completed {
            fingerprint: fingerprint(),
            response: Some(Payload::Sealed(Arc::new(SealedResponse {
                key_id: "k1".into(),
                nonce: [9; 24],
                ciphertext: Bytes::from_static(&[5; 20]),
            }))),
            origin: None,
        }
    }

    #[test]
    fn unknown_extensions_are_skipped_before_and_after_the_origin() {
        let later = extension(LATER, b"from a later release");
        let empty = extension(0xffff, b"");
        let own = extension(TRACE_ORIGIN, &origin_fields());
        for (plain, kind) in completed_records() {
            for origin in [None, Some(origin())] {
                let record = plain.clone().with_origin(origin.clone());
                let fields = plain.encode().unwrap();
                let own: &[u8] = if origin.is_some() { &own } else { &[] };
                let areas: [Vec<u8>; 4] = [
                    [&later[..], own].concat(),
                    [own, &later[..]].concat(),
                    [&later[..], own, &empty, &later].concat(),
                    [&empty[..], own, &empty].concat(),
                ];
                for area in areas {
                    let bytes = [&fields[..], &area].concat();
                    let decoded = decode(&bytes).expect("decodes");
                    assert_eq!(
                        decoded,
                        Record::Completed(record.clone()),
                        "kind {kind}, area {area:?}: as without the unknown extensions"
                    );
                    let Record::Completed(decoded) = decoded else {
                        unreachable!()
                    };
                    assert_eq!(
                        decoded.encode().unwrap(),
                        [&fields[..], own].concat(),
                        "encoded again, the unknown extensions are gone"
                    );
                }
            }
        }
        // A sealed record's clear extensions, all unknown: skipped as well.
        let bytes = [&sealed().encode().unwrap()[..], &later, &empty].concat();
        assert_eq!(decode(&bytes).unwrap(), Record::Completed(sealed()));
    }

    #[test]
    fn an_extension_that_runs_past_the_record_is_an_error() {
        let tombstone = Completed::tombstone(fingerprint()).encode().unwrap();
        let later = extension(LATER, b"abc");
        let with = |area: &[u8]| [&tombstone[..], area].concat();
        let mut one_over = later.clone();
        one_over[2..6].copy_from_slice(&4u32.to_le_bytes());
        let mut largest = later.clone();
        largest[2..6].copy_from_slice(&u32::MAX.to_le_bytes());
        for area in [one_over, largest] {
            assert!(
                matches!(decode(&with(&area)), Err(DecodeError::Truncated)),
                "{area:?}"
            );
        }
        // A header cut short: one to five bytes of an extension's six.
        for n in 1..HEADER_LEN {
            assert!(
                matches!(decode(&with(&later[..n])), Err(DecodeError::Truncated)),
                "{n} bytes"
            );
        }
        // Every cut of an area of two extensions: at a boundary a record, else an error.
        let area = [&later[..], &extension(TRACE_ORIGIN, &origin_fields())].concat();
        for n in 0..=area.len() {
            let cut = decode(&with(&area[..n]));
            assert_eq!(
                cut.is_ok(),
                [0, later.len(), area.len()].contains(&n),
                "{n}"
            );
        }
    }

    #[test]
    fn a_malformed_area_is_an_error() {
        // A response's record: after a tombstone's fingerprint, `00 00` is an origin block.
        let (completed, _) = &completed_records()[0];
        let fields = completed.encode().unwrap();
        let own = extension(TRACE_ORIGIN, &origin_fields());
        let longer = extension(TRACE_ORIGIN, &[&origin_fields()[..], b"x"].concat());
        let cases: [(Vec<u8>, &str); 3] = [
            (extension(RESERVED, b"abc"), "extension type 0"),
            ([&own[..], &own].concat(), "two trace origins"),
            (longer, "trace origin"),
        ];
        for (area, why) in cases {
            match decode(&[&fields[..], &area].concat()) {
                Err(DecodeError::Malformed(said)) => assert_eq!(said, why),
                other => panic!("{why}: {other:?}"),
            }
        }
        // An origin whose tracestate runs one byte past its extension's value.
        let shorter = extension(TRACE_ORIGIN, &origin_fields()[..origin_fields().len() - 1]);
        assert!(matches!(
            decode(&[&fields[..], &shorter].concat()),
            Err(DecodeError::Truncated)
        ));
        // An origin in clear beside a seal: the format keeps it inside the seal.
        let beside = [&sealed().encode().unwrap()[..], &own].concat();
        assert!(matches!(
            decode(&beside),
            Err(DecodeError::Malformed("a trace origin beside a seal"))
        ));
        // An in-flight record has no area: its bytes end with its lease.
        let token = crate::record::ClaimToken::new(crate::record::Fence::new(1));
        let in_flight = layout::in_flight(&token, &fingerprint(), std::time::SystemTime::now());
        let extended = [&in_flight[..], &extension(LATER, b"")].concat();
        assert!(matches!(
            decode(&extended),
            Err(DecodeError::Malformed("trailing bytes"))
        ));
    }

    #[cfg(feature = "seal")]
    #[test]
    fn a_sealed_plaintext_skips_unknown_extensions_and_refuses_an_area_past_its_end() {
        use crate::record::StoredResponse;
        use crate::record::codec::{decode_sealed_plaintext, encode_sealed_plaintext};

        let response = StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Bytes::from_static(b"abc"),
            trailers: None,
        };
        let mut fields = Vec::new();
        encode_sealed_plaintext(&response, None, &mut fields).unwrap();
        let area = [
            &extension(LATER, b"later")[..],
            &extension(TRACE_ORIGIN, &origin_fields()),
            &extension(LATER, b""),
        ]
        .concat();
        let plaintext = |area_len: u32| {
            let marker = [0xff, 0xff];
            [&marker[..], &area_len.to_le_bytes(), &area, &fields].concat()
        };
        let decoded = decode_sealed_plaintext(Bytes::from(plaintext(area.len() as u32)));
        assert_eq!(decoded.unwrap(), (response, Some(origin())));
        for wrong in [area.len() as u32 + 1, u32::MAX, area.len() as u32 - 1] {
            let decoded = decode_sealed_plaintext(Bytes::from(plaintext(wrong)));
            assert!(decoded.is_err(), "an area of {wrong} bytes");
        }
    }

    /// A small deterministic generator (xorshift64), so that a failure names its seed.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn random_areas_decode_as_without_their_unknown_extensions_and_damage_never_panics() {
        let records = completed_records();
        for seed in 1..=300u64 {
            let mut random = Random(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let (plain, _) = &records[random.below(records.len())];
            let origin = (random.below(2) == 0).then(origin);
            let record = plain.clone().with_origin(origin.clone());
            let mut extensions: Vec<Vec<u8>> = (0..random.below(4))
                .map(|_| {
                    // Any type but 0 (never written) and 1 (known here).
                    let kind = (random.next() as u16).max(2);
                    let value: Vec<u8> =
                        (0..random.below(24)).map(|_| random.next() as u8).collect();
                    extension(kind, &value)
                })
                .collect();
            if origin.is_some() {
                let at = random.below(extensions.len() + 1);
                extensions.insert(at, extension(TRACE_ORIGIN, &origin_fields()));
            }
            let fields = plain.encode().unwrap();
            let bytes = [&fields[..], &extensions.concat()].concat();
            assert_eq!(
                decode(&bytes).unwrap(),
                Record::Completed(record),
                "seed {seed}"
            );
            // Any byte of the area changed, any cut: an error or a record, never a panic.
            for at in fields.len()..bytes.len() {
                let mut changed = bytes.clone();
                changed[at] = random.next() as u8;
                let _ = decode(&changed);
                let _ = decode(&bytes[..at]);
            }
        }
    }
}
