//! [`PgStore`]: the records of [`tower-idempotency`](tower_idempotency) in a PostgreSQL table
//! (PostgreSQL 12 or newer, through sqlx), shared by every instance behind a load balancer; and
//! [`PgTx`]: a handler's writes committed with its idempotency record, in one transaction.
//!
//! ```toml
//! [dependencies]
//! tower-idempotency = "0.1"
//! tower-idempotency-postgres = "0.1"
//! ```
//!
//! Rust 1.95 or newer. The store goes under the layer, and a handler that takes a [`PgTx`] writes
//! through the transaction that will hold its record:
//!
//! ```no_run
//! use axum::{Router, http::StatusCode, routing::post};
//! use tower_idempotency::IdempotencyLayer;
//! use tower_idempotency_postgres::{PgStore, PgTx};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), tower_idempotency_postgres::PgStoreError> {
//! let store = PgStore::connect("postgres://app@127.0.0.1/payments")?;
//! store.migrate().await?; // creates the table if it is missing
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(create_charge).route_layer(IdempotencyLayer::new(store)));
//! # Ok(())
//! # }
//!
//! // The charge's row commits with the request's record, or neither does.
//! async fn create_charge(mut tx: PgTx, body: String) -> StatusCode {
//!     let insert = sqlx::query("INSERT INTO charges (body) VALUES ($1)").bind(body);
//!     match insert.execute(&mut *tx).await {
//!         Ok(_) => StatusCode::CREATED,
//!         Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
//!     }
//! }
//! ```
//!
//! - **Cost**: a new key 2 statements (claim, complete), a replay 1 ([`PgStore`]).
//! - **Time** is the database's: instances whose clocks disagree still agree on every record.
//!   Expired rows count as gone at once, and are swept every 60 s
//!   ([`PgStore::with_sweep_interval`]).
//! - **[`PgTx`]**: a stored response commits the handler's writes and its record together; an
//!   error, a panic or a status that is not stored rolls both back, and a commit that fails
//!   never delivers the response it rolled back.
//! - **Queue consumers** get the same with [`PgStore::mark_processed`], in the transaction that
//!   applies the message.
//! - **Waiting duplicates** ([`IdempotencyLayer::wait_for_in_flight`]) on any instance are woken
//!   by the completion with [`PgStore::with_notifications`].
//!
//! What a store must do, and why, is the [protocol](tower_idempotency::protocol)'s §10.
//!
//! [`IdempotencyLayer::wait_for_in_flight`]: tower_idempotency::IdempotencyLayer::wait_for_in_flight

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor as _, PgPool, Postgres};
use tokio::time::Instant;

use health::Health;
use notify::Notifier;
pub use sql::DEFAULT_TABLE;
use sql::Statements;
use sweep::Sweeper;
use tower_idempotency::store::StoreError;
use tx::Open;
pub use tx::{PgTx, PgTxError};

// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

mod calls;
mod health;
mod inspect;
mod notify;
mod processed;
mod sql;
mod sweep;
mod tx;

