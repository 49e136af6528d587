//! The budgets behind [`ScopeQuota`](super::ScopeQuota): each scope's bytes left, refilled at a
//! steady rate, in shards by scope tag.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::record::{Completed, Payload};

/// What a claim counts against its scope's quota: about what an in-flight record costs a store
/// (its key, value and expiry), whatever happens to it afterwards.
pub(crate) const CLAIM_COST: u64 = 256;

/// The budgets of the scopes seen lately, for one layer.
pub(crate) struct Quotas {
    /// The most a scope's budget holds: half the bound. It refills at that many bytes per dedup
    /// window, the window being the layer's when it asks.
    burst: f64,
    shards: Box<[Mutex<Shard>]>,
}

/// A shard of the budgets, by scope tag.
#[derive(Default)]
struct Shard {
    budgets: HashMap<u64, Budget, BuildHasherDefault<TagHasher>>,
    /// How many budgets the shard may hold before the full ones are forgotten.
    sweep_at: usize,
}

/// Hashes a scope tag as itself: the tag is a keyed hash already (`RecordId`), so hashing it again
/// would only cost time.
#[derive(Default)]
struct TagHasher(u64);

impl Hasher for TagHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, tag: u64) {
        self.0 = tag;
    }
}

/// One scope's budget: what it held at `at`. Negative when responses stored after its admission
/// spent more than was left; it refills from there.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: f64,
    at: Instant,
}

const SHARDS: usize = 16;
/// A shard sweeps the budgets that refilled (and so equal no budget at all) once it holds this
/// many, or twice as many as the last sweep left.
const SWEEP_FLOOR: usize = 256;

