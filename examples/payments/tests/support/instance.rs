//! One instance of the example on PostgreSQL, in-process on a tokio runtime of its own over a
//! pool of its own: two instances on one database are two runtimes, and a crash is its runtime
//! shut down at once, which stops everything the instance runs (handlers, lease renewals, the
//! consumer, the reconciler) and closes its connections, so the database rolls back what they
//! held open.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, Row};
use test_servers::postgres_server::PostgresServer;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};

use example_payments::app;
use example_payments::pg;
use example_payments::provider::WINDOW;
use example_payments::queue::ConsumerConfig;

use super::api::{ALICE, Call, Reply, create_charge, visa};
use super::instruments::Hang;
use super::stack::Parts;

/// The idempotency layer's lease in these tests: a crashed instance's claim runs out this soon.
pub const LEASE: Duration = Duration::from_secs(1);
/// A reconciler that stays out of the way.
pub const NEVER: Duration = Duration::from_secs(3600);
/// How long a test waits for something to happen.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// One instance of the example, on a runtime of its own.
pub struct Instance {
    runtime: Option<Runtime>,
    pub router: Router,
    /// Its components, behind the test's instruments.
    pub parts: Arc<Parts>,
    stop: CancellationToken,
}

impl Instance {
    /// An instance on the database at `url` (its schema created if missing), whose reconciler
    /// settles charges `authorizing` longer than `reconcile_after`.
    pub async fn start(url: &str, reconcile_after: Duration) -> Self {
        let stop = CancellationToken::new();
        let url = url.to_owned();
        let workers = stop.clone();
        // Set up with `block_on`, on a thread that may block: `PgStore::migrate`'s future is not
        // `Send`, so it cannot be spawned.
        let (runtime, router, parts) = tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime");
            let (router, parts) = runtime.block_on(async move {
                let store = pg::connect(&url).await.expect("the database is usable");
                let parts = Arc::new(Parts::postgres(&store, WINDOW));
                // The outbox's consumer and the reconciler, as `config.rs` starts them.
                let poll = ConsumerConfig::default().block(Duration::from_millis(200));
                drop(
                    parts
                        .consume("ledger", MemoryStore::new(), poll, &workers)
                        .await,
                );
                tokio::spawn(parts.reconciler(reconcile_after).run(workers));
                let layer = IdempotencyLayer::new(BoxStore::new(store)).lease(LEASE);
                (app(parts.state(), layer), parts)
            });
            (runtime, router, parts)
        })
        .await
        .expect("the instance starts");
        Self {
            runtime: Some(runtime),
            router,
            parts,
            stop,
        }
    }

    /// Sends `call`, made on this instance's router, in a task of the instance.
    pub fn spawn(&self, call: Call) -> JoinHandle<Reply> {
        self.runtime
            .as_ref()
            .expect("a running instance")
            .spawn(call.send())
    }

    pub async fn send(&self, call: Call) -> Reply {
        self.spawn(call).await.expect("the instance answers")
    }

    /// A charge as Alice under `key`.
    pub fn charge_call(&self, key: &str, body: &Value) -> Call {
        create_charge(&self.router, ALICE, key, body)
    }

    pub async fn charge(&self, key: &str, body: &Value) -> Reply {
        self.send(self.charge_call(key, body)).await
    }

    /// Sends the charge again while the key is in flight (409), as a client honouring
    /// `Retry-After` would, until it gets another answer.
    pub async fn retry_charge(&self, key: &str, body: &Value) -> Reply {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let reply = self.charge(key, body).await;
            if reply.status != StatusCode::CONFLICT {
                return reply;
            }
            assert!(
                Instant::now() < deadline,
                "still in flight: {}",
                reply.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn post_empty(&self, path: &str, key: &str) -> Reply {
        self.send(Call::post(&self.router, path).auth(ALICE).key(key))
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Call::get(&self.router, path).auth(ALICE)).await
    }

    /// The ids and statuses of Alice's charges, newest first.
    pub async fn charges(&self) -> Vec<(String, String)> {
        let list = self.get("/v1/charges").await;
        assert_eq!(list.status, StatusCode::OK, "{}", list.text());
        list.json["data"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|charge| {
                (
                    charge["id"].as_str().unwrap_or_default().to_owned(),
                    charge["status"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    /// Waits until Alice's balance is `amount` euro cents.
    pub async fn wait_for_balance(&self, amount: i64) {
        let expected = json!([{ "amount": amount, "currency": "eur" }]);
        let deadline = Instant::now() + PATIENCE;
        loop {
            let balance = self.get("/v1/balance").await;
            if balance.json["available"] == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the balance is not {amount}: {}",
                balance.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops everything the instance runs, at once, as a crash of its process would.
    pub fn crash(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

pub async fn admin(server: &PostgresServer) -> PgConnection {
    PgConnection::connect(&server.url())
        .await
        .expect("an admin connection")
}

/// One number from `sql`.
pub async fn count(server: &PostgresServer, sql: &str) -> i64 {
    sqlx::query(sql)
        .fetch_one(&mut admin(server).await)
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"))
        .get(0)
}

/// How many payments the provider made: its keys used for a new payment, across instances.
pub async fn provider_payments(server: &PostgresServer) -> i64 {
    count(
        server,
        "SELECT count(*) FROM provider_keys WHERE request LIKE 'create_payment %'",
    )
    .await
}

/// Waits until `sql` counts `expected`.
pub async fn wait_for_count(server: &PostgresServer, sql: &str, expected: i64) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let now = count(server, sql).await;
        if now == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{sql}: {now}, not {expected}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub const AUTHORIZING: &str = "SELECT count(*) FROM charges WHERE status = 'authorizing'";

/// Starts an instance whose provider hangs `at` a point of every call, sends a charge to it, waits
/// until the charge is `authorizing` in the database (and, hanging after the effect, the provider
/// has charged), and crashes it.
pub async fn crash_during_the_provider_call(
    server: &PostgresServer,
    at: Hang,
    key: &str,
    body: &Value,
) {
    let first = Instance::start(&server.url(), NEVER).await;
    first.parts.keys.hang(at);
    let lost = first.spawn(first.charge_call(key, body));
    wait_for_count(server, AUTHORIZING, 1).await;
    let charged = i64::from(at == Hang::AfterEffect);
    wait_for_count(
        server,
        "SELECT count(*) FROM provider_keys WHERE request LIKE 'create_payment %'",
        charged,
    )
    .await;
    first.crash();
    let answer = lost.await;
    assert!(
        answer.as_ref().is_err_and(|err| err.is_cancelled()),
        "the client never gets an answer: {answer:?}"
    );
}

/// Locks the provider's key table, as the outage did: every provider call that writes a key waits
/// until the transaction ends (reads go on). Returns the connection holding the lock.
pub async fn lock_provider_keys(server: &PostgresServer) -> PgConnection {
    let mut lock = admin(server).await;
    for sql in ["BEGIN", "LOCK TABLE provider_keys IN EXCLUSIVE MODE"] {
        sqlx::query(sql)
            .execute(&mut lock)
            .await
            .unwrap_or_else(|err| panic!("{sql}: {err}"));
    }
    lock
}

/// Releases the lock of [`lock_provider_keys`]: the calls held behind it commit now.
pub async fn release(mut lock: PgConnection) {
    sqlx::query("COMMIT")
        .execute(&mut lock)
        .await
        .expect("the lock's transaction ends");
}

/// Sends a charge while the provider's key table is locked past the provider client's deadline
/// (8 s): the answer says the outcome is not known yet (never "nothing was charged"), and the
/// charge is kept `authorizing`. Then the lock goes, and the provider's write commits.
pub async fn charge_through_a_locked_provider(
    server: &PostgresServer,
    instance: &Instance,
    key: &str,
) {
    let lock = lock_provider_keys(server).await;
    let first = instance.charge(key, &visa(3100)).await;
    first.assert_outcome_unknown();
    release(lock).await;
    wait_for_count(server, "SELECT count(*) FROM provider_payments", 1).await;
}
