//! Change notifications (opt-in, [`PgStore::with_notifications`](super::PgStore::with_notifications)): completions and releases send
//! `NOTIFY` on the table's channel with the record's id, and one `LISTEN` connection per store
//! wakes the requests of this process that wait on that record
//! (`IdempotencyLayer::wait_for_in_flight`), whichever instance finished it.
//!
//! The listener starts with the first wait and stops when the last clone of the store is dropped.
//! A notification can be lost (sent while the listener reconnects): on every (re)connection the
//! listener wakes every wait, and the waits also ask the store on a slow backoff of their own.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::Inner;
use tower_idempotency::record::RecordId;

/// How long the listener waits before it connects again after a failure.
const RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// One store's listener, and the waits it wakes.
#[derive(Debug, Default)]
pub(super) struct Notifier {
    started: AtomicBool,
    stop: CancellationToken,
    waits: Arc<Mutex<Waits>>,
}

/// The waits on each record id, each with the slot that lets it leave.
#[derive(Debug, Default)]
struct Waits {
    next: u64,
    /// By the id's bytes: a `RecordId` also carries a tag of its scope, which a notification does
    /// not.
    by_id: HashMap<[u8; 16], Vec<(u64, oneshot::Sender<()>)>>,
}

fn lock(waits: &Mutex<Waits>) -> MutexGuard<'_, Waits> {
    // The map holds no invariant a panic could break halfway.
    waits.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Resolves when the record may have changed; leaves its place when dropped.
#[derive(Debug)]
pub(crate) struct Changed {
    woken: oneshot::Receiver<()>,
    waits: Arc<Mutex<Waits>>,
    id: [u8; 16],
    slot: u64,
}

impl Future for Changed {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // A sender dropped without a send (the store went away) counts as a change too: the
        // waiter asks the store once more.
        Pin::new(&mut self.woken).poll(cx).map(|_| ())
    }
}

impl Drop for Changed {
    fn drop(&mut self) {
        let mut waits = lock(&self.waits);
        if let Some(slots) = waits.by_id.get_mut(&self.id) {
            slots.retain(|(slot, _)| *slot != self.slot);
            if slots.is_empty() {
                waits.by_id.remove(&self.id);
            }
        }
    }
}

impl Notifier {
    /// Watches `id` from now, starting the listener if it does not run yet.
    pub(super) fn changed(&self, pool: &PgPool, channel: &str, id: &RecordId) -> Changed {
        self.start(pool, channel);
        let (wake, woken) = oneshot::channel();
        let mut waits = lock(&self.waits);
        let slot = waits.next;
        waits.next += 1;
        waits
            .by_id
            .entry(*id.as_bytes())
            .or_default()
            .push((slot, wake));
        Changed {
            woken,
            waits: self.waits.clone(),
            id: *id.as_bytes(),
            slot,
        }
    }

    /// The number of record ids watched now.
    #[cfg(test)]
    fn watched(&self) -> usize {
        lock(&self.waits).by_id.len()
    }

    fn start(&self, pool: &PgPool, channel: &str) {
        if self.started.load(Ordering::Relaxed) || self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let task = listen(
            pool.clone(),
            channel.to_owned(),
            self.waits.clone(),
            self.stop.clone(),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(task);
            }
            // Outside a runtime: the next wait tries again.
            Err(_) => self.started.store(false, Ordering::Relaxed),
        }
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Inner {
    /// The completion statements, notifying or not: the claim's own row updated in place, and
    /// the whole completion, for when the first wrote nothing.
    pub(super) fn complete_sql(&self) -> [&str; 2] {
        let s = &self.statements;
        match self.notifies {
            true => [&s.complete_claimed_notifying, &s.complete_notifying],
            false => [&s.complete_claimed, &s.complete],
        }
    }

    /// The release statement, notifying or not.
    pub(super) fn release_sql(&self) -> &str {
        match self.notifies {
            true => &self.statements.release_notifying,
            false => &self.statements.release,
        }
    }
}

/// Listens on `channel` until `stop`, waking the waits on each notified id; connects again after a
/// failure, and wakes every wait on each (re)connection, since notifications may have been missed.
async fn listen(pool: PgPool, channel: String, waits: Arc<Mutex<Waits>>, stop: CancellationToken) {
    loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let failure = match stop.run_until_cancelled(connected).await {
            None => return,
            Some(Ok(mut listener)) => {
                wake_all(&waits);
                loop {
                    match stop.run_until_cancelled(listener.recv()).await {
                        None => return,
                        Some(Ok(notification)) => wake(&waits, notification.payload()),
                        Some(Err(err)) => break err,
                    }
                }
            }
            Some(Err(err)) => err,
        };
        tracing::warn!(
            target: "tower_idempotency",
            error = &failure as &dyn std::error::Error,
            %channel,
            "the PostgreSQL change listener failed; waiting requests poll until it is back"
        );
        if stop
            .run_until_cancelled(tokio::time::sleep(RECONNECT_DELAY))
            .await
            .is_none()
        {
            return;
        }
    }
}

/// Wakes the waits on the record whose id is `payload` (32 hex digits); ignores anything else.
fn wake(waits: &Mutex<Waits>, payload: &str) {
    let Some(id) = parse_id(payload) else {
        return;
    };
    if let Some(slots) = lock(waits).by_id.remove(&id) {
        for (_, wake) in slots {
            let _ = wake.send(());
        }
    }
}

fn wake_all(waits: &Mutex<Waits>) {
    for (_, slots) in lock(waits).by_id.drain() {
        for (_, wake) in slots {
            let _ = wake.send(());
        }
    }
}

fn parse_id(hex: &str) -> Option<[u8; 16]> {
    if hex.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (byte, pair) in bytes.iter_mut().zip(hex.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_32_hex_digits() {
        assert_eq!(parse_id(&"ab".repeat(16)), Some([0xab; 16]));
        assert_eq!(parse_id(&"AB".repeat(16)), Some([0xab; 16]));
        assert_eq!(parse_id("ab"), None);
        assert_eq!(parse_id(&"zz".repeat(16)), None);
        assert_eq!(parse_id(&"é".repeat(16)), None);
    }

    #[tokio::test]
    async fn a_wait_leaves_when_dropped_and_is_woken_by_its_id() {
        let waits = Arc::new(Mutex::new(Waits::default()));
        let notifier = Notifier {
            waits: waits.clone(),
            // No listener: the test wakes the waits itself.
            started: AtomicBool::new(true),
            stop: CancellationToken::new(),
        };
        let pool = PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").expect("a lazy pool");
        let id = RecordId::new(b"scope", "k");
        let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        let first = notifier.changed(&pool, "c", &id);
        let second = notifier.changed(&pool, "c", &id);
        assert_eq!(notifier.watched(), 1);
        drop(second);
        assert_eq!(lock(&waits).by_id[id.as_bytes()].len(), 1);
        wake(&waits, &hex);
        first.await;
        assert_eq!(notifier.watched(), 0);
        let gone = notifier.changed(&pool, "c", &id);
        drop(gone);
        assert_eq!(notifier.watched(), 0, "nothing left behind");
    }
}
