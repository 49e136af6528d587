//! A [`tower`](https://docs.rs/tower) layer that makes any axum or hyper service safe to retry.
//!
//! A client whose request timed out cannot tell "never arrived" from "done, reply lost" from
//! "still running", so it retries. Without help, a retried payment is charged twice. With
//! [`IdempotencyLayer`], the client names each operation with an `Idempotency-Key` header, the same
//! key on every retry, and the server recognises the retry:
//!
//! | situation | answer | handler runs? |
//! |---|---|---|
//! | a new key | the key is claimed atomically, the handler runs, its response is stored | once |
//! | the same key and request, completed | the stored response, byte for byte, with `Idempotent-Replayed: true` | no |
//! | the same key and request, still running | 409 with `Retry-After` | no |
//! | the same key, a different request | 422 | no |
//! | no key, or an invalid one | 400 | no |
//! | a body over the limit | 413 | no |
//! | the store unreachable | 503 with `Retry-After` (or run unprotected, if fail-open) | no |
//!
//! Errors the layer makes are RFC 9457 `application/problem+json` by default, or in the API's own
//! format ([`problem`], [`IdempotencyLayer::render_problems`]).
//!
//! ```toml
//! [dependencies]
//! tower-idempotency = "0.1"
//! ```
//!
//! Rust 1.95 or newer. On the routes that need it, over a [`MemoryStore`] (one process; the Redis
//! and PostgreSQL stores are their own crates, [below](#stores)):
//!
//! ```
//! use axum::{Router, body::Body, routing::post};
//! use http::{Request, StatusCode};
//! use http_body_util::BodyExt;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let charges = Arc::new(AtomicUsize::new(0));
//! let counter = charges.clone();
//! let app = Router::new()
//!     .route("/v1/charges", post(move |body: String| async move {
//!         let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
//!         (StatusCode::CREATED, format!("charge {n} for {body}"))
//!     }))
//!     // On the routes above only (not `.layer`, which would cover every route: login, webhooks).
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new()));
//!
//! let charge = || Request::post("/v1/charges")
//!     .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
//!     .body(Body::from("100 EUR"))
//!     .unwrap();
//!
//! let first = app.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let first_body = first.into_body().collect().await.unwrap().to_bytes();
//!
//! // The client timed out and retries: same key, same request.
//! let retry = app.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), first_body);
//! assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
//! # }
//! ```
//!
//! # The protocol
//! The complete contract, in numbered sections that the tests cite, is the [`protocol`] module
//! (`docs/PROTOCOL.md` in the sources). In short:
//!
//! - **Which requests.** `POST` and `PATCH` by default ([`IdempotencyLayer::methods`]); everything
//!   else passes through untouched, with no buffering and no store call.
//! - **The key.** The `Idempotency-Key` header, either the IETF draft's quoted sf-string
//!   (`"8e03978e-..."`) or Stripe's bare form (`8e03978e-...`): both mean the same key. 1 to 255
//!   visible ASCII characters ([`IdempotencyKey`]).
//! - **Scope.** Keys are unique inside a scope, such as the authenticated account
//!   ([`IdempotencyLayer::scope`]). **Without a scope, all clients share one key space: only right
//!   for a single-tenant service.**
//! - **Fingerprint.** blake3 over the method, path and query, body, and an allow-list of headers
//!   ([`Fingerprint`](record::Fingerprint)). The same key with a different fingerprint is a client
//!   bug: 422.
//! - **Claim.** One atomic store call claims the key for a lease (30 s), renewed while the handler
//!   runs; a crashed instance frees its keys when the lease runs out.
//! - **Execution.** A claimed request runs to completion even when the client disconnects, so its
//!   retry finds the result; [`Shutdown`] waits for such work at shutdown. A handler that errors or
//!   panics gets a 500 problem and its claim is released.
//! - **Storing the result.** The response goes to the client as soon as its record is written, or
//!   at once when the write fails: the write is then retried in the background (backoff up to 1 s,
//!   the lease renewed meanwhile) for as long as the claim can still be ours. A record that
//!   vanished meanwhile (its lease ran out, or a Redis without persistence restarted empty) is
//!   written all the same, since the handler did run; only a key claimed by another request
//!   meanwhile ends the attempts, and that is logged.
//! - **A store away for longer than the lease.** The claim runs out while the store is away. When
//!   the store answers again, the pending write lands within about a second, and retries get the
//!   replay. A retry that reaches the store before that write finds the key free and runs the
//!   handler a second time; the late write is then refused and logged. So keep the lease longer
//!   than the store outages you mean to ride out, and give downstream effects a key derived from
//!   the request's ([`IdempotencyKey::derive`]), so that a second run repeats none of them.
//! - **What is stored.** 2xx, 3xx and the 4xx a handler decides (`402`, `410`), but not a
//!   request refused as it was sent (validation or authentication: `400`, `401`, `403`, `404`,
//!   `422`, ..., so that the corrected retry runs) nor 408, 409, 425 and 429
//!   ([`DefaultStorePolicy`]; [`Every4xxStorePolicy`] stores every 4xx), unless the
//!   response says `Cache-Control: no-store` or the policy, which sees the response's status,
//!   headers and extensions, says otherwise ([`IdempotencyLayer::store_policy`]); headers minus
//!   hop-by-hop headers, `Date` and `Set-Cookie`; the body, and the trailers if it ended with some.
//!   Others release the claim: a retry runs again. A response over the response limit (body and
//!   trailers) is delivered and leaves a tombstone: never a second run.
//! - **The dedup window.** Completed records live 24 h ([`IdempotencyLayer::dedup_window`]).
//! - **Opt-in.** A duplicate of a request in flight can wait for its replay instead of getting 409
//!   ([`IdempotencyLayer::wait_for_in_flight`]); responses can state when their key's record
//!   expires ([`IdempotencyLayer::retention_header`]); with their features (below), JSON bodies can
//!   count by their RFC 8785 canonical form rather than their bytes (`canonical-json`), and
//!   replays of records this process completed can skip the store (`replay-cache`).
//!
//! # Where to put the layer
//! Inside authentication (so the scope function can read the principal), and inside compression
//! and other response transformations (so the stored response is the handler's own, and a replay
//! is compressed like a first response). Outside everything that has effects.
//!
//! # Handlers
//! The validated key is in the request's extensions, and with the `axum` feature it is an
//! extractor: derive the key of a downstream call from it ([`IdempotencyKey::derive`]). Every
//! response carries its [`Outcome`] in its extensions, and the layer logs one `tracing` event per
//! protected request (target `tower_idempotency`; keys and scopes appear only hashed).
//!
//! # Stores
//! [`MemoryStore`] for one process and for tests; `RedisStore` (crate
//! [`tower-idempotency-redis`](https://docs.rs/tower-idempotency-redis), Redis 7.0 or newer) or
//! `PgStore` (crate [`tower-idempotency-postgres`](https://docs.rs/tower-idempotency-postgres))
//! for many instances behind a load balancer; [`BoxStore`] for a store chosen at run time, behind
//! one type. Store wrappers add what a store lacks: `store::ReplayCache`, `store::CircuitBreaker`
//! and `store::ScopeQuota` (each with its feature, below). Write your own store by implementing
//! [`store::Store`] (and [`store::OperatorStore`], for an operator's lookups), and run the crate's
//! contract suite on it (crate [`tower-idempotency-test`](https://docs.rs/tower-idempotency-test),
//! `store_contract!`); the [`record`] module has the types a store keeps, and the encoding in
//! [`Record::decode`](record::Record::decode) and
//! [`Completed::encode`](record::Completed::encode) for stores that keep bytes.
//!
//! # Metrics
//! With the `metrics` feature (on by default), the layer and the consumer record through the
//! [`metrics`](https://docs.rs/metrics) facade, into whatever recorder the application installs
//! (`metrics-exporter-prometheus`, StatsD, ...); with none installed, nothing is recorded.
//!
//! Two metrics: `idempotency_requests_total`, a counter by `outcome` (an [`Outcome`]'s name),
//! and `idempotency_store_call_duration_seconds`, a histogram by store `operation` and `result`
//! ([PROTOCOL §12.5](protocol#125-metrics) lists every label value).
//!
//! One count per covered request (a passthrough of an uncovered method is not counted), one
//! sample per store call, the layer's and the consumer's. Labels take only the values listed: no
//! key, scope or other part of a request is ever a label.
//!
//! # The client's half
//! The crate [`tower-idempotency-client`](https://docs.rs/tower-idempotency-client) wraps an HTTP client (hyper-util's, or any tower service):
//! it names each operation with one key, sends the same bytes on every attempt, and retries
//! connection failures, timeouts, `409`, `429`, `503` and other transient `5xx`, after the
//! server's `Retry-After` or a backoff with full jitter, within a deadline.
//!
//! # gRPC
//! With the `grpc` feature, `IdempotencyLayer::grpc` protects the unary methods of a tonic service
//! it names: the key from the `idempotency-key` metadata entry, answers stored and replayed with
//! their initial metadata, message and trailers, the layer's own answers gRPC statuses with
//! `google.rpc.RetryInfo` where they say "later" (`grpc` module, PROTOCOL §16).
//! `tower-idempotency-client`'s `GrpcRetryLayer` (its `grpc` feature) is the client's half over
//! tonic's `Channel`.
//!
//! # Queue consumers
//! With the `consumer` feature, `consumer::Deduplicator` gives at-least-once queue consumers the
//! same guarantee on the same stores: a message's work runs once per message id, a redelivery is
//! skipped, and a failed attempt is retried by the redelivery.
//!
//! # Features
//! - `axum` (default): the [`IdempotencyKey`] and [`HeldClaim`] extractors.
//! - `metrics` (default): counters and store latencies through the `metrics` facade (above).
// A feature's items are linked where it is on, named where it is off, so that the docs build
// without warnings with any set of features.
#![cfg_attr(
    feature = "seal",
    doc = "- `seal`: [`seal::SealedStore`], records encrypted and authenticated at rest."
)]
#![cfg_attr(
    not(feature = "seal"),
    doc = "- `seal`: `seal::SealedStore`, records encrypted and authenticated at rest."
)]
#![cfg_attr(
    feature = "grpc",
    doc = "- `grpc`: gRPC mode for tonic services ([`IdempotencyLayer::grpc`], the [`grpc`] module)."
)]
#![cfg_attr(
    not(feature = "grpc"),
    doc = "- `grpc`: gRPC mode for tonic services (`IdempotencyLayer::grpc`, the `grpc` module)."
)]
//!   Brings tonic (without its transport) and prost.
// Each option below is built only when asked for: its code, and the crate it brings.
#![cfg_attr(
    feature = "canonical-json",
    doc = "- `canonical-json`: [`IdempotencyLayer::canonical_json`] and [`Fingerprint::of_json`](record::Fingerprint::of_json) (RFC 8785). Brings `serde_json_canonicalizer`."
)]
#![cfg_attr(
    not(feature = "canonical-json"),
    doc = "- `canonical-json`: `IdempotencyLayer::canonical_json` and `Fingerprint::of_json` (RFC 8785). Brings `serde_json_canonicalizer`."
)]
#![cfg_attr(
    feature = "replay-cache",
    doc = "- `replay-cache`: [`store::ReplayCache`], this process's completed records replayed from memory. Brings `quick_cache`."
)]
#![cfg_attr(
    not(feature = "replay-cache"),
    doc = "- `replay-cache`: `store::ReplayCache`, this process's completed records replayed from memory. Brings `quick_cache`."
)]
#![cfg_attr(
    feature = "circuit-breaker",
    doc = "- `circuit-breaker`: [`store::CircuitBreaker`], a store wrapper that answers at once, without the store, while the store keeps failing (PROTOCOL §9.11)."
)]
#![cfg_attr(
    not(feature = "circuit-breaker"),
    doc = "- `circuit-breaker`: `store::CircuitBreaker`, a store wrapper that answers at once, without the store, while the store keeps failing (PROTOCOL §9.11)."
)]
#![cfg_attr(
    feature = "scope-quota",
    doc = "- `scope-quota`: [`store::ScopeQuota`], a store wrapper that bounds the bytes of records each scope (tenant) writes (PROTOCOL §3.4)."
)]
#![cfg_attr(
    not(feature = "scope-quota"),
    doc = "- `scope-quota`: `store::ScopeQuota`, a store wrapper that bounds the bytes of records each scope (tenant) writes (PROTOCOL §3.4)."
)]
#![cfg_attr(
    feature = "trace-origin",
    doc = "- `trace-origin`: [`IdempotencyLayer::trace_origin`], each record keeping the trace context of the run that completed it (PROTOCOL §5.6). Records with an origin decode and replay without it."
)]
#![cfg_attr(
    not(feature = "trace-origin"),
    doc = "- `trace-origin`: `IdempotencyLayer::trace_origin`, each record keeping the trace context of the run that completed it (PROTOCOL §5.6). Records with an origin decode and replay without it."
)]
#![cfg_attr(
    feature = "consumer",
    doc = "- `consumer`: the [`consumer`] module, the idempotent queue consumer (above)."
)]
#![cfg_attr(
    not(feature = "consumer"),
    doc = "- `consumer`: the `consumer` module, the idempotent queue consumer (above)."
)]
//!
//! - `opentelemetry` (brings `trace-origin`): with `IdempotencyLayer::trace_origin`, a request without a `traceparent`
//!   keeps its span's OpenTelemetry context as its record's origin, and a replay's span gets a
//!   span link to the span of the run it replays (PROTOCOL §5.6, §12.1). Brings the
//!   `opentelemetry` API crate **0.33** and `tracing-opentelemetry` **0.34**: the application's
//!   OpenTelemetry layer must be of these releases (another one is not seen, and the layer warns
//!   once), re-exported as

