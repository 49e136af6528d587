//! `idempotency-keys`: the operator's tool for
//! [tower-idempotency](https://docs.rs/tower-idempotency). It answers "what happened to key X of
//! customer Y?" and forgets one key, on the Redis, Redis Cluster or PostgreSQL store an
//! application uses, without decoding store bytes or record-id digests by hand.
//!
//! ```text
//! cargo install tower-idempotency-cli
//! idempotency-keys --redis redis://127.0.0.1:6379 lookup --scope acct_1 --key order-42
//! idempotency-keys forget --scope acct_1 --key order-42 --postgres postgres://app@db/app \
//!     --reason "charge refunded by hand; the customer must be able to pay again"
//! ```
//!
//! `lookup` prints the key's state: absent, in flight (claimed when, lease until when, under
//! which fence), completed (status, body length, fence and claim time where the store keeps
//! them, expiry, the trace origin of the run that completed it; the response's headers and body
//! with `--body`) or a tombstone. A sealed response is opened only with its keys
//! (`--seal-keys-env IDEMPOTENCY_SEAL_KEYS`); without them the tool names the key it is sealed
//! under. `forget` frees the key for the next request: a completed record always, one in flight
//! only with `--force`. Both print a table, or with `--json` one JSON object; `forget --json`
//! also writes its audit line to stderr as one JSON object. The store options go before or
//! after the command.
//!
//! Exit codes ([`Exit`]): 0 found (lookup) or forgotten (forget); 1 absent; 2 a usage error (the
//! command line or its inputs); 3 refused (forget of a key in flight without `--force`); 4 the
//! store did not answer; 5 nothing where the tool looked (no key at all under the Redis prefix,
//! or no such table): the options are likely wrong.
//!
//! The scope is the bytes the application's scope function makes of a request (for the payments
//! example, the account id): `--scope <text>`, `--scope-hex <hex>`, or `--no-scope` for an
//! application without a scope function. The README says how to find a tenant's.
//!
//! What each state means, and what forgetting does to fences, is `docs/PROTOCOL.md` §10.9 (in
//! the crate's repository); the library calls behind the tool are
//! [`tower_idempotency::operator`]. This crate's library is the tool itself, for its tests:
//!
//! ```
//! use clap::Parser;
//! use tower_idempotency_cli::Cli;
//!
//! // The store's options before or after the command.
//! let cli = Cli::try_parse_from([
//!     "idempotency-keys", "lookup", "--scope", "acct_1", "--key", "order-42",
//!     "--redis", "redis://127.0.0.1:6379", "--redis-prefix", "app:",
//! ])?;
//! assert!(cli.check().is_ok());
//! # Ok::<(), clap::Error>(())
//! ```

#![forbid(unsafe_code)]

mod output;
mod place;

use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};
use tower_idempotency::record::RecordId;
use tower_idempotency::seal::{SealKeys, SealedStore};
use tower_idempotency::store::ForgetOutcome;
use tower_idempotency::{BoxStore, operator};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

use place::Place;
pub use place::PlaceError;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "idempotency-keys",
    version,
    about = "Look up or forget one idempotency key in a tower-idempotency store",
    after_help = "The store options go before or after the command.\n\n\
                  Exit codes: 0 found (lookup) or forgotten (forget); 1 absent; 2 usage error \
                  (the command line or its inputs); 3 refused (in flight, not forced); 4 the \
                  store did not answer; 5 nothing where the tool looked (no key at all under the \
                  Redis prefix, or no such table): check --redis-prefix or --postgres-table."
)]
pub struct Cli {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    options: StoreOptions,
    #[command(subcommand)]
    command: Command,
}

/// The tool's exit codes, one per answer a script tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Exit {
    /// 0: the key has a live record (lookup), or it is forgotten (forget).
    Found = 0,
    /// 1: the key has no live record where the tool looked.
    Absent = 1,
    /// 2: the command line or its inputs are wrong (clap's usage errors, an invalid key, a
    /// `--scope-hex` that is not hex, a blank reason, an invalid URL or table name, seal keys
    /// missing from the environment).
    Usage = 2,
    /// 3: `forget` refused: the key is in flight and `--force` was not given.
    Refused = 3,
    /// 4: the store did not answer: unreachable, too slow, refusing, or holding a record the
    /// tool cannot read or open.
    Store = 4,
    /// 5: nothing where the tool looked: no key at all under the Redis prefix, or no such
    /// PostgreSQL table. The options likely name the wrong place.
    NothingHere = 5,
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> Self {
        ExitCode::from(exit as u8)
    }
}

