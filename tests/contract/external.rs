//! A store written as a user outside the crate writes one, with nothing but the public API, runs
//! the exported contract suite (crate `tower-idempotency-test`) in one line.
//!
//! `TinyStore` is a `HashMap` behind a `Mutex`, expiring on tokio time: the smallest store that
//! keeps the contract (PROTOCOL.md §10.1, §10.2).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::record::{
    ClaimToken, Completed, Fence, Fingerprint, InFlight, Record, RecordId,
};
use tower_idempotency::store::{
    Claim, CompletedView, ForgetOutcome, InFlightView, Inspected, OperatorStore, Store, StoreError,
};
use tower_idempotency_test::Harness;

/// What one key holds, and until when.
#[derive(Debug)]
enum Entry {
    InFlight {
        token: ClaimToken,
        fingerprint: Fingerprint,
    },
    Completed(Completed),
}

#[derive(Debug, Clone, Default)]
struct TinyStore {
    records: Arc<Mutex<HashMap<RecordId, (Entry, Instant)>>>,
}

impl TinyStore {
    /// Runs `f` on the live records: an expired record is gone for every operation (§10.2).
    fn with_live<T>(&self, f: impl FnOnce(&mut HashMap<RecordId, (Entry, Instant)>) -> T) -> T {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        records.retain(|_, (_, expires)| *expires > now);
        f(&mut records)
    }

    /// The live record under `id`, as an operator reads it (its times on the wall clock).
    fn view(records: &HashMap<RecordId, (Entry, Instant)>, id: &RecordId) -> Option<Inspected> {
        let (entry, expires) = records.get(id)?;
        let at = std::time::SystemTime::now() + expires.saturating_duration_since(Instant::now());
        Some(match entry {
            Entry::InFlight { token, fingerprint } => Inspected::InFlight(InFlightView {
                fingerprint: *fingerprint,
                fence: token.fence(),
                lease_ends: at,
            }),
            // The smallest store keeps no fence once completed, as the contract allows.
            Entry::Completed(completed) => Inspected::Completed(CompletedView {
                completed: completed.clone(),
                fence: None,
                expires: at,
            }),
        })
    }

    /// Whether `id` is in flight under `token`.
    fn owned(
        records: &HashMap<RecordId, (Entry, Instant)>,
        id: &RecordId,
        token: &ClaimToken,
    ) -> bool {
        matches!(records.get(id), Some((Entry::InFlight { token: t, .. }, _)) if t == token)
    }
}

impl Store for TinyStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        Ok(self.with_live(|records| match records.get(id) {
            Some((Entry::InFlight { fingerprint, .. }, expires)) => {
                Claim::Existing(Record::InFlight(InFlight {
                    fingerprint: *fingerprint,
                    lease_remaining: expires.saturating_duration_since(Instant::now()),
                }))
            }
            Some((Entry::Completed(completed), _)) => {
                Claim::Existing(Record::Completed(completed.clone()))
            }
            None => {
                let token = ClaimToken::new(Fence::next_in_process());
                let entry = Entry::InFlight {
                    token,
                    fingerprint: *fingerprint,
                };
                records.insert(*id, (entry, Instant::now() + lease));
                Claim::Claimed(token)
            }
        }))
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_live(|records| {
            if !records.contains_key(id) || Self::owned(records, id, token) {
                let entry = Entry::Completed(completed.clone());
                records.insert(*id, (entry, Instant::now() + ttl));
                true
            } else {
                // This completion, sent again: already written.
                matches!(records.get(id), Some((Entry::Completed(c), _)) if c == completed)
            }
        }))
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_live(|records| {
            let owned = Self::owned(records, id, token);
            if let (true, Some((_, expires))) = (owned, records.get_mut(id)) {
                *expires = Instant::now() + lease;
            }
            owned
        }))
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        Ok(self.with_live(|records| {
            let owned = Self::owned(records, id, token);
            if owned {
                records.remove(id);
            }
            owned
        }))
    }
}

/// What an operator reads and forgets (§10.9): the contract checks it too.
impl OperatorStore for TinyStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspected>, StoreError> {
        Ok(self.with_live(|records| Self::view(records, id)))
    }

    async fn forget(&self, id: &RecordId, force: bool) -> Result<ForgetOutcome, StoreError> {
        Ok(self.with_live(|records| match Self::view(records, id) {
            None => ForgetOutcome::Absent,
            Some(Inspected::InFlight(view)) if !force => ForgetOutcome::Refused(view),
            Some(was) => {
                // Fences come from the process's clock and counter: none is lost with the record.
                records.remove(id);
                ForgetOutcome::Forgotten(was)
            }
        }))
    }
}

#[derive(Debug, Default)]
struct TinyHarness {
    store: TinyStore,
}

impl Harness for TinyHarness {
    type Store = TinyStore;

    fn store(&self) -> TinyStore {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }
}

tower_idempotency_test::store_contract!(TinyHarness::default(), start_paused = true);
tower_idempotency_test::layer_contract!(TinyHarness::default(), start_paused = true);