/// The default bound on one store call, taking a connection included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the store deletes expired rows by default.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// The most connections [`PgStore::connect`] opens.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// The bound on [`PgStore::migrate`].
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts of one call when the connection it got turns out to be broken (the server restarted,
/// or ended it): the next attempt takes another.
const ATTEMPTS: u32 = 3;
/// Runs of the claim statement when a concurrent transaction keeps writing the key between its
/// snapshot and its insert (see `sql`).
const CLAIM_RUNS: u32 = 4;
/// Durations are stored to the millisecond, capped at a century.
const MAX_MILLIS: u128 = 100 * 365 * 24 * 60 * 60 * 1000;

/// A store in a PostgreSQL table (PostgreSQL 12 or newer), through a sqlx pool: many server
/// instances share one truth, and the table's primary key is what lets one claim of a key win.
///
/// Each record is one row of `idempotency_records` ([`PgStore::with_table`] names another).
/// Create it with [`PgStore::migrate`] at start-up, or with this SQL
/// ([`PgStore::schema_sql`] gives it for another table name):
///
/// ```sql
#[doc = include_str!("schema.sql")]
/// ```
///
/// - **One statement, one round trip per call.** A claim inserts the in-flight row or reads the
///   live one in one statement (taking over a row whose lease or window has passed); a replay, a
///   409 or a 422 writes nothing. Complete, renew and release are each one statement fenced by
///   the claim's token. A new key costs 2 statements (claim, complete), a replay 1, plus 1 per
///   lease renewal of a long handler. sqlx prepares each statement once per connection and
///   caches it, and sends a `Sync` (no statement) when a connection goes back to its pool.
/// - **The database's clock.** Leases and windows are measured with `statement_timestamp()`, so
///   instances whose clocks disagree still agree on every record.
/// - **Expiry without a TTL.** Reads and claims ignore a row whose time is up, so correctness
///   never waits for a delete. The store deletes expired rows in the background, every 60 s
///   ([`PgStore::with_sweep_interval`]), in batches of 500 with
///   `FOR UPDATE SKIP LOCKED`, so instances sweeping together share the work and nobody waits on
///   it; a run stops after 50 000 rows and, with rows left, runs again a moment later rather than
///   an interval later, so that a busy store keeps up. The task starts with the first call and stops when the last clone of the store is
///   dropped; [`PgStore::sweep`] runs one by hand.
/// - **Bounded calls.** Each call, taking a connection included, gives up after the store's
///   timeout (1 s, [`PgStore::with_timeout`]) with [`StoreError::Timeout`]; a failed connection
///   is [`StoreError::Unavailable`] with the sqlx error as its source. A call whose connection
///   turns out broken (the server restarted, or ended it) is tried again on another, up to three
///   times within the timeout: every call is safe to send twice. A completion whose first answer
///   was lost finds the record it wrote and answers `true` (the completed row keeps its token).
///   A claim whose answer was lost (a timeout, or its request dropped) is released behind it.
/// - **A server that goes away.** Once a connection has failed, calls check that the server
///   accepts a connection (one call at a time) before they use the pool: while it refuses, each
///   call fails at once with the connection error (sqlx's pool alone would wait out the timeout,
///   taking a refusal for a server still starting); once it accepts, calls use the pool again,
///   on new connections. Nothing needs restarting.
///
/// ```no_run
/// use tower_idempotency::IdempotencyLayer;
/// use tower_idempotency_postgres::PgStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency_postgres::PgStoreError> {
/// let store = PgStore::connect("postgres://app@127.0.0.1/payments")?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    statements: Statements,
    timeout: Duration,
    sweep_every: Option<Duration>,
    sweeper: Sweeper,
    health: Arc<Health>,
    /// The transactions of claimed requests whose work has not ended (see `tx`).
    open: Open,
    /// Whether completions and releases send `NOTIFY` (see `notify`).
    notifies: bool,
    notifier: Notifier,
    /// Whether the missing table was logged: once per store, since every call would repeat it.
    missing_table_logged: AtomicBool,
}

impl Inner {
    fn new(
        pool: PgPool,
        statements: Statements,
        timeout: Duration,
        sweep_every: Option<Duration>,
        health: Arc<Health>,
    ) -> Self {
        Self {
            pool,
            statements,
            timeout,
            sweep_every,
            sweeper: Sweeper::default(),
            health,
            open: Open::default(),
            notifies: false,
            notifier: Notifier::default(),
            missing_table_logged: AtomicBool::new(false),
        }
    }
}

/// Setting up or administering a [`PgStore`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgStoreError {
    /// The connection URL is invalid.
    #[error("invalid PostgreSQL URL")]
    Url(#[source] sqlx::Error),
    /// PostgreSQL could not be reached, or failed.
    #[error("PostgreSQL is unreachable or failed")]
    Database(#[source] sqlx::Error),
    /// The call did not finish in time.
    #[error("PostgreSQL did not answer within {0:?}")]
    Timeout(Duration),
    /// The store's table does not exist (SQLSTATE 42P01 on one of the store's own statements).
    /// Every call fails with it, as the source of [`StoreError::Unavailable`], until the table is
    /// created; the store logs it once, at ERROR.
    #[error(
        "the table {0} does not exist: run PgStore::migrate, or create it with the SQL of PgStore::schema_sql"
    )]
    MissingTable(String),
    /// Every run of the claim statement found the key rewritten by another transaction.
    #[error("the key was rewritten under every attempt to claim it")]
    Contended,
    /// [`PgStore::connect`] was called outside a Tokio runtime, where sqlx cannot start its pool.
    #[error("PgStore::connect must be called inside a Tokio runtime")]
    NoRuntime,
    /// [`PgStore::try_with_table`] was given a name that is not a plain table name.
    #[error("invalid table name: {0}")]
    InvalidTable(String),
}

