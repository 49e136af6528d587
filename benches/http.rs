//! HTTP load benchmark: what the idempotency layer costs behind a real HTTP server.
//!
//! ```sh
//! cargo bench --bench http
//! # knobs (defaults shown); BENCH_SECONDS=1 BENCH_ROUNDS=1 BENCH_WARMUP=0 is a quick smoke run
//! BENCH_SECONDS=5 BENCH_ROUNDS=5 BENCH_WARMUP=1 BENCH_CONNECTIONS=32 BENCH_THREADS=1 \
//!     BENCH_SERVER_THREADS=<nproc> BENCH_WORKLOADS=replay,new-key,conflict cargo bench --bench http
//! ```
//!
//! Needs `wrk` (`apt-get install wrk`) and `redis-server` 7.0+ (`apt-get install redis-server`) on
//! `PATH`. Everything runs on loopback: the bench starts its own `redis-server` on a free port (the
//! test fixture), and serves one trivial axum handler (`POST /v1/charges` answering 201 with a
//! ~200-byte JSON charge) several ways, each on its own port, from one multi-thread tokio runtime
//! in this process:
//!
//! - `bare`: no layer;
//! - `memory`: behind `IdempotencyLayer::new(MemoryStore)`;
//! - `memory+cache`: the same with `replay_cache` on;
//! - `redis-floor`: no layer, but the handler makes by hand, on one multiplexed connection, the
//!   Redis calls a layer must make (`SET NX PX GET`, then the crate's fenced completion script),
//!   and answers replays and 409s from what `GET` returned (`http/floor.rs`): the most any Redis
//!   layer can reach;
//! - `redis`: behind `IdempotencyLayer::new(RedisStore::from_url(..))`;
//! - `redis+cache`: the same with `replay_cache` on (replays of this process's completions make no
//!   Redis call).
//!
//! The report gives each variant's throughput as a ratio to bare and, for a layer on Redis, to
//! `redis-floor` (per round, then the median and the range over rounds), with the bench process's
//! CPU per request and, on Redis, the redis-server's.
//!
//! Workloads, each a generated wrk Lua script (every request: the same ~60-byte JSON body):
//!
//! - `replay`: one fixed `Idempotency-Key`, primed by one request first: every request is a replay;
//! - `new-key`: a unique key per request (per-run random prefix, wrk thread id, counter);
//! - `conflict`: a key held in flight by one request that never completes (the handler waits
//!   forever on `x-hold: 1`, a header that is not part of the fingerprint), then the same request
//!   without `x-hold`: every request is a 409. `bare` has no 409: for it this is the same requests
//!   answered 201, the baseline of that workload.
//!
//! Each round runs every workload against every server back to back, so they see the same machine
//! conditions; the report takes medians over rounds. wrk's own "Non-2xx" count
//! includes the expected 409s, so the Lua `response()` hook counts statuses per code (and replayed
//! responses) and every run is checked: replay and new-key must answer 201, conflict 409 behind the
//! layer, replays must carry `Idempotent-Replayed`, and the handler must run exactly when it
//! should. A mismatch is printed loudly and the bench exits non-zero.
//!
//! Per run the bench measures its own process CPU time and the redis-server's
//! (`clock_gettime` on the process CPU clocks, nanosecond resolution; falling back to
//! `/proc/<pid>/stat` ticks), and `INFO commandstats` (reset before each run). Redis counts the
//! commands that this crate's Lua scripts run inside each `EVALSHA`/`EVAL` as commands of their
//! own: every script makes one `GET`, then its write (`SET` for complete and renew, `DEL` for
//! release) when its fence holds. The crate never sends `GET` or `DEL` itself, so network round
//! trips = all calls - `GET` - `DEL` - one `SET` per `EVALSHA` (which here is always a complete
//! or a renew whose fence holds) - that is, all calls - 2 x `EVALSHA` in the common case, and the
//! `EVAL` releases of claims abandoned when wrk stops (see `RedisStore::claim`) are counted right.
//!
//! With the `postgres` feature (`cargo bench --bench http --features postgres`, and the
//! PostgreSQL server binaries installed), a fourth server, `postgres`, runs behind `PgStore` on a
//! private PostgreSQL server the bench starts (the test fixture: fsync off, as the Redis server
//! keeps nothing on disk).
//!
//! `BENCH_VARIANTS=bare,memory,redis` (default: all) runs only some servers, e.g. to profile one.
//! `BENCH_DEDUP_WINDOW` (seconds, default 86400) and `BENCH_MEMORY_CAPACITY` (bytes, default
//! lifted) check that memory stays flat over a long new-key run, e.g.
//! `BENCH_VARIANTS=memory BENCH_WORKLOADS=new-key BENCH_ROUNDS=1 BENCH_SECONDS=60
//! BENCH_DEDUP_WINDOW=10 cargo bench --bench http`: the end of the run prints the store's size and
//! the process's resident and peak memory.
//!
//! A run started by `cargo test --benches` (no `--bench` argument) does nothing. CI runs a smoke:
//! `BENCH_SECONDS=1 BENCH_ROUNDS=1 BENCH_WARMUP=0 cargo bench --bench http`, which fails on any
//! MISMATCH (statuses, replay markers, handler counts) and checks no timing.

#[path = "http/floor.rs"]
mod floor;
#[cfg(feature = "postgres")]
#[path = "../tests/support/postgres_server.rs"]
mod postgres_server;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use axum::serve::ListenerExt;
use redis_server::RedisServer;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RedisStore};

