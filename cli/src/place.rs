//! Where the records are, checked cheaply, so that a wrong `--redis-prefix` or `--postgres-table`
//! is said as such instead of looking like an absent key (or a store's advice to the application).

use std::time::Duration;

use deadpool_redis::redis;
use sqlx::{ConnectOptions as _, Connection as _, PgPool};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

use crate::CliError;

/// How many keys one `SCAN` step looks at: enough to settle the question on a small database in
/// one round trip, little enough to cost the server nothing.
const SCAN_COUNT: u32 = 1000;

/// The store's records' place, as the options name it.
pub(crate) enum Place {
    /// One Redis server: its keys under the prefix are scanned for.
    Redis {
        pool: deadpool_redis::Pool,
        prefix: String,
        timeout: Duration,
    },
    /// A Redis Cluster: not checked (each master would be scanned on its own).
    Cluster,
    /// PostgreSQL: the table is looked up by name.
    Postgres {
        pool: PgPool,
        table: String,
        timeout: Duration,
    },
}

/// A check of the place could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlaceError {
    /// Redis failed the `SCAN` for the prefix's keys.
    #[error("Redis failed the scan for the prefix's keys")]
    Redis(#[source] deadpool_redis::PoolError),
    /// No connection to PostgreSQL could be made: refused, unresolved, no such database, denied.
    #[error("cannot connect to PostgreSQL")]
    Connect(#[source] sqlx::Error),
    /// PostgreSQL failed the table's lookup.
    #[error("PostgreSQL failed the lookup of the table")]
    Postgres(#[source] sqlx::Error),
    /// The check did not finish in time.
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
}

impl Place {
    pub(crate) fn redis(store: &RedisStore, prefix: &str, timeout: Duration) -> Self {
        match store.pool() {
            Some(pool) => Place::Redis {
                pool: pool.clone(),
                prefix: prefix.to_owned(),
                timeout,
            },
            None => Place::Cluster,
        }
    }

    pub(crate) fn postgres(store: &PgStore, timeout: Duration) -> Self {
        Place::Postgres {
            pool: store.pool().clone(),
            table: store.table().to_owned(),
            timeout,
        }
    }

    /// On PostgreSQL, fails with [`CliError::NoTable`] when the table does not exist
    /// (`to_regclass`, one round trip), on a connection of its own: the pool retries a refused
    /// connection until its timeout, which would say "too slow" of a server that is down, where
    /// one connection says why at once.
    pub(crate) async fn check_table(&self) -> Result<(), CliError> {
        let Place::Postgres {
            pool,
            table,
            timeout,
        } = self
        else {
            return Ok(());
        };
        let check = async {
            let mut connection = pool
                .connect_options()
                .connect()
                .await
                .map_err(PlaceError::Connect)?;
            let exists = sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
                .bind(table.as_str())
                .fetch_one(&mut connection)
                .await
                .map_err(PlaceError::Postgres)?;
            let _ = connection.close().await;
            Ok::<_, PlaceError>(exists)
        };
        let exists = tokio::time::timeout(*timeout, check)
            .await
            .map_err(|_| PlaceError::Timeout(*timeout))??;
        if exists {
            Ok(())
        } else {
            Err(CliError::NoTable(table.clone()))
        }
    }

    /// After an absent answer, on one Redis server, fails with [`CliError::EmptyPrefix`] when a
    /// `SCAN` (one step, one round trip) covers the whole database and finds no record under the
    /// prefix. A step that does not cover it and finds none settles nothing: the key is absent.
    pub(crate) async fn check_absent(&self) -> Result<(), CliError> {
        let Place::Redis {
            pool,
            prefix,
            timeout,
        } = self
        else {
            return Ok(());
        };
        let pattern = format!("{}{{*", glob_escape(prefix));
        let scan = async {
            let mut conn = pool.get().await?;
            let (cursor, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(0)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await
                .map_err(deadpool_redis::PoolError::Backend)?;
            Ok::<_, deadpool_redis::PoolError>(cursor == 0 && keys.is_empty())
        };
        let none = tokio::time::timeout(*timeout, scan)
            .await
            .map_err(|_| PlaceError::Timeout(*timeout))?
            .map_err(PlaceError::Redis)?;
        if none {
            Err(CliError::EmptyPrefix(prefix.clone()))
        } else {
            Ok(())
        }
    }
}

/// `text` as a `MATCH` pattern that matches only itself: Redis's glob characters escaped.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_escape;

    #[test]
    fn a_prefix_matches_only_itself() {
        assert_eq!(glob_escape("idempotency:"), "idempotency:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
