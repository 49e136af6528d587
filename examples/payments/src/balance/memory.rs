//! The balances in memory: the balance and the applied event ids change under one lock.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Applied, Available, BalanceError, Balances, RETENTION, check_amount};
use crate::events::PaymentEvent;

/// Every account's balances, in memory.
#[derive(Debug, Default)]
pub struct MemoryBalances {
    books: Mutex<HashMap<String, Book>>,
}

/// One account's balances and applied events.
#[derive(Debug, Default)]
struct Book {
    available: BTreeMap<String, i64>,
    applied: HashSet<String>,
    /// The applied ids, oldest first, to forget them after [`RETENTION`].
    order: VecDeque<(Instant, String)>,
}

#[async_trait]
impl Balances for MemoryBalances {
    async fn apply(&self, event: &PaymentEvent) -> Result<Applied, BalanceError> {
        check_amount(event)?;
        let now = Instant::now();
        let mut books = self.books.lock().unwrap_or_else(PoisonError::into_inner);
        let book = books.entry(event.account.clone()).or_default();
        let expired = |(at, _): &mut (Instant, String)| now.duration_since(*at) >= RETENTION;
        while let Some((_, id)) = book.order.pop_front_if(expired) {
            book.applied.remove(&id);
        }
        if book.applied.contains(&event.id) {
            return Ok(Applied::Already);
        }
        if let Some((currency, change)) = event.balance_change() {
            let currency = currency.to_owned();
            let balance = book.available.entry(currency.clone()).or_default();
            *balance = (balance.checked_add(change)).ok_or(BalanceError::Overflow { currency })?;
        }
        book.applied.insert(event.id.clone());
        book.order.push_back((now, event.id.clone()));
        Ok(Applied::New)
    }

    async fn get(&self, account: &str) -> Result<Vec<Available>, BalanceError> {
        let books = self.books.lock().unwrap_or_else(PoisonError::into_inner);
        let available = books.get(account).map(|book| &book.available);
        Ok((available.into_iter().flatten())
            .map(|(currency, amount)| Available {
                amount: *amount,
                currency: currency.clone(),
            })
            .collect())
    }
}
