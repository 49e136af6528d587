//! Deleting expired rows: a background task per store, and [`PgStore::sweep`].
//!
//! Correctness never waits for it (reads and claims ignore a row whose time is up); it keeps the
//! table and its index from growing without bound.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Admin, Inner, PgStore, PgStoreError};

/// Rows deleted by one statement: small, so a batch holds its row locks only for a moment.
pub(super) const BATCH: u32 = 500;
/// Batches per run of the background task (50 000 rows): a backlog is worked off over a few runs
/// rather than in one long one.
pub(super) const BATCHES_PER_RUN: u32 = 100;
/// The pause before the next run when a run stopped at its cap, with expired rows left: far
/// shorter than the interval, so that a store taking more keys than a run removes per interval
/// (833 a second at the defaults) keeps up.
const BACKLOG_PAUSE: Duration = Duration::from_millis(100);

/// The background task of one store: started by its first call, stopped when the last clone of
/// the store is dropped.
#[derive(Debug, Default)]
pub(super) struct Sweeper {
    started: AtomicBool,
    stop: CancellationToken,
}

impl Sweeper {
    /// Starts the task on the current tokio runtime, unless it runs already.
    pub(super) fn start(&self, inner: &Arc<Inner>, every: Duration) {
        if self.started.load(Ordering::Relaxed) || self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(run(Arc::downgrade(inner), self.stop.clone(), every));
            }
            // Outside a runtime: the next call tries again.
            Err(_) => self.started.store(false, Ordering::Relaxed),
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Sweeps every `every`, starting at a random point of the first interval, so that instances
/// started together do not sweep together.
async fn run(inner: Weak<Inner>, stop: CancellationToken, every: Duration) {
    let fraction = RandomState::new().hash_one(0u8) as f64 / u64::MAX as f64;
    let mut delay = every.mul_f64(fraction);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = every;
        // Only while a clone of the store is held elsewhere: this one is dropped before the wait.
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let store = PgStore { inner };
        let swept = all(&store, BATCHES_PER_RUN).await;
        if matches!(swept, Ok(deleted) if deleted >= u64::from(BATCH * BATCHES_PER_RUN)) {
            delay = BACKLOG_PAUSE;
        }
        match swept {
            Ok(0) => {}
            Ok(deleted) => tracing::debug!(
                target: "tower_idempotency",
                deleted,
                table = store.table(),
                "deleted expired records"
            ),
            // Every call fails too: told once, with the fix, like theirs.
            Err(PgStoreError::MissingTable(_)) => store.log_missing_table(),
            Err(err) => tracing::warn!(
                target: "tower_idempotency",
                error = &err as &dyn std::error::Error,
                table = store.table(),
                "deleting expired records failed; trying again at the next sweep"
            ),
        }
    }
}

/// Deletes expired rows in batches until a batch comes back short, or after `max_batches`.
pub(super) async fn all(store: &PgStore, max_batches: u32) -> Result<u64, PgStoreError> {
    let mut deleted = 0;
    for _ in 0..max_batches {
        let batch = store
            .admin(
                store.inner.timeout,
                Admin::Query(&store.inner.statements.sweep, Some(i64::from(BATCH))),
            )
            .await?;
        deleted += batch;
        if batch < u64::from(BATCH) {
            break;
        }
    }
    Ok(deleted)
}
