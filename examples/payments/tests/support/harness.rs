//! One app on one store (memory, or a private `redis-server`), and the means to call it: what the
//! in-process scenarios of `charges.rs` and `hostile_input.rs` run on, each on both stores
//! ([`on_both_stores!`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use serde_json::Value;
use test_servers::redis_server::RedisServer;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_redis::RedisStore;

use example_payments::config::STREAM;
use example_payments::ledger::LEDGER_PREFIX;
use example_payments::provider;
use example_payments::provider::keys::PROVIDER_PREFIX;
use example_payments::{AppState, app};

use super::api::{Call, authorize, create_charge};
use super::stack::Parts;

/// The prefix of the layer's records in Redis: the store's default.
pub const RECORDS_PREFIX: &str = "idempotency:";

/// How long the provider remembers a key in the scenarios that let its window run out.
pub const SHORT_WINDOW: Duration = Duration::from_millis(100);

/// One app on one store, and the means to call it.
pub struct Harness {
    pub parts: Parts,
    pub state: AppState,
    pub router: Router,
    pub records: Records,
    pub redis: Option<RedisServer>,
    /// How long the provider remembers a key.
    window: Duration,
    /// Numbers the keys of [`Harness::charge`].
    keys: AtomicUsize,
}

/// Where the idempotency layer keeps its records.
pub enum Records {
    Memory(MemoryStore),
    Redis(RedisStore),
}

impl Harness {
    pub fn memory() -> Self {
        let parts = Parts::memory(provider::WINDOW);
        Self::on(parts, Records::Memory(MemoryStore::new()), None)
    }

    /// The layer's records, the charges, the events and the provider's keys in one Redis, as
    /// `config.rs` puts them when `REDIS_URL` is set.
    pub async fn redis() -> Self {
        let server = RedisServer::start();
        let store = RedisStore::from_url(&server.url()).expect("a valid URL");
        store.check().await.expect("the fixture's Redis answers");
        let parts = Parts::redis(&store.shared_connection(), provider::WINDOW).await;
        Self::on(parts, Records::Redis(store), Some(server))
    }

    pub fn on(parts: Parts, records: Records, redis: Option<RedisServer>) -> Self {
        let state = parts.state();
        let router = Self::app(&state, &records);
        Self {
            parts,
            state,
            router,
            records,
            redis,
            window: provider::WINDOW,
            keys: AtomicUsize::new(0),
        }
    }

    pub fn app(state: &AppState, records: &Records) -> Router {
        let store = match records {
            Records::Memory(store) => BoxStore::new(store.clone()),
            Records::Redis(store) => BoxStore::new(store.clone()),
        };
        app(state.clone(), IdempotencyLayer::new(store))
    }

    /// Everything but the layer's records built anew, the provider's keys and the charges'
    /// operations held for `window`.
    pub async fn provider_window(&mut self, window: Duration) {
        self.parts = match &self.records {
            Records::Redis(store) => Parts::redis(&store.shared_connection(), window).await,
            Records::Memory(_) => Parts::memory(window),
        };
        self.state = self.parts.state();
        self.router = Self::app(&self.state, &self.records);
        self.window = window;
    }

    /// Another instance on this harness's Redis, as a second process with the same `REDIS_URL`:
    /// its own layer, ledger handle and provider client, sharing every record through Redis.
    pub async fn second_instance(&self) -> Harness {
        let url = self.redis.as_ref().expect("a Redis").url();
        let records = RedisStore::from_url(&url).expect("a valid URL");
        let parts = Parts::redis(&records.shared_connection(), provider::WINDOW).await;
        Harness::on(parts, Records::Redis(records), None)
    }

    /// The provider's `(calls, effects)`.
    pub fn provider_counts(&self) -> (usize, usize) {
        (self.parts.outage.calls(), self.parts.keys.effects())
    }

    /// Forgets every idempotency record (a flushed Redis, a dedup window that ran out), keeping the
    /// ledger and the provider.
    pub fn lose_idempotency_records(&mut self) {
        match &self.redis {
            Some(server) => {
                let deleted = server.command(&[
                    "EVAL",
                    "local keys = redis.call('KEYS', ARGV[1]) \
                     for _, key in ipairs(keys) do redis.call('DEL', key) end \
                     return #keys",
                    "0",
                    &format!("{RECORDS_PREFIX}*"),
                ]);
                assert!(deleted.as_integer().is_some(), "{deleted:?}");
            }
            None => {
                self.records = Records::Memory(MemoryStore::new());
                self.router = Self::app(&self.state, &self.records);
            }
        }
    }

