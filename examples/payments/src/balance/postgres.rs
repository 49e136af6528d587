//! The balances in PostgreSQL's `balances` table: the event id is recorded as processed
//! ([`PgStore::mark_processed`], a row its primary key refuses twice) and, only if it was new,
//! the balance changed, in one transaction. The outbox consumer runs both in the transaction
//! that takes the event off the outbox ([`PgBalances::apply_in`]).

use async_trait::async_trait;
use sqlx::PgConnection;
use tower_idempotency_postgres::PgStore;

use super::{Applied, Available, BalanceError, Balances, RETENTION, check_amount};
use crate::consumer::SCOPE;
use crate::events::PaymentEvent;

/// SQLSTATE `numeric_value_out_of_range`: a `bigint` would overflow.
const OUT_OF_RANGE: &str = "22003";

/// The balances of `store`'s database; the applied event ids are records of `store`.
#[derive(Debug, Clone)]
pub struct PgBalances {
    store: PgStore,
}

impl PgBalances {
    pub fn new(store: PgStore) -> Self {
        Self { store }
    }

    /// Applies `event` in the transaction of `conn`, unless it was applied before: the record
    /// that it was and the balance change commit with that transaction, or neither does.
    pub async fn apply_in(
        &self,
        conn: &mut PgConnection,
        event: &PaymentEvent,
    ) -> Result<Applied, BalanceError> {
        check_amount(event)?;
        let new = (self.store.mark_processed(conn, SCOPE, &event.id, RETENTION)).await?;
        if !new {
            return Ok(Applied::Already);
        }
        let Some((currency, change)) = event.balance_change() else {
            return Ok(Applied::New);
        };
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
            Ok(_) => Ok(Applied::New),
            Err(sqlx::Error::Database(err)) if err.code().as_deref() == Some(OUT_OF_RANGE) => {
                let currency = currency.to_owned();
                Err(BalanceError::Overflow { currency })
            }
            Err(err) => Err(err.into()),
        }
    }
}

#[async_trait]
impl Balances for PgBalances {
    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        let mut tx = self.store.pool().begin().await?;
        let applied = self.apply_in(&mut tx, event).await?;
        tx.commit().await?;
        Ok(applied)
    }

    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        let sql = "SELECT amount, currency FROM balances WHERE account = $1 ORDER BY currency";
        let rows: Vec<(i64, String)> = sqlx::query_as(sql)
            .bind(account)
            .fetch_all(self.store.pool())
            .await?;
        let available = |(amount, currency)| Available { amount, currency };
        Ok(rows.into_iter().map(available).collect())
    }
}
