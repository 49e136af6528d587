//! The memory store's optional per-scope limit: how many bytes each scope's records hold, and when
//! its completed records come due, so that a refused claim can say when room frees.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// What tracking a record's scope costs beyond the entry: its due time in the scope's heap, and
/// the scope's share of the map.
pub(super) const SCOPE_OVERHEAD: usize = 32;
const SHARDS: usize = 16;

/// Bytes held per scope, against one limit for every scope.
#[derive(Debug)]
pub(super) struct Scopes {
    limit: usize,
    shards: Box<[Mutex<HashMap<u64, Usage>>]>,
}

#[derive(Debug, Default)]
struct Usage {
    bytes: usize,
    /// When the scope's completed records come due, soonest first.
    due: BinaryHeap<Reverse<Instant>>,
}

impl Scopes {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// Counts `bytes` more for `scope`, unless that takes it past the limit: then nothing is
    /// counted, and the answer is how long until one of the scope's completed records comes due
    /// (`None` when it has none: only claims in flight, which are decided within their lease).
    pub(super) fn reserve(
        &self,
        scope: u64,
        bytes: usize,
        now: Instant,
    ) -> Result<(), Option<Duration>> {
        let mut shard = self.shard(scope);
        let usage = shard.entry(scope).or_default();
        match usage.bytes.checked_add(bytes) {
            Some(total) if total <= self.limit => {
                usage.bytes = total;
                Ok(())
            }
            _ => {
                while usage.due.peek().is_some_and(|Reverse(at)| *at <= now) {
                    usage.due.pop();
                }
                let room_at = usage.due.peek().map(|Reverse(at)| *at - now);
                if usage.bytes == 0 {
                    shard.remove(&scope);
                }
                Err(room_at)
            }
        }
    }

    /// Counts `bytes` fewer for `scope`; a scope that holds nothing is forgotten.
    pub(super) fn free(&self, scope: u64, bytes: usize) {
        let mut shard = self.shard(scope);
        if let Some(usage) = shard.get_mut(&scope) {
            usage.bytes = usage.bytes.saturating_sub(bytes);
            if usage.bytes == 0 {
                shard.remove(&scope);
            }
        }
    }

    /// Notes that one of `scope`'s completed records comes due at `at`.
    pub(super) fn due_at(&self, scope: u64, at: Instant, now: Instant) {
        let mut shard = self.shard(scope);
        if let Some(usage) = shard.get_mut(&scope) {
            // Dropping what is past keeps the heap no larger than the scope's live records.
            while usage.due.peek().is_some_and(|Reverse(due)| *due <= now) {
                usage.due.pop();
            }
            usage.due.push(Reverse(at));
        }
    }

    fn shard(&self, scope: u64) -> MutexGuard<'_, HashMap<u64, Usage>> {
        // The tag is a hash: its low bits spread scopes evenly.
        self.shards[(scope % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_scope_past_its_limit_is_refused_with_the_time_until_room_frees() {
        let scopes = Scopes::new(100);
        let now = Instant::now();
        assert_eq!(scopes.reserve(1, 60, now), Ok(()));
        assert_eq!(scopes.reserve(1, 60, now), Err(None));
        scopes.due_at(1, now + Duration::from_secs(90), now);
        scopes.due_at(1, now + Duration::from_secs(30), now);
        assert_eq!(
            scopes.reserve(1, 60, now),
            Err(Some(Duration::from_secs(30)))
        );
        // Another scope has a limit of its own.
        assert_eq!(scopes.reserve(2, 100, now), Ok(()));
        // Past the first due time, the next one counts.
        let later = now + Duration::from_secs(31);
        assert_eq!(
            scopes.reserve(1, 60, later),
            Err(Some(Duration::from_secs(59)))
        );
        // A scope that held nothing for a while has no due times left.
        scopes.free(1, 60);
        assert_eq!(scopes.reserve(1, 60, later), Ok(()));
        assert_eq!(scopes.reserve(1, 41, later), Err(None));
    }

    #[test]
    fn a_scope_that_holds_nothing_is_forgotten() {
        let scopes = Scopes::new(100);
        let now = Instant::now();
        assert_eq!(scopes.reserve(7, 10, now), Ok(()));
        scopes.free(7, 10);
        assert!(scopes.shard(7).is_empty());
        assert_eq!(scopes.reserve(7, 101, now), Err(None));
        assert!(scopes.shard(7).is_empty());
    }
}
