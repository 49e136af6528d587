//! What a store keeps under a key, and its compact, versioned binary encoding.
//!
//! A record is either [`InFlight`] (claimed, the handler is running) or [`Completed`] (the handler
//! ran; its response, if it could be stored). [`RecordId`] names a record and [`ClaimToken`] fences
//! the writes of the claim that made it; its [`Fence`] numbers the claims of a key.
//! Every store of the workspace keeps a completed record as [`Completed::encode`] writes it and
//! reads it back with [`Record::decode`]: Redis and PostgreSQL, and the memory store too (one
//! allocation per record for the whole dedup window). Redis keeps an in-flight record encoded as
//! well, and its scripts read the claim token and lease end in place, at the offsets of
//! [`layout`]; PostgreSQL keeps an in-flight claim in the row's own columns, and the memory store
//! as typed values.
//!
//! Encoding, version 1 (integers little-endian):
//!
//! | kind | layout |
//! |---|---|
//! | in flight | `01 01` token (16) fingerprint (32) lease end, unix ms (u64) |
//! | completed | `01 02` fingerprint (32) status (u16) header count (u32), per header: name length (u16) name, value length (u32) value; body length (u32) body; extensions |
//! | tombstone | `01 03` fingerprint (32); extensions |
//! | sealed | `01 04` fingerprint (32) key id length (u8) key id, nonce (24), ciphertext length (u32) ciphertext: a completed record's fields after its fingerprint, encrypted, then the 16-byte tag; extensions (never an origin: it is sealed) |
//! | completed with trailers | `01 05`, then a completed record's fields, then the trailers: count (u32), per trailer: name length (u16) name, value length (u32) value; extensions |
//!
//! The claim token sits at bytes 2..18 of an in-flight record, so a store script can fence on it
//! without decoding the rest.
//!
//! Extensions are what an option adds to a completed record, to the record's end: none, or one
//! after another, each its type (u16, never 0), its value's length (u32) and its value. A release
//! skips a type it does not know by its length, so a record a later release extends still
//! replays; a record without extensions is its kind's fields alone, as before extensions existed.
//! Type 1 is the [`TraceOrigin`]: trace id (16) span id (8) flags (1) tracestate length (u16)
//! tracestate. A sealed response's extensions (its origin) are sealed with it, first in its
//! plaintext and marked: `ff ff`, the area's length (u32), the extensions, then the response's
//! fields.
//!
//! Read, never written: an origin block (`00 00`, then the origin's fields as type 1 holds them)
//! right after a completed record's or tombstone's fingerprint, or at the start of a seal's
//! plaintext, where unreleased builds wrote origins before extensions existed.

mod codec;
mod extension;
mod id;
mod model;
mod reader;
mod trace_origin;

pub use crate::fingerprint::Fingerprint;
pub(crate) use codec::encode_tombstone;
pub use codec::layout;
pub use codec::{DecodeError, EncodeError};
#[cfg(feature = "seal")]
pub(crate) use codec::{
    decode_sealed_plaintext, encode_sealed_header, encode_sealed_plaintext, is_key_id,
    sealed_plaintext_len,
};
pub use id::{ClaimToken, Fence, RecordId};
pub use model::{Completed, InFlight, Payload, Record, SealedResponse, StoredResponse};
pub use trace_origin::{MAX_TRACESTATE_LEN, TraceOrigin};