const PATH: &str = "/v1/charges";
/// The handler's response: a fixed charge object (203 bytes).
const CHARGE: &str = r#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"eur","status":"succeeded","captured":true,"customer":"cus_NffrFeUfNV2Hib","description":"Order #1234","created":1679090539}"#;
/// Every request's body (64 bytes).
const REQUEST_BODY: &str = r#"{"amount":1099,"currency":"eur","customer":"cus_NffrFeUfNV2Hib"}"#;
/// The memory store's byte cap. `MemoryStore::new()` caps records at 256 MiB and answers 503 when
/// full; the new-key workload stores one ~450-byte record per request, so a long or fast run would
/// end up measuring 503s. The bench lifts the cap (same code path otherwise) and prints what the
/// store holds at the end.
const MEMORY_CAPACITY: usize = usize::MAX / 2;
/// A line of `/proc/self/status` (`VmRSS:`, `VmHWM:`), or `?`.
fn proc_status(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(field).map(|v| v.trim().to_owned()))
        })
        .unwrap_or_else(|| "?".into())
}

/// Extra time wrk gets past its duration before the bench kills it.
const WRK_GRACE: Duration = Duration::from_secs(30);
/// Timeout of the bench's own priming and probing requests.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between runs, so that stragglers of one run never land in the next one's counters.
const SETTLE: Duration = Duration::from_millis(200);
/// Redis commands the harness itself sends (excluded from the per-request counts).
const HARNESS_COMMANDS: &[&str] = &["info", "config|resetstat", "dbsize"];

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Variant {
    Bare,
    Memory,
    /// The memory store with the replay cache.
    MemoryCache,
    /// The Redis store's calls made by hand, with no layer (`floor`).
    RedisFloor,
    Redis,
    /// The Redis store with the replay cache.
    RedisCache,
    /// With the `postgres` feature only.
    Postgres,
}

impl Variant {
    const ALL: &[Variant] = &[
        Variant::Bare,
        Variant::Memory,
        Variant::MemoryCache,
        Variant::RedisFloor,
        Variant::Redis,
        Variant::RedisCache,
        #[cfg(feature = "postgres")]
        Variant::Postgres,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Bare => "bare",
            Variant::Memory => "memory",
            Variant::MemoryCache => "memory+cache",
            Variant::RedisFloor => "redis-floor",
            Variant::Redis => "redis",
            Variant::RedisCache => "redis+cache",
            Variant::Postgres => "postgres",
        }
    }

    /// Whether the server answers as a layer does (replays, 409): all but bare.
    fn layered(self) -> bool {
        self != Variant::Bare
    }

    /// The floor of the variant's store: the same store calls made by hand.
    fn floor(self) -> Option<Variant> {
        match self {
            Variant::Redis | Variant::RedisCache => Some(Variant::RedisFloor),
            _ => None,
        }
    }

    /// Whether the variant's store is the bench's Redis server (its CPU and commands are counted).
    fn on_redis(self) -> bool {
        matches!(
            self,
            Variant::Redis | Variant::RedisCache | Variant::RedisFloor
        )
    }
}

/// The replay cache's bounds in the `+cache` variants: room for every replay key, far from full.
const REPLAY_CACHE_ENTRIES: usize = 10_000;
const REPLAY_CACHE_BYTES: usize = 64 << 20;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Workload {
    Replay,
    NewKey,
    Conflict,
}

impl Workload {
    const ALL: [Workload; 3] = [Workload::Replay, Workload::NewKey, Workload::Conflict];

    fn name(self) -> &'static str {
        match self {
            Workload::Replay => "replay",
            Workload::NewKey => "new-key",
            Workload::Conflict => "conflict",
        }
    }

    /// The status every response of this workload must have.
    fn expected_status(self, variant: Variant) -> u16 {
        match (self, variant.layered()) {
            (Workload::Conflict, true) => 409,
            _ => 201,
        }
    }
}

/// The bench's knobs, from the environment.
#[derive(Debug)]
struct Settings {
    seconds: u64,
    rounds: usize,
    warmup: u64,
    connections: u32,
    threads: u32,
    server_threads: usize,
    workloads: Vec<Workload>,
    variants: Vec<Variant>,
    /// The layers' dedup window, in seconds (default: the layer's own, 24 h).
    dedup_window: u64,
    /// The memory store's byte cap (default: lifted, see `MEMORY_CAPACITY`).
    memory_capacity: usize,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let nproc = std::thread::available_parallelism().map_or(2, usize::from);
        let settings = Settings {
            seconds: env_number("BENCH_SECONDS", 5)?,
            rounds: env_number("BENCH_ROUNDS", 5)?,
            warmup: env_number("BENCH_WARMUP", 1)?,
            connections: env_number("BENCH_CONNECTIONS", 32)?,
            threads: env_number("BENCH_THREADS", 1)?,
            server_threads: env_number("BENCH_SERVER_THREADS", nproc)?,
            workloads: env_list("BENCH_WORKLOADS", &Workload::ALL, Workload::name)?,
            variants: env_list("BENCH_VARIANTS", Variant::ALL, Variant::name)?,
            dedup_window: env_number("BENCH_DEDUP_WINDOW", 24 * 60 * 60)?,
            memory_capacity: env_number("BENCH_MEMORY_CAPACITY", MEMORY_CAPACITY)?,
        };
        if settings.seconds == 0 || settings.rounds == 0 {
            return Err("BENCH_SECONDS and BENCH_ROUNDS must be at least 1".into());
        }
        if settings.threads == 0 || settings.connections < settings.threads {
            return Err("BENCH_THREADS must be at least 1 and at most BENCH_CONNECTIONS".into());
        }
        if settings.server_threads == 0 {
            return Err("BENCH_SERVER_THREADS must be at least 1".into());
        }
        if settings.workloads.is_empty() || settings.variants.is_empty() {
            return Err("BENCH_WORKLOADS or BENCH_VARIANTS names nothing".into());
        }
        Ok(settings)
    }

    /// The exact command that reproduces this run.
    fn command(&self) -> String {
        let workloads: Vec<_> = self.workloads.iter().map(|w| w.name()).collect();
        let variants = if self.variants.len() == Variant::ALL.len() {
            String::new()
        } else {
            let names: Vec<_> = self.variants.iter().map(|v| v.name()).collect();
            format!("BENCH_VARIANTS={} ", names.join(","))
        };
        let mut variants = variants;
        if self.dedup_window != 24 * 60 * 60 {
            variants.push_str(&format!("BENCH_DEDUP_WINDOW={} ", self.dedup_window));
        }
        if self.memory_capacity != MEMORY_CAPACITY {
            variants.push_str(&format!("BENCH_MEMORY_CAPACITY={} ", self.memory_capacity));
        }
        format!(
            "BENCH_SECONDS={} BENCH_ROUNDS={} BENCH_WARMUP={} BENCH_CONNECTIONS={} BENCH_THREADS={} \
             BENCH_SERVER_THREADS={} BENCH_WORKLOADS={} {variants}cargo bench --bench http",
            self.seconds,
            self.rounds,
            self.warmup,
            self.connections,
            self.threads,
            self.server_threads,
            workloads.join(",")
        )
    }

    fn estimated_seconds(&self) -> u64 {
        let runs = (self.workloads.len() * self.variants.len()) as u64;
        runs * (self.warmup + self.seconds * self.rounds as u64)
            + runs * (self.rounds as u64 + 1) / 2
    }
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => value
            .trim()
            .parse()
            .map_err(|_| format!("{name}={value:?} is not a valid number")),
    }
}

