//! One app on one ledger (memory, or a database of its own on the binary's shared PostgreSQL),
//! and the means to call it: what the in-process scenarios run on, each on both
//! ([`on_both_ledgers!`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use serde_json::Value;
use sqlx::Connection;
use test_servers::postgres_server::PostgresServer;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_postgres::PgStore;

use example_payments::provider;
use example_payments::{AppState, app, pg};

use super::api::{Call, authorize, create_charge};
use super::stack::Parts;

/// How long the provider remembers a key in the scenarios that let its window run out.
pub(crate) const SHORT_WINDOW: Duration = Duration::from_millis(100);

/// One app on one ledger, and the means to call it.
pub(crate) struct Harness {
    pub parts: Parts,
    pub state: AppState,
    pub router: Router,
    pub records: Records,
    /// How long the provider remembers a key.
    window: Duration,
    /// Numbers the keys of [`Harness::charge`].
    keys: AtomicUsize,
}

/// Where the idempotency layer keeps its records: beside the money.
#[derive(Clone)]
pub(crate) enum Records {
    Memory(MemoryStore),
    Postgres(PgStore),
}

/// A new database on the binary's shared PostgreSQL, its schema created as at start-up.
pub(crate) async fn new_database() -> (PgStore, String) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let server = PostgresServer::shared();
    let name = format!(
        "t{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let mut admin = sqlx::PgConnection::connect(&server.url())
        .await
        .expect("postgres");
    sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("a database");
    let url = server.url_for(&name);
    (pg::connect(&url).await.expect("the schema"), url)
}

impl Harness {
    pub(crate) fn memory() -> Self {
        Self::memory_with(provider::WINDOW)
    }

    fn memory_with(window: Duration) -> Self {
        let records = Records::Memory(MemoryStore::new());
        Self::on(Parts::memory(window), records, window)
    }

    pub(crate) async fn postgres() -> Self {
        let (store, _) = new_database().await;
        let parts = Parts::postgres(&store, provider::WINDOW);
        Self::on(parts, Records::Postgres(store), provider::WINDOW)
    }

    pub(crate) fn on(parts: Parts, records: Records, window: Duration) -> Self {
        let state = parts.state();
        let router = Self::app(&state, &records);
        Self {
            parts,
            state,
            router,
            records,
            window,
            keys: AtomicUsize::new(0),
        }
    }

    pub(crate) fn app(state: &AppState, records: &Records) -> Router {
        let store = match records {
            Records::Memory(store) => BoxStore::new(store.clone()),
            Records::Postgres(store) => BoxStore::new(store.clone()),
        };
        app(state.clone(), IdempotencyLayer::new(store))
    }

    /// Everything built anew but the records (and, on PostgreSQL, the charges), the provider's
    /// keys and the charges' operations held for `window`.
    pub(crate) fn provider_window(&mut self, window: Duration) {
        self.parts = match &self.records {
            Records::Postgres(store) => Parts::postgres(store, window),
            Records::Memory(_) => Parts::memory(window),
        };
        self.state = self.parts.state();
        self.router = Self::app(&self.state, &self.records);
        self.window = window;
    }

    /// Another instance on this harness's database, sharing its provider: its own layer, ledger
    /// handle and provider client.
    pub(crate) fn second_instance(&self) -> Harness {
        let Records::Postgres(store) = &self.records else {
            panic!("a second instance shares a database");
        };
        let parts = Parts::postgres_with(store, self.parts.provider.clone(), self.window);
        Harness::on(parts, self.records.clone(), self.window)
    }

    /// The provider's `(calls, effects)`.
    pub(crate) fn provider_counts(&self) -> (usize, usize) {
        (self.parts.probe.calls(), self.parts.probe.effects())
    }

