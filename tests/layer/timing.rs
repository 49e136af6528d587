//! When answers come, not only which (PROTOCOL.md §6.6, §9.2), on paused time over a memory store
//! whose calls take time, as a store over the network does: a waiting duplicate is answered as
//! soon as the first request's completion or release lands in this process, never a poll later;
//! a different request with the key gets its 422 without waiting; a change a store signals during
//! a wait's claim is not missed, and a wait ends with its last waiter; a handler that finishes while a
//! renewal is on its way is answered at once; and a renewal outage shorter than two thirds of the
//! lease never loses the claim, wherever it starts.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_idempotency::record::{ClaimToken, Completed, RecordId};
use tower_idempotency::store::StoreError;
use tower_idempotency::{Idempotency, IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{
    Faulty, Handler, Reply, StoreCall, created, gated_handler, post, respond, send, service,
    spawn_send,
};

/// "At once": inside the wait's longest poll interval (250 ms), and past the slow store's round
/// trips (5 ms each, 35 ms for a write: a release, then the waiter's claim, run and completion
/// take 80 ms).
const PROMPT: Duration = Duration::from_millis(150);

type Store = Faulty<MemoryStore>;

/// A memory store whose calls take 5 ms, and whose completions and releases 30 ms more.
fn slow_store() -> Store {
    let store = Faulty::new(MemoryStore::new());
    store.delay(Some(Duration::from_millis(5)));
    store.delay_call(StoreCall::Complete, Some(Duration::from_millis(30)));
    store.delay_call(StoreCall::Release, Some(Duration::from_millis(30)));
    store
}

fn waiting_layer(store: &Store) -> IdempotencyLayer<Store> {
    IdempotencyLayer::new(store.clone()).wait_for_in_flight(Duration::from_secs(10))
}

/// Lets time pass, a millisecond at a time, until `n` keys have waiters on `layer`.
async fn until_waiting(layer: &IdempotencyLayer<Store>, n: usize) {
    for _ in 0..1_000 {
        if layer.waiting() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{} keys with waiters, not {n}", layer.waiting());
}

/// Sends the first request and, once its handler runs, `n` duplicates; lets them wait for 380 ms,
/// just past the wait's fourth poll (at 375 ms), so that its next is 250 ms away.
async fn first_and_waiters(
    layer: &IdempotencyLayer<Store>,
    handler: &Handler,
    started: &Notify,
    n: usize,
) -> (
    Idempotency<Handler, Store>,
    JoinHandle<Reply>,
    Vec<JoinHandle<Reply>>,
) {
    let svc = service(layer.clone(), handler.clone());
    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let waiters = (0..n).map(|_| spawn_send(&svc, post("k", "x"))).collect();
    until_waiting(layer, 1).await;
    tokio::time::sleep(Duration::from_millis(380)).await;
    (svc, first, waiters)
}

/// Awaits `reply`, asserting it came within [`PROMPT`] of `since`.
async fn promptly(reply: JoinHandle<Reply>, since: Instant, what: &str) -> Reply {
    let reply = reply.await.expect("a request");
    let took = since.elapsed();
    assert!(
        took < PROMPT,
        "§6.6: {what} within {PROMPT:?}, not at the wait's next poll; it took {took:?}: {reply:?}"
    );
    reply
}

#[tokio::test(start_paused = true)]
async fn a_waiter_gets_the_replay_as_the_completion_lands() {
    let store = slow_store();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let layer = waiting_layer(&store);
    let (_svc, first, mut waiters) = first_and_waiters(&layer, &handler, &started, 1).await;

    gate.notify_one();
    let released = Instant::now();
    let waiter = waiters.pop().expect("a waiter");
    let replay = promptly(
        waiter,
        released,
        "the waiter gets the replay once the completion lands",
    )
    .await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
    assert_eq!(handler.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_runs_as_soon_as_the_first_request_is_released() {
    let store = slow_store();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (on_start, opened) = (started.clone(), gate.clone());
    let handler = Handler::new(move |call| {
        let (started, gate) = (on_start.clone(), opened.clone());
        async move {
            if call.n == 1 {
                started.notify_one();
                gate.notified().await;
                return Ok(respond(503, "unavailable"));
            }
            Ok(created(format!("call {}", call.n)))
        }
    });
    let layer = waiting_layer(&store);
    let (_svc, first, mut waiters) = first_and_waiters(&layer, &handler, &started, 1).await;

    gate.notify_one();
    let released = Instant::now();
    let waiter = waiters.pop().expect("a waiter");
    let ran = promptly(
        waiter,
        released,
        "the waiter claims the released key and runs",
    )
    .await;
    assert_eq!(
        (ran.outcome, ran.text()),
        (Some(Outcome::Executed), "call 2".into())
    );
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::NotStored)
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_leaves_does_not_end_the_others_wait() {
    let store = slow_store();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let layer = waiting_layer(&store);
    let (_svc, first, mut waiters) = first_and_waiters(&layer, &handler, &started, 2).await;

    let gone = waiters.pop().expect("a waiter");
    gone.abort();
    assert!(gone.await.is_err_and(|err| err.is_cancelled()));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        layer.waiting(),
        1,
        "§6.6: the key's wait goes on for the waiter still there"
    );

    gate.notify_one();
    let released = Instant::now();
    let stayed = waiters.pop().expect("a waiter");
    let replay = promptly(stayed, released, "the waiter that stayed gets the replay").await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
    assert_eq!(layer.waiting(), 0, "§6.6: no wait is left behind");
}

#[tokio::test(start_paused = true)]
async fn a_different_request_with_a_key_being_waited_on_gets_its_422_at_once() {
    let store = slow_store();
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let layer = waiting_layer(&store);
    let (svc, first, mut waiters) = first_and_waiters(&layer, &handler, &started, 1).await;

    let sent = Instant::now();
    let other = send(&svc, post("k", "another body")).await;
    let took = sent.elapsed();
    assert_eq!(other.status.as_u16(), 422, "§4.3: {other:?}");
    assert!(
        took < Duration::from_millis(20),
        "§4.3, §6.6: a 422 never waits; it took {took:?}"
    );

    gate.notify_one();
    let replay = waiters.pop().expect("a waiter").await.expect("the waiter");
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.6: the genuine duplicate still waits for the replay: {replay:?}"
    );
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
}

/// A handler that finishes while a renewal waits on a slow store is answered then, not when the
/// renewal is done or at the next renewal's tick.
#[tokio::test(start_paused = true)]
async fn a_handler_finishing_during_a_slow_renewal_is_answered_at_once() {
    let lease = Duration::from_secs(3);
    let store = Faulty::new(MemoryStore::new());
    // The first renewal is sent at 1 s and answered at 1.8 s.
    store.delay_call(StoreCall::Renew, Some(Duration::from_millis(800)));
    let handler = Handler::new(|call| async move {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        Ok(created(format!("call {}", call.n)))
    });
    let svc = service(IdempotencyLayer::new(store).lease(lease), handler);
    let sent = Instant::now();
    let reply = send(&svc, post("k", "x")).await;
    let took = sent.elapsed();
    assert_eq!(reply.outcome, Some(Outcome::Executed), "{reply:?}");
    assert!(
        took < Duration::from_millis(1300),
        "§9.2: the handler's answer waits for no renewal; it took {took:?} for 1.1 s of work"
    );
}

/// Renewals fail from 0.45 of a lease to 1.05 (0.6 of a lease, just before the second renewal
/// of a schedule of halves): every third of a lease, a renewal landed at a third, so the claim
/// lasts until four thirds and the first renewal after the outage keeps it. Retries meanwhile get
/// 409, never a second run.
#[tokio::test(start_paused = true)]
async fn a_renewal_outage_shorter_than_two_thirds_of_the_lease_keeps_the_claim() {
    let lease = Duration::from_secs(3);
    let store = Faulty::new(MemoryStore::new());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "slow");
    let svc = service(
        IdempotencyLayer::new(store.clone()).lease(lease),
        handler.clone(),
    );
    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let claimed = Instant::now();

    // A retry every tenth of a lease, for two leases; the outage from 0.45 to 1.05.
    let tenth = lease / 10;
    for (steps, then_failing) in [(1..=4, true), (5..=10, false), (11..=20, false)] {
        for step in steps {
            tokio::time::sleep_until(claimed + tenth * step).await;
            send(&svc, post("k", "x")).await.assert_in_flight();
        }
        tokio::time::sleep(tenth / 2).await;
        store.fail_call(StoreCall::Renew, then_failing);
    }
    assert_eq!(
        handler.calls(),
        1,
        "§9.2: the outage was shorter than what the lease had left"
    );
    gate.notify_one();
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
}

/// A store that signals each completion and release (`Store::changed`), as `PgStore` does with
/// notifications: a signal reaches every watch made before it.
#[derive(Debug, Clone)]
struct Signalling<St> {
    inner: St,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

impl<St> Signalling<St> {
    fn new(inner: St) -> Self {
        Self {
            inner,
            changes: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    fn signal(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

impl<St: tower_idempotency::store::Store> tower_idempotency::store::Store for Signalling<St> {
    async fn complete(
        &self,
        id: &RecordId,
        token: &ClaimToken,
        completed: &Completed,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let written = self.inner.complete(id, token, completed, ttl).await;
        self.signal();
        written
    }

    async fn release(&self, id: &RecordId, token: &ClaimToken) -> Result<bool, StoreError> {
        let released = self.inner.release(id, token).await;
        self.signal();
        released
    }

    fn changed(&self, _: &RecordId) -> Option<impl Future<Output = ()> + Send + 'static> {
        // Subscribed now: a signal sent from here on resolves it.
        let mut changes = self.changes.subscribe();
        Some(async move {
            let _ = changes.changed().await;
        })
    }

    tower_idempotency::forward_store!(inner => claim, renew, prepare);
}

/// Over a store that signals changes, a wait watches for them from before each of its claims: a
/// completion signalled while a claim's answer (that still saw the record in flight) is on its
/// way wakes it again at once, not at its next safety poll a second later.
#[tokio::test(start_paused = true)]
async fn a_change_signalled_during_a_waits_claim_is_not_missed() {
    let faulty = Faulty::new(MemoryStore::new());
    // Each claim is applied at once, and answered 200 ms later.
    faulty.delay_answer(StoreCall::Claim, Some(Duration::from_millis(200)));
    let store = Signalling::new(faulty);
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let here = service(IdempotencyLayer::new(store.clone()), handler.clone());
    let elsewhere = IdempotencyLayer::new(store).wait_for_in_flight(Duration::from_secs(10));

    let first = spawn_send(&here, post("k", "x"));
    started.notified().await;
    let arrived = Instant::now();
    let waiter = spawn_send(&service(elsewhere, handler.clone()), post("k", "x"));
    // Its claim is answered at 0.2 s; its wait's first poll claims at 1.2 s, answered at 1.4 s.
    tokio::time::sleep_until(arrived + Duration::from_millis(1300)).await;
    gate.notify_one();
    let completed = Instant::now();
    let replay = waiter.await.expect("the waiter");
    let took = completed.elapsed();
    assert_eq!(replay.outcome, Some(Outcome::Replayed), "{replay:?}");
    assert!(
        took < Duration::from_millis(600),
        "§6.6: the waiter is woken by the signal sent during its claim; it took {took:?}"
    );
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
}

/// When its last waiter leaves, a key's wait ends: it asks the store nothing more, and shutdown
/// has nothing of it to wait for.
#[tokio::test(start_paused = true)]
async fn a_wait_ends_with_its_last_waiter() {
    let store = tower_idempotency_test::Counting::new(MemoryStore::new());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let layer = IdempotencyLayer::new(store.clone()).wait_for_in_flight(Duration::from_secs(10));
    let shutdown = layer.shutdown_handle();
    let svc = service(layer.clone(), handler.clone());
    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    // The first request's work, counted as it runs.
    let running = shutdown.running();
    let waiter = spawn_send(&svc, post("k", "x"));
    for _ in 0..100 {
        if layer.waiting() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(layer.waiting(), 1);

    waiter.abort();
    assert!(waiter.await.is_err_and(|err| err.is_cancelled()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let claims = store.calls().claim;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        (store.calls().claim, shutdown.running()),
        (claims, running),
        "§6.6: no one waits, so nothing polls the key and nothing is left for shutdown"
    );
    gate.notify_one();
    assert_eq!(
        first.await.expect("the first").outcome,
        Some(Outcome::Executed)
    );
}