impl PgStore {
    /// A store on `pool`, with the default table (`idempotency_records`), timeout (1 second) and
    /// sweep interval (60 seconds).
    ///
    /// Each call takes a connection from the pool and gives it back. sqlx's default
    /// `test_before_acquire(true)` pings every connection it hands out: a second round trip per
    /// call. [`PgStore::connect`] builds a pool without it, and instead stops reusing the
    /// connections opened before a connection failure.
    pub fn new(pool: PgPool) -> Self {
        let statements = Statements::new(DEFAULT_TABLE).expect("the default table name is valid");
        Self {
            inner: Arc::new(Inner::new(
                pool,
                statements,
                DEFAULT_TIMEOUT,
                Some(DEFAULT_SWEEP_INTERVAL),
                Arc::default(),
            )),
        }
    }

    /// A store on a new pool for `url` (`postgres://user:password@host:port/database`), of up to
    /// 10 connections. Nothing is connected until the first call; use [`PgStore::check`] or
    /// [`PgStore::migrate`] to fail fast at start-up.
    ///
    /// The pool does not ping a connection before each call (that would be a second round trip).
    /// After a connection failure, it opens new connections rather than reuse the ones opened
    /// before it, so a restarted server is used again at once.
    ///
    /// Call it inside a Tokio runtime: sqlx's pool starts its maintenance task at once.
    ///
    /// # Errors
    /// [`PgStoreError::Url`] when the URL is invalid; [`PgStoreError::NoRuntime`] outside a Tokio
    /// runtime.
    pub fn connect(url: &str) -> Result<Self, PgStoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(PgStoreError::NoRuntime);
        }
        let options: PgConnectOptions = url.parse().map_err(PgStoreError::Url)?;
        let health = Arc::new(Health::default());
        let hook = health.clone();
        let pool = PgPoolOptions::new()
            .max_connections(DEFAULT_MAX_CONNECTIONS)
            .test_before_acquire(false)
            .before_acquire(move |_, meta| {
                let usable = !hook.opened_before_failure(meta.age);
                Box::pin(async move { Ok(usable) })
            })
            .connect_lazy_with(options);
        let mut store = Self::new(pool);
        Arc::get_mut(&mut store.inner)
            .expect("a new store is not shared")
            .health = health;
        Ok(store)
    }

    /// Keeps the records in `table` (`name` or `schema.name`: lowercase letters, digits and
    /// underscores). Default: `idempotency_records`.
    ///
    /// # Panics
    /// When `table` is not such a name: it is written into the store's SQL, so it is checked.
    pub fn with_table(self, table: &str) -> Self {
        self.try_with_table(table)
            .unwrap_or_else(|err| panic!("{err}"))
    }

    /// [`PgStore::with_table`] for a name read at run time (a setting, a command line): a name
    /// that is not a table name is an error rather than a panic.
    ///
    /// # Errors
    /// [`PgStoreError::InvalidTable`], saying what a name may hold.
    ///
    /// ```
    /// use sqlx::PgPool;
    /// use tower_idempotency_postgres::PgStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = PgStore::new(PgPool::connect_lazy("postgres://localhost/app").unwrap());
    /// assert!(store.clone().try_with_table("billing.idempotency_records").is_ok());
    /// assert!(store.try_with_table("records; DROP TABLE users").is_err());
    /// # }
    /// ```
    pub fn try_with_table(self, table: &str) -> Result<Self, PgStoreError> {
        let statements = Statements::new(table).map_err(PgStoreError::InvalidTable)?;
        Ok(self.with_inner(|inner| inner.statements = statements))
    }

    /// Sets the bound on each call, taking a connection included. Default: 1 second.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        self.with_inner(|inner| inner.timeout = timeout)
    }

    /// Sets how often the store deletes expired rows, or `None` for never (call
    /// [`PgStore::sweep`] yourself, say from a scheduled job). Default: every 60 seconds. Expired
    /// rows count as gone whether or not they have been deleted.
    pub fn with_sweep_interval(self, every: Option<Duration>) -> Self {
        self.with_inner(|inner| inner.sweep_every = every)
    }

    /// Whether completions and releases send a `NOTIFY` with the record's id, on the channel
    /// named after the table (`idempotency_records_changes`), so that requests waiting on a
    /// record ([`IdempotencyLayer::wait_for_in_flight`](tower_idempotency::IdempotencyLayer::wait_for_in_flight))
    /// get their answer as soon as any instance finishes it, rather than at their next poll. The
    /// store then keeps one connection of its pool listening, from the first wait on. Default:
    /// `false`.
    ///
    /// Turn it on, on every instance, when waiting is on and the latency of a waiting duplicate
    /// matters (without it, a duplicate on another instance than the first request's learns of its
    /// completion within a quarter of a second). The cost: a `NOTIFY` in every completion and
    /// release, and PostgreSQL serialises the commits of transactions that notify, which limits
    /// completions per second on a busy database.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::IdempotencyLayer;
    /// use tower_idempotency_postgres::PgStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency_postgres::PgStoreError> {
    /// let store = PgStore::connect("postgres://app@127.0.0.1/payments")?.with_notifications(true);
    /// let layer = IdempotencyLayer::new(store).wait_for_in_flight(Duration::from_secs(5));
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_notifications(self, notify: bool) -> Self {
        self.with_inner(|inner| inner.notifies = notify)
    }

    fn with_inner(self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| {
            let statements = Statements::new(&shared.statements.table)
                .expect("the table name was checked before");
            let mut fresh = Inner::new(
                shared.pool.clone(),
                statements,
                shared.timeout,
                shared.sweep_every,
                shared.health.clone(),
            );
            fresh.notifies = shared.notifies;
            fresh
        });
        // A listener already running stops with the old store; the next wait starts one.
        inner.notifier = Notifier::default();
        // A sweep already running (with the old settings) stops; the next call starts one.
        inner.sweeper = Sweeper::default();
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The pool the store takes its connections from.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The table the store keeps its records in.
    pub fn table(&self) -> &str {
        &self.inner.statements.table
    }

    /// The SQL that creates the store's table and its index, for teams that manage their schema
    /// themselves: what [`PgStore::migrate`] runs.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use tower_idempotency_postgres::PgStore;
    /// use sqlx::PgPool;
    ///
    /// let store = PgStore::new(PgPool::connect_lazy("postgres://localhost/app").unwrap())
    ///     .with_table("billing.idempotency_records");
    /// assert!(store.schema_sql().contains("CREATE TABLE IF NOT EXISTS \"billing\".\"idempotency_records\""));
    /// # }
    /// ```
    pub fn schema_sql(&self) -> &str {
        &self.inner.statements.schema
    }

    /// Creates the table and its index if they do not exist (one round trip, under an advisory
    /// lock, so instances starting together do not trip over each other). Bounded by 30 seconds.
    ///
    /// # Errors
    /// A [`PgStoreError`] when PostgreSQL is unreachable or refuses (say, the user may not create
    /// tables).
    pub async fn migrate(&self) -> Result<(), PgStoreError> {
        // A connection of its own first, so that a server refusing connections is reported as
        // such, not as a timeout.
        self.inner.health.suspect();
        self.admin(
            MIGRATE_TIMEOUT,
            Admin::Script(&self.inner.statements.migrate),
        )
        .await
        .map(drop)
    }

    /// Connects and checks that the table exists: call it at start-up to fail fast with a clear
    /// message. Bounded by the store's timeout.
    ///
    /// # Errors
    /// [`PgStoreError::MissingTable`] when the table does not exist; another [`PgStoreError`]
    /// when PostgreSQL is unreachable or slow.
    pub async fn check(&self) -> Result<(), PgStoreError> {
        self.inner.health.suspect();
        self.admin(
            self.inner.timeout,
            Admin::Query(&self.inner.statements.check, None),
        )
        .await
        .map(drop)
    }

    /// Deletes every expired row now, in batches of 500 (each bounded by the store's timeout),
    /// and returns how many it deleted. The store does this by itself every sweep interval; call
    /// it when that is off ([`PgStore::with_sweep_interval`]).
    ///
    /// # Errors
    /// A [`PgStoreError`] when a batch fails; the batches before it stay deleted.
    pub async fn sweep(&self) -> Result<u64, PgStoreError> {
        sweep::all(self, u32::MAX).await
    }

    /// One statement on a pooled connection, bounded by `timeout`.
    ///
    /// A statement rather than a closure, and no `sqlx::raw_sql`, so that the futures of
    /// `migrate`, `check` and `sweep` are `Send` (the compiler cannot prove either `Send` for
    /// every lifetime of the connection).
    async fn admin(&self, timeout: Duration, statement: Admin<'_>) -> Result<u64, PgStoreError> {
        self.start_sweep();
        let run = async {
            self.inner.health.check(&self.inner.pool).await?;
            let mut conn = self.inner.pool.acquire().await?;
            let done = match statement {
                // A bare `&str` runs as a simple query: several statements, one round trip.
                Admin::Script(sql) => conn.execute(sql).await?,
                Admin::Query(sql, None) => sqlx::query(sql).execute(&mut *conn).await?,
                Admin::Query(sql, Some(n)) => sqlx::query(sql).bind(n).execute(&mut *conn).await?,
            };
            Ok::<_, sqlx::Error>(done.rows_affected())
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => {
                if is_connection_failure(&err) {
                    self.inner.health.failed();
                }
                // Returned, not logged: the caller (`check`, a sweep) reports it.
                if is_missing_table(&err) {
                    return Err(PgStoreError::MissingTable(self.table().to_owned()));
                }
                Err(PgStoreError::Database(err))
            }
            Err(_) => Err(PgStoreError::Timeout(timeout)),
        }
    }

    fn start_sweep(&self) {
        if let Some(every) = self.inner.sweep_every {
            self.inner.sweeper.start(&self.inner, every);
        }
    }

    /// Runs `attempt` on a pooled connection, within the store's timeout, again on another
    /// connection when the one it got was broken.
    async fn run<T, F, Fut>(&self, mut attempt: F) -> Result<T, StoreError>
    where
        F: FnMut(PoolConnection<Postgres>) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        self.start_sweep();
        let timeout = self.inner.timeout;
        let deadline = Instant::now() + timeout;
        let mut failures = 0;
        loop {
            let connected = AtomicBool::new(false);
            let call = async {
                self.inner.health.check(&self.inner.pool).await?;
                let conn = self.inner.pool.acquire().await?;
                connected.store(true, Ordering::Relaxed);
                attempt(conn).await
            };
            let err = match tokio::time::timeout_at(deadline, call).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => {
                    // Still waiting for a connection the pool was free to open: the server may
                    // be gone. (Not when every connection is busy: that is load, not absence.)
                    let pool = &self.inner.pool;
                    if !connected.load(Ordering::Relaxed)
                        && pool.size() < pool.options().get_max_connections()
                    {
                        self.inner.health.suspect();
                    }
                    return Err(StoreError::Timeout(timeout));
                }
                Ok(Err(err)) => err,
            };
            if !is_connection_failure(&err) {
                return Err(StoreError::Unavailable(Box::new(
                    self.statement_failed(err),
                )));
            }
            self.inner.health.failed();
            failures += 1;
            if failures == ATTEMPTS {
                return Err(unavailable(err));
            }
        }
    }
}

