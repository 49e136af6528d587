//! What a store holds under a key: a record [`InFlight`] (claimed, its handler running) or
//! [`Completed`] (the handler ran; its response, or a tombstone).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use super::trace_origin::TraceOrigin;
use crate::fingerprint::Fingerprint;

/// A stored response: status, headers (every value, in order), body and trailers.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers, already stripped of what must not be replayed.
    pub headers: HeaderMap,
    /// The body bytes.
    pub body: Bytes,
    /// The trailers the body ended with (every value, in order), or `None` when it ended without
    /// a trailers frame. A gRPC response's status is in them (`grpc-status`, `grpc-message`).
    pub trailers: Option<HeaderMap>,
}

impl StoredResponse {
    /// The bytes this response holds in a store, roughly: body, header and trailer names and
    /// values.
    pub fn size(&self) -> usize {
        let fields = |map: &HeaderMap| {
            map.iter()
                .map(|(name, value)| name.as_str().len() + value.len() + 8)
                .sum::<usize>()
        };
        self.body.len() + fields(&self.headers) + self.trailers.as_ref().map_or(0, fields)
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
    /// not be stored (larger than the response limit, or failing while it was read), so it cannot
    /// be replayed.
    pub response: Option<Payload>,
    /// The trace context of the execution that completed it, when the layer records it
    /// (`IdempotencyLayer::trace_origin`, feature `trace-origin`, PROTOCOL.md
    /// §5.6): a replay points at it. A sealed record keeps it inside its seal, so it is `None`
    /// until the record is opened.
    pub origin: Option<Arc<TraceOrigin>>,
}

impl Completed {
    /// A completed record that replays `response`, kept in clear.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::record::{Completed, Fingerprint, StoredResponse};
    ///
    /// let done = Completed::with_response(
    ///     Fingerprint::from_bytes([1; 32]),
    ///     StoredResponse {
    ///         status: StatusCode::CREATED,
    ///         headers: HeaderMap::new(),
    ///         body: Bytes::from("{}"),
    ///         trailers: None,
    ///     },
    /// );
    /// assert_eq!(done.plain().unwrap().status, StatusCode::CREATED);
    /// ```
    pub fn with_response(fingerprint: Fingerprint, response: StoredResponse) -> Self {
        Self {
            fingerprint,
            response: Some(Payload::Plain(Arc::new(response))),
            origin: None,
        }
    }

    /// A tombstone: a completed record without a response (PROTOCOL.md §5.2).
    ///
    /// ```
    /// use tower_idempotency::record::{Completed, Fingerprint};
    ///
    /// let tombstone = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
    /// assert!(tombstone.response.is_none());
    /// ```
    pub fn tombstone(fingerprint: Fingerprint) -> Self {
        Self {
            fingerprint,
            response: None,
            origin: None,
        }
    }

    /// This record with the trace context of the execution that completed it.
    ///
    /// ```
    /// use tower_idempotency::record::{Completed, Fingerprint, TraceOrigin};
    ///
    /// let origin = TraceOrigin::new([1; 16], [2; 8], 1).unwrap();
    /// let done = Completed::tombstone(Fingerprint::from_bytes([1; 32])).with_origin(Some(origin.clone()));
    /// assert_eq!(done.origin.as_deref(), Some(&origin));
    /// ```
    pub fn with_origin(mut self, origin: Option<TraceOrigin>) -> Self {
        self.origin = origin.map(Arc::new);
        self
    }

    /// The response in clear, if the record keeps one: `None` for a tombstone and for a sealed
    /// response.
    ///
    /// ```
    /// use tower_idempotency::record::{Completed, Fingerprint};
    ///
    /// let tombstone = Completed::tombstone(Fingerprint::from_bytes([1; 32]));
    /// assert!(tombstone.plain().is_none());
    /// ```
    pub fn plain(&self) -> Option<&Arc<StoredResponse>> {
        match &self.response {
            Some(Payload::Plain(response)) => Some(response),
            _ => None,
        }
    }
}

/// What a completed record keeps of its response: the response itself, or the response sealed
/// (`docs/PROTOCOL.md` §5.4, §12).
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// The response in clear.
    Plain(Arc<StoredResponse>),
    /// The response encrypted and authenticated under an application key (a `SealedStore`,
    /// feature `seal`). It is replayed only once opened; a layer that is handed one unopened
    /// answers `500 record-unreadable` and never runs the request again.
    Sealed(Arc<SealedResponse>),
}

/// A sealed response: status, headers and body encrypted and authenticated together with
/// XChaCha20-Poly1305 under the key `key_id` names. The associated data binds it to its record id
/// (scope and key), its fingerprint and this header, so that it opens nowhere else.
///
/// ```
/// use bytes::Bytes;
/// use tower_idempotency::record::SealedResponse;
///
/// let sealed = SealedResponse { key_id: "2025-01".into(), nonce: [0; 24], ciphertext: Bytes::new() };
/// assert_eq!(sealed.key_id, "2025-01");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SealedResponse {
    /// The id of the key it was sealed under: 1 to 64 bytes of visible ASCII, no `:` or `,`.
    pub key_id: String,
    /// The nonce it was sealed with.
    pub nonce: [u8; 24],
    /// The encrypted response followed by its 16-byte authentication tag.
    pub ciphertext: Bytes,
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
}
