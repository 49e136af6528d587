//! Waiting for an in-flight request (opt-in, `IdempotencyLayer::wait_for_in_flight`): a duplicate
//! of a request that is still running waits, up to a bound, for the first to finish, instead of
//! getting `409` at once.
//!
//! The duplicates of one key in one layer share one wait: a [`Watch`] in [`Waits`], whose task asks
//! the store about the key and tells every waiter the answer, so that the store sees the same calls
//! for one waiter as for a thousand. It asks by claiming again, the store's one atomic read: a
//! completed record settles the wait (each waiter answers from it), a free key settles it too (the
//! task gives its claim back, and each waiter claims for itself, as any request would), and the
//! first request still in flight means asking again later. Later is when this layer completes or
//! releases the key (in-process notification, which covers every store when the first request ran
//! here), when the store signals a change ([`Store::changed`]: `PgStore` with notifications), and
//! otherwise after a backoff from [`FIRST_POLL`] doubling up to [`MAX_POLL`] (every
//! [`NOTIFIED_POLL`] for a store that signals), so a key costs at most one store call per
//! `MAX_POLL` however many wait on it.
//!
//! A waiter whose client goes away drops its receiver; the task ends when the last one has gone,
//! and takes the key's entry with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::Shared;
use crate::error_chain::ErrorChain;
use crate::fingerprint::Fingerprint;
use crate::record::{Record, RecordId};
use crate::store::{Claim, Store, StoreError};

/// How long the shared wait lets pass before it first asks the store again: each waiter has just
/// claimed, and seen the key in flight.
pub(crate) const FIRST_POLL: Duration = Duration::from_millis(25);
/// The longest interval between two store calls of one key's wait.
pub(crate) const MAX_POLL: Duration = Duration::from_millis(250);
/// The interval between two store calls of one key's wait when the store signals changes
/// ([`Store::changed`]): a net for a signal lost (a listener reconnecting) or never sent (a crashed
/// owner's lease running out).
pub(crate) const NOTIFIED_POLL: Duration = Duration::from_secs(1);

/// The keys that requests of one layer are waiting on.
#[derive(Debug, Clone, Default)]
pub(crate) struct Waits {
    keys: Arc<Mutex<HashMap<RecordId, Arc<Watch>>>>,
}

/// One key's shared wait.
#[derive(Debug)]
struct Watch {
    /// The answer, once there is one; its receivers count the waiters.
    settled: watch::Sender<Option<Settled>>,
    /// Wakes the waiters once the answer is there, in the order they came. (A watch receiver's
    /// own wake-up draws its place at random, so that the waiters of one history would run in an
    /// order that changes from run to run.)
    answered: Notify,
    /// Woken when this layer completes or releases the key.
    changed: Notify,
}

/// How a wait ended for every waiter of the key.
#[derive(Debug, Clone)]
pub(super) enum Settled {
    /// The key holds this record: completed, or another request's claim.
    Record(Record),
    /// The key was free: each waiter claims it for itself.
    Free,
}