impl Cli {
    /// Checks what clap cannot, because the store options are global (accepted before or after
    /// the command) and a group of global arguments is checked before the command's are read:
    /// exactly one store is named.
    ///
    /// # Errors
    /// A usage error (exit 2, as clap's) when none or several are named.
    pub fn check(&self) -> Result<(), clap::Error> {
        let named = [
            self.store.redis.is_some(),
            self.store.redis_cluster.is_some(),
            self.store.postgres.is_some(),
        ]
        .into_iter()
        .filter(|named| *named)
        .count();
        let (kind, message) = match named {
            1 => return Ok(()),
            0 => (
                ErrorKind::MissingRequiredArgument,
                "one store is required: --redis <URL>, --redis-cluster <URL,URL,..> or --postgres <URL>",
            ),
            _ => (
                ErrorKind::ArgumentConflict,
                "only one store at a time: --redis, --redis-cluster or --postgres",
            ),
        };
        Err(Cli::command().error(kind, message))
    }

    /// Whether the command asks for JSON: then `forget`'s audit line is one JSON object on
    /// stderr, in place of the library's text line.
    pub fn json(&self) -> bool {
        match self.command {
            Command::Lookup { json, .. } | Command::Forget { json, .. } => json,
        }
    }
}

/// Where the records live: exactly one store ([`Cli::check`]), before or after the command.
#[derive(Debug, Args)]
struct StoreArgs {
    /// A single Redis server: redis://[user:password@]host:port[/db]
    #[arg(long, value_name = "URL", global = true, alias = "redis-url")]
    redis: Option<String>,
    /// A Redis Cluster: its nodes' URLs, separated by commas.
    #[arg(long, value_name = "URL,URL,..", value_delimiter = ',', global = true)]
    redis_cluster: Option<Vec<String>>,
    /// PostgreSQL: postgres://user[:password]@host[:port]/database
    #[arg(
        long,
        value_name = "URL",
        global = true,
        aliases = ["postgres-url", "database-url"]
    )]
    postgres: Option<String>,
}

/// Options of the stores that change where records are found.
#[derive(Debug, Args)]
#[group(multiple = true)]
struct StoreOptions {
    /// Redis: the prefix of the store's keys (RedisStore::with_prefix).
    #[arg(
        long,
        value_name = "PREFIX",
        default_value = "idempotency:",
        global = true
    )]
    redis_prefix: String,
    /// Redis: the largest record a compressed value may declare (RedisStore::with_max_decompressed);
    /// the store's default unless given.
    #[arg(long, value_name = "BYTES", global = true)]
    redis_max_decompressed: Option<usize>,
    /// PostgreSQL: the records' table, `name` or `schema.name` (PgStore::with_table).
    #[arg(
        long,
        value_name = "TABLE",
        default_value = "idempotency_records",
        global = true
    )]
    postgres_table: String,
    /// How long to wait for the store, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0, global = true)]
    timeout: f64,
    /// Open sealed responses with the keys in this environment variable (`id:base64key,...`, as
    /// the application reads them, e.g. IDEMPOTENCY_SEAL_KEYS). Without it, a sealed response
    /// shows only the id of the key it is sealed under. The keys are read from the environment,
    /// never from the command line, so that they stay out of shell history and process lists.
    #[arg(long, value_name = "VAR", global = true)]
    seal_keys_env: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show what the store holds for one key of one scope.
    Lookup {
        #[command(flatten)]
        target: Target,
        /// Include the stored response's headers and body.
        #[arg(long)]
        body: bool,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Forget one key of one scope, so that the next request with it runs again.
    Forget {
        #[command(flatten)]
        target: Target,
        /// Why (logged at WARN with the record id): a ticket, an incident, a sentence.
        #[arg(long, value_name = "TEXT")]
        reason: String,
        /// Forget the key even while a request holds it in flight (its handler may still be
        /// running: if it finishes before another claim, its record is written all the same).
        #[arg(long)]
        force: bool,
        /// Print one JSON object instead of a table, and the audit line on stderr as one JSON
        /// object in place of the text line.
        #[arg(long)]
        json: bool,
    },
}

