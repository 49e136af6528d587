//! Where a handler's final writes go: the provider's answer, and the event it publishes.
//!
//! In memory, each write is made as it comes, and the event goes to the publisher. In PostgreSQL,
//! they go into the request's transaction ([`tower_idempotency_postgres::PgTx`]), the event into the outbox
//! table: the idempotency layer commits that transaction together with the request's record when
//! it stores the response, so the charge's new state, its event and its record commit together, or
//! none of them does and the retry runs again.
//!
//! A handler takes its `Work` only once the provider answered, so that no connection is held
//! during the call, and drops it before it returns (the layer commits after the handler).

use axum::http::Extensions;
use tower_idempotency_postgres::PgTx;

use super::AppState;
use super::error::ApiError;
use super::events::{PaymentEvent, Publisher};

/// A handler's final writes.
#[derive(Debug)]
pub enum Work {
    /// In memory: made as they come.
    Direct,
    /// In PostgreSQL: in the request's transaction.
    Tx(PgTx),
}

impl Work {
    /// The request's `Work`: its transaction when the charges are in PostgreSQL (taken from the
    /// request's `extensions`, where the layer put it).
    pub async fn begin(state: &AppState, extensions: &Extensions) -> Result<Self, ApiError> {
        if !state.ledger.is_postgres() {
            return Ok(Work::Direct);
        }
        match PgTx::from_extensions(extensions).await {
            Ok(tx) => Ok(Work::Tx(tx)),
            Err(err) => {
                tracing::warn!(error = %super::report(&err), "no transaction for the request");
                Err(ApiError::storage_unavailable())
            }
        }
    }

    /// Publishes `event`: to `events` now, or into the outbox in the request's transaction.
    pub async fn publish(
        &mut self,
        events: &Publisher,
        event: PaymentEvent,
    ) -> Result<(), ApiError> {
        match self {
            Work::Direct => {
                events.publish(event).await;
                Ok(())
            }
            Work::Tx(tx) => super::pg::outbox::insert(tx, &event)
                .await
                .map_err(super::pg::unavailable),
        }
    }

    /// The request's transaction.
    pub fn connection(&mut self) -> Result<&mut sqlx::PgConnection, ApiError> {
        match self {
            Work::Tx(tx) => Ok(tx),
            Work::Direct => {
                tracing::error!("a write meant for PostgreSQL has no transaction");
                Err(ApiError::storage_unavailable())
            }
        }
    }
}
