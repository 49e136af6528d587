//! A payments API made safe to retry with `tower-idempotency`.
//!
//! A client that creates a charge and times out cannot know whether the charge happened, so it
//! retries. This example shows the layer doing what a payments API needs:
//!
//! - `POST /v1/charges` needs an `Idempotency-Key`; a retry with the same key gets the first
//!   response back (`Idempotent-Replayed: true`) and the card is charged once.
//! - Keys are scoped to the account: authentication runs *outside* the idempotency layer and
//!   puts an `Account` (`auth.rs`) in the request; the layer's scope function reads it. The
//!   account is an opaque id derived from the API key: the key itself never reaches a handler, a
//!   store, a Redis key name or a log line.
//! - A declined card (402) is a decided outcome: stored and replayed. An unavailable provider (503)
//!   is transient: not stored, so the retry runs again. A provider whose answer is lost (its
//!   client's deadline passed, the connection dropped after the call was sent) has an unknown
//!   outcome, which is not a failure: `504` `provider_outcome_unknown`, not stored, and the charge
//!   is kept `authorizing` (never deleted, never "nothing was charged"); the retry with the same
//!   key resumes it, and the reconciler (`reconciler.rs`) settles it from the provider's side.
//!   Only the provider's own refusal before any effect (`503` to every attempt) says nothing was
//!   charged.
//! - The handler passes the payment provider its own idempotency key, derived from the client's
//!   key and the account ([`tower_idempotency::IdempotencyKey::derive`]): even a request whose
//!   idempotency record was lost cannot charge twice. The provider binds each key to the request
//!   it was first used for (operation, amount, source, capture flag, payment) for its own 24 h
//!   window (`provider/`): the same key with another request, which only reaches it once the
//!   layer has forgotten the key, is refused with `400` and `{"error": {"type":
//!   "idempotency_error", "code": "idempotency_key_reused", ...}}`, and nothing happens; after
//!   the window the key is new again. The handlers call the provider over its HTTP API (an axum
//!   `Router`, served in process) through the crate's client layer,
//!   [`tower_idempotency_client::IdempotentRetryLayer`], with that key as the `Idempotency-Key`
//!   (`provider/client.rs`): a provider `503` is retried, up to 3 attempts, before the charge
//!   answers `503` itself. The provider runs each call to its end even when its caller gave up, as
//!   a real provider does, keeps every payment (`GET /v1/payments?created_gte=`: its payments
//!   report), and refuses a refund beyond what is left of its payment (`amount_too_large`,
//!   atomically with its keys): the last line of defence against a double refund.
//! - Every effect outside the idempotency record is fenced (`charges.rs`): a handler stalled past
//!   its claim's lease (a locked table, a frozen database) may find that the client's retry took
//!   the key over and ran again. Each provider call carries the handler's
//!   [`tower_idempotency::HeldClaim::fence`]; the provider keeps the largest fence per key and
//!   refuses a smaller one, and the handler asks [`tower_idempotency::HeldClaim::still_held`]
//!   right before the call. The run taken over records nothing and answers `409`
//!   `idempotency_key_superseded`; its client's retry gets the newer run's answer. One charge per
//!   operation (account and provider key) is the store's own constraint, not the lock in front of
//!   it (`ledger.rs`): a `UNIQUE` index in PostgreSQL, a `SET NX` in Redis, the map's entry in
//!   memory. A second run inserts nothing and resumes, or answers with, the first charge.
//! - It speaks Stripe's wire format where a Stripe SDK notices, so the official SDKs work against
//!   it (`api_base` pointed here): bodies are forms (`application/x-www-form-urlencoded`, with
//!   Stripe's nested `metadata[key]=value`) or JSON (`params.rs`); errors are `{"error": {"type",
//!   "code", "message", ...}}`, the idempotency layer's too (rendered by `error::render_problem`
//!   as RFC 9457 documents that carry the same `error` member); a key reused for another request
//!   is `400` `idempotency_error` (the SDKs' `IdempotencyError`); and `Stripe-Should-Retry: true`
//!   marks the answers a retry fixes (`409` while the key's first request runs, `503`).
//!   The layer fingerprints the body's raw bytes: an SDK's retry sends the same bytes and is
//!   recognised; the same charge written another way under the same key (JSON instead of a
//!   form, its parameters in another order) is another request, and refused.
//! - `GET /metrics` serves the layer's metrics in Prometheus' text format (`prometheus.rs`).
//! - The idempotency records' store is chosen at start-up, from the environment, behind one
//!   type ([`tower_idempotency::BoxStore`]): one server, whichever store.
//! - Its records are sealed ([`tower_idempotency::seal::SealedStore`]): a charge stored for
//!   replay is encrypted and authenticated under the keys of `IDEMPOTENCY_SEAL_KEYS`
//!   (`id:base64key,...`, the first sealing, the others still opening: rotation), or, unset, a
//!   fixed development key that start-up warns of.
//! - Captures, refunds and cancellations walk one explicit state machine (`state_machine.rs`).
//! - Every approved charge, capture and refund publishes an event (`charge.succeeded`,
//!   `charge.captured`, `charge.refunded`; `events.rs`) to an at-least-once queue (`queue/`): a
//!   Redis Stream with a consumer group, or the same behaviour in memory. The event id is derived
//!   from the provider's payment or refund id, so whatever publishes it twice for one payment (a
//!   handler that runs twice, the reconciler) publishes one event id twice.
//! - A ledger consumer (`consumer.rs`), started beside the server, applies each event to the
//!   account's balance exactly once: the crate's [`tower_idempotency::consumer::Deduplicator`]
//!   skips redeliveries and keeps two consumers off one event, and the balance ledger
//!   (`balance.rs`) records the event id atomically with the balance change, which closes the gap
//!   a crash between the effect and the Deduplicator's record would leave. Balances change with
//!   checked arithmetic: an event that would overflow one is refused for good, logged and acked,
//!   never wrapped nor retried forever. `GET /v1/balance` shows the result: captured money
//!   counts, refunds subtract, an authorization alone does not count.
//! - A route the API does not have answers as Stripe's does: `404` with `{"error": {"type":
//!   "invalid_request_error", "message": "Unrecognized request URL (POST: /v1/refunds). ..."}}`,
//!   which an SDK raises as a clear error.
//! - No client can hold the server open (`http_server.rs`): the request line and headers must
//!   arrive within 10 s, the body within 10 s more, else the request fails or its connection is
//!   closed.
//! - On SIGTERM or Ctrl-C the server stops accepting, lets requests in flight finish, and waits
//!   for the layer's detached work ([`tower_idempotency::Shutdown`]), all within
//!   `SHUTDOWN_TIMEOUT_MS` (20 s by default); connections still open then are closed. The consumer
//!   finishes the event at hand and stops, and the process exits.
//!
//! The provider is simulated. There is one ledger of charges per deployment (`ledger.rs`): with
//! `REDIS_URL` set, the idempotency records, the charges, the events (a Redis Stream with a
//! consumer group), the balances, the consumer's records and the provider's keys and payments are
//! in Redis, and every instance on it lists, captures, refunds and cancels the same charges (each
//! change a Lua compare-and-set checked against the state machine); unset, all of it is in memory.
//! `LEDGER_REDIS_URL` moves the charges, events, balances and provider data to another Redis: they
//! are durable data (charges, a stream and balances that never expire, the records that stand for
//! an outside provider's), unlike the idempotency records, which all expire and may be flushed, so
//! in production they belong on a Redis with persistence and no eviction.
//!
//! Every Redis command goes through the idempotency store's connection
//! ([`tower_idempotency_redis::SharedConnection`], one per Redis: `LEDGER_REDIS_URL` gets a store
//! of its own for it), with the store's 1 s bound on each call and its healing: on a Redis
//! Cluster, a master that stops answering with its connections open (frozen, hung, partitioned)
//! is left for its promoted replica within seconds. A Redis that times out or cannot be reached
//! is a `503` for the caller (a `504` when a provider's write may have happened). The ledger
//! consumer's blocking reads take a dedicated connection (`queue/redis.rs`), made again after
//! any error.
//!
//! With `DATABASE_URL` set (and the `postgres` feature), everything is in that PostgreSQL
//! instead (`pg/`): the idempotency records ([`tower_idempotency_postgres::PgStore`]), the charges, the
//! balances, an outbox of events, the consumer's processed event ids and the provider's keys. A
//! charge's new state and its event commit with the request's idempotency record, in one
//! transaction; a retry after a crash resumes the charge it finds. The schema is created (or
//! brought up to date) at start-up.
//!
//! In every mode a reconciler (`reconciler.rs`) runs beside the server: it settles the charges an
//! unknown outcome (a timeout, a crash) left `authorizing`, `capturing`, `refunding` or
//! `canceling`, from what the provider did under the call's key, and reads the provider's payments
//! report for payments that no charge names (a payment that committed after its charge was given
//! up): it writes their charges from them, so that no money the provider moved is missing from the
//! ledger and the balance.
//!
//! # Run it
//! ```text
//! cargo run -p example-payments                                   # everything in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p example-payments  # in Redis 7 or newer
//! REDIS_CLUSTER_URLS=redis://10.0.0.1:6379,redis://10.0.0.2:6379 cargo run -p example-payments
//! DATABASE_URL=postgres://app@127.0.0.1/payments cargo run -p example-payments
//! ```
//! Environment: `ADDR` (default `127.0.0.1:3000`), `REDIS_URL` (unset: in memory),
//! `REDIS_CLUSTER_URLS` (instead of `REDIS_URL`: a Redis Cluster, comma-separated seed node URLs;
//! everything `REDIS_URL` would put in Redis goes to the cluster),
//! `LEDGER_REDIS_URL` (default: `REDIS_URL`, or the cluster), `DATABASE_URL` (set: everything in PostgreSQL, the
//! two Redis variables unused), `RECONCILE_AFTER_MS` (how long a charge stays in an `-ing` state
//! before the reconciler settles it, default 120000, in every mode), `PSP_LATENCY_MS` (the provider's delay per call,
//! default 0; from 3000 every call outlasts the provider client's attempt timeout),
//! `IDEMPOTENCY_WAIT_MS` (how long a duplicate of a charge still running waits for its replay
//! before it gets `409`; unset or 0: `409` at once), `IDEMPOTENCY_QUOTA_BYTES` (each account's
//! quota of idempotency record bytes per instance and day, default 67108864: past it the account
//! gets `429` with `Retry-After`, the others are untouched), `SHUTDOWN_TIMEOUT_MS` (how long a shutdown may take, default 20000: keep it below
//! the time your orchestrator waits before it kills the process, 30 s on Kubernetes), `RUST_LOG`
//! (default `info`).
//!
//! # Walk through it
//! With the server running in one terminal, send these from another. Any non-empty bearer token is
//! an account. Create a charge, with a form body as Stripe's SDKs send it (or JSON, with
//! `-H 'Content-Type: application/json' -d '{"amount": 2500, ...}'`):
//! ```text
//! curl -si http://127.0.0.1:3000/v1/charges \
//!   -H 'Authorization: Bearer sk_test_alice' \
//!   -H 'Idempotency-Key: order-1001' \
//!   -d amount=2500 -d currency=eur -d source=tok_visa -d 'metadata[order_id]=1001'
//!
//! HTTP/1.1 201 Created
//! {"id":"ch_204c358b65c143f8","object":"charge","amount":2500,"currency":"eur", ... "metadata":{"order_id":"1001"},"status":"captured", ...}
//! ```
//! `amount` is in minor units (cents), from 1 to 99,999,999; any other is `400` with
//! `{"error": {"code": "parameter_invalid", "param": "amount", ...}}`. `description` is optional,
//! at most 1,000 characters (`400` otherwise, `"param": "description"`); `metadata` at most 50
//! keys of up to 40 characters, with values of up to 500. A parameter the API does not know is
//! `400` `parameter_unknown`. A request refused by validation, before any effect, is answered
//! `Cache-Control: no-store`: the layer stores nothing for it (as Stripe saves nothing), so the
//! same key with a corrected request runs; and an error quotes at most 200 bytes of a parameter's
//! name or value, cut with `...[truncated]`.
//!
//! Every response the layer stores fits its limit: the API reads at most 64 KiB of request body
//! (`413` beyond, [`REQUEST_LIMIT`]) and the layer stores responses up to 1 MiB
//! ([`RESPONSE_LIMIT`]). A client that lost a 201 or 402 gets it back, byte for byte, by retrying
//! with its key.
//!
//! Send the same command again, as a client that timed out would: the same response comes back,
//! byte for byte, marked `idempotent-replayed: true`, and nothing is charged again.
//!
//! Change the amount but keep the key: the layer refuses with `400 Bad Request`, an
//! `application/problem+json` document with `"error": {"type": "idempotency_error", ...}`,
//! because a key names one request.
//!
//! A declined card, with a new key, twice: `402 Payment Required` with
//! `{"error":{"type":"card_error","code":"card_declined",...}}`, the second time replayed. The
//! failed charge is in the list:
//! ```text
//! curl -si http://127.0.0.1:3000/v1/charges \
//!   -H 'Authorization: Bearer sk_test_alice' \
//!   -H 'Idempotency-Key: order-1002' \
//!   -d amount=2500 -d currency=eur -d source=tok_chargeDeclined
//! curl -s http://127.0.0.1:3000/v1/charges -H 'Authorization: Bearer sk_test_alice'
//! ```
//! Then: `capture=false` authorizes only; `POST /v1/charges/{id}/capture`, `/refunds`
//! (`amount=...`, default the rest) and `/cancel` move it on, each with its own
//! `Idempotency-Key`. `tok_pspUnavailable` answers 503 (after three attempts at the provider), and
//! retrying it runs again.
//!
//! With Stripe's Python SDK (`pip install stripe`), pointed here:
//! ```text
//! import stripe
//! stripe.api_base = "http://127.0.0.1:3000"
//! stripe.api_key = "sk_test_alice"
//! stripe.max_network_retries = 2
//! charge = stripe.Charge.create(amount=2000, currency="usd", source="tok_visa",
//!                               idempotency_key="order-2001")
//! ```
//!
//! The balance, once the consumer has applied the events (the first charge above, captured; the
//! declined one is not an event):
//! ```text
//! curl -s http://127.0.0.1:3000/v1/balance -H 'Authorization: Bearer sk_test_alice'
//!
//! {"object":"balance","available":[{"amount":2500,"currency":"eur"}]}
//! ```

