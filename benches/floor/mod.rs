//! The store floors: the same store calls the layer makes, written by hand in a handler, with no
//! layer: what an application would pay for idempotency at the least, on Redis and PostgreSQL.

pub mod postgres;
pub mod redis;

use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;

/// A 201 with `body` as JSON, marked as a replay when `replayed`: how the floors answer.
pub fn created(body: Bytes, replayed: bool) -> axum::response::Response {
    let mut response = (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response();
    if replayed {
        response.headers_mut().insert(
            "idempotent-replayed",
            header::HeaderValue::from_static("true"),
        );
    }
    response
}
