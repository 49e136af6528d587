//! The example's PostgreSQL database (`DATABASE_URL`): the idempotency records ([`PgStore`]'s
//! table) and the example's own tables (`pg/schema.sql`: charges, balances, the outbox), created
//! at start-up when missing.

use std::time::Duration;

use tower_idempotency_postgres::PgStore;

use super::error::ApiError;

/// The example's own tables: `CREATE TABLE IF NOT EXISTS`, run at start-up.
const SCHEMA: &str = include_str!("pg/schema.sql");

/// SQLSTATE `undefined_column`.
const UNDEFINED_COLUMN: &str = "42703";

/// The bound on creating the schema.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serialises the schema's creation by instances that start together (`CREATE TABLE IF NOT
/// EXISTS` alone can fail when two run at once).
const MIGRATION_LOCK: i64 = 0x7061_796d_656e_7473; // "payments"

/// Connects to `DATABASE_URL` and creates what is missing of the schema; returns the idempotency
/// store, whose pool the example's tables share. Errors name `DATABASE_URL`, on one line.
pub async fn connect(url: &str) -> Result<PgStore, String> {
    let unusable = |why: String| format!("cannot use PostgreSQL at DATABASE_URL: {why}");
    let store = PgStore::connect(url)
        .map_err(|err| format!("bad DATABASE_URL: {}", super::report(&err)))?;
    (store.migrate().await).map_err(|err| unusable(super::report(&err)))?;
    let schema = format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK});\n{SCHEMA}");
    let create = async {
        let mut conn = store.pool().acquire().await?;
        sqlx::raw_sql(&schema).execute(&mut *conn).await?;
        // A table left by an earlier shape of the example is not made again: refused now, not at
        // the first charge.
        sqlx::query("SELECT charge, call_key, reconciling FROM charges LIMIT 0")
            .execute(&mut *conn)
            .await
    };
    match tokio::time::timeout(MIGRATE_TIMEOUT, create).await {
        Ok(Ok(_)) => Ok(store),
        Ok(Err(sqlx::Error::Database(err))) if err.code().as_deref() == Some(UNDEFINED_COLUMN) => {
            Err(unusable(format!(
                "its charges table was made by an earlier version of this example ({}): drop \
                 the example's tables (charges, balances, payment_events) or use another database",
                err.message()
            )))
        }
        Ok(Err(err)) => Err(unusable(super::report(&err))),
        Err(_) => Err(unusable(format!(
            "creating the schema took over {MIGRATE_TIMEOUT:?}"
        ))),
    }
}

/// A failed statement, as the API answers it: 503, nothing stored, so that the retry runs again.
pub fn unavailable(err: sqlx::Error) -> ApiError {
    tracing::warn!(error = %super::report(&err), "PostgreSQL failed");
    ApiError::storage_unavailable()
}