pub mod auth;
pub mod balance;
mod charges;
pub mod consumer;
mod error;
pub mod events;
mod http_server;
pub mod ledger;
mod params;
pub mod pg;
pub mod prometheus;
pub mod provider;
pub mod queue;
pub mod reconciler;
mod state_machine;
mod work;

use std::error::Error;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, ProblemKind, ScopeQuota};
use tower_idempotency_redis::{RedisStore, SharedConnection};

pub use balance::Balances;
pub use consumer::LedgerConsumer;
pub use events::Publisher;
pub use ledger::Ledger;
pub use provider::{Provider, ProviderClient};
pub use queue::{ConsumerConfig, Queue};

/// How long a shutdown may take by default: requests in flight and detached work.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// The default of `IDEMPOTENCY_QUOTA_BYTES`: what each account's idempotency records may take of
/// the store, per instance and day (32 MiB at once, then about 400 bytes a second: tens of
/// thousands of charges in a burst). One account writing records as fast as it can is answered
/// `429` past it, and the others keep their room (PROTOCOL.md §3.4).
const QUOTA_BYTES: u64 = 64 << 20;

/// The stream the events go to, when they go to Redis. Hash-tagged: on a cluster, the stream and
/// its consumer group live in one slot.
pub const STREAM: &str = "payments:{events}";
/// The prefix of the balance keys in Redis.
pub const BALANCES_PREFIX: &str = "payments:balance:";
/// The prefix of the provider's keys and payments in Redis (see [`provider::KeyTable`]); its
/// `{provider}` hash tag keeps them in one slot of a cluster.
pub const PROVIDER_PREFIX: &str = "payments:{provider}:";
/// The prefix of the ledger consumer's Deduplicator records, in the Redis of the stream: a
/// namespace apart from the HTTP layer's records (see [`consumer::deduplicator`]).
pub const CONSUMER_PREFIX: &str = "payments:consumer:";

