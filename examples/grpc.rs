//! A tonic service made safe to retry: `payments.v1.Payments`, whose unary `CreateCharge` is
//! protected by the idempotency layer in gRPC mode, and whose server-streaming `ListCharges` passes
//! through untouched (the messages, server and client are the `grpc-payments` crate,
//! `examples/grpc-payments`, written by hand: no `protoc`).
//!
//! ```text
//! cargo run --example grpc --features grpc                          # records in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example grpc --features grpc
//! DATABASE_URL=postgres://app@127.0.0.1/payments cargo run --example grpc --features grpc
//! ```
//!
//! Environment: `ADDR` (default `127.0.0.1:50051`); `REDIS_URL` (records in that Redis, 7.0 or
//! newer) or `DATABASE_URL` (records in that PostgreSQL, its table created if missing); neither:
//! records in memory. The charges themselves are in memory. A call, with `grpcurl`:
//!
//! ```text
//! grpcurl -plaintext -proto examples/grpc-payments/payments.proto -H 'idempotency-key: order-42' \
//!   -d '{"amount": 1000, "currency": "EUR"}' 127.0.0.1:50051 payments.v1.Payments/CreateCharge
//! ```
//!
//! The same call again with the same key answers with the same charge (and
//! `idempotent-replayed: true`); with another message, `FAILED_PRECONDITION`; while the first
//! runs, `ABORTED` with a `google.rpc.RetryInfo`; without a key, `INVALID_ARGUMENT`.

use std::error::Error;
use std::net::SocketAddr;

use tonic::transport::Server;
use tower::Layer;
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

use grpc_payments::{CREATE_CHARGE, Ledger, PaymentsServer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:50051".into())
        .parse()?;
    let (store, kind) = records().await?;
    let layer = layer(store);
    let shutdown = layer.shutdown_handle();
    tracing::info!(%addr, records = kind, "serving payments.v1.Payments");
    Server::builder()
        .add_service(layer.layer(PaymentsServer::new(Ledger::default())))
        .serve_with_shutdown(addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Calls whose clients went away still run to their end, so that their retries find them.
    shutdown.wait().await;
    Ok(())
}

/// The idempotency layer of the service: `CreateCharge` protected, everything else passed through.
/// One tenant here; a real service scopes keys by the caller (`.scope(..)` from its credentials).
pub fn layer(store: BoxStore) -> IdempotencyLayer<BoxStore> {
    IdempotencyLayer::new(store)
        .single_tenant()
        .grpc([CREATE_CHARGE])
}

/// Where the records are: `DATABASE_URL`, `REDIS_URL`, or memory.
async fn records() -> Result<(BoxStore, &'static str), Box<dyn Error>> {
    if let Some(url) = env("DATABASE_URL") {
        let pool = sqlx::PgPool::connect(&url).await?;
        let store = PgStore::new(pool);
        store.migrate().await?;
        return Ok((BoxStore::new(store), "postgres"));
    }
    if let Some(url) = env("REDIS_URL") {
        let store = RedisStore::from_url(&url)?;
        store.check().await?;
        return Ok((BoxStore::new(store), "redis"));
    }
    Ok((BoxStore::new(MemoryStore::new()), "memory"))
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}