impl Waits {
    /// The number of keys that requests are waiting on now.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Tells the key's wait, if there is one, that the key changed here.
    pub(crate) fn notify(&self, id: &RecordId) {
        if let Some(watch) = self.lock().get(id) {
            watch.changed.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Arc<Watch>>> {
        // The map holds no invariant a panic could break halfway.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes the key's entry if it is still `watch`, and no waiter joined it since `done`.
    fn leave(&self, id: &RecordId, watch: &Arc<Watch>, done: bool) -> bool {
        let mut keys = self.lock();
        let current = keys.get(id).is_some_and(|w| Arc::ptr_eq(w, watch));
        let gone = done || watch.settled.receiver_count() == 0;
        if current && gone {
            keys.remove(id);
        }
        gone
    }
}

/// One waiter's place in a key's wait. Leaving it (answered, timed out, or dropped with its
/// request) removes the key's entry if it was the last waiter, so nothing is left behind even
/// before the wait's task notices.
struct Waiter {
    settled: Option<watch::Receiver<Option<Settled>>>,
    watch: Arc<Watch>,
    waits: Waits,
    id: RecordId,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        drop(self.settled.take());
        self.waits.leave(&self.id, &self.watch, false);
    }
}

impl<St: Store> Shared<St> {
    /// Tells the requests waiting on `id` in this process, if waiting is on, that it changed.
    pub(super) fn notify_waiters(&self, id: &RecordId) {
        // Without the opt-in wait nobody waits: no need to look the key up under the lock.
        if self.config.wait.is_some() {
            self.waits.notify(id);
        }
    }

    /// Joins the key's shared wait (starting it if there is none) until it settles or `deadline`.
    pub(super) async fn wait_on(
        self: &Arc<Self>,
        id: &RecordId,
        fingerprint: &Fingerprint,
        deadline: Instant,
    ) -> Option<Settled> {
        let waiter = {
            let mut keys = self.waits.lock();
            let watch = match keys.get(id) {
                Some(watch) => watch.clone(),
                None => {
                    let watch = Arc::new(Watch {
                        settled: watch::Sender::new(None),
                        answered: Notify::new(),
                        changed: Notify::new(),
                    });
                    keys.insert(*id, watch.clone());
                    let task = self.clone().watch(*id, *fingerprint, watch.clone());
                    // Counted for `Shutdown`, like every task the layer starts.
                    self.background.spawn(task);
                    watch
                }
            };
            Waiter {
                settled: Some(watch.settled.subscribe()),
                watch,
                waits: self.waits.clone(),
                id: *id,
            }
        };
        let settled = waiter.settled.as_ref()?;
        let answered = async {
            loop {
                // Registered before the answer is looked at, so that one sent in between wakes it.
                let woken = waiter.watch.answered.notified();
                let mut woken = std::pin::pin!(woken);
                woken.as_mut().enable();
                if let Some(settled) = settled.borrow().clone() {
                    return settled;
                }
                woken.await;
            }
        };
        tokio::time::timeout_at(deadline, answered).await.ok()
    }

    /// The shared wait's task: asks the store when this layer changed the key, or after the
    /// backoff, until the key is no longer the same request in flight or no one waits.
    async fn watch(self: Arc<Self>, id: RecordId, fingerprint: Fingerprint, watch: Arc<Watch>) {
        // Watched from before each claim, so a change between two claims is not missed.
        let mut store_changed = self.store.changed(&id).map(Box::pin);
        let (mut interval, max) = match store_changed {
            Some(_) => (NOTIFIED_POLL, NOTIFIED_POLL),
            None => (FIRST_POLL, MAX_POLL),
        };
        loop {
            let from_store = async {
                match store_changed.as_mut() {
                    Some(changed) => changed.await,
                    None => std::future::pending().await,
                }
            };
            // In this order when several are ready, so that one history makes one choice.
            tokio::select! {
                biased;
                () = watch.settled.closed() => {
                    if self.waits.leave(&id, &watch, false) {
                        return;
                    }
                    continue;
                }
                () = watch.changed.notified() => {}
                () = from_store => {}
                () = tokio::time::sleep(interval) => interval = (interval * 2).min(max),
            }
            store_changed = self.store.changed(&id).map(Box::pin);
            let settled = match self.store.claim(&id, &fingerprint, self.config.lease).await {
                Ok(Claim::Existing(Record::InFlight(in_flight)))
                    if in_flight.fingerprint == fingerprint =>
                {
                    continue;
                }
                Ok(Claim::Existing(record)) => Settled::Record(record),
                Ok(Claim::Claimed(token)) => {
                    // Not ours to run: give it back, and let each waiter claim as a request does.
                    if let Err(err) = self.store.release(&id, &token).await {
                        tracing::warn!(
                            target: "tower_idempotency",
                            error = %ErrorChain(&err),
                            "a waiting request's claim could not be released; the key is free when its lease ends"
                        );
                    }
                    Settled::Free
                }
                // A scope past its quota, and the key free: each waiter's own claim is refused.
                Err(StoreError::QuotaExceeded { .. }) => Settled::Free,
                // The store is away (or its breaker open): the waiters keep waiting, up to their
                // bound.
                Err(_) => continue,
            };
            self.waits.leave(&id, &watch, true);
            watch.settled.send_replace(Some(settled));
            watch.answered.notify_waiters();
            return;
        }
    }
}
