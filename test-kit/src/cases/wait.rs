//! Cases for waiting on a request in flight (`IdempotencyLayer::wait_for_in_flight`, PROTOCOL.md
//! §6.6): through the layer that runs the first request (notified in process) and through a
//! second layer over the same store, as another instance of the service would be (polling).

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::*;
use tower_idempotency::{Idempotency, IdempotencyLayer, Outcome};

/// The longest interval between two store calls of one key's wait (`MAX_POLL`).
const MAX_POLL: Duration = Duration::from_millis(250);

/// Lets time pass until `n` keys have waiters on `layer`.
async fn until_waiting<H: Harness, St>(h: &H, layer: &IdempotencyLayer<St>, n: usize) {
    for _ in 0..5_000 {
        if layer.waiting() >= n {
            return;
        }
        h.advance(Duration::from_millis(1)).await;
    }
    panic!(
        "§6.6: a duplicate of a request in flight waits (wait_for_in_flight); {} keys with \
         waiters, not {n}",
        layer.waiting()
    );
}

/// Through a service of `waiting` over `handler`: sends the first request and, once its handler
/// runs (`started`), a duplicate, and lets time pass until the duplicate waits.
async fn first_and_a_waiter<H: Harness>(
    h: &H,
    waiting: &IdempotencyLayer<H::Store>,
    handler: &Handler,
    started: &Notify,
) -> (
    Idempotency<Handler, H::Store>,
    JoinHandle<Reply>,
    JoinHandle<Reply>,
) {
    let svc = service(waiting.clone(), handler.clone());
    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let duplicate = spawn_send(&svc, post("k", "x"));
    until_waiting(h, waiting, 1).await;
    (svc, first, duplicate)
}

/// A layer over `store` that waits `bound`.
fn waiting_layer<H: Harness, St>(h: &H, store: St, bound: Duration) -> IdempotencyLayer<St> {
    layer(h, store).wait_for_in_flight(bound)
}

/// A duplicate that arrives while the first request runs waits for it and gets its replay, on the
/// layer that runs the first (notified) and on another instance over the same store (polling);
/// the handler runs once, and no wait is left behind.
/// PROTOCOL.md §6.6.
pub async fn a_waiting_duplicate_gets_the_replay<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let here = waiting_layer(&h, h.store(), h.lease() * 4);
    let elsewhere = waiting_layer(&h, h.store(), h.lease() * 4);
    let svc = service(here.clone(), handler.clone());
    let other = service(elsewhere.clone(), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let duplicate = spawn_send(&svc, post("k", "x"));
    let remote = spawn_send(&other, post("k", "x"));
    until_waiting(&h, &here, 1).await;
    until_waiting(&h, &elsewhere, 1).await;
    h.advance(h.lease() / 2).await;
    gate.notify_one();

    let first = first.await.expect("the first request");
    assert_eq!(
        (first.outcome, first.text()),
        (Some(Outcome::Executed), "charged 1".into()),
        "§6.6: the first request's answer is unchanged by its waiters"
    );
    for waiter in [duplicate, remote] {
        let reply = waiter.await.expect("a waiting duplicate");
        assert_eq!(
            reply.outcome,
            Some(Outcome::Replayed),
            "§6.6: a waiting duplicate, on this instance or another, gets the replay once the \
             first request completes: {reply:?}"
        );
        assert_eq!(
            reply.body, first.body,
            "§6.4, §6.6: the waiter's replay repeats the first response's body"
        );
    }
    assert_eq!(
        handler.calls(),
        1,
        "§6.6: the handler runs once for the first request and its waiters"
    );
    assert_eq!(
        (here.waiting(), elsewhere.waiting()),
        (0, 0),
        "§6.6: no wait is left behind once its waiters are answered"
    );
}

/// Past its bound, a waiting duplicate gets the `409` with `Retry-After`, and the first request's
/// answer is unchanged.
/// PROTOCOL.md §6.3, §6.6.
pub async fn a_duplicate_past_the_wait_bound_gets_409<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let bound = margin(&h);
    let waiting = waiting_layer(&h, h.store(), bound);
    let svc = service(waiting.clone(), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let asked = Instant::now();
    let conflict = send(&svc, post("k", "x")).await;
    assert!(
        asked.elapsed() >= bound,
        "§6.6: a duplicate waits up to its bound before the 409; answered after {:?}",
        asked.elapsed()
    );
    let retry_after = conflict.assert_in_flight();
    assert!(
        (1..=whole_seconds(h.lease())).contains(&retry_after),
        "§6.3: the 409's Retry-After is at least 1 s and never past the lease: {retry_after}"
    );
    assert_eq!(
        waiting.waiting(),
        0,
        "§6.6: the wait ended with its last waiter"
    );

    gate.notify_one();
    let first = first.await.expect("the first request");
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "§6.6: the first request's answer is unchanged by a waiter that gave up"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.6: a waiter past its bound does not run the handler"
    );
}

