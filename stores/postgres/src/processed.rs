//! The idempotent consumer inside the consumer's own transaction: a processed message's id is a
//! row of the store's table, inserted in the transaction that applies the message, so that
//! "already processed" is the primary key refusing a second row.

use std::time::Duration;

use sqlx::PgConnection;

use super::PgStore;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, RecordId};

impl PgStore {
    /// Records, in the caller's transaction, that the queue message `message_id` of `scope` (a
    /// consumer group's or a queue's name) is processed, for `window`: `true` the first time,
    /// `false` when it already was, and the message's work is to be skipped.
    ///
    /// Call it first in the transaction that applies the message, and commit both together: the
    /// work and its record then commit or roll back as one, so a redelivery after a crash at any
    /// point either finds the record (and skips) or finds nothing (and runs). A concurrent
    /// delivery of the same message waits on the first one's row until that transaction ends:
    /// committed, it gets `false`; rolled back, `true`. Ids share the table with HTTP keys, in a
    /// domain of their own ([`RecordId::for_message`]), and expire like them. Use either this or
    /// `tower_idempotency::consumer::Deduplicator` (its feature `consumer`) for one scope, not both.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency_postgres::PgStore;
    /// use sqlx::{self, PgPool};
    ///
    /// # async fn apply(store: &PgStore, pool: &PgPool, id: &str, amount: i64) -> Result<(), sqlx::Error> {
    /// let mut tx = pool.begin().await?;
    /// if store.mark_processed(&mut tx, "ledger", id, Duration::from_secs(7 * 86_400)).await? {
    ///     sqlx::query("UPDATE balances SET available = available + $1")
    ///         .bind(amount)
    ///         .execute(&mut *tx)
    ///         .await?;
    /// }
    /// tx.commit().await?; // then ack the message
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// The statement's error; the transaction is then aborted, and the message stays unacked.
    pub async fn mark_processed(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        message_id: &str,
        window: Duration,
    ) -> Result<bool, sqlx::Error> {
        let id = RecordId::for_message(scope.as_bytes(), message_id);
        // Every delivery of a message is the same request: one fingerprint for all.
        let processed = Completed::tombstone(Fingerprint::from_bytes([0; 32]));
        let bytes = processed
            .encode()
            .map_err(|err| sqlx::Error::Encode(Box::new(err)))?;
        // A token no other write carries: the completion statement then inserts, or takes over
        // an expired row, and leaves a live one alone.
        let token = ClaimToken::new(Fence::next_in_process());
        self.complete_on(conn, &id, &token, &processed.fingerprint, &bytes, window)
            .await
    }
}