/// A comma-separated subset of `all` from the environment (default: all), in `all`'s order.
fn env_list<T: Copy + PartialEq>(
    name: &str,
    all: &[T],
    label: fn(T) -> &'static str,
) -> Result<Vec<T>, String> {
    let Ok(list) = std::env::var(name) else {
        return Ok(all.to_vec());
    };
    let wanted: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    let known: Vec<_> = all.iter().map(|t| label(*t)).collect();
    if let Some(unknown) = wanted.iter().find(|n| !known.contains(n)) {
        return Err(format!(
            "{name}: unknown name {unknown:?} (known: {})",
            known.join(", ")
        ));
    }
    Ok(all
        .iter()
        .copied()
        .filter(|t| wanted.contains(&label(*t)))
        .collect())
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then do nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("benches/http: run it with `cargo bench --bench http` (skipped: no --bench)");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("\nFAILED: some runs did not answer as expected (see MISMATCH above)");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("benches/http: {err}");
            ExitCode::FAILURE
        }
    }
}

/// One server under test.
struct Server {
    variant: Variant,
    port: u16,
    /// How many requests the server received (counted before the layer).
    received: Arc<AtomicU64>,
    /// How often the handler ran to completion.
    executions: Arc<AtomicU64>,
    /// How many `x-hold` requests reached the handler (and wait there forever).
    holds: Arc<AtomicU64>,
    /// The replay workload's key, primed once.
    replay_key: String,
    /// The conflict workload's key, held in flight (layered variants).
    held_key: String,
    /// The connection of the request that holds `held_key`, kept open.
    _hold: Option<TcpStream>,
}

/// What one wrk run printed from the Lua `done()` hook.
#[derive(Debug, Default, Clone)]
struct WrkResult {
    requests: u64,
    duration_us: u64,
    connect_errors: u64,
    read_errors: u64,
    write_errors: u64,
    timeouts: u64,
    p50_us: u64,
    p99_us: u64,
    replayed: u64,
    statuses: BTreeMap<u16, u64>,
}

impl WrkResult {
    fn parse(stdout: &str) -> Result<Self, String> {
        let line = stdout
            .lines()
            .find_map(|line| line.strip_prefix("BENCH_RESULT "))
            .ok_or_else(|| format!("wrk printed no BENCH_RESULT line:\n{stdout}"))?;
        let fields: HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|field| field.split_once('='))
            .collect();
        let number = |name: &str| -> Result<u64, String> {
            let value = fields
                .get(name)
                .ok_or_else(|| format!("BENCH_RESULT has no {name}: {line}"))?;
            value
                .parse::<f64>()
                .map(|v| v.round() as u64)
                .map_err(|_| format!("BENCH_RESULT {name}={value} is not a number"))
        };
        let mut statuses = BTreeMap::new();
        for pair in fields
            .get("statuses")
            .copied()
            .unwrap_or_default()
            .split(',')
            .filter(|p| !p.is_empty())
        {
            let (code, count) = pair
                .split_once(':')
                .ok_or_else(|| format!("bad status count {pair:?} in {line}"))?;
            let code = code.parse().map_err(|_| format!("bad status {code:?}"))?;
            let count: f64 = count.parse().map_err(|_| format!("bad count {count:?}"))?;
            *statuses.entry(code).or_default() += count as u64;
        }
        Ok(WrkResult {
            requests: number("requests")?,
            duration_us: number("duration_us")?,
            connect_errors: number("connect")?,
            read_errors: number("read")?,
            write_errors: number("write")?,
            timeouts: number("timeout")?,
            p50_us: number("p50_us")?,
            p99_us: number("p99_us")?,
            replayed: number("replayed")?,
            statuses,
        })
    }

    fn statuses_text(&self) -> String {
        let parts: Vec<_> = self
            .statuses
            .iter()
            .map(|(code, n)| format!("{code}x{n}"))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(" ")
        }
    }
}

/// One measured run: a workload against one variant.
#[derive(Debug, Clone)]
struct Sample {
    round: usize,
    workload: Workload,
    variant: Variant,
    wrk: WrkResult,
    rps: f64,
    cpu_us_per_request: f64,
    redis_cpu_us_per_request: f64,
    /// Redis calls per request by command (the harness's own commands left out).
    redis_calls: BTreeMap<String, f64>,
    redis_round_trips_per_request: f64,
    /// How often the handler ran to completion during the run.
    executions: u64,
    /// How many requests the server received during the run.
    received: u64,
    /// Whether the run passed its checks.
    answered_as_expected: bool,
}