impl PgStore {
    /// What a failed statement of the store's own says: a missing table is named, and logged
    /// with its fix the first time.
    fn statement_failed(&self, err: sqlx::Error) -> PgStoreError {
        if is_missing_table(&err) {
            self.log_missing_table();
            return PgStoreError::MissingTable(self.table().to_owned());
        }
        PgStoreError::Database(err)
    }

    /// Logs, once per store, that its table does not exist and how to create it: every call fails
    /// until then, and a line per call would bury the fix.
    fn log_missing_table(&self) {
        if self
            .inner
            .missing_table_logged
            .swap(true, Ordering::Relaxed)
        {
            return;
        }
        tracing::error!(
            target: "tower_idempotency",
            table = self.table(),
            "the idempotency store's table does not exist, so every call fails (requests get 503): \
             create it with PgStore::migrate() at start-up, or with the SQL of PgStore::schema_sql()"
        );
    }
}

/// Whether `err` says that a table does not exist (SQLSTATE 42P01).
fn is_missing_table(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some("42P01")
}

/// Whether `err`, from the handler's own transaction, is a refusal that sending the same work
/// again cannot fix. At the commit (`at_commit`), where the deferred checks of the handler's
/// writes run: SQLSTATE class 22 (data exception), 23 (integrity constraint violation: a deferred
/// foreign key, unique or exclusion constraint) or 42 (an object that does not exist, a privilege
/// missing). At the completion statement, before the commit: 25P02, the transaction had already
/// failed (a statement of the handler's own failed, and the handler answered all the same), so it
/// can only roll back. Serialization failures and deadlocks (class 40), connection failures and
/// timeouts are not: a retry may succeed.
fn rejects_the_work(err: &sqlx::Error, at_commit: bool) -> bool {
    sqlstate(err).is_some_and(|code| refused_for_good(&code, at_commit))
}

