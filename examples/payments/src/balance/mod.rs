//! Every account's available balance per currency, a [`Balances`] per backend. Its `apply` is
//! idempotent: the balance change and the record that event `evt_...` was applied are one atomic
//! step. An event that would overflow the balance (checked arithmetic), or whose amount is not
//! positive, changes nothing and is refused for good. Applied ids are kept for [`RETENTION`].

mod memory;
mod postgres;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use axum::Json;
use axum::extract::{Extension, State};
use serde::Serialize;

pub use memory::MemoryBalances;
pub use postgres::PgBalances;

use super::AppState;
use super::auth::Account;
use super::error::ApiError;
use super::events::PaymentEvent;

/// How long an applied event id is remembered (the balances never expire).
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// The balances.
#[async_trait]
pub trait Balances: fmt::Debug + Send + Sync {
    /// Applies `event` to its account's balance unless it was applied before, atomically.
    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError>;

    /// The account's balance per currency, sorted by currency.
    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError>;
}

/// What [`Balances::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The event was applied now.
    New,
    /// The event had been applied before: nothing changed.
    Already,
}

/// Applying or reading failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BalanceError {
    /// PostgreSQL failed: nothing changed (the transaction rolled back).
    #[error("the balance ledger is unavailable")]
    Postgres(#[from] sqlx::Error),
    /// The balance would go past what an `i64` holds: nothing changed.
    #[error("the {currency} balance would overflow")]
    Overflow { currency: String },
    /// The event's amount is not positive: nothing changed.
    #[error("the event's amount is not positive: {0}")]
    InvalidAmount(i64),
}

impl BalanceError {
    /// Whether applying the same event again can never succeed.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            BalanceError::Overflow { .. } | BalanceError::InvalidAmount(_)
        )
    }
}

/// Refuses an event whose amount is not positive (so that a refund's negation is exact).
fn check_amount(event: &PaymentEvent) -> Result<(), BalanceError> {
    match event.amount {
        amount if amount <= 0 => Err(BalanceError::InvalidAmount(amount)),
        _ => Ok(()),
    }
}

/// One currency's balance, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Available {
    pub amount: i64,
    pub currency: String,
}

/// `GET /v1/balance`'s body: `{"object": "balance", "available": [{"amount", "currency"}]}`.
#[derive(Debug, Serialize)]
pub struct BalanceJson {
    object: &'static str,
    available: Vec<Available>,
}

/// `GET /v1/balance`: the account's available balance per currency; 503 when it is unreachable.
pub async fn show(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
) -> Result<Json<BalanceJson>, ApiError> {
    let available = state.balances.get(account.id()).await.map_err(|err| {
        tracing::warn!(error = %super::report(&err), "cannot read the balance");
        ApiError::ledger_unavailable()
    })?;
    let object = "balance";
    Ok(Json(BalanceJson { object, available }))
}
