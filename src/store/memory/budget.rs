//! What the memory store's records may hold: bytes against the store's capacity and, when a
//! per-scope limit is set, against each scope's limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::scopes::{SCOPE_OVERHEAD, Scopes};
use crate::record::RecordId;

/// What one record costs beyond its response: the key and entry (128 bytes in a map that is at
/// most 7/8 full, and about two thirds on average), and its expiry items (40 bytes each, in queues
/// that grow by doubling).
pub(super) const ENTRY_OVERHEAD: usize = 256;

/// The bytes the records hold, and the limits they are held to.
#[derive(Debug)]
pub(super) struct Budget {
    used: AtomicUsize,
    capacity: usize,
    scopes: Option<Scopes>,
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// The store is full.
    Store,
    /// The record's scope is at its limit; room frees after the duration, when known.
    Scope(Option<Duration>),
}

impl Budget {
    pub(super) fn new(capacity: usize, scope_limit: Option<usize>) -> Self {
        Self {
            used: AtomicUsize::new(0),
            capacity,
            scopes: scope_limit.map(Scopes::new),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// What a record costs before its response.
    pub(super) fn overhead(&self) -> usize {
        ENTRY_OVERHEAD + self.scopes.as_ref().map_or(0, |_| SCOPE_OVERHEAD)
    }

    pub(super) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Counts `bytes` more for the record `id`, within the store's capacity and its scope's limit.
    pub(super) fn reserve(&self, id: &RecordId, bytes: usize, now: Instant) -> Result<(), Refused> {
        if let Some(scopes) = &self.scopes {
            scopes
                .reserve(id.scope_tag(), bytes, now)
                .map_err(Refused::Scope)?;
        }
        let reserved = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes)
                    .filter(|total| *total <= self.capacity)
            });
        if reserved.is_err() {
            if let Some(scopes) = &self.scopes {
                scopes.free(id.scope_tag(), bytes);
            }
            return Err(Refused::Store);
        }
        Ok(())
    }

    /// Counts `bytes` fewer for the record `id`.
    pub(super) fn free(&self, id: &RecordId, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        if let Some(scopes) = &self.scopes {
            scopes.free(id.scope_tag(), bytes);
        }
    }

    /// Notes that the completed record `id` comes due at `at`, for the time a refusal names.
    pub(super) fn completed(&self, id: &RecordId, at: Instant, now: Instant) {
        if let Some(scopes) = &self.scopes {
            scopes.due_at(id.scope_tag(), at, now);
        }
    }
}