#![cfg_attr(
    feature = "opentelemetry",
    doc = "  [`otel::opentelemetry`] and [`otel::tracing_opentelemetry`]; [`otel`] has an exporter setup."
)]
#![cfg_attr(
    not(feature = "opentelemetry"),
    doc = "  `otel::opentelemetry` and `otel::tracing_opentelemetry`; `otel` has an exporter setup."
)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod config;
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub mod consumer;
mod detach;
pub mod error_chain;
#[cfg(feature = "axum")]
mod extract;
mod fingerprint;
mod future;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
mod held_claim;
mod hex;
mod key;
mod layer;
mod layer_metrics;
mod lease;
mod log_throttle;
pub mod operator;
#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub mod otel;
mod outcome;
pub mod problem;
pub mod protocol;
mod protocol_mode;
pub mod record;
mod retention;
mod scope;
#[cfg(feature = "seal")]
#[cfg_attr(docsrs, doc(cfg(feature = "seal")))]
pub mod seal;
mod service;
pub mod store;
mod store_policy;

pub use body::{RequestBody, ResponseBody};
pub use detach::Shutdown;
#[cfg(feature = "axum")]
pub use extract::{MissingClaimExtension, MissingKeyExtension};
pub use future::ResponseFuture;
pub use held_claim::HeldClaim;
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use layer::{ConfigError, IdempotencyLayer};
pub use outcome::Outcome;
pub use retention::{IDEMPOTENCY_KEY_EXPIRES, RetentionFormat};
pub use scope::{Rejection, Scope, ScopeRequest};
pub use service::{IDEMPOTENT_REPLAYED, Idempotency};
pub use store::{BoxStore, MemoryStore};
pub use store_policy::{DefaultStorePolicy, Every4xxStorePolicy, StorePolicy};

// The README's examples, compiled as doc tests (and run, where they need no server).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