/// The largest request body the API reads: 64 KiB, above the charges clients send (one with a
/// `charges::DESCRIPTION_CHARS`-character description and Stripe's largest metadata, 50 keys
/// of 40 characters with values of 500, in ASCII, is under 40 KB as a form); a larger one gets
/// `413` from the idempotency layer and nothing runs.
pub const REQUEST_LIMIT: usize = 64 * 1024;

/// The largest response the idempotency layer stores, and so can replay: 1 MiB. Every response
/// of the API fits, so a client that lost one can always get it back: a charge echoes at most its
/// request's description and metadata (at most 6 bytes for each of its [`REQUEST_LIMIT`] bytes
/// once escaped in JSON), and an error quotes at most 200 bytes of the request.
pub const RESPONSE_LIMIT: usize = 1024 * 1024;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub ledger: Arc<Ledger>,
    /// The simulated provider: the outside service (tests count its calls and take it down).
    pub provider: Provider,
    /// The handlers' client of `provider`: its HTTP API, through the client retry layer.
    pub provider_client: ProviderClient,
    /// Where the handlers publish their events.
    pub events: Publisher,
    /// What the ledger consumer made of the events.
    pub balances: Balances,
    /// What `GET /metrics` renders, if the process records metrics (`prometheus.rs`).
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl AppState {
    /// An empty ledger, a simulated provider that takes `provider_latency` per call, and events
    /// and balances in memory.
    pub fn new(provider_latency: Duration) -> Self {
        let provider = Provider::new(provider_latency);
        Self {
            ledger: Arc::default(),
            provider: provider.clone(),
            provider_client: ProviderClient::new(provider),
            events: Publisher::new(Queue::memory()),
            balances: Balances::memory(),
            metrics: None,
        }
    }

    /// Serves what `handle` renders at `GET /metrics`.
    pub fn with_metrics(mut self, handle: metrics_exporter_prometheus::PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }

    /// Calls `provider` instead of the one in memory.
    pub fn with_provider(mut self, provider: Provider) -> Self {
        self.provider_client = ProviderClient::new(provider.clone());
        self.provider = provider;
        self
    }

    /// Keeps the charges in `ledger`.
    pub fn with_ledger(mut self, ledger: Ledger) -> Self {
        self.ledger = Arc::new(ledger);
        self
    }

    /// Publishes the events to `queue`, and shows the `balances` that its consumer keeps.
    pub fn with_events(mut self, queue: Queue, balances: Balances) -> Self {
        self.events = Publisher::new(queue);
        self.balances = balances;
        self
    }
}

