//! The client's half of the [protocol](tower_idempotency::protocol): a layer for HTTP clients that
//! names each operation once and retries it safely.
//!
//! ```toml
//! [dependencies]
//! tower-idempotency-client = "0.1"
//! # for tonic clients too: tower-idempotency-client = { version = "0.1", features = ["grpc"] }
//! ```
//!
//! Rust 1.95 or newer.
//!
//! A client that gets no answer cannot tell "never arrived" from "done, answer lost" from "still
//! running". [`IdempotentRetryLayer`] answers the question the only safe way: it gives each
//! request one `Idempotency-Key` (a fresh UUID v4, unless the caller set one) and sends the same
//! key and the same body bytes on every attempt, so that a server speaking the protocol (such as
//! one behind [`IdempotencyLayer`](tower_idempotency::IdempotencyLayer)) runs the operation once and answers
//! the retries with the stored response (`Idempotent-Replayed: true`). Here one answer is lost on
//! the way back, and the retry gets the replay:
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use axum::{Router, routing::post};
//! use http::{Request, StatusCode};
//! use http_body_util::Full;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//! use tower_idempotency_client::{Attempts, IdempotentRetryLayer};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // The server: the operation behind the server half of the protocol.
//! let charges = Arc::new(AtomicUsize::new(0));
//! let counter = charges.clone();
//! let server = Router::new()
//!     .route("/v1/charges", post(move || async move {
//!         counter.fetch_add(1, Ordering::SeqCst);
//!         StatusCode::CREATED
//!     }))
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new()));
//!
//! // A link that loses the first answer after the server sent it.
//! let lost = Arc::new(AtomicUsize::new(0));
//! let link = service_fn(move |request: Request<Full<bytes::Bytes>>| {
//!     let server = server.clone();
//!     let first = lost.fetch_add(1, Ordering::SeqCst) == 0;
//!     async move {
//!         let response = server.oneshot(request).await?;
//!         if first {
//!             return Err("connection reset".into());
//!         }
//!         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(response)
//!     }
//! });
//!
//! let client = ServiceBuilder::new().layer(IdempotentRetryLayer::new()).service(link);
//! let pay = Request::post("/v1/charges").body(Full::<bytes::Bytes>::from("amount=100")).unwrap();
//! let response = client.oneshot(pay).await.unwrap();
//!
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let attempts = response.extensions().get::<Attempts>().unwrap();
//! assert_eq!((attempts.count(), attempts.replayed()), (2, true));
//! assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
//! # }
//! ```
//!
//! # What is retried
//! Only requests that may be sent twice: those with a key (the methods of
//! [`IdempotentRetryLayer::key_methods`], `POST` and `PATCH` by default, always get one) and
//! those idempotent by definition (`GET`, `HEAD`, `PUT`, `DELETE`, `OPTIONS`). Any other request
//! is sent once.
//!
//! | outcome of an attempt | retried? | why |
//! |---|---|---|
//! | the inner service failed: connection refused, reset, cut off before the response | yes | it may not have happened; if it did, the key makes the retry a replay |
//! | the attempt's timeout ran out | yes | done, not done or still running: the retry finds out |
//! | `409` | yes | the key's first request is still running; wait and get its answer |
//! | `409` named `not-replayable` (`Idempotency-Problem`) | no: [`Error::NotReplayable`] | the operation ran once and its response is not kept; every retry gets the same answer |
//! | `429`, `503` | yes, after `Retry-After` if given | the server asked to come back later |
//! | `502`, `504` | yes | a gateway lost the upstream's answer, or never got one |
//! | other `5xx`, except `501` and `505` | yes | a failure the server did not store: a retry runs again |
//! | `501`, `505` | no | the server's fixed limits: the same answer every time |
//! | `400`, `401`, `403`, `404`, `413`, `422`, any other `4xx` | no | the request's own fault; `422` means the key was used for another request, or the server refused the request's changes (`commit-rejected`: nothing was done) |
//! | `1xx`, `2xx`, `3xx` | no | an answer |
//!
//! # When
//! After a wait: the server's `Retry-After` when it gave one (seconds or an HTTP date), otherwise
//! exponential backoff with full jitter. Attempts stop at [`IdempotentRetryLayer::max_attempts`],
//! at the [`IdempotentRetryLayer::deadline`] (no wait is started that would end past it), or when
//! an optional [`IdempotentRetryLayer::budget`] is spent, and before the server would forget the
//! key (the moment its retention header states, on any answer of this layer's server with the
//! header on, its first `409` included, or [`IdempotentRetryLayer::retention`]: then
//! [`Error::RetentionPassed`]). The last answer is returned as it is:
//! a `503` after the last attempt is a `503` response, not an error. A failure of the last attempt
//! is an [`Error`] that counts the attempts.
//!
//! # What the caller learns
//! Every response carries [`Attempts`] in its extensions: how many attempts it took, the key
//! they carried, and whether the answer was a replay. Each retry is a `tracing` event (target
//! `tower_idempotency_client`, fields `attempt`, `reason`, `delay_ms`, `server_asked`); giving up on a
//! retryable answer is a warning that says why. Keys and bodies are never logged.
//!
//! # Built from tower
//! The attempts run in tower's [`Retry`](tower::retry::Retry) with a
//! [`Policy`](tower::retry::Policy) of this module, each under tower's
//! [`Timeout`](tower::timeout::Timeout), and the budget is tower's
//! [`Budget`](tower::retry::budget::Budget). The backoff is this module's own: tower's adds its
//! jitter on top of the exponential base instead of drawing the whole wait at random, and does not
//! say how long it waits, which the deadline and `Retry-After` need to know.
//!
//! # gRPC
// The feature's items are linked where it is on, named where it is off, so that the docs build
// without warnings with any set of features.
#![cfg_attr(
    feature = "grpc",
    doc = "With the `grpc` feature, [`IdempotentRetryLayer::grpc`] makes the same layer for a tonic"
)]
#![cfg_attr(
    not(feature = "grpc"),
    doc = "With the `grpc` feature, `IdempotentRetryLayer::grpc` makes the same layer for a tonic"
)]
//! transport (`Channel`): the named unary methods retried with one `idempotency-key`, judged by
#![cfg_attr(
    feature = "grpc",
    doc = "their `grpc-status` and the `RetryInfo` the server sends (the [`grpc`] module)."
)]
#![cfg_attr(
    not(feature = "grpc"),
    doc = "their `grpc-status` and the `RetryInfo` the server sends (the `grpc` module)."
)]
//!
//! # Bodies
//! The request body is read into memory before the first attempt (up to
//! [`IdempotentRetryLayer::body_limit`]; over it, [`Error::BodyTooLarge`] and nothing is sent),
//! and the inner service gets a `Request<Full<Bytes>>`. A retry covers the attempt up to the
//! response's head: a response body cut off while the caller reads it is the caller's to handle
//! (the same request again, with [`Attempts::key`], gets the replay; `examples/payments/src/bin/client.rs` does
//! so).

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backoff;
mod classify;
mod error;
mod future;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
mod info;
mod layer;
mod policy;
mod retention;
mod service;

pub use error::Error;
pub use future::ResponseFuture;
#[cfg(feature = "grpc")]
pub use grpc::{GrpcRetry, GrpcRetryLayer};
pub use info::Attempts;
pub use layer::IdempotentRetryLayer;
pub use service::IdempotentRetry;

use error::BoxError;

// The README's examples, compiled as doc tests; one of them is a gRPC client.
#[cfg(all(doctest, feature = "grpc"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
