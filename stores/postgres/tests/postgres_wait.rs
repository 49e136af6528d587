//! Waiting on a request in flight over `PgStore` with change notifications
//! (`PgStore::with_notifications`): a duplicate on another instance is woken by the `NOTIFY` of
//! the first request's completion, not by its next poll.
//! PROTOCOL.md §6.6, §10.8.

use std::sync::Arc;
use std::time::Duration;

use test_servers::postgres_server::PostgresServer;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_test::{Counting, gated_handler, post, send, service};

async fn notifying(server: &PostgresServer) -> PgStore {
    let store = PgStore::connect(&server.url())
        .expect("a store")
        .with_notifications(true);
    store.migrate().await.expect("the table");
    store
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

    let first = tokio::spawn({
        let svc = first_svc.clone();
        async move {
            let reply = send(&svc, post("k", "x")).await;
            (reply, Instant::now())
        }
    });
    started.notified().await;
    let duplicate = tokio::spawn({
        let other = other.clone();
        async move {
            let reply = send(&other, post("k", "x")).await;
            (reply, Instant::now())
        }
    });
    while waiting.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Well before the wait's own poll (a second after it began), so only a notification wakes it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.notify_one();

    let (first, answered) = first.await.expect("the first request");
    let (duplicate, replayed) = duplicate.await.expect("the duplicate");
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