impl Quotas {
    /// Budgets of `bytes / 2` each, for a bound of `bytes` per dedup window.
    pub(crate) fn new(bytes: u64) -> Self {
        Self {
            burst: bytes as f64 / 2.0,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// `Ok` if `scope` may claim a record now; otherwise how long until it may.
    pub(crate) fn admit(&self, scope: u64, window: Duration, now: Instant) -> Result<(), Duration> {
        let rate = self.rate(window);
        let shard = self.shard(scope);
        let Some(budget) = shard.budgets.get(&scope) else {
            return Ok(());
        };
        let missing = CLAIM_COST as f64 - self.refilled(budget, rate, now);
        if missing <= 0.0 {
            return Ok(());
        }
        Err(Duration::from_secs_f64(missing / rate))
    }

    /// Counts `bytes` written for `scope`, even past what is left: they are written already.
    pub(crate) fn spend(&self, scope: u64, bytes: u64, window: Duration, now: Instant) {
        let rate = self.rate(window);
        let mut shard = self.shard(scope);
        let burst = self.burst;
        let budget = shard.budgets.entry(scope).or_insert(Budget {
            left: burst,
            at: now,
        });
        *budget = Budget {
            left: self.refilled(budget, rate, now) - bytes as f64,
            at: now,
        };
        if shard.budgets.len() >= shard.sweep_at.max(SWEEP_FLOOR) {
            shard
                .budgets
                .retain(|_, budget| self.refilled(budget, rate, now) < burst);
            shard.sweep_at = 2 * shard.budgets.len();
        }
    }

    /// Bytes a second.
    fn rate(&self, window: Duration) -> f64 {
        self.burst / window.as_secs_f64().max(1e-3)
    }

    fn refilled(&self, budget: &Budget, rate: f64, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(budget.at).as_secs_f64();
        (budget.left + elapsed * rate).min(self.burst)
    }

    fn shard(&self, scope: u64) -> std::sync::MutexGuard<'_, Shard> {
        // The tag is a keyed hash already: its high bits spread scopes evenly over the shards,
        // and its low bits, which the maps use, over each shard's map.
        let shard = &self.shards[(scope >> 60) as usize % SHARDS];
        // A panic under this lock leaves only numbers behind, each whole.
        shard.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Quotas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quotas")
            .field("burst", &self.burst)
            .finish_non_exhaustive()
    }
}

/// What a completion counts against its scope's quota: its response's bytes, about as a store
/// holds them ([`StoredResponse::size`](crate::record::StoredResponse::size), or a sealed
/// response's ciphertext and key id, under a `SealedStore`); a tombstone costs nothing more than
/// its claim.
pub(crate) fn completion_cost(completed: &Completed) -> u64 {
    let bytes = match &completed.response {
        None => 0,
        Some(Payload::Plain(response)) => response.size(),
        Some(Payload::Sealed(sealed)) => sealed.ciphertext.len() + sealed.key_id.len(),
    };
    bytes as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(1000);

    fn quotas(bytes: u64) -> Quotas {
        Quotas::new(bytes)
    }

    #[test]
    fn a_new_scope_is_admitted_with_half_the_bound() {
        let quotas = quotas(10_000);
        let now = Instant::now();
        assert_eq!(quotas.admit(1, WINDOW, now), Ok(()));
        // 5,000 bytes of burst: 4,800 spent leaves less than a claim.
        quotas.spend(1, 4_800, WINDOW, now);
        let wait = quotas.admit(1, WINDOW, now).unwrap_err();
        // 56 bytes missing at 5 bytes a second.
        assert_eq!(wait, Duration::from_secs_f64(56.0 / 5.0));
        // Another scope is untouched.
        assert_eq!(quotas.admit(2, WINDOW, now), Ok(()));
    }

    #[test]
    fn a_budget_refills_at_half_the_bound_per_window() {
        let quotas = quotas(10_000);
        let now = Instant::now();
        quotas.spend(1, 5_000, WINDOW, now);
        assert!(quotas.admit(1, WINDOW, now).is_err());
        // 256 bytes at 5 a second: 51.2 s.
        assert!(
            quotas
                .admit(1, WINDOW, now + Duration::from_secs(51))
                .is_err()
        );
        assert_eq!(
            quotas.admit(1, WINDOW, now + Duration::from_secs(52)),
            Ok(())
        );
        // Never more than the burst, however long it rested.
        let later = now + 10 * WINDOW;
        quotas.spend(1, 4_800, WINDOW, later);
        assert!(quotas.admit(1, WINDOW, later).is_err());
    }

    #[test]
    fn a_spend_keeps_what_the_budget_refilled_since_the_last() {
        let quotas = quotas(10_000);
        let now = Instant::now();
        quotas.spend(1, 5_000, WINDOW, now);
        // 100 s at 5 bytes a second gave 500 back: 200 spent then leaves 300, more than a claim.
        let later = now + Duration::from_secs(100);
        quotas.spend(1, 200, WINDOW, later);
        assert_eq!(quotas.admit(1, WINDOW, later), Ok(()));
        // 300 more leaves nothing: a claim's 256 bytes take 51.2 s to come back.
        quotas.spend(1, 300, WINDOW, later);
        assert_eq!(
            quotas.admit(1, WINDOW, later),
            Err(Duration::from_secs_f64(256.0 / 5.0))
        );
    }

    #[test]
    fn a_debt_is_paid_before_admission() {
        let quotas = quotas(10_000);
        let now = Instant::now();
        // A response stored after admission may take the budget below zero.
        quotas.spend(1, 7_000, WINDOW, now);
        let wait = quotas.admit(1, WINDOW, now).unwrap_err();
        // 2,000 owed plus a claim, at 5 bytes a second.
        assert_eq!(wait, Duration::from_secs_f64(2_256.0 / 5.0));
    }

    #[test]
    fn quotas_show_their_burst() {
        assert_eq!(
            format!("{:?}", quotas(1_000)),
            "Quotas { burst: 500.0, .. }"
        );
    }

    #[test]
    fn a_claim_is_admitted_with_exactly_its_cost_left() {
        // A burst of 512: one claim spent leaves exactly one more.
        let quotas = quotas(1_024);
        let now = Instant::now();
        quotas.spend(1, CLAIM_COST, WINDOW, now);
        assert_eq!(quotas.admit(1, WINDOW, now), Ok(()));
        quotas.spend(1, 1, WINDOW, now);
        assert!(quotas.admit(1, WINDOW, now).is_err());
    }

    #[test]
    fn a_completion_costs_its_body_fields_and_framing() {
        let fingerprint = crate::record::Fingerprint::from_bytes([0; 32]);
        let mut headers = http::HeaderMap::new();
        headers.insert("content-type", http::HeaderValue::from_static("text/plain"));
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let response = crate::record::StoredResponse {
            status: http::StatusCode::CREATED,
            headers,
            body: bytes::Bytes::from_static(b"0123456789"),
            trailers: Some(trailers),
        };
        let completed = Completed {
            fingerprint,
            response: Some(Payload::Plain(std::sync::Arc::new(response))),
            origin: None,
        };
        // 10 of body; "content-type" (12) + "text/plain" (10) + 8; "grpc-status" (11) + "0" (1)
        // + 8.
        assert_eq!(completion_cost(&completed), 10 + 30 + 20);
        let tombstone = Completed::tombstone(fingerprint);
        assert_eq!(completion_cost(&tombstone), 0);
        // Under a quota, a `SealedStore` sends its ciphertext: that is what the store keeps.
        let sealed = Completed {
            fingerprint,
            response: Some(Payload::Sealed(std::sync::Arc::new(
                crate::record::SealedResponse {
                    key_id: "k1".to_owned(),
                    nonce: [0; 24],
                    ciphertext: bytes::Bytes::from(vec![0; 100]),
                },
            ))),
            origin: None,
        };
        assert_eq!(completion_cost(&sealed), 100 + 2);
    }

    #[test]
    fn refilled_budgets_are_forgotten() {
        let quotas = quotas(10_000);
        let now = Instant::now();
        // A scope tag in `shard` (shards are chosen by the tag's high bits).
        let tag = |shard: usize, n: usize| ((shard as u64) << 60) | n as u64;
        // One short of a sweep in every shard...
        for shard in 0..SHARDS {
            for n in 0..SWEEP_FLOOR - 1 {
                quotas.spend(tag(shard, n), 1, WINDOW, now);
            }
        }
        // ...then, once those have refilled, one more each: only the new ones are kept.
        let later = now + WINDOW;
        for shard in 0..SHARDS {
            quotas.spend(tag(shard, SWEEP_FLOOR), 1, WINDOW, later);
        }
        let held: usize = quotas
            .shards
            .iter()
            .map(|s| s.lock().unwrap().budgets.len())
            .sum();
        assert_eq!(held, SHARDS);
        assert!(quotas.admit(tag(3, 0), WINDOW, later).is_ok());
    }
}
