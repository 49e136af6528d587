//! The simulation's only source of chance: SplitMix64, seeded per run, so that one seed always
//! makes one history. Hand-written (a dozen lines) rather than a crate's generator, whose stream
//! may change between versions and with it every recorded seed.

use std::ops::Range;
use std::time::Duration;

#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `range` (not empty).
    pub(crate) fn below(&mut self, range: Range<u64>) -> u64 {
        range.start + self.next_u64() % (range.end - range.start)
    }

    /// `true` with probability `per_mille` / 1000.
    pub(crate) fn chance(&mut self, per_mille: u64) -> bool {
        self.next_u64() % 1000 < per_mille
    }

    pub(crate) fn millis(&mut self, range: Range<u64>) -> Duration {
        Duration::from_millis(self.below(range))
    }

    /// A child generator, for a part of the world whose draws must not shift another's.
    pub(crate) fn fork(&mut self) -> Self {
        Self(self.next_u64())
    }
}