/// The API. `idempotency` is scoped to the authenticated account here, and given the API's body
/// limits ([`REQUEST_LIMIT`], [`RESPONSE_LIMIT`]); keep its
/// [`shutdown_handle`](IdempotencyLayer::shutdown_handle) to drain its work at shutdown.
pub fn app(state: AppState, idempotency: IdempotencyLayer<BoxStore>) -> Router {
    let idempotency = idempotency
        .request_body_limit(REQUEST_LIMIT)
        .response_body_limit(RESPONSE_LIMIT)
        .scope(auth::account_scope)
        // Stripe answers a key reused for another request with 400, which its SDKs raise as their
        // `IdempotencyError`; and its SDKs read errors from `{"error": {...}}`.
        .problem_status(ProblemKind::Mismatch, StatusCode::BAD_REQUEST)
        .render_problems(error::render_problem);
    Router::new()
        .route("/v1/charges", post(charges::create).get(charges::list))
        .route("/v1/charges/{id}", get(charges::get))
        .route("/v1/charges/{id}/capture", post(charges::capture))
        .route("/v1/charges/{id}/refunds", post(charges::refund))
        .route("/v1/charges/{id}/cancel", post(charges::cancel))
        .route("/v1/balance", get(balance::show))
        // Layers wrap what comes before them: authentication runs first and puts the `Account`
        // in the request, then the idempotency layer keys its records by that account.
        .layer(idempotency)
        .layer(middleware::from_fn(auth::authenticate))
        // After the layers: the scraper needs no API key, and reads nothing idempotent.
        .route("/metrics", get(prometheus::show))
        .fallback(error::unrecognized_url)
        .with_state(state)
}

