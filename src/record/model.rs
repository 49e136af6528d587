//! What a store holds under a key: a record [`InFlight`] (claimed, its handler running) or
//! [`Completed`] (the handler ran; its response, or a tombstone).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::fingerprint::Fingerprint;

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
}
