//! The payments example on PostgreSQL (feature `postgres`, `DATABASE_URL` set): every piece of
//! its state in one database, so that a restarted server lists and replays its charges, and
//! instances on one database share one truth.
//!
//! | what | where |
//! |---|---|
//! | idempotency records | [`PgStore`]'s table, `idempotency_records` |
//! | charges | `charges` (`charges.rs`) |
//! | events | the outbox, `payment_events` (`outbox.rs`) |
//! | the ledger consumer's processed event ids | `idempotency_records`, through [`PgStore::mark_processed`] |
//! | balances | `balances` (`balances.rs`) |
//! | the provider's idempotency keys | `provider_keys` (it stands for an outside service's own records) |
//!
//! The schema is created at start-up when missing ([`Database::connect`]: [`PgStore::migrate`],
//! then [`SCHEMA`]).
//!
//! A new charge:
//!
//! 1. the layer claims the key (one statement);
//! 2. the handler commits the charge `authorizing`, in a short transaction of its own, before it
//!    calls the provider, so that a crash during the call leaves the charge where it can be
//!    found;
//! 3. the provider is called with a key derived from the client's;
//! 4. the handler writes the provider's answer (the charge's final state) and its event (into the
//!    outbox) through the request's [`PgTx`](tower_idempotency_postgres::PgTx), and the layer commits them
//!    with the idempotency record: all three, or none.
//!
//! A crash during the provider call leaves the charge `authorizing` and the key's claim in flight
//! until its lease runs out. Then the client's retry claims the key again, finds the charge by its
//! key and resumes it: the provider, called with the same key, answers with the same payment and
//! moves no money twice. Without a retry, the reconciler (`../reconciler.rs`) settles the charge
//! once it has been `authorizing` for [`RECONCILE_AFTER`], from what the provider says it did; and
//! likewise a charge left `capturing`, `refunding` or `canceling`, and a charge whose provider
//! call timed out (its outcome unknown).
//!
//! A run that was not dead but stalled past its lease (its claim taken over by the retry) is
//! stopped by three things, none of them the lease: the `UNIQUE (account, operation)` index lets
//! the two runs share one charge row; the request's transaction, which holds the final writes,
//! commits only with the claim's record, so the stalled run's rolls back (those writes need no
//! fence); and its provider call, outside every transaction here, carries its claim's fence,
//! which the provider refuses once the newer run called with a larger one.
//!
//! The ledger consumer (`outbox.rs`) takes each event off the outbox and applies it to its balance
//! in one transaction, where the event's id is recorded as processed: each event changes a
//! balance once.

pub mod balances;
pub mod charges;
pub mod outbox;

use std::sync::Arc;
use std::time::Duration;

use sqlx::{self, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency_postgres::PgStore;

use super::error::ApiError;
use super::provider::{KeyTable, Provider};
use super::reconciler::Reconciler;
use super::{AppState, Balances, Ledger};
pub use charges::PgCharges;
pub use outbox::OutboxConsumer;

/// The environment variable that names the database.
pub const DATABASE_URL: &str = "DATABASE_URL";

/// The example's own tables: `CREATE TABLE IF NOT EXISTS`, run at start-up.
pub const SCHEMA: &str = include_str!("schema.sql");

/// How long a charge stays `authorizing` before the reconciler settles it, by default: four
/// lease lengths of the idempotency layer (30 s each), far above any provider call.
pub const RECONCILE_AFTER: Duration = Duration::from_secs(120);

/// How often the ledger consumer looks at an empty outbox.
pub const OUTBOX_POLL: Duration = Duration::from_millis(200);

/// SQLSTATE `unique_violation`.
const UNIQUE_VIOLATION: &str = "23505";

/// The bound on creating the schema.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serialises the schema's creation by instances that start together (`CREATE TABLE IF NOT
/// EXISTS` alone can fail when two run at once).
const MIGRATION_LOCK: i64 = 0x7061_796d_656e_7473; // "payments"

/// The example's database: the idempotency store, whose pool the example's tables share.
#[derive(Debug, Clone)]
pub struct Database {
    store: PgStore,
}

impl Database {
    /// Connects to the database at `url` and creates what is missing of the schema. The errors
    /// name [`DATABASE_URL`], on one line.
    pub async fn connect(url: &str) -> Result<Self, String> {
        let report = |err: &dyn std::error::Error| super::report(err);
        let store =
            PgStore::connect(url).map_err(|err| format!("bad {DATABASE_URL}: {}", report(&err)))?;
        let unusable = |err: &dyn std::error::Error| {
            format!("cannot use PostgreSQL at {DATABASE_URL}: {}", report(err))
        };
        store.migrate().await.map_err(|err| unusable(&err))?;
        let schema = format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK});\n{SCHEMA}");
        let create = async {
            let mut conn = store.pool().acquire().await?;
            sqlx::raw_sql(&schema).execute(&mut *conn).await
        };
        match tokio::time::timeout(MIGRATE_TIMEOUT, create).await {
            Ok(Ok(_)) => {}
            Ok(Err(sqlx::Error::Database(err)))
                if err.code().as_deref() == Some(UNIQUE_VIOLATION) =>
            {
                return Err(format!(
                    "cannot use PostgreSQL at {DATABASE_URL}: the charges table has two charges \
                     for one operation, so one charge per operation cannot be enforced ({}); \
                     keep the one the balance counts, set the other's operation to NULL, and \
                     start again",
                    err.message()
                ));
            }
            Ok(Err(err)) => return Err(unusable(&err)),
            Err(_) => {
                return Err(format!(
                    "cannot use PostgreSQL at {DATABASE_URL}: creating the schema took over {MIGRATE_TIMEOUT:?}"
                ));
            }
        }
        Ok(Self { store })
    }

    /// The idempotency store.
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// The pool every table is reached through.
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    /// `state` with its charges, balances and provider keys in this database. (Its publisher
    /// stays unused: the handlers write their events into the outbox, through the request's
    /// transaction.)
    pub fn state(&self, state: AppState) -> AppState {
        let latency = state.provider.latency();
        let provider = Provider::with_keys(
            latency,
            KeyTable::postgres(self.pool().clone(), state.provider.window()),
        );
        let mut state = state.with_provider(provider);
        state.ledger = Arc::new(Ledger::postgres(PgCharges::new(
            self.pool().clone(),
            state.provider.window(),
        )));
        state.balances = Balances::postgres(self.store.clone());
        state
    }

    /// Starts the ledger consumer of the outbox and the reconciler, for charges `authorizing`
    /// longer than `reconcile_after`, until `stop`.
    pub fn spawn_workers(
        &self,
        state: &AppState,
        reconcile_after: Duration,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        let consumer =
            OutboxConsumer::new(self.pool().clone(), state.balances.clone(), OUTBOX_POLL);
        let reconciler = Reconciler::new(state, reconcile_after);
        tokio::spawn(async move {
            tokio::join!(consumer.run(stop.clone()), reconciler.run(stop));
        })
    }
}

/// A failed statement, as the API answers it: 503, nothing stored, so that the retry runs again.
pub fn unavailable(err: sqlx::Error) -> ApiError {
    tracing::warn!(error = %super::report(&err), "PostgreSQL failed");
    ApiError::storage_unavailable()
}