fn run() -> Result<bool, String> {
    let settings = Settings::from_env()?;
    let wrk = find_on_path("wrk").ok_or(
        "wrk not found on PATH. Install it: `apt-get install wrk` (Debian/Ubuntu), \
         `brew install wrk` (macOS), or build it from https://github.com/wg/wrk",
    )?;
    if find_on_path("redis-server").is_none() {
        return Err(
            "redis-server not found on PATH. Install it: `apt-get install redis-server` \
                    (Redis 7.0 or newer)"
                .into(),
        );
    }
    let clocks = CpuClocks::detect();

    println!("# tower-idempotency HTTP benchmark");
    println!();
    println!("command:  {}", settings.command());
    print_machine(&wrk);
    println!("cpu time: {}", clocks.describe());
    println!(
        "plan:     {} workload(s) x {} server(s) x {} round(s) of {} s, warm-up {} s each: about {} s",
        settings.workloads.len(),
        settings.variants.len(),
        settings.rounds,
        settings.seconds,
        settings.warmup,
        settings.estimated_seconds()
    );
    println!();

    let workdir = TempDir::new()?;
    let redis = RedisServer::start();
    let redis_pid = redis.pid().ok_or("redis-server has no pid")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.server_threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build the tokio runtime: {e}"))?;

    let run_id = random_hex();
    let memory_store = MemoryStore::with_capacity(settings.memory_capacity);
    let window = Duration::from_secs(settings.dedup_window);
    let redis_store = RedisStore::from_url(&redis.url()).map_err(|e| format!("{e}"))?;
    runtime
        .block_on(redis_store.check())
        .map_err(|e| format!("RedisStore::check: {e}"))?;
    let redis_client = tower_idempotency::deadpool_redis::redis::Client::open(redis.url())
        .map_err(|e| format!("redis client: {e}"))?;

    // The PostgreSQL server of the fixture (fsync off, like the Redis server's lack of
    // persistence): a private server on a free port, never the shared one.
    #[cfg(feature = "postgres")]
    let (_postgres, postgres_store) = {
        let server = postgres_server::PostgresServer::start();
        let _runtime = runtime.enter();
        let store = tower_idempotency::PgStore::connect(&server.url())
            .map_err(|e| format!("{e}"))?
            .with_sweep_interval(None);
        runtime
            .block_on(store.migrate())
            .map_err(|e| format!("PgStore::migrate: {e}"))?;
        println!("postgres on {}", server.url());
        (server, store)
    };

    let mut servers = Vec::new();
    for &variant in &settings.variants {
        let received = Arc::new(AtomicU64::new(0));
        let executions = Arc::new(AtomicU64::new(0));
        let holds = Arc::new(AtomicU64::new(0));
        let app = charges_app(executions.clone(), holds.clone());
        let app = match variant {
            Variant::Bare => app,
            Variant::Memory => {
                app.layer(IdempotencyLayer::new(memory_store.clone()).dedup_window(window))
            }
            Variant::MemoryCache => app.layer(
                IdempotencyLayer::new(memory_store.clone())
                    .dedup_window(window)
                    .replay_cache(REPLAY_CACHE_ENTRIES, REPLAY_CACHE_BYTES),
            ),
            Variant::RedisFloor => floor::redis_app(
                runtime
                    .block_on(redis_client.get_multiplexed_async_connection())
                    .map_err(|e| format!("redis connection: {e}"))?,
                window.as_millis() as u64,
                executions.clone(),
                holds.clone(),
            ),
            Variant::Redis => {
                app.layer(IdempotencyLayer::new(redis_store.clone()).dedup_window(window))
            }
            Variant::RedisCache => app.layer(
                IdempotencyLayer::new(redis_store.clone())
                    .dedup_window(window)
                    .replay_cache(REPLAY_CACHE_ENTRIES, REPLAY_CACHE_BYTES),
            ),
            #[cfg(feature = "postgres")]
            Variant::Postgres => {
                app.layer(IdempotencyLayer::new(postgres_store.clone()).dedup_window(window))
            }
            #[cfg(not(feature = "postgres"))]
            Variant::Postgres => unreachable!("not in Variant::ALL without the postgres feature"),
        };
        // Outermost, the same in every variant: one relaxed atomic add per request.
        let count = received.clone();
        let app = app.layer(tower::layer::layer_fn(move |inner| Counted {
            inner,
            count: count.clone(),
        }));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("local_addr: {e}"))?
            .port();
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        runtime.spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                eprintln!("server error: {err}");
            }
        });
        let mut server = Server {
            variant,
            port,
            received,
            executions,
            holds,
            replay_key: format!("bench-{run_id}-replay-{}", variant.name()),
            held_key: format!("bench-{run_id}-held-{}", variant.name()),
            _hold: None,
        };
        prepare(&mut server)?;
        servers.push(server);
    }
    for server in &servers {
        println!(
            "server {:<12} http://127.0.0.1:{}{PATH}",
            server.variant.name(),
            server.port
        );
    }
    println!(
        "redis-server pid {redis_pid} on {} ({})",
        redis.url(),
        redis_version(&redis)
    );
    println!();

    let mut ok = true;
    let mut run_counter = 0usize;
    let mut script_for = |workload: Workload, server: &Server| -> Result<PathBuf, String> {
        run_counter += 1;
        let script = lua_script(workload, server, &format!("bench-{run_id}-r{run_counter}"));
        let path = workdir.path().join(format!(
            "{}-{}-{run_counter}.lua",
            workload.name(),
            server.variant.name()
        ));
        std::fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    };

    if settings.warmup > 0 {
        println!("warm-up: {} s per workload and server", settings.warmup);
        for &workload in &settings.workloads {
            for server in &servers {
                let script = script_for(workload, server)?;
                let sample = measure(
                    &settings,
                    &wrk,
                    &script,
                    settings.warmup,
                    server,
                    workload,
                    0,
                    &redis,
                    redis_pid,
                    &clocks,
                )?;
                ok &= check(&settings, &sample, server, "warm-up");
            }
        }
        println!();
    }

    let mut samples: Vec<Sample> = Vec::new();
    let started = Instant::now();
    for round in 1..=settings.rounds {
        println!("round {round}/{}", settings.rounds);
        for &workload in &settings.workloads {
            for server in &servers {
                let script = script_for(workload, server)?;
                let sample = measure(
                    &settings,
                    &wrk,
                    &script,
                    settings.seconds,
                    server,
                    workload,
                    round,
                    &redis,
                    redis_pid,
                    &clocks,
                )?;
                let mut sample = sample;
                sample.answered_as_expected =
                    check(&settings, &sample, server, &format!("round {round}"));
                ok &= sample.answered_as_expected;
                println!(
                    "  {:<8} {:<12} {:>9.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  cpu {:>6.1} µs/req{}  [{}]",
                    workload.name(),
                    server.variant.name(),
                    sample.rps,
                    ms(sample.wrk.p50_us),
                    ms(sample.wrk.p99_us),
                    sample.cpu_us_per_request,
                    if server.variant.on_redis() {
                        format!(
                            "  redis {:>5.1} µs/req {:.2} rt/req",
                            sample.redis_cpu_us_per_request, sample.redis_round_trips_per_request
                        )
                    } else {
                        String::new()
                    },
                    sample.wrk.statuses_text()
                );
                samples.push(sample);
            }
        }
    }
    let measured = started.elapsed();

    println!();
    print_report(&settings, &samples, &wrk);
    println!();
    println!(
        "measured for {:.0} s; memory store: {} records, {:.1} MiB; redis: {} keys",
        measured.as_secs_f64(),
        memory_store.len(),
        memory_store.used_bytes() as f64 / (1024.0 * 1024.0),
        redis
            .command(&["DBSIZE"])
            .as_integer()
            .map_or_else(|| "?".into(), |n| n.to_string()),
    );
    println!(
        "bench process memory at the end: {} resident, {} at the peak",
        proc_status("VmRSS:"),
        proc_status("VmHWM:")
    );
    println!("load average at the end: {}", load_average());

    // Stop the servers (and the held requests) before the Redis fixture goes.
    drop(servers);
    runtime.shutdown_timeout(Duration::from_secs(2));
    drop(redis);
    drop(workdir);
    Ok(ok)
}

