//! Opt-in compression of completed records ([`RedisStore::with_compression`]): Redis holds every
//! record's bytes in memory for the whole dedup window, and a JSON response shrinks by about half.
//!
//! A record over the threshold is stored LZ4-compressed (lz4_flex's block format, in safe Rust)
//! when that makes it smaller, framed as: the encoding's version byte, [`COMPRESSED`] in the kind
//! byte, the record's length (u32, little-endian), the LZ4 block. Its kind is not an in-flight
//! record's, so the scripts treat it as any completed record, and the same completion compressed
//! again gives the same bytes (a completion sent again is recognised). Every store reads
//! compressed values whether it compresses or not, so instances can turn compression on (or off)
//! one at a time.
//!
//! A compressed value declares its record's length, and reading it allocates that much: a value
//! whose declared length is over the store's bound ([`RedisStore::with_max_decompressed`],
//! [`DEFAULT_MAX_DECOMPRESSED`]) is refused before anything is allocated, so that a forged or
//! damaged value cannot make each request that reads it allocate hundreds of MiB. A record over
//! the bound is stored as it is, never compressed: a store never writes what it would refuse.
//!
//! [`RedisStore::with_max_decompressed`]: crate::RedisStore::with_max_decompressed
//! [`DEFAULT_MAX_DECOMPRESSED`]: crate::DEFAULT_MAX_DECOMPRESSED
//!
//! [`RedisStore::with_compression`]: crate::RedisStore::with_compression

use std::fmt;

use tower_idempotency::record::layout;

/// The kind byte of a compressed record: outside the record kinds of the encoding, which stay
/// below it.
pub(super) const COMPRESSED: u8 = 0x80;

/// Version, kind and the record's length.
const HEADER: usize = 6;

/// An LZ4 block never expands its input by more than this: a record declaring a larger length than
/// its block allows is damaged, and nothing is allocated for it.
const MAX_RATIO: usize = 255;

/// Completed records longer than `threshold` bytes are compressed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Compression {
    pub(super) threshold: usize,
}

impl Compression {
    /// `record` compressed, if it is over the threshold, no longer than `max` (what the store
    /// reads back) and compressing makes it smaller; as it is otherwise (a sealed record, for
    /// one, does not compress).
    pub(super) fn compress(&self, record: Vec<u8>, max: usize) -> Vec<u8> {
        let Ok(length) = u32::try_from(record.len()) else {
            return record;
        };
        if record.len() <= self.threshold || record.len() < HEADER || record.len() > max {
            return record;
        }
        let mut out = vec![0; HEADER + lz4_flex::block::get_maximum_output_size(record.len())];
        out[0] = record[layout::VERSION_BYTE];
        out[1] = COMPRESSED;
        out[2..HEADER].copy_from_slice(&length.to_le_bytes());
        let Ok(written) = lz4_flex::block::compress_into(&record, &mut out[HEADER..]) else {
            return record;
        };
        out.truncate(HEADER + written);
        if out.len() < record.len() {
            out
        } else {
            record
        }
    }
}

/// The record a stored value holds: decompressed if it is compressed, as it is otherwise. A
/// compressed value declaring more than `max` bytes is refused before anything is allocated.
///
/// # Errors
/// [`Damaged`] when a compressed value declares more than `max` bytes, or does not decompress to
/// the length it declares.
pub(super) fn decompress(value: Vec<u8>, max: usize) -> Result<Vec<u8>, Damaged> {
    if value.get(layout::KIND) != Some(&COMPRESSED) {
        return Ok(value);
    }
    let block = value
        .get(HEADER..)
        .ok_or(Damaged("its header is cut short"))?;
    let declared = u32::from_le_bytes(value[2..HEADER].try_into().expect("four bytes"));
    let length = usize::try_from(declared).map_err(|_| Damaged("its length is too large"))?;
    if length > max {
        return Err(Damaged(
            "its length is more than the store's bound (RedisStore::with_max_decompressed)",
        ));
    }
    if length > block.len().saturating_mul(MAX_RATIO) {
        return Err(Damaged("its length is more than its block can hold"));
    }
    let record = lz4_flex::block::decompress(block, length)
        .map_err(|_| Damaged("its block does not decompress"))?;
    if record.len() != length {
        return Err(Damaged(
            "it decompresses to another length than it declares",
        ));
    }
    Ok(record)
}

/// A compressed record that does not decompress: its bytes were changed or cut. It is not
/// replayed ([`StoreError::Unreadable`](tower_idempotency::store::StoreError::Unreadable)).
#[derive(Debug)]
pub(super) struct Damaged(&'static str);

impl fmt::Display for Damaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a compressed record cannot be read: {}", self.0)
    }
}

impl std::error::Error for Damaged {}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = crate::DEFAULT_MAX_DECOMPRESSED;

    fn record(len: usize) -> Vec<u8> {
        // A version byte, a completed record's kind, then JSON-like text that compresses.
        let mut record = vec![1, 2];
        while record.len() < len {
            record.extend_from_slice(br#"{"object":"charge","amount":1000,"currency":"eur"},"#);
        }
        record.truncate(len);
        record
    }

    #[test]
    fn records_over_the_threshold_round_trip_smaller() {
        let compression = Compression { threshold: 1024 };
        let small = record(1024);
        assert_eq!(compression.compress(small.clone(), MAX), small);
        let large = record(4096);
        let stored = compression.compress(large.clone(), MAX);
        assert_eq!(stored[1], COMPRESSED);
        assert!(stored.len() < large.len() / 2, "{} bytes", stored.len());
        assert_eq!(
            compression.compress(large.clone(), MAX),
            stored,
            "deterministic"
        );
        assert_eq!(decompress(stored, MAX).unwrap(), large);
        assert_eq!(decompress(small.clone(), MAX).unwrap(), small);
    }

    #[test]
    fn what_does_not_shrink_is_kept_as_it_is() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let compression = Compression { threshold: 0 };
        assert_eq!(compression.compress(noise.clone(), MAX), noise);
    }

    #[test]
    fn damaged_records_are_errors_not_panics_or_large_allocations() {
        let stored = Compression { threshold: 0 }.compress(record(4096), MAX);
        // Every cut.
        for end in 2..stored.len() {
            let _ = decompress(stored[..end].to_vec(), MAX);
        }
        // Every byte changed, one at a time.
        for i in 2..stored.len() {
            let mut changed = stored.clone();
            changed[i] ^= 0x55;
            let _ = decompress(changed, MAX);
        }
        // A length no block of this size can hold: refused before anything is allocated.
        let mut bomb = stored.clone();
        bomb[2..6].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decompress(bomb, MAX).is_err());
        assert!(decompress(vec![1, COMPRESSED, 0], MAX).is_err());
    }

    #[test]
    fn a_length_over_the_bound_is_refused_and_larger_records_stay_as_they_are() {
        let large = record(8192);
        // A store bounded below the record does not compress it: it would not read it back.
        assert_eq!(
            Compression { threshold: 0 }.compress(large.clone(), 4096),
            large
        );
        let stored = Compression { threshold: 0 }.compress(large.clone(), MAX);
        assert!(
            decompress(stored.clone(), 8192).is_ok(),
            "exactly the bound"
        );
        let refused = decompress(stored, 8191).expect_err("over the bound");
        assert!(refused.to_string().contains("bound"), "{refused}");
    }
}
