//! One run's layer configuration, drawn from its seed, so that the seeds between them reach the
//! whole protocol: waiting for a request in flight, `Retry-After`, the lease, fail-open, canonical
//! JSON, scopes, sealing, the replay cache, a quota per scope, the response limit, the window.

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::ReplayCache;
use tower_idempotency::store::ScopeQuota;
use tower_idempotency::{BoxStore, IdempotencyLayer, Rejection, Scope};

use super::rng::Rng;

/// A response limit small enough for an oversized handler's body to pass it.
pub(crate) const SMALL_RESPONSE_LIMIT: usize = 256;
/// The bytes of padding an oversized handler adds to its body.
pub(crate) const OVERSIZE: usize = 1_000;

#[derive(Debug, Clone)]
pub(crate) struct Setup {
    pub lease: Duration,
    pub retry_after: Duration,
    pub wait: Option<Duration>,
    pub fail_open: bool,
    pub canonical_json: bool,
    /// Tenants, each its own scope (one: no scope function).
    pub tenants: usize,
    pub seal: bool,
    pub replay_cache: bool,
    pub quota: Option<u64>,
    pub response_limit: usize,
    pub dedup_window: Duration,
}

impl Setup {
    /// The configuration of one run. `lease` sets the pace; on the paused clock the lease itself
    /// varies (every other time is in proportion to it), on real time it is kept.
    pub(crate) fn draw(rng: &mut Rng, lease: Duration, real_time: bool) -> Self {
        let lease = if real_time {
            lease
        } else {
            lease.mul_f64([0.5, 1.0, 1.0, 2.5, 15.0][rng.below(0..5) as usize])
        };
        let retry_after = match rng.below(0..4) {
            0 => Duration::from_secs(1),
            1 => lease / 2,
            2 => lease * 2,
            _ => lease * 3,
        };
        Self {
            lease,
            retry_after,
            wait: rng
                .chance(400)
                .then(|| lease.mul_f64([0.3, 1.0, 3.0][rng.below(0..3) as usize])),
            fail_open: rng.chance(250),
            canonical_json: rng.chance(500),
            tenants: rng.below(1..4) as usize,
            seal: rng.chance(250),
            replay_cache: rng.chance(300),
            quota: rng
                .chance(150)
                .then(|| [2_048, 65_536][rng.below(0..2) as usize]),
            response_limit: if rng.chance(300) {
                SMALL_RESPONSE_LIMIT
            } else {
                1 << 20
            },
            dedup_window: if rng.chance(200) {
                lease * 12
            } else {
                Duration::from_secs(3600)
            },
        }
    }

    /// The store as this run's layers see it: sealed below the fault injector if sealing is on
    /// (the injector and the oracle see records in clear), behind a replay cache per instance if
    /// that is on.
    pub(crate) fn seal(&self, store: BoxStore) -> BoxStore {
        if !self.seal {
            return store;
        }
        let key = SealKey::new("sim", [7; 32]).expect("a key");
        BoxStore::new(SealedStore::new(
            store,
            SealKeys::new([key]).expect("one key"),
        ))
    }

    /// The layer of one instance over `store`.
    pub(crate) fn layer(&self, store: BoxStore) -> IdempotencyLayer<BoxStore> {
        let store = if self.replay_cache {
            BoxStore::new(ReplayCache::new(store, 1_000, 1 << 20))
        } else {
            store
        };
        // This instance's budgets, as an application keeps them.
        let store = match self.quota {
            Some(bytes) => BoxStore::new(ScopeQuota::new(store, bytes)),
            None => store,
        };
        let mut layer = IdempotencyLayer::new(store)
            .lease(self.lease)
            .dedup_window(self.dedup_window)
            .retry_after(self.retry_after)
            .fail_open(self.fail_open)
            .canonical_json(self.canonical_json)
            .response_body_limit(self.response_limit);
        if let Some(bound) = self.wait {
            layer = layer.wait_for_in_flight(bound);
        }
        if self.tenants > 1 {
            layer.scope(|parts: &http::request::Parts| {
                match parts.headers.get(TENANT).map(|v| v.as_bytes()) {
                    Some(tenant) => Ok(Scope::from(tenant)),
                    None => Err(Rejection::from(StatusCode::UNAUTHORIZED)),
                }
            })
        } else {
            layer.single_tenant()
        }
    }

    /// The scope bytes of `tenant`'s requests: none without a scope function.
    pub(crate) fn scope(&self, tenant: usize) -> Vec<u8> {
        if self.tenants > 1 {
            format!("t{tenant}").into_bytes()
        } else {
            Vec::new()
        }
    }

    /// Operation `op`'s tenant and key: with tenants, the same key text in each scope, so that
    /// scopes are shown to keep keys apart.
    pub(crate) fn tenant_and_key(&self, op: usize) -> (usize, String) {
        if self.tenants > 1 {
            (op % self.tenants, format!("k-{}", op / self.tenants))
        } else {
            (0, format!("op-{op}"))
        }
    }
}

pub(crate) const TENANT: &str = "x-tenant";