/// [`rejects_the_work`], by SQLSTATE.
fn refused_for_good(code: &str, at_commit: bool) -> bool {
    if at_commit {
        ["22", "23", "42"]
            .iter()
            .any(|class| code.starts_with(class))
    } else {
        code == "25P02"
    }
}

/// Whether `err` says the connection, or the server, is gone (rather than that a statement
/// failed): SQLSTATE class 08 (connection exception) and 57P01-57P03 (the server shutting down,
/// or ending this connection: `pg_terminate_backend`).
fn is_connection_failure(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => {
            sqlstate(err).is_some_and(|code| code.starts_with("08") || code.starts_with("57P"))
        }
        _ => false,
    }
}

fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

fn unavailable(err: sqlx::Error) -> StoreError {
    StoreError::Unavailable(Box::new(PgStoreError::Database(err)))
}

/// Milliseconds for the SQL: at least 1, at most a century.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis().clamp(1, MAX_MILLIS)).unwrap_or(i64::MAX)
}

/// An administrative statement: [`PgStore::admin`] runs it and answers the rows it affected.
pub(crate) enum Admin<'a> {
    /// Several statements, sent as one simple query.
    Script(&'a str),
    /// One statement, with an optional integer parameter.
    Query(&'a str, Option<i64>),
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.statements.table)
            .field("timeout", &self.inner.timeout)
            .field("sweep_every", &self.inner.sweep_every)
            .field("notifies", &self.inner.notifies)
            .field("connections", &self.inner.pool.size())
            .field("idle", &self.inner.pool.num_idle())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_clamped_for_the_sql() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_MILLIS as i64);
    }

    #[test]
    fn only_what_a_retry_cannot_fix_rejects_the_work() {
        // At the commit: integrity, data and undefined-object errors of the handler's writes.
        for code in [
            "23503", "23505", "23514", "23P01", "22003", "22P02", "42P01", "42501",
        ] {
            assert!(refused_for_good(code, true), "{code} at the commit");
        }
        // Serialization failures, deadlocks, connection loss, shutdown, cancellation, a failed
        // transaction: a retry may succeed, or the transaction is the handler's to end.
        for code in [
            "40001", "40P01", "08006", "57P01", "57014", "25P02", "53300",
        ] {
            assert!(!refused_for_good(code, true), "{code} at the commit");
        }
        // At the completion statement, only a transaction that had already failed.
        assert!(refused_for_good("25P02", false));
        for code in ["23505", "42P01", "40001", "08006"] {
            assert!(!refused_for_good(code, false), "{code} at the completion");
        }
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!rejects_the_work(&io, true));
        assert!(!rejects_the_work(&sqlx::Error::PoolTimedOut, true));
        assert!(!rejects_the_work(&sqlx::Error::RowNotFound, false));
    }

    #[test]
    fn only_connection_errors_are_tried_again() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(is_connection_failure(&io));
        assert!(!is_connection_failure(&sqlx::Error::RowNotFound));
        assert!(!is_connection_failure(&sqlx::Error::PoolTimedOut));
    }
}
