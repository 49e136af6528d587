//! What waiting for a request in flight costs (`wait_for_in_flight`): store calls per waiting
//! duplicate, and how long after the first request's answer a duplicate gets its replay. A
//! measurement, not a check: run it with
//! `cargo test --all-features --test layer wait_cost -- --ignored --nocapture --test-threads 1`.
//!
//! The first request's handler takes 1.5 s; `n` duplicates arrive 0.5 s in and wait (bound 5 s),
//! either on the layer that runs the first (it tells the wait when it completes) or on a second
//! layer over the same store, as another instance of the service would (the wait polls).

use std::time::Duration;

use tokio::time::Instant;
use tower_idempotency::store::Store;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{Counting, Handler, created, post, send, service};

const HANDLER: Duration = Duration::from_millis(1500);
const ARRIVAL: Duration = Duration::from_millis(500);

async fn measure<St: Store + Clone>(name: &str, base: St) {
    for n in [1usize, 10, 100] {
        for remote in [false, true] {
            let store = Counting::new(base.clone());
            let handler = Handler::new(|call| async move {
                if call.n == 1 {
                    tokio::time::sleep(HANDLER).await;
                }
                Ok(created("done"))
            });
            let here =
                IdempotencyLayer::new(store.clone()).wait_for_in_flight(Duration::from_secs(5));
            let there =
                IdempotencyLayer::new(store.clone()).wait_for_in_flight(Duration::from_secs(5));
            let first_svc = service(here.clone(), handler.clone());
            let waiting_svc = service(if remote { there } else { here }, handler.clone());
            let key = format!("{name}-{n}-{remote}");

            let started = Instant::now();
            let first = tokio::spawn({
                let svc = first_svc.clone();
                let request = post(&key, "x");
                async move {
                    let reply = send(&svc, request).await;
                    (reply, Instant::now())
                }
            });
            tokio::time::sleep(ARRIVAL).await;
            let before = store.calls();
            let waiters: Vec<_> = (0..n)
                .map(|_| {
                    let svc = waiting_svc.clone();
                    let request = post(&key, "x");
                    tokio::spawn(async move {
                        let reply = send(&svc, request).await;
                        (reply, Instant::now())
                    })
                })
                .collect();
            let (first, first_done) = first.await.expect("the first request");
            assert_eq!(first.outcome, Some(Outcome::Executed));
            let mut lags = Vec::new();
            for waiter in waiters {
                let (reply, done) = waiter.await.expect("a waiter");
                assert_eq!(reply.outcome, Some(Outcome::Replayed), "{reply:?}");
                lags.push(done.saturating_duration_since(first_done));
            }
            let after = store.calls();
            // The first request's completion falls in the window: not the waiters' cost.
            let calls = after.total() - before.total() - 1;
            let max = lags.iter().max().copied().unwrap_or_default();
            let mean = lags.iter().sum::<Duration>() / n as u32;
            println!(
                "{name:9} {:9} n={n:3}: {calls:4} store calls ({:.2} per waiter); replay after the first's answer: mean {mean:?}, max {max:?}; first took {:?}",
                if remote { "elsewhere" } else { "here" },
                calls as f64 / n as f64,
                first_done - started,
            );
            assert_eq!(handler.calls(), 1);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn wait_cost_memory() {
    measure("memory", MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn wait_cost_redis() {
    let server = test_servers::redis_server::RedisServer::start();
    let store = tower_idempotency_redis::RedisStore::from_url(&server.url()).expect("a store");
    measure("redis", store).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn wait_cost_postgres() {
    let server = test_servers::postgres_server::PostgresServer::start();
    let store = tower_idempotency_postgres::PgStore::connect(&server.url()).expect("a store");
    store.migrate().await.expect("the table");
    measure("postgres", store).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn wait_cost_postgres_notifying() {
    let server = test_servers::postgres_server::PostgresServer::start();
    let store = tower_idempotency_postgres::PgStore::connect(&server.url())
        .expect("a store")
        .with_notifications(true);
    store.migrate().await.expect("the table");
    measure("pg+notify", store).await;
}
