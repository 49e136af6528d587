//! The floor of the Postgres store (see `redis_floor.rs` for what a floor is): the same handler,
//! making by hand, on a plain sqlx pool of the store's size (10 connections, no ping before each
//! use), the two statements any layer on one table must make: a claim that inserts the key or
//! reads its live record, in one round trip, and a completion fenced by the claim's token.
//!
//! A replay reads and writes nothing else, as in the store's own claim: the read comes first, so
//! a replay takes no row lock. The rows go in the store's own table (`PgStore::migrate` made it),
//! so they pay for the same constraints and indexes; ids are a hash of the key, as the store's
//! are, but in bytes of their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sqlx::{self, PgPool, Row, postgres::PgPoolOptions};

use super::created;
use crate::app::{CHARGE, PATH};

/// $1 id, $2 fingerprint, $3 the token's unique half (8 bytes), $4 lease (ms): `true`, the token
/// with its fence (the database's clock in microseconds, as the store numbers a claim) and no
/// record when claimed, or `false` and the live record's `completed` bytes (`NULL` in flight). No
/// row when another claim committed the key after the statement's snapshot: a 409, as the key is
/// in flight.
const CLAIM: &str = "WITH live AS (
    SELECT completed FROM idempotency_records WHERE id = $1 AND expires_at > statement_timestamp()
), claimed AS (
    INSERT INTO idempotency_records AS r (id, fingerprint, token, expires_at)
    SELECT $1, $2, int8send((extract(epoch FROM statement_timestamp()) * 1000000)::int8) || $3,
        statement_timestamp() + $4::int8 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT FROM live)
    ON CONFLICT (id) DO UPDATE SET token = excluded.token, completed = NULL,
        expires_at = excluded.expires_at
    WHERE r.expires_at <= statement_timestamp()
    RETURNING token
)
SELECT true AS claimed, token, NULL::bytea AS completed FROM claimed
UNION ALL SELECT false, NULL, completed FROM live";
/// $1 id, $2 token, $3 completed bytes, $4 window (ms): one row when the claim still held.
const COMPLETE: &str = "UPDATE idempotency_records
SET completed = $3, expires_at = statement_timestamp() + $4::int8 * interval '1 millisecond'
WHERE id = $1 AND token = $2 AND completed IS NULL";
/// The store's pool size and claim lease.
const CONNECTIONS: u32 = 10;
const LEASE_MS: i64 = 30_000;
/// The held claim of the conflict workload outlives the run: the floor renews nothing.
const HELD_LEASE_MS: i64 = 24 * 60 * 60 * 1000;
/// A stand-in for the fingerprint a record carries, so rows weigh the same.
const FINGERPRINT: [u8; 32] = [0; 32];

/// A pool like the store's, on `url`.
pub async fn pool(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(CONNECTIONS)
        .test_before_acquire(false)
        .connect(url)
        .await
}

/// A 16-byte id for `key`, as the store's record ids are 16 bytes, from std's hasher: the floor's
/// keys are its own, and need no more than to spread.
fn id_of(key: &[u8]) -> [u8; 16] {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let hasher = BuildHasherDefault::<DefaultHasher>::default();
    let high = hasher.hash_one((0u8, key));
    let low = hasher.hash_one((1u8, key));
    (u128::from(high) << 64 | u128::from(low)).to_le_bytes()
}

/// The Postgres floor's app: `POST /v1/charges`, answering as the layered variants do.
pub fn postgres_app(
    pool: PgPool,
    window_ms: u64,
    executions: Arc<AtomicU64>,
    holds: Arc<AtomicU64>,
) -> Router {
    let tokens = Arc::new(AtomicU64::new(0));
    let window_ms = i64::try_from(window_ms).unwrap_or(i64::MAX);
    Router::new().route(
        PATH,
        post(move |headers: HeaderMap, body: Bytes| {
            let (pool, tokens) = (pool.clone(), tokens.clone());
            let (executions, holds) = (executions.clone(), holds.clone());
            async move {
                let Some(key) = headers.get("idempotency-key") else {
                    return StatusCode::BAD_REQUEST.into_response();
                };
                let id = id_of(key.as_bytes());
                let unique = tokens.fetch_add(1, Ordering::Relaxed).to_le_bytes();
                let hold = headers.contains_key("x-hold");
                let lease = if hold { HELD_LEASE_MS } else { LEASE_MS };
                let claim = sqlx::query(CLAIM)
                    .bind(&id[..])
                    .bind(&FINGERPRINT[..])
                    .bind(&unique[..])
                    .bind(lease)
                    .fetch_optional(&pool)
                    .await;
                let row = match claim {
                    Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    Ok(None) => return StatusCode::CONFLICT.into_response(),
                    Ok(Some(row)) => row,
                };
                let token: Vec<u8> = match (
                    row.try_get::<bool, _>("claimed"),
                    row.try_get("completed"),
                    row.try_get("token"),
                ) {
                    (Ok(false), Ok(Some(completed)), _) => return replay(completed),
                    (Ok(false), Ok(None), _) => return StatusCode::CONFLICT.into_response(),
                    (Ok(true), _, Ok(Some(token))) => token,
                    _ => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                };
                if hold {
                    holds.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                }
                std::hint::black_box(&body);
                executions.fetch_add(1, Ordering::Relaxed);
                let written = sqlx::query(COMPLETE)
                    .bind(&id[..])
                    .bind(&token[..])
                    .bind(CHARGE.as_bytes())
                    .bind(window_ms)
                    .execute(&pool)
                    .await;
                match written {
                    Ok(_) => created(Bytes::from_static(CHARGE.as_bytes()), false),
                    Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                }
            }
        }),
    )
}

fn replay(completed: Vec<u8>) -> Response {
    created(Bytes::from(completed), true)
}
