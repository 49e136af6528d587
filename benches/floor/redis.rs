//! The floor of a remote store: the same handler, making by hand, on one plain multiplexed
//! connection, the store calls any layer must make for it, with nothing else (no fingerprint, no
//! record encoding, no lease renewal). A layer's throughput over its floor's is what the layer
//! itself costs; the floor over bare is what the store's round trips cost.
//!
//! Redis: a claim is the crate's claim script (`stores/redis/src/claim.lua`: one round trip that
//! claims, numbering the claim with Redis's clock, or returns the record), and a completion is
//! its fenced completion script (`complete.lua`); each `EVALSHA`, falling back to `EVAL` once. A
//! replay answers from the record the claim returned; an in-flight record answers 409, as the
//! layer would.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use deadpool_redis::redis;

use super::created;
use crate::app::{CHARGE, PATH};

/// The crate's claim script: the fence number a layer's claim must get.
const CLAIM: &str = include_str!("../../stores/redis/src/claim.lua");
/// The crate's completion script: the fence a layer's completion must make.
const COMPLETE: &str = include_str!("../../stores/redis/src/complete.lua");
/// A claim's lease, as the layer's default.
const LEASE_MS: u64 = 30_000;
/// The lease of the conflict workload's held claim. A layer renews a running claim's lease; the
/// floor makes no renewals (they are not per-request work), so the held claim gets a lease longer
/// than any run instead, lest it expire mid-bench and its key turn into replays.
const HELD_LEASE_MS: u64 = 24 * 60 * 60 * 1000;
/// The in-flight and completed records' first bytes: version, kind (the crate's layout, so the
/// completion script's fence reads them as it reads the crate's records).
const IN_FLIGHT: [u8; 2] = [1, 1];
const COMPLETED: [u8; 2] = [1, 2];
/// A stand-in for the fingerprint the records carry (32 bytes), so the values weigh the same.
const FINGERPRINT: [u8; 32] = [0; 32];

/// The Redis floor's app: `POST /v1/charges`, answering as the layered variants do.
pub fn redis_app(
    connection: redis::aio::MultiplexedConnection,
    window_ms: u64,
    executions: Arc<AtomicU64>,
    holds: Arc<AtomicU64>,
) -> Router {
    let claim = Arc::new(redis::Script::new(CLAIM));
    let complete = Arc::new(redis::Script::new(COMPLETE));
    let tokens = Arc::new(AtomicU64::new(0));
    Router::new().route(
        PATH,
        post(move |headers: HeaderMap, body: Bytes| {
            let mut connection = connection.clone();
            let (claim, complete, tokens) = (claim.clone(), complete.clone(), tokens.clone());
            let (executions, holds) = (executions.clone(), holds.clone());
            async move {
                let Some(key) = headers.get("idempotency-key") else {
                    return StatusCode::BAD_REQUEST.into_response();
                };
                let key = [b"floor:".as_slice(), key.as_bytes()].concat();
                // The unique half (bytes 8..16) tells claims apart; Redis fills in the fence.
                let unique = tokens.fetch_add(1, Ordering::Relaxed).to_le_bytes();
                let token = [[0; 8], unique].concat();
                let in_flight = [&IN_FLIGHT[..], &token, &FINGERPRINT, &[0; 8]].concat();
                let hold = headers.contains_key("x-hold");
                let lease = if hold { HELD_LEASE_MS } else { LEASE_MS };
                let claim = claim
                    .key(&key)
                    .arg(&in_flight)
                    .arg(lease)
                    .invoke_async::<Vec<u8>>(&mut connection)
                    .await;
                // Ours when it carries our token's unique half (bytes 10..18); the script wrote
                // the fence into bytes 2..10.
                match claim {
                    Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    Ok(record) if record.get(10..18) != Some(&in_flight[10..18]) => {
                        answer_existing(record)
                    }
                    Ok(record) => {
                        let token = record[2..18].to_vec();
                        if hold {
                            holds.fetch_add(1, Ordering::SeqCst);
                            std::future::pending::<()>().await;
                        }
                        std::hint::black_box(&body);
                        executions.fetch_add(1, Ordering::Relaxed);
                        let completed = [&COMPLETED[..], &FINGERPRINT, CHARGE.as_bytes()].concat();
                        let written = complete
                            .key(&key)
                            .arg(&token[..])
                            .arg(completed)
                            .arg(window_ms)
                            .invoke_async::<i64>(&mut connection)
                            .await;
                        match written {
                            Ok(_) => created(Bytes::from_static(CHARGE.as_bytes()), false),
                            Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                        }
                    }
                }
            }
        }),
    )
}

/// A replay of a completed record, 409 for one in flight.
fn answer_existing(record: Vec<u8>) -> Response {
    let header = COMPLETED.len() + FINGERPRINT.len();
    if record.len() < header || record[..2] != COMPLETED {
        return StatusCode::CONFLICT.into_response();
    }
    created(Bytes::from(record).slice(header..), true)
}