/// Counts the requests a server receives: the per-request costs divide by this count, which
/// includes the requests still in flight when wrk stops (wrk's own count leaves them out).
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    count: Arc<AtomicU64>,
}

impl<S, R> tower::Service<R> for Counted<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.inner.call(request)
    }
}

/// The handler, the same for every variant: 201 and a fixed charge, after reading the body. A
/// request with `x-hold` waits forever (it holds its key in flight for the conflict workload).
fn charges_app(executions: Arc<AtomicU64>, holds: Arc<AtomicU64>) -> Router {
    Router::new().route(
        PATH,
        post(move |headers: HeaderMap, body: Bytes| {
            let executions = executions.clone();
            let holds = holds.clone();
            async move {
                if headers.contains_key("x-hold") {
                    holds.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                }
                std::hint::black_box(&body);
                executions.fetch_add(1, Ordering::Relaxed);
                (
                    StatusCode::CREATED,
                    [(header::CONTENT_TYPE, "application/json")],
                    CHARGE,
                )
            }
        }),
    )
}

/// Primes the replay key and holds the conflict key, checking that each answers as it should.
fn prepare(server: &mut Server) -> Result<(), String> {
    let name = server.variant.name();
    let first = http_post(server.port, &server.replay_key, false)
        .map_err(|e| format!("{name}: priming request failed: {e}"))?;
    let again = http_post(server.port, &server.replay_key, false)
        .map_err(|e| format!("{name}: priming request failed: {e}"))?;
    let replays = server.variant.layered();
    if first != (201, false) || again != (201, replays) {
        return Err(format!(
            "{name}: priming the replay key answered {first:?} then {again:?}; \
             expected (201, false) then (201, {replays})"
        ));
    }
    if !server.variant.layered() {
        return Ok(());
    }
    let hold = send_hold(server.port, &server.held_key)
        .map_err(|e| format!("{name}: the holding request failed: {e}"))?;
    // The handler runs only once the key is claimed: wait until it has started.
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    while server.holds.load(Ordering::SeqCst) == 0 {
        if Instant::now() > deadline {
            return Err(format!(
                "{name}: the holding request did not reach the handler"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    server._hold = Some(hold);
    let probe = http_post(server.port, &server.held_key, false)
        .map_err(|e| format!("{name}: probing the held key failed: {e}"))?;
    if probe.0 != 409 {
        return Err(format!(
            "{name}: a request for the held key answered {probe:?}, expected 409"
        ));
    }
    Ok(())
}

/// Sends one POST (with `Connection: close`) and returns its status and whether it was a replay.
fn http_post(port: u16, key: &str, hold: bool) -> io::Result<(u16, bool)> {
    let mut stream = connect(port)?;
    stream.write_all(request_bytes(port, key, hold, true).as_bytes())?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad reply {text:?}")))?;
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let replayed = head
        .lines()
        .any(|line| line.eq_ignore_ascii_case("idempotent-replayed: true"));
    Ok((status, replayed))
}

/// Sends the request that holds `key` in flight, and returns its (still open) connection.
fn send_hold(port: u16, key: &str) -> io::Result<TcpStream> {
    let mut stream = connect(port)?;
    stream.write_all(request_bytes(port, key, true, false).as_bytes())?;
    Ok(stream)
}

fn connect(port: u16) -> io::Result<TcpStream> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, CLIENT_TIMEOUT)?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    Ok(stream)
}

fn request_bytes(port: u16, key: &str, hold: bool, close: bool) -> String {
    let mut request = format!(
        "POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Idempotency-Key: {key}\r\nContent-Length: {}\r\n",
        REQUEST_BODY.len()
    );
    if hold {
        request.push_str("x-hold: 1\r\n");
    }
    if close {
        request.push_str("Connection: close\r\n");
    }
    request.push_str("\r\n");
    request.push_str(REQUEST_BODY);
    request
}

/// The wrk script of one run. `prefix` is unique to the run (new-key keys never repeat).
fn lua_script(workload: Workload, server: &Server, prefix: &str) -> String {
    let mut lua = format!(
        "-- generated by benches/http.rs: workload {}, server {}\n\
         wrk.method = \"POST\"\n\
         wrk.body = '{REQUEST_BODY}'\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\n",
        workload.name(),
        server.variant.name()
    );
    match workload {
        Workload::Replay => {
            let _ = writeln!(
                lua,
                "wrk.headers[\"Idempotency-Key\"] = \"{}\"",
                server.replay_key
            );
        }
        Workload::Conflict => {
            let _ = writeln!(
                lua,
                "wrk.headers[\"Idempotency-Key\"] = \"{}\"",
                server.held_key
            );
        }
        Workload::NewKey => {
            let _ = write!(
                lua,
                r#"
local counter = 0
local request_headers = nil

function init(args)
  request_headers = {{ ["Content-Type"] = "application/json" }}
end

function request()
  counter = counter + 1
  request_headers["Idempotency-Key"] = "{prefix}-" .. tid .. "-" .. counter
  return wrk.format(nil, nil, request_headers, nil)
end
"#
            );
        }
    }
    lua.push_str(
        r#"
local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

statuses = {}
replayed = 0

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  if headers["idempotent-replayed"] == "true" or headers["Idempotent-Replayed"] == "true" then
    replayed = replayed + 1
  end
end

function done(summary, latency, requests)
  local codes = {}
  local replays = 0
  for _, thread in ipairs(threads) do
    local counts = thread:get("statuses")
    if counts then
      for code, n in pairs(counts) do
        codes[code] = (codes[code] or 0) + n
      end
    end
    replays = replays + (thread:get("replayed") or 0)
  end
  local list = {}
  for code, n in pairs(codes) do
    list[#list + 1] = string.format("%d:%d", code, n)
  end
  table.sort(list)
  local e = summary.errors
  io.write(string.format(
    "BENCH_RESULT requests=%d duration_us=%d connect=%d read=%d write=%d timeout=%d " ..
    "non2xx=%d p50_us=%d p99_us=%d mean_us=%.1f max_us=%d replayed=%d statuses=%s\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max,
    replays, table.concat(list, ",")))
end
"#,
    );
    lua
}

/// Runs wrk once against `server` and measures it.
#[allow(clippy::too_many_arguments)]
fn measure(
    settings: &Settings,
    wrk: &Path,
    script: &Path,
    seconds: u64,
    server: &Server,
    workload: Workload,
    round: usize,
    redis: &RedisServer,
    redis_pid: u32,
    clocks: &CpuClocks,
) -> Result<Sample, String> {
    std::thread::sleep(SETTLE);
    redis.config_resetstat();
    let executions_before = server.executions.load(Ordering::SeqCst);
    let received_before = server.received.load(Ordering::SeqCst);
    let cpu_before = clocks.process_ns(None);
    let redis_cpu_before = clocks.process_ns(Some(redis_pid));

    let output = run_wrk(settings, wrk, script, seconds, server.port)?;

    let cpu_after = clocks.process_ns(None);
    let redis_cpu_after = clocks.process_ns(Some(redis_pid));
    let executions = server.executions.load(Ordering::SeqCst) - executions_before;
    let received = server.received.load(Ordering::SeqCst) - received_before;
    let stats = redis.info_commandstats();

    let wrk_result = WrkResult::parse(&output)?;
    // Costs per request served: what the server received, which is wrk's count plus the requests
    // in flight when wrk stopped.
    let requests = received.max(1) as f64;
    let redis_calls: BTreeMap<String, f64> = stats
        .iter()
        .filter(|(name, _)| !HARNESS_COMMANDS.contains(&name.as_str()))
        .map(|(name, calls)| (name.clone(), *calls as f64 / requests))
        .collect();
    let total: f64 = redis_calls.values().sum();
    let calls = |name: &str| redis_calls.get(name).copied().unwrap_or(0.0);
    // Calls made inside scripts: every GET and DEL (the crate sends neither itself), and the SET
    // of each EVALSHA (complete or renew, whose fence holds in this bench).
    let inside_scripts = calls("get") + calls("del") + calls("evalsha");
    let sample = Sample {
        round,
        workload,
        variant: server.variant,
        rps: wrk_result.requests as f64 / (wrk_result.duration_us.max(1) as f64 / 1e6),
        cpu_us_per_request: cpu_after.saturating_sub(cpu_before) as f64 / 1e3 / requests,
        redis_cpu_us_per_request: redis_cpu_after.saturating_sub(redis_cpu_before) as f64
            / 1e3
            / requests,
        // Never below zero: rounding of a run that made no call at all.
        redis_round_trips_per_request: (total - inside_scripts).max(0.0),
        redis_calls,
        executions,
        received,
        answered_as_expected: true,
        wrk: wrk_result,
    };
    Ok(sample)
}

/// Runs wrk with a hard deadline and returns its standard output.
fn run_wrk(
    settings: &Settings,
    wrk: &Path,
    script: &Path,
    seconds: u64,
    port: u16,
) -> Result<String, String> {
    let mut child = Command::new(wrk)
        .arg(format!("-t{}", settings.threads))
        .arg(format!("-c{}", settings.connections))
        .arg(format!("-d{seconds}s"))
        .arg("--timeout")
        .arg("5s")
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}{PATH}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", wrk.display()))?;
    let mut stdout = child.stdout.take().ok_or("no wrk stdout")?;
    let mut stderr = child.stderr.take().ok_or("no wrk stderr")?;
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(seconds) + WRK_GRACE;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "wrk did not finish within {seconds} s + {WRK_GRACE:?}; killed it"
                ));
            }
            Err(e) => return Err(format!("waiting for wrk failed: {e}")),
        }
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    if !status.success() {
        return Err(format!(
            "wrk failed ({status}):\n{stdout}\n{stderr}\nscript: {}",
            script.display()
        ));
    }
    if !stderr.trim().is_empty() {
        eprintln!("wrk stderr: {}", stderr.trim());
    }
    Ok(stdout)
}