/// One key of one scope.
#[derive(Debug, Args)]
struct Target {
    #[command(flatten)]
    scope: ScopeArgs,
    /// The key as the client sent it in its Idempotency-Key header (bare or quoted).
    #[arg(long, value_name = "KEY")]
    key: String,
}

/// The scope's bytes: one of the three, so that a forgotten `--scope` is an error, not a look in
/// the wrong namespace.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct ScopeArgs {
    /// The scope's bytes, as text (an account id, a tenant name).
    #[arg(long, value_name = "TEXT")]
    scope: Option<String>,
    /// The scope's bytes, in hex (for a scope that is not text).
    #[arg(long, value_name = "HEX")]
    scope_hex: Option<String>,
    /// The empty scope: the application's layer has no scope function.
    #[arg(long)]
    no_scope: bool,
}

/// Why the tool could not answer; [`CliError::exit`] says with which exit code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// `--scope-hex` is not hex.
    #[error("--scope-hex: {0}")]
    ScopeHex(&'static str),
    /// `--timeout` is not a number of seconds.
    #[error("--timeout must be a positive number of seconds")]
    Timeout,
    /// The Redis store could not be set up.
    #[error("the Redis store could not be set up")]
    Redis(#[from] tower_idempotency_redis::RedisStoreError),
    /// The PostgreSQL store could not be set up.
    #[error("the PostgreSQL store could not be set up")]
    Postgres(#[from] tower_idempotency_postgres::PgStoreError),
    /// The lookup or the forget failed.
    #[error(transparent)]
    Operator(#[from] operator::OperatorError),
    /// `--seal-keys-env` names a variable that is not set.
    #[error("--seal-keys-env: the environment variable {0} is not set")]
    SealKeysUnset(String),
    /// The variable `--seal-keys-env` names does not hold a key list.
    #[error("--seal-keys-env: {0} does not hold `id:base64key,...`")]
    SealKeys(String, #[source] tower_idempotency::seal::SealKeyError),
    /// Checking where the records are (the table, the keys under the prefix) failed.
    #[error("{0}")]
    Place(#[from] place::PlaceError),
    /// No key at all under the Redis prefix: the key is absent, and so is every other.
    #[error(
        "no key under prefix {0:?} at all: is the prefix right? (--redis-prefix: what the \
         application passes to RedisStore::with_prefix; default \"idempotency:\")"
    )]
    EmptyPrefix(String),
    /// The PostgreSQL table does not exist.
    #[error(
        "no table {0} in this database: is the table right? (--postgres-table: what the \
         application passes to PgStore::with_table; default idempotency_records)"
    )]
    NoTable(String),
}

impl CliError {
    /// The exit code this error ends the tool with.
    pub fn exit(&self) -> Exit {
        match self {
            CliError::Operator(operator::OperatorError::Store(_)) | CliError::Place(_) => {
                Exit::Store
            }
            CliError::EmptyPrefix(_) | CliError::NoTable(_) => Exit::NothingHere,
            _ => Exit::Usage,
        }
    }
}

impl ScopeArgs {
    fn bytes(&self) -> Result<Vec<u8>, CliError> {
        match (&self.scope, &self.scope_hex) {
            (Some(text), _) => Ok(text.as_bytes().to_vec()),
            (None, Some(hex)) => parse_hex(hex),
            (None, None) => Ok(Vec::new()),
        }
    }
}

fn parse_hex(hex: &str) -> Result<Vec<u8>, CliError> {
    let hex = hex.trim();
    if !hex.len().is_multiple_of(2) {
        return Err(CliError::ScopeHex("an odd number of hex digits"));
    }
    (0..hex.len())
        .step_by(2)
        .map(|at| {
            hex.get(at..at + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or(CliError::ScopeHex("not a hex digit"))
        })
        .collect()
}

impl StoreOptions {
    fn timeout(&self) -> Result<Duration, CliError> {
        Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|timeout| !timeout.is_zero())
            .ok_or(CliError::Timeout)
    }
}

impl StoreArgs {
    /// The store the arguments name, built as the application builds it; behind a `SealedStore`
    /// when `--seal-keys-env` is given. With it, where its records are, for the checks.
    fn open(&self, options: &StoreOptions) -> Result<(BoxStore, Place), CliError> {
        let (store, place) = self.open_plain(options)?;
        let Some(var) = &options.seal_keys_env else {
            return Ok((store, place));
        };
        let list = std::env::var(var).map_err(|_| CliError::SealKeysUnset(var.clone()))?;
        let keys = SealKeys::parse(&list).map_err(|err| CliError::SealKeys(var.clone(), err))?;
        Ok((BoxStore::new(SealedStore::new(store, keys)), place))
    }

    fn open_plain(&self, options: &StoreOptions) -> Result<(BoxStore, Place), CliError> {
        let timeout = options.timeout()?;
        let redis = |store: RedisStore| {
            let store = store
                .with_prefix(options.redis_prefix.clone())
                .with_timeout(timeout);
            let store = match options.redis_max_decompressed {
                Some(bytes) => store.with_max_decompressed(bytes),
                None => store,
            };
            let place = Place::redis(&store, &options.redis_prefix, timeout);
            (BoxStore::new(store), place)
        };
        if let Some(url) = &self.redis {
            return Ok(redis(RedisStore::from_url(url)?));
        }
        if let Some(urls) = &self.redis_cluster {
            return Ok(redis(RedisStore::cluster(urls.clone())?));
        }
        let url = self.postgres.as_deref().unwrap_or_default();
        // No sweep: the tool reads and forgets one key, and deletes nothing else.
        let store = PgStore::connect(url)?
            .try_with_table(&options.postgres_table)?
            .with_timeout(timeout)
            .with_sweep_interval(None);
        let place = Place::postgres(&store, timeout);
        Ok((BoxStore::new(store), place))
    }
}

/// Runs the command line: prints to stdout, errors to stderr; the exit code is the documented
/// one ([`Exit`]). Logs (the forget's WARN line) go to stderr through `tracing`, if a subscriber
/// is set; with `--json`, `forget` writes its audit line to stderr as one JSON object.
pub async fn run(cli: Cli) -> ExitCode {
    match execute(cli).await {
        Ok(exit) => exit.into(),
        Err(err) => {
            eprintln!("error: {}", output::chain(&err));
            err.exit().into()
        }
    }
}

async fn execute(cli: Cli) -> Result<Exit, CliError> {
    let (store, place) = cli.store.open(&cli.options)?;
    match cli.command {
        Command::Lookup { target, body, json } => {
            let scope = target.scope.bytes()?;
            let id = operator::record_id(&scope, &target.key)?;
            // Before the call: a missing table is said as such, not as the store's advice to
            // the application.
            place.check_table().await?;
            let found = operator::lookup(&store, &scope, &target.key).await?;
            if found.is_none() {
                place.check_absent().await?;
            }
            let report = output::Report::new(&scope, &target.key, &id);
            if json {
                println!("{}", report.lookup_json(found.as_ref(), body));
            } else {
                print!("{}", report.lookup_table(found.as_ref(), body));
            }
            Ok(if found.is_some() {
                Exit::Found
            } else {
                Exit::Absent
            })
        }
        Command::Forget {
            target,
            reason,
            force,
            json,
        } => {
            let scope = target.scope.bytes()?;
            let id: RecordId = operator::record_id(&scope, &target.key)?;
            place.check_table().await?;
            let outcome = operator::forget(&store, &scope, &target.key, &reason, force).await?;
            if matches!(outcome, ForgetOutcome::Absent) {
                place.check_absent().await?;
            }
            let report = output::Report::new(&scope, &target.key, &id);
            if json {
                eprintln!("{}", report.forget_audit(&outcome, force, reason.trim()));
                println!("{}", report.forget_json(&outcome, force));
            } else {
                print!("{}", report.forget_table(&outcome));
            }
            Ok(match outcome {
                ForgetOutcome::Forgotten(_) => Exit::Found,
                ForgetOutcome::Refused(_) => Exit::Refused,
                _ => Exit::Absent,
            })
        }
    }
}
