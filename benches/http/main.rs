//! HTTP load benchmark: what the idempotency layer costs behind a real HTTP server.
//!
//! ```sh
//! cargo bench -p benches --bench http   # every variant: memory, Redis, PostgreSQL, their floors
//! # knobs (defaults shown); BENCH_SECONDS=1 BENCH_ROUNDS=1 BENCH_WARMUP=0 is a quick smoke run
//! BENCH_SECONDS=5 BENCH_ROUNDS=5 BENCH_WARMUP=1 BENCH_CONNECTIONS=32 BENCH_THREADS=1 \
//!     BENCH_SERVER_THREADS=<nproc> BENCH_WORKLOADS=replay,new-key,conflict cargo bench -p benches --bench http
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
//! - `memory+cache`: the same behind a `ReplayCache`;
//! - `redis-floor`: no layer, but the handler makes by hand, on one multiplexed connection, the
//!   Redis calls a layer must make (the crate's claim script, then its fenced completion script),
//!   and answers replays and 409s from the record the claim returned (`floor/redis.rs`): the most any
//!   Redis layer can reach;
//! - `redis`: behind `IdempotencyLayer::new(RedisStore::from_url(..))`;
//! - `redis+cache`: the same behind a `ReplayCache` (replays of this process's completions make no
//!   Redis call);
//! - with the `postgres` feature: `postgres-floor`, the claim and completion statements by hand on
//!   a pool like the store's, in the store's own table (`floor/postgres.rs`), and `postgres`,
//!   behind `PgStore`, on a private PostgreSQL server the bench starts (the test fixture: fsync
//!   off, as the Redis server keeps nothing on disk).
//!
//! The report gives each variant's throughput as a ratio to bare and, for a layer on a remote
//! store, to its floor (per round, then the median and the range over rounds), with the bench
//! process's CPU per request, the store server's CPU and its calls per request (`http/stores.rs`:
//! Redis `INFO commandstats`, counted into round trips; Postgres `pg_stat_statements`, each
//! statement kind with its mean server time). Each round's line also gives the slowest request and
//! the resident memory of the bench process and of Redis, for soaks.
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
//! conditions, every other round in reverse order, so that drift within a round does not always
//! favour the same side of a pair; the report takes medians over rounds. wrk's own "Non-2xx" count
//! includes the expected 409s, so the Lua `response()` hook counts statuses per code (and replayed
//! responses) and every run is checked: replay and new-key must answer 201, conflict 409 behind the
//! layer, replays must carry `Idempotent-Replayed`, and the handler must run exactly when it
//! should. A mismatch is printed loudly and the bench exits non-zero.
//!
//! wrk's own CPU and how often it slept are read with `getrusage(RUSAGE_CHILDREN)` around each run:
//! wrk shares the cores, so a ratio is about the ratio of server plus wrk CPU per request, and a
//! server slower than wrk leaves wrk idle, so that its responses must wake it.
//!
//! CPU time is read from the process CPU clocks (`clock_gettime`, nanoseconds; `/proc/<pid>/stat`
//! ticks as a fallback); PostgreSQL's is its postmaster's and its backends' (`http/process.rs`).
//!
//! `BENCH_VARIANTS=bare,memory,redis` (default: all) runs only some servers, e.g. to profile one.
//! `BENCH_DEDUP_WINDOW` (seconds, default 86400) and `BENCH_MEMORY_CAPACITY` (bytes, default
//! lifted) make a soak: records expire during the run, and each round's line shows whether
//! latency and memory stay flat, e.g. `BENCH_VARIANTS=memory,redis BENCH_WORKLOADS=new-key
//! BENCH_ROUNDS=10 BENCH_SECONDS=60 BENCH_WARMUP=0 BENCH_DEDUP_WINDOW=30 cargo bench -p benches --bench
//! http`; the end of the run prints the store's size and the process's resident and peak memory.
//!
//! A run started by `cargo test --benches` (no `--bench` argument) does nothing. CI runs a smoke,
//! `BENCH_SECONDS=1 BENCH_ROUNDS=1 BENCH_WARMUP=0 cargo bench -p benches --bench http`, which
//! fails on any MISMATCH (statuses, replay markers, handler counts) and checks no timing.