/// Checks one run's answers; prints a loud MISMATCH for each problem.
fn check(settings: &Settings, sample: &Sample, server: &Server, when: &str) -> bool {
    let executions = sample.executions;
    let wrk = &sample.wrk;
    let expected = sample.workload.expected_status(server.variant);
    let answered: u64 = wrk.statuses.values().sum();
    let mut problems = Vec::new();
    if wrk.requests == 0 {
        problems.push("no request completed".to_string());
    }
    let unexpected: Vec<_> = wrk
        .statuses
        .iter()
        .filter(|(code, _)| **code != expected)
        .map(|(code, n)| format!("{n} x {code}"))
        .collect();
    if !unexpected.is_empty() {
        problems.push(format!(
            "expected only {expected}, got {} as well",
            unexpected.join(", ")
        ));
    }
    if answered != wrk.requests {
        problems.push(format!(
            "response() saw {answered} responses, wrk counted {} requests",
            wrk.requests
        ));
    }
    let errors = wrk.connect_errors + wrk.read_errors + wrk.write_errors + wrk.timeouts;
    if errors > 0 {
        problems.push(format!(
            "socket errors: connect {}, read {}, write {}, timeout {}",
            wrk.connect_errors, wrk.read_errors, wrk.write_errors, wrk.timeouts
        ));
    }
    let replays_expected = sample.workload == Workload::Replay && server.variant.layered();
    let replays_ok = if replays_expected {
        wrk.replayed == answered
    } else {
        wrk.replayed == 0
    };
    if !replays_ok {
        problems.push(format!(
            "{} of {answered} responses carried Idempotent-Replayed: true, expected {}",
            wrk.replayed,
            if replays_expected { "all" } else { "none" }
        ));
    }
    // wrk does not count the requests still in flight when it stops: at most one per connection.
    let slack = u64::from(settings.connections);
    if !(wrk.requests..=wrk.requests + slack).contains(&sample.received) {
        problems.push(format!(
            "the server received {} requests, wrk counted {}",
            sample.received, wrk.requests
        ));
    }
    // The handler runs once per request, except where the layer answers for it (a request whose
    // connection wrk closed at the end may not have reached it yet).
    let runs_handler = !server.variant.layered() || sample.workload == Workload::NewKey;
    if runs_handler
        && !(sample.received.saturating_sub(slack)..=sample.received).contains(&executions)
    {
        problems.push(format!(
            "the handler ran {executions} times for {} requests received",
            sample.received
        ));
    }
    if !runs_handler && executions != 0 {
        problems.push(format!(
            "the handler ran {executions} times; the layer should have answered every request"
        ));
    }
    for problem in &problems {
        eprintln!(
            "!!! MISMATCH ({when}, {} {}): {problem}",
            sample.workload.name(),
            server.variant.name()
        );
    }
    problems.is_empty()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The median of per-round ratios to bare, with their range when there are several rounds: on a
/// shared machine, rounds differ by more than small changes do, and the range says by how much.
fn ratio_text(ratios: Vec<f64>) -> String {
    let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let several = ratios.len() > 1;
    let mid = median(ratios);
    if several {
        format!("{mid:.2} ({low:.2}–{high:.2})")
    } else {
        format!("{mid:.2}")
    }
}

fn print_report(settings: &Settings, samples: &[Sample], wrk: &Path) {
    let of = |workload: Workload, variant: Variant| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.workload == workload && s.variant == variant)
            .collect()
    };
    let med = |list: &[&Sample], f: fn(&Sample) -> f64| median(list.iter().map(|s| f(s)).collect());

    println!("## Results (medians of {} round(s))", settings.rounds);
    println!();
    println!(
        "| workload | server | req/s | vs bare (range) | vs floor (range) | p50 | p99 | server CPU/req | +CPU vs bare | Redis CPU/req | Redis round trips/req |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &workload in &settings.workloads {
        let bare = of(workload, Variant::Bare);
        let bare_cpu = med(&bare, |s| s.cpu_us_per_request);
        for &variant in &settings.variants {
            let list = of(workload, variant);
            if list.is_empty() {
                continue;
            }
            // The ratio of each round to the base's run of the same round, then the median.
            let ratios_to = |base: &[&Sample]| -> Vec<f64> {
                list.iter()
                    .filter_map(|s| {
                        base.iter()
                            .find(|b| b.round == s.round)
                            .map(|b| s.rps / b.rps)
                    })
                    .collect()
            };
            let ratios = ratios_to(&bare);
            let vs_floor = match variant.floor().map(|floor| of(workload, floor)) {
                Some(floor) if !floor.is_empty() => ratio_text(ratios_to(&floor)),
                _ => "—".to_string(),
            };
            let cpu = med(&list, |s| s.cpu_us_per_request);
            let (vs_bare, extra_cpu) = if variant == Variant::Bare {
                ("1.00".to_string(), "—".to_string())
            } else if bare.is_empty() {
                ("—".to_string(), "—".to_string())
            } else {
                (ratio_text(ratios), format!("{:+.1} µs", cpu - bare_cpu))
            };
            let (redis_cpu, round_trips) = if variant.on_redis() {
                (
                    format!("{:.1} µs", med(&list, |s| s.redis_cpu_us_per_request)),
                    format!("{:.2}", med(&list, |s| s.redis_round_trips_per_request)),
                )
            } else {
                ("—".to_string(), "—".to_string())
            };
            let mut label = match (workload, variant) {
                (Workload::Conflict, Variant::Bare) => "bare (201: no 409 without the layer)",
                _ => variant.name(),
            }
            .to_string();
            if list.iter().any(|s| !s.answered_as_expected) {
                label.push_str(" **MISMATCH**");
            }
            println!(
                "| {} | {} | {} | {} | {} | {:.2} ms | {:.2} ms | {:.1} µs | {} | {} | {} |",
                workload.name(),
                label,
                thousands(med(&list, |s| s.rps)),
                vs_bare,
                vs_floor,
                med(&list, |s| s.wrk.p50_us as f64) / 1000.0,
                med(&list, |s| s.wrk.p99_us as f64) / 1000.0,
                cpu,
                extra_cpu,
                redis_cpu,
                round_trips
            );
        }
    }
    println!();
    println!(
        "wrk -t{} -c{} -d{}s --latency, loopback, keep-alive; server: axum on a {}-worker tokio \
         runtime in the bench process (`server CPU` is that whole process, per request); \
         Redis (no persistence) on the same machine.",
        settings.threads, settings.connections, settings.seconds, settings.server_threads,
    );
    println!("Command: `{}` ({}).", settings.command(), wrk_version(wrk));
    println!("Machine: {}.", machine_line());

    println!();
    println!("## Per-round req/s");
    println!();
    for &workload in &settings.workloads {
        for &variant in &settings.variants {
            let list = of(workload, variant);
            let rounds: Vec<_> = list.iter().map(|s| thousands(s.rps)).collect();
            println!(
                "{:<9} {:<12} {}",
                workload.name(),
                variant.name(),
                rounds.join("  ")
            );
        }
    }

    println!();
    println!("## Redis commands per request (redis server, round 1, raw INFO commandstats)");
    println!();
    println!(
        "Redis counts the calls inside scripts too (each script: one GET, then its SET or DEL); \
         round trips = all - get - del - evalsha's SET. `eval` is the release of a claim abandoned \
         when wrk closed its connections mid-request."
    );
    for &workload in &settings.workloads {
        for sample in samples
            .iter()
            .filter(|s| s.workload == workload && s.variant.on_redis() && s.round == 1)
        {
            let calls: Vec<_> = sample
                .redis_calls
                .iter()
                .map(|(name, per)| format!("{name} {per:.3}"))
                .collect();
            println!(
                "{:<9} {:<12} {}  => round trips {:.3}/req",
                workload.name(),
                sample.variant.name(),
                calls.join(", "),
                // `+ 0.0` prints a count of no calls as 0.000, not -0.000.
                sample.redis_round_trips_per_request + 0.0
            );
        }
    }
}

fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// CPU time of a process, in nanoseconds.
struct CpuClocks {
    ticks_per_second: u64,
}

impl CpuClocks {
    fn detect() -> Self {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        CpuClocks {
            ticks_per_second: u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100),
        }
    }

    fn describe(&self) -> String {
        let precise = Self::clock_ns(None).is_some();
        format!(
            "{} (fallback: /proc/<pid>/stat utime+stime at {} ticks/s)",
            if precise {
                "process CPU clocks (clock_gettime, ns)"
            } else {
                "process CPU clocks unavailable"
            },
            self.ticks_per_second
        )
    }

    /// The CPU time (user + system, all threads, exited ones included) of this process (`None`)
    /// or of `pid`.
    fn process_ns(&self, pid: Option<u32>) -> u64 {
        Self::clock_ns(pid)
            .or_else(|| self.proc_stat_ns(pid))
            .unwrap_or(0)
    }

    fn clock_ns(pid: Option<u32>) -> Option<u64> {
        let mut clock: libc::clockid_t = libc::CLOCK_PROCESS_CPUTIME_ID;
        if let Some(pid) = pid {
            let pid = libc::pid_t::try_from(pid).ok()?;
            // SAFETY: `clock` is a valid place for the clock id.
            if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
                return None;
            }
        }
        let mut time = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `time` is a valid timespec to write to.
        if unsafe { libc::clock_gettime(clock, &mut time) } != 0 {
            return None;
        }
        Some(u64::try_from(time.tv_sec).ok()? * 1_000_000_000 + u64::try_from(time.tv_nsec).ok()?)
    }

    fn proc_stat_ns(&self, pid: Option<u32>) -> Option<u64> {
        let path = match pid {
            Some(pid) => format!("/proc/{pid}/stat"),
            None => "/proc/self/stat".to_string(),
        };
        let stat = std::fs::read_to_string(path).ok()?;
        // Fields after the parenthesised command name start at field 3 (state); utime is 14.
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((utime + stime) * 1_000_000_000 / self.ticks_per_second)
    }
}

