//! Exponential backoff with full jitter.
//!
//! Not tower's `ExponentialBackoff`: it adds its jitter on top of the exponential base (a wait
//! between `base` and `base × (1 + jitter)`), so clients that failed together still retry close
//! together, and it hands back a `Sleep` rather than the delay, which the policy needs in order to
//! weigh it against the deadline and `Retry-After` and to report it. Full jitter (a wait drawn
//! uniformly from zero to the exponential bound) spreads the retries of many clients the most.
//! The random numbers come from tower's `HasherRng`.

use std::time::Duration;

use tower::util::rng::{HasherRng, Rng};

/// The bounds of the backoff: the first retry waits up to `initial`, each further one up to
/// twice as long as the one before, never more than `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
}

impl Backoff {
    /// The upper bound of the wait before retry number `retry` (1 for the first retry).
    pub(crate) fn bound(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1 << doublings)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The wait before retry number `retry`: uniform in `[0, bound(retry)]`.
    pub(crate) fn delay(&self, retry: u32, rng: &mut HasherRng) -> Duration {
        self.bound(retry).mul_f64(rng.next_f64().clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACKOFF: Backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
    };

    #[test]
    fn the_bound_doubles_up_to_the_maximum() {
        let bounds: Vec<u128> = (1..=6).map(|n| BACKOFF.bound(n).as_millis()).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(BACKOFF.bound(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn delays_spread_over_the_whole_range() {
        let mut rng = HasherRng::default();
        let delays: Vec<Duration> = (0..1000).map(|_| BACKOFF.delay(3, &mut rng)).collect();
        let bound = Duration::from_millis(400);
        assert!(delays.iter().all(|delay| *delay <= bound));
        // Full jitter: waits near zero and near the bound both occur.
        assert!(delays.iter().any(|delay| *delay < bound / 10));
        assert!(delays.iter().any(|delay| *delay > bound * 9 / 10));
    }
}