mod postgres_stats;
mod process;
mod report;
mod settings;
mod stores;
mod wrk;

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use axum::serve::ListenerExt;
use benches::app::{CHARGE, PATH, REQUEST_BODY};
use benches::floor;
use process::{ChildrenUse, CpuClocks, resident_kib, status_field};
use report::{check, load_average, ms, print_machine, print_report};
use settings::{
    REPLAY_CACHE_BYTES, REPLAY_CACHE_ENTRIES, Settings, StoreServer, Variant, Workload,
};
use stores::{StoreServers, StoreUse};
use test_servers::redis_server::RedisServer;
use tower_idempotency::store::ReplayCache;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_redis::RedisStore;
use wrk::{WrkResult, lua_script, run_wrk};

/// Timeout of the bench's own priming and probing requests.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between runs, so that stragglers of one run never land in the next one's counters.
const SETTLE: Duration = Duration::from_millis(200);

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then do nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!(
            "benches/http: run it with `cargo bench -p benches --bench http` (skipped: no --bench)"
        );
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

/// One measured run: a workload against one variant.
#[derive(Debug, Clone)]
struct Sample {
    round: usize,
    workload: Workload,
    variant: Variant,
    wrk: WrkResult,
    rps: f64,
    cpu_us_per_request: f64,
    /// wrk's CPU time per request, in microseconds.
    client_cpu_us: f64,
    /// How often wrk went to sleep, per request: each time, a response had to wake it.
    client_sleeps: f64,
    /// What the variant's store server did, per request (zero without one).
    store: StoreUse,
    /// The bench process's resident memory at the end of the run, in KiB.
    resident_kib: Option<u64>,
    /// How often the handler ran to completion during the run.
    executions: u64,
    /// How many requests the server received during the run.
    received: u64,
    /// Whether the run passed its checks.
    answered_as_expected: bool,
}

impl Sample {
    /// The bench process's resident memory, and the Redis server's on Redis, in MiB.
    fn resident_text(&self) -> String {
        let mib = |kib: Option<u64>| {
            kib.map_or("?".to_owned(), |k| format!("{:.0} MiB", k as f64 / 1024.0))
        };
        match self.variant.server() {
            Some(StoreServer::Redis) => format!(
                "{} (redis {})",
                mib(self.resident_kib),
                mib(self.store.resident_kib)
            ),
            _ => mib(self.resident_kib),
        }
    }
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
    let redis_client = deadpool_redis::redis::Client::open(redis.url())
        .map_err(|e| format!("redis client: {e}"))?;

