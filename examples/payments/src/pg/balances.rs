//! The balances in the `balances` table, changed in the transaction that records the event as
//! processed: the PostgreSQL backend of [`Balances`](super::super::Balances).

use sqlx::{self, PgConnection, PgPool, Row};
use tower_idempotency_postgres::PgStore;

use super::super::balance::{Applied, Available, BalanceError, RETENTION};
use super::super::consumer::SCOPE;
use super::super::events::PaymentEvent;

/// SQLSTATE `numeric_value_out_of_range`: a `bigint` would overflow.
const OUT_OF_RANGE: &str = "22003";

/// Applies `event` in the transaction of `conn`, unless it was applied before: its id is recorded
/// as processed in `store`'s table first, so a second delivery finds it there and changes
/// nothing. Both commit with the transaction, or neither does.
pub async fn apply(
    conn: &mut PgConnection,
    store: &PgStore,
    event: &PaymentEvent,
) -> Result<Applied, BalanceError> {
    if !store
        .mark_processed(conn, SCOPE, &event.id, RETENTION)
        .await?
    {
        return Ok(Applied::Already);
    }
    if let Some((currency, change)) = event.balance_change() {
        let changed = sqlx::query(
            "INSERT INTO balances (account, currency, amount) VALUES ($1, $2, $3)
             ON CONFLICT (account, currency) DO UPDATE SET amount = balances.amount + excluded.amount",
        )
        .bind(&event.account)
        .bind(currency)
        .bind(change)
        .execute(conn)
        .await;
        match changed {
            Ok(_) => {}
            Err(sqlx::Error::Database(err)) if err.code().as_deref() == Some(OUT_OF_RANGE) => {
                return Err(BalanceError::Overflow {
                    currency: currency.to_owned(),
                });
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(Applied::New)
}

/// The account's balances.
pub async fn get(pool: &PgPool, account: &str) -> Result<Vec<Available>, sqlx::Error> {
    let rows = sqlx::query("SELECT amount, currency FROM balances WHERE account = $1")
        .bind(account)
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Available {
                amount: row.try_get(0)?,
                currency: row.try_get(1)?,
            })
        })
        .collect()
}