/// Runs the server, configured from the environment, until SIGTERM or Ctrl-C.
pub async fn run() -> Result<(), Box<dyn Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let latency = env_millis("PSP_LATENCY_MS")?.unwrap_or_default();
    let shutdown_timeout = env_millis("SHUTDOWN_TIMEOUT_MS")?.unwrap_or(SHUTDOWN_TIMEOUT);
    let state = AppState::new(latency).with_metrics(prometheus::install()?);
    if let Some(url) = env_url("DATABASE_URL") {
        return serve_postgres(&addr, state, &url, shutdown_timeout).await;
    }
    let records = match (env_url("REDIS_URL"), env_urls("REDIS_CLUSTER_URLS")) {
        (Some(_), Some(_)) => {
            return Err("set REDIS_URL or REDIS_CLUSTER_URLS, not both".into());
        }
        (Some(url), None) => Some(connect_redis(RedisAt::Server("REDIS_URL", url)).await?),
        (None, Some(urls)) => Some(connect_redis(RedisAt::Cluster(urls)).await?),
        (None, None) => None,
    };
    // The consumer's Deduplicator keeps its records beside the queue: in memory with the
    // in-memory queue, in the stream's Redis otherwise (under a prefix of their own).
    // The ledger's Redis is the records' (one connection for both) unless `LEDGER_REDIS_URL`
    // names another one; its errors name the variable the URL came from.
    let ledger = match env_url("LEDGER_REDIS_URL") {
        Some(url) => Some(connect_redis(RedisAt::Server("LEDGER_REDIS_URL", url)).await?),
        None => records.clone(),
    };
    let (state, consumer_store) = match ledger {
        None => (state, BoxStore::new(MemoryStore::new())),
        Some((redis, var)) => {
            let (conn, queue, balances) = connect_ledger(&redis, var).await?;
            tracing::info!("events and balances: Redis stream {STREAM:?}");
            // The provider stands for one outside service that every instance calls: its keys
            // are shared, beside the ledger's durable data (apart from the idempotency records
            // when LEDGER_REDIS_URL names another Redis, so flushing those keeps them).
            let keys = provider::KeyTable::redis(conn.clone(), PROVIDER_PREFIX, provider::WINDOW);
            // One ledger for every instance on that Redis: the charges themselves are there.
            (
                state
                    .with_events(queue, balances)
                    .with_provider(Provider::with_keys(latency, keys))
                    .with_ledger(Ledger::redis(conn)),
                BoxStore::new(redis.with_prefix(CONSUMER_PREFIX)),
            )
        }
    };
    // The idempotency records' store, chosen here at run time: the server is the same whichever.
    let (store, store_name) = match records {
        None => (BoxStore::new(MemoryStore::new()), "memory"),
        Some((store, _)) if store.is_cluster() => (BoxStore::new(store), "redis cluster"),
        Some((store, _)) => (BoxStore::new(store), "redis"),
    };
    let reconcile_after = env_millis("RECONCILE_AFTER_MS")?.unwrap_or(pg::RECONCILE_AFTER);
    serve(
        &addr,
        state,
        store,
        ConsumerStore::Dedup(consumer_store, reconcile_after),
        store_name,
        shutdown_timeout,
    )
    .await
}