    /// Forgets every idempotency record (a dedup window that ran out), keeping the ledger and
    /// the provider.
    pub(crate) async fn lose_idempotency_records(&mut self) {
        match &self.records {
            Records::Postgres(store) => {
                sqlx::query("DELETE FROM idempotency_records")
                    .execute(store.pool())
                    .await
                    .expect("the records");
            }
            Records::Memory(_) => {
                self.records = Records::Memory(MemoryStore::new());
                self.router = Self::app(&self.state, &self.records);
            }
        }
    }

    /// Lets the layer's and the provider's dedup windows run out; the provider's must be short.
    pub(crate) async fn pass_the_windows(&mut self) {
        let window = self.window;
        assert!(
            window <= Duration::from_secs(1),
            "{window:?}: shorten it first"
        );
        self.lose_idempotency_records().await;
        tokio::time::sleep(window + Duration::from_millis(20)).await;
    }

    /// Sends `call` while the provider's answers are lost after it acted: `504`, the outcome
    /// unknown to the client.
    pub(crate) async fn send_losing_the_answer(&self, call: Call) {
        self.parts.probe.set_losing_answers(true);
        let reply = call.send().await;
        self.parts.probe.set_losing_answers(false);
        reply.assert_outcome_unknown();
    }

    /// One round of the reconciler, taking every unsettled charge however recent.
    pub(crate) async fn reconcile_now(&self) {
        let reconciled = self.parts.reconciler(Duration::ZERO).round().await;
        assert!(reconciled.is_ok(), "{reconciled:?}");
    }

    pub(crate) fn post(&self, path: &str) -> Call {
        Call::post(&self.router, path)
    }

    pub(crate) fn get(&self, path: &str) -> Call {
        Call::get(&self.router, path)
    }

    /// A charge of `amount` euro cents, authorized only; its id.
    pub(crate) async fn authorized(&self, api_key: &str, amount: i64) -> String {
        let charge = self.charge(api_key, authorize(amount)).await;
        assert_eq!(charge["status"], "authorized");
        charge["id"].as_str().expect("a charge id").to_owned()
    }

    /// Creates a charge as `api_key` with a fresh key; panics unless it is 201.
    pub(crate) async fn charge(&self, api_key: &str, body: Value) -> Value {
        let key = format!("create-{}", self.keys.fetch_add(1, Ordering::SeqCst));
        let reply = create_charge(&self.router, api_key, &key, &body)
            .send()
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        reply.json
    }

    /// Asserts ALICE's charge `id` is `status` with `refunded` of it refunded.
    pub(crate) async fn assert_refunded(&self, id: &str, status: &str, refunded: i64) {
        let charge = self.charge_status(super::api::ALICE, id).await;
        assert_eq!(
            (&charge["status"], &charge["amount_refunded"]),
            (&Value::from(status), &Value::from(refunded)),
            "{charge}"
        );
    }

    /// What the provider refunded of each of its payments, oldest first.
    pub(crate) async fn provider_refunded(&self) -> Vec<i64> {
        let payments = self.parts.provider.payments_since(0, 100).await;
        payments.iter().map(|p| p.refunded).collect()
    }

    pub(crate) async fn charge_status(&self, api_key: &str, id: &str) -> Value {
        let reply = self
            .get(&format!("/v1/charges/{id}"))
            .auth(api_key)
            .send()
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json
    }
}

pub(crate) fn ids(list: &Value) -> Vec<&str> {
    list["data"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|charge| charge["id"].as_str().expect("an id"))
        .collect()
}

/// Runs each scenario, `async fn(&mut Harness)`, with the money in memory and in PostgreSQL.
#[allow(
    unused_macros,
    reason = "test binaries that run no scenario on both ledgers"
)]
macro_rules! on_both_ledgers {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(&mut super::Harness::memory()).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(&mut super::Harness::postgres().await).await;
                }
            )*
        }
    };
}

#[allow(
    unused_imports,
    reason = "test binaries that run no scenario on both ledgers"
)]
pub(crate) use on_both_ledgers;