    /// Lets the layer's and the provider's dedup windows run out; the provider's must be short.
    pub async fn pass_the_windows(&mut self) {
        let window = self.window;
        assert!(
            window <= Duration::from_secs(1),
            "{window:?}: shorten it first"
        );
        self.lose_idempotency_records();
        tokio::time::sleep(window + Duration::from_millis(20)).await;
    }

    /// Checks what every scenario must leave behind.
    pub fn finish(self) {
        if let Some(server) = &self.redis {
            assert_eq!(
                server
                    .keys_without_ttl()
                    .into_iter()
                    .filter(|key| !is_durable(key))
                    .collect::<Vec<_>>(),
                Vec::<String>::new(),
                "every Redis key but the durable data must expire"
            );
        }
    }

    /// Sends `call` while the provider's answers are lost after it acted: `504`, the outcome
    /// unknown to the client.
    pub async fn send_losing_the_answer(&self, call: Call) {
        self.parts.outage.set_losing_answers(true);
        let reply = call.send().await;
        self.parts.outage.set_losing_answers(false);
        reply.assert_error(
            StatusCode::GATEWAY_TIMEOUT,
            "api_error",
            "provider_outcome_unknown",
        );
    }

    /// One round of the reconciler, taking every unsettled charge however recent.
    pub async fn reconcile_now(&self) {
        let reconciled = self.parts.reconciler(Duration::ZERO).round().await;
        assert!(reconciled.is_ok(), "{reconciled:?}");
    }

    pub fn post(&self, path: &str) -> Call {
        Call::post(&self.router, path)
    }

    pub fn get(&self, path: &str) -> Call {
        Call::get(&self.router, path)
    }

    /// A charge of `amount` euro cents, authorized only; its id.
    pub async fn authorized(&self, api_key: &str, amount: i64) -> String {
        let charge = self.charge(api_key, authorize(amount)).await;
        assert_eq!(charge["status"], "authorized");
        charge["id"].as_str().expect("a charge id").to_owned()
    }

    /// Creates a charge as `api_key` with a fresh key; panics unless it is 201.
    pub async fn charge(&self, api_key: &str, body: Value) -> Value {
        let key = format!("create-{}", self.keys.fetch_add(1, Ordering::SeqCst));
        let reply = create_charge(&self.router, api_key, &key, &body)
            .send()
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        reply.json
    }

    /// Asserts ALICE's charge `id` is `status` with `refunded` of it refunded.
    pub async fn assert_refunded(&self, id: &str, status: &str, refunded: i64) {
        let charge = self.charge_status(super::api::ALICE, id).await;
        assert_eq!(
            (&charge["status"], &charge["amount_refunded"]),
            (&Value::from(status), &Value::from(refunded)),
            "{charge}"
        );
    }

    /// What the provider refunded of each of its payments, oldest first.
    pub async fn provider_refunded(&self) -> Vec<i64> {
        let payments = self.parts.provider.payments_since(0, 100).await;
        payments
            .expect("the report")
            .iter()
            .map(|p| p.refunded)
            .collect()
    }

    pub async fn charge_status(&self, api_key: &str, id: &str) -> Value {
        let reply = self
            .get(&format!("/v1/charges/{id}"))
            .auth(api_key)
            .send()
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json
    }
}

/// Whether the Redis key `key` holds durable data, kept with no expiry: a charge, an account's
/// list, the ledger's indexes, the provider's payments, the event stream.
pub fn is_durable(key: &str) -> bool {
    let ledger = key
        .strip_prefix(LEDGER_PREFIX)
        .is_some_and(|rest| !rest.starts_with("op:"));
    let payments = key
        .strip_prefix(PROVIDER_PREFIX)
        .is_some_and(|rest| rest.starts_with("payment"));
    ledger || payments || key == STREAM
}

pub fn ids(list: &Value) -> Vec<&str> {
    list["data"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|charge| charge["id"].as_str().expect("an id"))
        .collect()
}

/// Runs each scenario, `async fn(&mut Harness)`, on the in-memory store and on Redis, then
/// checks what every scenario must leave behind.
#[allow(
    unused_macros,
    reason = "test binaries that do not run scenarios on both stores"
)]
macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $scenario() {
                    let mut harness = super::Harness::memory();
                    super::$scenario(&mut harness).await;
                    harness.finish();
                }
            )*
        }

        mod redis {
            $(
                #[tokio::test]
                async fn $scenario() {
                    let mut harness = super::Harness::redis().await;
                    super::$scenario(&mut harness).await;
                    harness.finish();
                }
            )*
        }
    };
}

#[allow(
    unused_imports,
    reason = "test binaries that do not run scenarios on both stores"
)]
pub(crate) use on_both_stores;