/// A duplicate that waited and still finds the key in flight gets a `Retry-After` of at most the
/// lease seen at its claim less the time it waited, even when `retry_after` is longer: it never
/// points past the lease's end (a 30 s lease, a `retry_after` of 60 s and a 20 s wait give at most
/// 10 s).
/// PROTOCOL.md §6.3, §6.6.
pub async fn retry_after_a_wait_is_the_lease_left_less_the_wait<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let bound = h.lease() * 2 / 3;
    let waiting = waiting_layer(&h, h.store(), bound).retry_after(h.lease() * 2);
    let svc = service(waiting, handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let conflict = send(&svc, post("k", "x")).await;
    let retry_after = conflict.assert_in_flight();
    let most = whole_seconds(h.lease() - bound);
    assert!(
        (1..=most).contains(&retry_after),
        "§6.3: after a wait of {bound:?}, Retry-After is at most the lease ({:?}) less the wait, \
         {most} s, whatever retry_after says: {retry_after}",
        h.lease()
    );
    gate.notify_one();
    first.await.expect("the first request");
    assert_eq!(
        handler.calls(),
        1,
        "§6.6: the waiter did not run the handler"
    );
}

/// Many duplicates of one key share one wait: the store sees each one's claim, then the shared
/// wait's calls, whose number does not grow with the duplicates (at most one per `MAX_POLL` after
/// a short backoff).
/// PROTOCOL.md §6.6.
pub async fn many_waiters_cost_a_bounded_number_of_store_calls<H: Harness>(h: H) {
    const WAITERS: usize = 20;
    let store = Counting::new(h.store());
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let elsewhere = waiting_layer(&h, store.clone(), Duration::from_secs(10));
    let svc = service(layer(&h, h.store()), handler.clone());
    let other = service(elsewhere.clone(), handler.clone());

    let first = spawn_send(&svc, post("k", "x"));
    started.notified().await;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| spawn_send(&other, post("k", "x")))
        .collect();
    until_waiting(&h, &elsewhere, 1).await;
    let held = Duration::from_secs(2);
    h.advance(held).await;
    gate.notify_one();
    first.await.expect("the first request");
    for waiter in waiters {
        let reply = waiter.await.expect("a waiter");
        assert_eq!(
            reply.outcome,
            Some(Outcome::Replayed),
            "§6.6: every waiter of the key gets the replay: {reply:?}"
        );
    }

    // The backoff (25, 50, 100, 200 ms) then one call per `MAX_POLL`, a few more for scheduling.
    let polls = 4 + held.as_millis().div_ceil(MAX_POLL.as_millis()) as usize + 4;
    let calls = store.calls();
    assert!(
        calls.claim <= WAITERS + polls,
        "§6.6: waiters of one key share one wait: each its own claim, plus the shared calls at \
         most every 250 ms; {} claims for {WAITERS} waiters, more than one each and {polls} \
         shared",
        calls.claim
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.6: the handler runs once for the first request and its waiters"
    );
}

/// A waiter whose client goes away (its response future dropped) stops waiting and leaves no
/// wait behind; the first request is not disturbed.
/// PROTOCOL.md §6.6.
pub async fn a_waiter_that_goes_away_leaves_nothing_behind<H: Harness>(h: H) {
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let waiting = waiting_layer(&h, h.store(), h.lease() * 4);
    let (svc, first, gone) = first_and_a_waiter(&h, &waiting, &handler, &started).await;
    gone.abort();
    assert!(
        gone.await.is_err_and(|err| err.is_cancelled()),
        "§6.6: the waiter's task is cancelled, as a client that goes away drops its response \
         future"
    );
    for _ in 0..100 {
        if waiting.waiting() == 0 {
            break;
        }
        h.advance(Duration::from_millis(1)).await;
    }
    assert_eq!(
        waiting.waiting(),
        0,
        "§6.6: a waiter whose client goes away stops waiting, and the last one leaves no wait \
         behind"
    );

    gate.notify_one();
    let first = first.await.expect("the first request");
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§6.6: the first request is not disturbed by a waiter that left"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.4: a retry after the first request completed gets the replay"
    );
    assert_eq!(
        handler.calls(),
        1,
        "§6.6: a waiter that left does not run the handler"
    );
}

/// When the first request's claim is released (its response is not stored), a waiting duplicate
/// claims the key and runs, as a new request would.
/// PROTOCOL.md §6.6, §8.1.
pub async fn a_waiter_runs_when_the_first_request_is_released<H: Harness>(h: H) {
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
    let waiting = waiting_layer(&h, h.store(), h.lease() * 4);
    let (svc, first, duplicate) = first_and_a_waiter(&h, &waiting, &handler, &started).await;
    gate.notify_one();

    let first = first.await.expect("the first request");
    assert_eq!(
        first.outcome,
        Some(Outcome::NotStored),
        "§8.1: a 503 is not stored, and its claim is released"
    );
    let duplicate = duplicate.await.expect("the duplicate");
    assert_eq!(
        (duplicate.outcome, duplicate.text()),
        (Some(Outcome::Executed), "call 2".into()),
        "§6.6: when the first request's claim is released, a waiter claims the key and runs"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(
        (replay.outcome, replay.text()),
        (Some(Outcome::Replayed), "call 2".into()),
        "§6.4: a retry gets the replay of the waiter's run"
    );
    assert_eq!(
        handler.calls(),
        2,
        "§6.6: the handler ran for the first request and once for the waiter"
    );
}
