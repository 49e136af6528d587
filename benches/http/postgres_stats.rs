//! What the bench's PostgreSQL server did per run: the statements it ran, by kind
//! (`pg_stat_statements`, reset before each run), and its processes' CPU time.

use std::collections::BTreeMap;

use sqlx::{self, PgPool, Row, postgres::PgPoolOptions};

/// The server setting that loads `pg_stat_statements` (it counts in shared memory, at once).
pub(crate) const SERVER_ARGS: &[&str] = &["-c", "shared_preload_libraries=pg_stat_statements"];

/// Reads the statement counts of a server started with [`SERVER_ARGS`].
pub(crate) struct PostgresStats {
    pool: PgPool,
    /// The postmaster's pid: its backends are its children.
    pub postmaster: u32,
}

impl PostgresStats {
    pub(crate) async fn connect(url: &str, postmaster: u32) -> Result<Self, String> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| format!("postgres stats connection: {e}"))?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&pool)
            .await
            .map_err(|e| format!("CREATE EXTENSION pg_stat_statements: {e}"))?;
        Ok(Self { pool, postmaster })
    }

    pub(crate) async fn reset(&self) -> Result<(), String> {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| format!("pg_stat_statements_reset: {e}"))
    }

    /// Statements run since the last reset, by kind (the statement's first words, and the mean
    /// time the server took to run one), the bench's own left out.
    pub(crate) async fn calls(&self) -> Result<BTreeMap<String, u64>, String> {
        let rows = sqlx::query(
            "SELECT query, calls, total_exec_time * 1000 / calls AS mean_us FROM pg_stat_statements
             WHERE query NOT LIKE '%pg_stat_statements%' AND calls > 0",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(|e| format!("reading pg_stat_statements: {e}"))?;
        let mut calls = BTreeMap::new();
        for row in rows {
            let query: String = row.try_get("query").map_err(|e| e.to_string())?;
            let count: i64 = row.try_get("calls").map_err(|e| e.to_string())?;
            let mean_us: f64 = row.try_get("mean_us").map_err(|e| e.to_string())?;
            let kind = format!("{} ({mean_us:.0} µs run)", kind(&query));
            *calls.entry(kind).or_default() += u64::try_from(count).unwrap_or(0);
        }
        Ok(calls)
    }
}

/// A statement's kind: its first two words, lowercase (`with live`, `insert into`, `update
/// floor_records`, ...).
fn kind(query: &str) -> String {
    let words: Vec<_> = query.split_whitespace().take(2).collect();
    words.join(" ").to_lowercase()
}