/// The environment variable `name`, a number of bytes, or `default` when it is unset.
fn env_bytes(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(bytes) => bytes
            .parse()
            .map_err(|_| format!("{name} must be a number of bytes, not {bytes:?}")),
        Err(_) => Ok(default),
    }
}

/// The environment variable `name`, a number of milliseconds, unless it is unset.
fn env_millis(name: &str) -> Result<Option<Duration>, String> {
    match std::env::var(name) {
        Ok(ms) => match ms.parse() {
            Ok(ms) => Ok(Some(Duration::from_millis(ms))),
            Err(_) => Err(format!(
                "{name} must be a number of milliseconds, not {ms:?}"
            )),
        },
        Err(_) => Ok(None),
    }
}

/// The development key that seals records when `IDEMPOTENCY_SEAL_KEYS` is unset: fixed, not
/// random, so that a second instance and a restarted one still open the records. Public: never
/// for production.
const DEV_SEAL_KEY: (&str, [u8; 32]) = ("dev-insecure", *b"tower-idempotency development!!!");

/// The keys that seal the idempotency records: `IDEMPOTENCY_SEAL_KEYS`, `id:base64key` entries
/// separated by commas, the first sealing and every one opening (to rotate, put a new key first
/// and drop the old one a dedup window later). Unset, the development key, with a warning.
fn seal_keys() -> Result<SealKeys, Box<dyn Error>> {
    match env_url("IDEMPOTENCY_SEAL_KEYS") {
        Some(list) => {
            let keys =
                SealKeys::parse(&list).map_err(|err| format!("IDEMPOTENCY_SEAL_KEYS: {err}"))?;
            let ids: Vec<_> = keys.ids().collect();
            tracing::info!(?ids, "idempotency records sealed under {:?}", ids[0]);
            Ok(keys)
        }
        None => {
            let (id, key) = DEV_SEAL_KEY;
            tracing::warn!(
                "IDEMPOTENCY_SEAL_KEYS is unset: idempotency records are sealed under the public \
                 development key {id:?}; set IDEMPOTENCY_SEAL_KEYS=id:base64key (32 bytes, e.g. \
                 `openssl rand -base64 32`) in production"
            );
            Ok(SealKeys::new([SealKey::new(id, key)?])?)
        }
    }
}

