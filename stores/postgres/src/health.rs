//! What the store knows of its connections' health, so that a server that went away is noticed,
//! reported with its error, and used again as soon as it is back.
//!
//! sqlx's pool treats a refused connection as a server still starting up and tries again until
//! its own acquire timeout (30 s by default): every call made while the server is down would wait
//! out the store's timeout and report only that. So once a connection has failed (or a call timed
//! out while the pool was free to open one), the store is *suspect*: before taking a pooled
//! connection, a call first opens one of its own, one call at a time. Refused, the call fails at
//! once with the connection error; accepted, the server is back, and calls use the pool again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};

#[derive(Debug, Default)]
pub(super) struct Health {
    /// When a connection last failed (on the standard clock, as sqlx measures a connection's age).
    failed_at: Mutex<Option<Instant>>,
    /// Whether calls check that the server accepts connections before using the pool.
    suspect: AtomicBool,
    /// One check at a time.
    probe: tokio::sync::Mutex<()>,
}

impl Health {
    /// A connection failed: connections opened before now are not reused (by the pool of
    /// `PgStore::connect`), and calls check the server first.
    pub(super) fn failed(&self) {
        *self
            .failed_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        self.suspect.store(true, Ordering::Relaxed);
    }

    /// A call timed out while the pool could have been opening a connection for it.
    pub(super) fn suspect(&self) {
        self.suspect.store(true, Ordering::Relaxed);
    }

    /// Whether a connection of `age` was opened before the last failure.
    pub(super) fn opened_before_failure(&self, age: Duration) -> bool {
        let failed = *self
            .failed_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        failed.is_some_and(|failed| {
            Instant::now()
                .checked_sub(age)
                .is_some_and(|opened| opened <= failed)
        })
    }

    /// When suspect, checks that the server accepts a connection (one call at a time; a call
    /// that waited for another's check uses its answer). The error is the connection's.
    pub(super) async fn check(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        if !self.suspect.load(Ordering::Relaxed) {
            return Ok(());
        }
        let _one = self.probe.lock().await;
        if !self.suspect.load(Ordering::Relaxed) {
            return Ok(());
        }
        let conn = PgConnection::connect_with(&pool.connect_options()).await?;
        self.suspect.store(false, Ordering::Relaxed);
        // Closed politely, off the call's path.
        tokio::spawn(async move {
            let _ = conn.close().await;
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_opened_before_a_failure_are_not_reused() {
        let health = Health::default();
        assert!(!health.opened_before_failure(Duration::from_secs(60)));
        health.failed();
        assert!(health.opened_before_failure(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(5));
        assert!(!health.opened_before_failure(Duration::from_millis(1)));
    }
}
