//! One log line per interval for a condition that repeats with every request, with a count of the
//! occurrences held back: a store outage or a full store must not write a warning per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Lets one occurrence through per interval and counts the others.
#[derive(Debug)]
pub(crate) struct LogThrottle {
    origin: Instant,
    interval: Duration,
    /// When the next occurrence may be logged, in milliseconds since `origin`.
    next: AtomicU64,
    held_back: AtomicU64,
}

impl LogThrottle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            origin: Instant::now(),
            interval,
            next: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when this occurrence is to be logged, `n` being how many were held back since the
    /// last one logged; `None` when it is held back.
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = millis(self.origin.elapsed());
        let next = self.next.load(Ordering::Acquire);
        let due = now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now + millis(self.interval),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok();
        if due {
            Some(self.held_back.swap(0, Ordering::AcqRel))
        } else {
            self.held_back.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

/// The throttled conditions of one layer, shared by every service it builds (a router may build
/// one per connection, or per request).
#[derive(Debug)]
pub(crate) struct LayerThrottles {
    /// Claim-time store failures: they repeat with every request while the store is away or full.
    pub(crate) store_failures: LogThrottle,
    /// Records that do not open: they repeat with every retry of their key.
    pub(crate) unreadable_records: LogThrottle,
}

impl LayerThrottles {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            store_failures: LogThrottle::new(interval),
            unreadable_records: LogThrottle::new(interval),
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_occurrence_per_interval_with_the_count_held_back() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        assert_eq!(throttle.admit(), Some(0));
        for _ in 0..5 {
            assert_eq!(throttle.admit(), None);
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(throttle.admit(), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(throttle.admit(), Some(6));
        assert_eq!(throttle.admit(), None);
    }
}
