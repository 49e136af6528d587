//! `PgStore` and `PgTx`: a charge's row and its idempotency record commit in one transaction, or
//! neither does, so a retry finds either the stored response or nothing done.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --example postgres
//! curl -si localhost:3000/v1/charges -H 'Idempotency-Key: k1' -H 'Content-Type: application/json' \
//!   -d '{"amount": 2500, "currency": "eur"}'    # 201, one row in example_charges
//! # the same again: the same 201, idempotent-replayed: true, still one row
//! # {"amount": -1, ...}: the CHECK constraint refuses the row at commit: 422 commit-rejected, no row
//! ```

use std::error::Error;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency_postgres::{PgStore, PgTx};

/// The example's own table: a charge per row, its amount checked by the database.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS example_charges (
    id bigserial PRIMARY KEY,
    amount bigint NOT NULL,
    currency text NOT NULL,
    CONSTRAINT positive_amount CHECK (amount > 0) DEFERRABLE INITIALLY DEFERRED
)";

#[derive(Debug, Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

/// The API: one route behind the layer, records in `store`'s table.
pub fn app(store: PgStore) -> Router {
    let idempotency = IdempotencyLayer::new(store).single_tenant();
    Router::new().route("/v1/charges", post(create_charge).route_layer(idempotency))
}

/// Writes through the request's transaction: the layer commits it together with the record when
/// it stores the `201`, and rolls it back when it does not (an error, a panic, a `5xx`).
async fn create_charge(
    mut tx: PgTx,
    Json(charge): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO example_charges (amount, currency) VALUES ($1, $2) RETURNING id",
    )
    .bind(charge.amount)
    .bind(&charge.currency)
    .fetch_one(&mut *tx)
    .await
    .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    let body = json!({ "id": id, "amount": charge.amount, "currency": charge.currency });
    Ok((StatusCode::CREATED, Json(body)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let store = PgStore::connect(&url)?;
    store.migrate().await?;
    sqlx::query(SCHEMA).execute(store.pool()).await?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(store)).await?;
    Ok(())
}