/// The environment variable `name`, unless it is unset or empty.
fn env_url(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|url| !url.is_empty())
}

/// The comma-separated URLs of the environment variable `name`, unless it names none.
fn env_urls(name: &str) -> Option<Vec<String>> {
    let urls: Vec<String> = env_url(name)?
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(str::to_owned)
        .collect();
    (!urls.is_empty()).then_some(urls)
}

/// Where a Redis is: one server (and the variable its URL came from, for error messages), or a
/// cluster (`REDIS_CLUSTER_URLS`).
enum RedisAt {
    Server(&'static str, String),
    Cluster(Vec<String>),
}

impl RedisAt {
    /// The environment variable it came from.
    fn var(&self) -> &'static str {
        match self {
            RedisAt::Server(var, _) => var,
            RedisAt::Cluster(_) => "REDIS_CLUSTER_URLS",
        }
    }

    fn store(&self) -> Result<RedisStore, tower_idempotency_redis::RedisStoreError> {
        match self {
            RedisAt::Server(_, url) => RedisStore::from_url(url),
            RedisAt::Cluster(urls) => RedisStore::cluster(urls),
        }
    }
}

/// Everything in the PostgreSQL at `url` (`DATABASE_URL`), schema created at start-up.
async fn serve_postgres(
    addr: &str,
    state: AppState,
    url: &str,
    shutdown_timeout: Duration,
) -> Result<(), Box<dyn Error>> {
    if ["REDIS_URL", "REDIS_CLUSTER_URLS", "LEDGER_REDIS_URL"]
        .into_iter()
        .any(|var| env_url(var).is_some())
    {
        tracing::warn!("DATABASE_URL is set: the Redis variables are not used");
    }
    let reconcile_after = env_millis("RECONCILE_AFTER_MS")?.unwrap_or(pg::RECONCILE_AFTER);
    let db = pg::Database::connect(url).await?;
    tracing::info!("charges, events, balances and records: PostgreSQL");
    let state = db.state(state);
    let store = BoxStore::new(db.store().clone());
    let workers = ConsumerStore::Postgres(db, reconcile_after);
    serve(addr, state, store, workers, "postgres", shutdown_timeout).await
}

/// Where the ledger consumer's Deduplicator keeps its records (with PostgreSQL, the database whose
/// outbox the consumer reads), and when the reconciler settles a charge.
enum ConsumerStore {
    /// The Deduplicator's store, beside the queue: memory or Redis.
    Dedup(BoxStore, Duration),
    Postgres(pg::Database, Duration),
}