fn find_on_path(binary: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

fn print_machine(wrk: &Path) {
    println!("machine:  {}", machine_line());
    println!("load:     {} (1, 5, 15 min)", load_average());
    println!("wrk:      {}", wrk_version(wrk));
    if let Ok(output) = Command::new("rustc").arg("-V").output() {
        println!(
            "rustc:    {}",
            String::from_utf8_lossy(&output.stdout).trim()
        );
    }
}

fn machine_line() -> String {
    let nproc = std::thread::available_parallelism().map_or(0, usize::from);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == "model name").then(|| value.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    format!("{nproc} CPUs ({model}), Linux {kernel}")
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn wrk_version(wrk: &Path) -> String {
    Command::new(wrk)
        .arg("-v")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.split(" Copyright").next().unwrap_or(l).trim().to_string())
        })
        .unwrap_or_else(|| "wrk".into())
}

fn redis_version(redis: &RedisServer) -> String {
    redis
        .command(&["INFO", "server"])
        .as_string()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .map(|v| format!("Redis {}", v.trim()))
        })
        .unwrap_or_else(|| "Redis ?".into())
}

/// A random hex string: this run's keys never meet an earlier run's.
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
}

/// A temporary directory for the wrk scripts, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self, String> {
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-bench-{}-{}",
            std::process::id(),
            random_hex()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(TempDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