    // The PostgreSQL server of the fixture (fsync off, like the Redis server's lack of
    // persistence): a private server on a free port, never the shared one.
    // It loads `pg_stat_statements`, which counts each run's statements.
    let (postgres, postgres_store, postgres_stats) = {
        let server =
            test_servers::postgres_server::PostgresServer::start_with(postgres_stats::SERVER_ARGS);
        let _runtime = runtime.enter();
        let store = tower_idempotency_postgres::PgStore::connect(&server.url())
            .map_err(|e| format!("{e}"))?
            .with_sweep_interval(None);
        runtime
            .block_on(store.migrate())
            .map_err(|e| format!("PgStore::migrate: {e}"))?;
        let postmaster = server.pid().ok_or("postgres has no pid")?;
        let stats = runtime.block_on(postgres_stats::PostgresStats::connect(
            &server.url(),
            postmaster,
        ))?;
        println!("postgres on {} (postmaster pid {postmaster})", server.url());
        (server, store, stats)
    };
    let stores = StoreServers {
        redis: &redis,
        redis_pid,
        postgres: &postgres_stats,
        runtime: &runtime,
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
                IdempotencyLayer::new(ReplayCache::new(
                    memory_store.clone(),
                    REPLAY_CACHE_ENTRIES,
                    REPLAY_CACHE_BYTES,
                ))
                .dedup_window(window),
            ),
            Variant::RedisFloor => floor::redis::redis_app(
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
                IdempotencyLayer::new(ReplayCache::new(
                    redis_store.clone(),
                    REPLAY_CACHE_ENTRIES,
                    REPLAY_CACHE_BYTES,
                ))
                .dedup_window(window),
            ),
            Variant::PostgresFloor => floor::postgres::postgres_app(
                runtime
                    .block_on(floor::postgres::pool(&postgres.url()))
                    .map_err(|e| format!("postgres floor pool: {e}"))?,
                window.as_millis() as u64,
                executions.clone(),
                holds.clone(),
            ),
            Variant::Postgres => {
                app.layer(IdempotencyLayer::new(postgres_store.clone()).dedup_window(window))
            }
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
                    &stores,
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
        // Every other round runs the servers in reverse order, so that no variant always runs
        // right after another: what drifts within a round (the stores growing, other load on the
        // machine) falls on both sides of each pair alike.
        let order: Vec<&Server> = match round % 2 {
            0 => servers.iter().rev().collect(),
            _ => servers.iter().collect(),
        };
        for &workload in &settings.workloads {
            for &server in &order {
                let script = script_for(workload, server)?;
                let sample = measure(
                    &settings,
                    &wrk,
                    &script,
                    settings.seconds,
                    server,
                    workload,
                    round,
                    &stores,
                    &clocks,
                )?;
                let mut sample = sample;
                sample.answered_as_expected =
                    check(&settings, &sample, server, &format!("round {round}"));
                ok &= sample.answered_as_expected;
                println!(
                    "  {:<8} {:<14} {:>9.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>7.1} ms  cpu {:>6.1} µs/req{}  wrk {:>4.1} µs/req {:.3} sleeps/req  [{}]  rss {}",
                    workload.name(),
                    server.variant.name(),
                    sample.rps,
                    ms(sample.wrk.p50_us),
                    ms(sample.wrk.p99_us),
                    ms(sample.wrk.max_us),
                    sample.cpu_us_per_request,
                    match server.variant.server() {
                        Some(store) => format!(
                            "  {} {:>5.1} µs/req {:.2} rt/req",
                            store.name(),
                            sample.store.cpu_us,
                            sample.store.round_trips
                        ),
                        None => String::new(),
                    },
                    sample.client_cpu_us,
                    sample.client_sleeps,
                    sample.wrk.statuses_text(),
                    sample.resident_text(),
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
        status_field(None, "VmRSS:").unwrap_or_else(|| "?".into()),
        status_field(None, "VmHWM:").unwrap_or_else(|| "?".into())
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
    stores: &StoreServers<'_>,
    clocks: &CpuClocks,
) -> Result<Sample, String> {
    std::thread::sleep(SETTLE);
    let store = server
        .variant
        .server()
        .map(|store| stores.start(store, clocks))
        .transpose()?;
    let executions_before = server.executions.load(Ordering::SeqCst);
    let received_before = server.received.load(Ordering::SeqCst);
    let cpu_before = clocks.process_ns(None);
    let client_before = ChildrenUse::now();

    let output = run_wrk(settings, wrk, script, seconds, server.port)?;

    let cpu_after = clocks.process_ns(None);
    let client = ChildrenUse::now().since(client_before);
    let executions = server.executions.load(Ordering::SeqCst) - executions_before;
    let received = server.received.load(Ordering::SeqCst) - received_before;
    // Costs per request served: what the server received, which is wrk's count plus the requests
    // in flight when wrk stopped.
    let requests = received.max(1) as f64;
    let store = match store {
        Some(started) => stores.finish(started, clocks, requests)?,
        None => StoreUse::default(),
    };
    let wrk_result = WrkResult::parse(&output)?;
    Ok(Sample {
        round,
        workload,
        variant: server.variant,
        rps: wrk_result.requests as f64 / (wrk_result.duration_us.max(1) as f64 / 1e6),
        cpu_us_per_request: cpu_after.saturating_sub(cpu_before) as f64 / 1e3 / requests,
        client_cpu_us: client.cpu_ns as f64 / 1e3 / requests,
        client_sleeps: client.sleeps as f64 / requests,
        store,
        resident_kib: resident_kib(None),
        executions,
        received,
        answered_as_expected: true,
        wrk: wrk_result,
    })
}

fn find_on_path(binary: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
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
