//! Waiting on a request in flight over `PgStore` with change notifications
//! (`PgStore::with_notifications`): a duplicate on another instance is woken by the `NOTIFY` of
//! the first request's completion or release, not by its next poll.
//! PROTOCOL.md §6.6, §10.8.

use std::sync::Arc;
use std::time::Duration;

use test_servers::postgres_server::PostgresServer;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_idempotency::{Idempotency, IdempotencyLayer, Outcome};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_test::{
    Counting, Handler, Reply, created, gated_handler, post, respond, send, service,
};

async fn notifying(server: &PostgresServer) -> PgStore {
    let store = PgStore::connect(&server.url())
        .expect("a store")
        .with_notifications(true);
    store.migrate().await.expect("the table");
    store
}

/// The scene of both tests: the first request through `first_svc` and, once its handler runs
/// (`started`), a duplicate through `other`, whose layer is `waiting`. Once it waits, and well
/// before its wait's own poll (a second after it began), `gate` opens, so that only a
/// notification wakes it. Each answer comes with the moment it came.
async fn first_then_a_waiting_duplicate<St: tower_idempotency::store::Store + Clone>(
    first_svc: Idempotency<Handler, PgStore>,
    other: Idempotency<Handler, St>,
    waiting: &IdempotencyLayer<St>,
    started: &Notify,
    gate: &Notify,
) -> ((Reply, Instant), (Reply, Instant)) {
    let first = tokio::spawn(async move {
        let reply = send(&first_svc, post("k", "x")).await;
        (reply, Instant::now())
    });
    started.notified().await;
    let duplicate = tokio::spawn(async move {
        let reply = send(&other, post("k", "x")).await;
        (reply, Instant::now())
    });
    while waiting.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.notify_one();
    (
        first.await.expect("the first request"),
        duplicate.await.expect("the duplicate"),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_on_another_instance_is_woken_by_the_completion() {
    let server = PostgresServer::start();
    let (here, there) = (
        notifying(&server).await,
        Counting::new(notifying(&server).await),
    );
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = gated_handler(started.clone(), gate.clone(), "charged");
    let wait = Duration::from_secs(10);
    let first_svc = service(IdempotencyLayer::new(here), handler.clone());
    let waiting = IdempotencyLayer::new(there.clone()).wait_for_in_flight(wait);
    let other = service(waiting.clone(), handler.clone());

    let ((first, answered), (duplicate, replayed)) =
        first_then_a_waiting_duplicate(first_svc, other, &waiting, &started, &gate).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(duplicate.outcome, Some(Outcome::Replayed), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    let lag = replayed.saturating_duration_since(answered);
    assert!(
        lag < Duration::from_millis(400),
        "replayed {lag:?} after the first's answer"
    );
    let claims = there.calls().claim;
    assert!(
        claims <= 3,
        "{claims} claims: the duplicate's, the wait's on connecting and on the notification"
    );
    assert_eq!(handler.calls(), 1);
}

/// §6.6, §10.8: a release notifies as a completion does. The first request's response is not
/// stored (a 500: its claim is released), and a duplicate waiting on another instance is woken by
/// the release's `NOTIFY`: it claims the key and runs the handler at once, not at its next poll.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_on_another_instance_is_woken_by_the_release() {
    let server = PostgresServer::start();
    let (here, there) = (notifying(&server).await, notifying(&server).await);
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = Handler::new({
        let (started, gate) = (started.clone(), gate.clone());
        move |call| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                if call.n > 1 {
                    return Ok(created(format!("charged {}", call.n)));
                }
                started.notify_one();
                gate.notified().await;
                Ok(respond(500, "failed"))
            }
        }
    });
    let first_svc = service(IdempotencyLayer::new(here), handler.clone());
    let waiting = IdempotencyLayer::new(there).wait_for_in_flight(Duration::from_secs(10));
    let other = service(waiting.clone(), handler.clone());

    let ((first, answered), (duplicate, ran)) =
        first_then_a_waiting_duplicate(first_svc, other, &waiting, &started, &gate).await;
    assert_eq!(first.status, 500, "{first:?}");
    assert_eq!(duplicate.outcome, Some(Outcome::Executed), "{duplicate:?}");
    assert_eq!(duplicate.text(), "charged 2");
    let lag = ran.saturating_duration_since(answered);
    assert!(
        lag < Duration::from_millis(400),
        "ran {lag:?} after the first's answer"
    );
    assert_eq!(handler.calls(), 2);
}