impl ConsumerStore {
    /// Starts the ledger consumer and the reconciler until `stop`: the consumer finishes the event
    /// at hand, then stops.
    async fn spawn(
        self,
        state: &AppState,
        stop: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, String> {
        let config = ConsumerConfig::default();
        let queue = async || {
            state
                .events
                .queue()
                .consumer(&consumer_name(), config)
                .await
                .map_err(|err| format!("cannot read the event stream: {}", report(&err)))
        };
        let balances = state.balances.clone();
        Ok(match self {
            ConsumerStore::Dedup(store, reconcile_after) => {
                let dedup = consumer::deduplicator(store, config.min_idle);
                let consumer = LedgerConsumer::new(queue().await?, balances, dedup);
                let reconciler = reconciler::Reconciler::new(state, reconcile_after);
                tokio::spawn(async move {
                    tokio::join!(consumer.run(stop.clone()), reconciler.run(stop));
                })
            }
            ConsumerStore::Postgres(db, reconcile_after) => {
                db.spawn_workers(state, reconcile_after, stop)
            }
        })
    }
}

/// Serves until SIGTERM or Ctrl-C, then lets the requests in flight and the layer's detached work
/// finish, within `shutdown_timeout`. The ledger consumer runs beside the server and stops at the
/// same signal, after the event at hand; `consumer_store` keeps its Deduplicator's records.
async fn serve(
    addr: &str,
    state: AppState,
    store: BoxStore,
    consumer_store: ConsumerStore,
    store_name: &str,
    shutdown_timeout: Duration,
) -> Result<(), Box<dyn Error>> {
    // Every stored response is sealed: readers of the store see no charge, writers cannot forge
    // or move one.
    let store = BoxStore::new(SealedStore::new(store, seal_keys()?));
    let mut idempotency = IdempotencyLayer::new(store);
    // One account cannot fill the store for the others: each has its quota of record bytes.
    idempotency = idempotency.scope_quota(ScopeQuota::new(env_bytes(
        "IDEMPOTENCY_QUOTA_BYTES",
        QUOTA_BYTES,
    )?));
    // A duplicate of a charge still running waits for it and gets its replay, not a 409.
    if let Some(bound) = env_millis("IDEMPOTENCY_WAIT_MS")? {
        idempotency = idempotency.wait_for_in_flight(bound);
    }
    let drained = idempotency.shutdown_handle();
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let signal = shutdown_signal()?;
    let stop = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            signal.await;
            stop.cancel();
        }
    });

    let consumer = consumer_store.spawn(&state, stop.clone()).await?;
    tokio::spawn(
        state
            .provider
            .clone()
            .sweep_keys_every(provider::SWEEP_EVERY, stop.clone()),
    );
    // The outbox relay runs until the last request has published its events.
    let relay_stop = CancellationToken::new();
    let relay = tokio::spawn(state.events.clone().relay(relay_stop.clone()));

    println!(
        "listening on http://{} (store: {store_name})",
        listener.local_addr()?
    );
    let shutdown_deadline = async {
        stop.cancelled().await;
        tokio::time::Instant::now() + shutdown_timeout
    };
    let ((), shutdown_deadline) = tokio::join!(
        http_server::serve(
            listener,
            app(state, idempotency),
            stop.clone(),
            shutdown_timeout
        ),
        shutdown_deadline,
    );
    // Handlers whose client went away run on, detached; let them finish and store their result.
    if tokio::time::timeout_at(shutdown_deadline, drained.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            ?shutdown_timeout,
            "gave up waiting for detached requests; their claims' leases will run out"
        );
    }
    relay_stop.cancel();
    let _ = relay.await;
    if let Err(err) = consumer.await {
        tracing::error!(%err, "the ledger consumer failed");
    }
    tracing::info!("stopped");
    Ok(())
}

/// A consumer name unique to this process: a restarted process is a new consumer of the group,
/// and takes over what the old one left pending.
fn consumer_name() -> String {
    use std::hash::{BuildHasher, RandomState};
    let nonce = RandomState::new().hash_one(std::process::id()) as u32;
    format!("ledger-{}-{nonce:08x}", std::process::id())
}

/// The connection of `redis` (the ledger's Redis, from the environment variable `var`), and the
/// event stream and the balances in it.
async fn connect_ledger(
    redis: &RedisStore,
    var: &str,
) -> Result<(SharedConnection, Queue, Balances), String> {
    let conn = redis.shared_connection();
    let queue = queue::RedisQueue::connect(conn.clone(), STREAM, consumer::SCOPE)
        .await
        .map_err(|err| format!("cannot use Redis at {var}: {}", report(&err)))?;
    Ok((
        conn.clone(),
        Queue::Redis(queue),
        Balances::redis(conn, BALANCES_PREFIX),
    ))
}

/// A Redis store (7.0 or newer), checked now so that a wrong URL fails at start-up, not at the
/// first request, and the environment variable it came from, which its errors name.
async fn connect_redis(at: RedisAt) -> Result<(RedisStore, &'static str), String> {
    let var = at.var();
    let store = at
        .store()
        .map_err(|err| format!("bad {var}: {}", report(&err)))?;
    store
        .check()
        .await
        .map_err(|err| format!("cannot use Redis at {var}: {}", report(&err)))?;
    Ok((store, var))
}

/// Resolves at the first SIGTERM or Ctrl-C. The handlers are installed now, before the server
/// listens, so an early signal is not lost.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutting down: finishing the requests in flight");
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down: finishing the requests in flight");
    })
}

/// An error and its sources, on one line.
pub fn report(err: &dyn Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some errors repeat their source in their own message.
        if !line.contains(&cause_text) {
            line.push_str(": ");
            line.push_str(&cause_text);
        }
        source = cause.source();
    }
    line
}
