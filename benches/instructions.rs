//! The layer's cost in instructions per request, in process, counted by callgrind: unlike time,
//! instructions do not move with the machine's other load, so a change of a few hundred shows.
//!
//! ```sh
//! cargo bench -p benches --bench instructions  # every case; valgrind, redis-server, PostgreSQL
//! PROBE=memory:new-key:500 cargo bench -p benches --bench instructions   # one case, without valgrind
//! INSTRUCTIONS_CASES=redis,redis-floor cargo bench -p benches --bench instructions   # some stores only
//! INSTRUCTIONS_QUICK=1 cargo bench -p benches --bench instructions    # every case once, natively
//! ```
//!
//! The requests are those of `benches/layer.rs` (`benches/app`): an axum `Router` driven with
//! `oneshot` on a current-thread runtime, one request at a time, a 64-byte JSON body and a
//! 203-byte JSON `201`. Per request = (Ir of 2,500 requests − Ir of 500) / 2,000, each count a
//! whole run of this program under `valgrind --tool=callgrind`: start-up, the first requests'
//! allocations and the runtime's set-up cancel out. Every answer's status is checked. The stores:
//! `memory`, `boxed` (the same behind `BoxStore`), `memory-quota` (the same with a scope quota it
//! never reaches: what keeping the budgets costs), `redis` (a `redis-server` of its own, whose
//! instructions are not counted: only the application's), and each `-sealed` behind `SealedStore`
//! (feature `seal`). A second table gives the bytes a stored record takes, plain and sealed.
//!
//! A remote store is measured against its floor: the same requests to the same router, whose
//! handler makes by hand the store calls any layer must make (the floors of `benches/http/main.rs`,
//! `floor/redis.rs` and `floor/postgres.rs`, in the package library): `redis-floor`, the
//! claim script's `EVALSHA` and the fenced completion's on one redis-rs multiplexed connection;
//! `postgres-floor`, the claim and completion statements through a sqlx pool like the store's. The
//! layer over its floor is what the layer itself costs a request on that store. With the
//! `postgres` feature, `postgres` and `postgres-floor` run on a private PostgreSQL server
//! (`test-servers`: `initdb` once, on a free port, `fsync` off); the store's
//! background sweep is off, as it is no request's work.
//!
//! `INSTRUCTIONS_QUICK=1` runs every case once with a few requests, natively, checking every
//! answer and counting nothing: the CI smoke.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use benches::app::{self, REPLAY_KEY, Variant, app, call, layered, layered_with, post_request};
use benches::floor;
use benches::support::{callgrind, chart};
use deadpool_redis::redis;
use tower_idempotency::record::{Fingerprint, Record, RecordId};
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::{Claim, ScopeQuota, Store};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

/// The request counts whose difference is measured.
const FEW: u64 = 500;
const MANY: u64 = 2_500;

/// What a case sends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// A key never used before, every request.
    NewKey,
    /// One key, completed once before the count: every request is a replay.
    Replay,
    /// One key held in flight by a request that never finishes: every request is a 409.
    Conflict,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::NewKey => "new-key",
            Workload::Replay => "replay",
            Workload::Conflict => "conflict",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        [Workload::NewKey, Workload::Replay, Workload::Conflict]
            .into_iter()
            .find(|w| w.name() == name)
    }
}

/// The cases measured, each against `bare` with the same requests (bare answers the held key's
/// requests with 201, as it answers a replay's), and a layer on a remote store against its floor.
fn cases() -> Vec<(&'static str, Workload)> {
    let mut cases = vec![
        ("bare", Workload::NewKey),
        ("bare", Workload::Replay),
        ("bare", Workload::Conflict),
        ("memory", Workload::NewKey),
        ("memory", Workload::Replay),
        ("memory", Workload::Conflict),
        ("boxed", Workload::NewKey),
        ("memory-quota", Workload::NewKey),
        ("memory-quota", Workload::Replay),
        ("memory-sealed", Workload::NewKey),
        ("memory-sealed", Workload::Replay),
        ("redis-floor", Workload::NewKey),
        ("redis-floor", Workload::Replay),
        ("redis", Workload::NewKey),
        ("redis", Workload::Replay),
        ("redis-sealed", Workload::NewKey),
        ("redis-sealed", Workload::Replay),
        ("postgres-floor", Workload::NewKey),
        ("postgres-floor", Workload::Replay),
        ("postgres", Workload::NewKey),
        ("postgres", Workload::Replay),
    ];
    // `INSTRUCTIONS_CASES=redis,redis-floor`: only those stores (and bare, the reference).
    if let Ok(only) = std::env::var("INSTRUCTIONS_CASES") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        cases.retain(|(setup, _)| *setup == "bare" || only.contains(setup));
    }
    cases
}

/// The floor a layered case is measured against: the same store's calls made by hand.
fn floor_of(setup: &str) -> Option<&'static str> {
    match setup.strip_suffix("-sealed").unwrap_or(setup) {
        "redis" => Some("redis-floor"),
        "postgres" => Some("postgres-floor"),
        _ => None,
    }
}

fn main() {
    if let Ok(case) = std::env::var("PROBE") {
        return run_case(&case);
    }
    if std::env::var_os("INSTRUCTIONS_QUICK").is_some() {
        return quick();
    }
    println!("| case | Ir per request | over bare | over its floor |");
    println!("|---|---:|---:|---:|");
    let mut measured = std::collections::HashMap::new();
    for (setup, workload) in cases() {
        let case = format!("{setup}:{}", workload.name());
        let per_request = ((count(&case, MANY) - count(&case, FEW)) / (MANY - FEW)) as i64;
        measured.insert((setup, workload.name()), per_request);
        let over = |reference: &str| {
            measured
                .get(&(reference, workload.name()))
                .map(|reference| format!("{:+}", per_request - reference))
                .unwrap_or_default()
        };
        let over_bare = if setup == "bare" {
            String::new()
        } else {
            over("bare")
        };
        let over_floor = floor_of(setup).map(over).unwrap_or_default();
        println!("| {case} | {per_request} | {over_bare} | {over_floor} |");
    }
    println!();
    draw(&measured);
    println!("| store | bytes of the replayed record, as stored |");
    println!("|---|---:|");
    for setup in ["redis", "redis-sealed"] {
        let run = Command::new(std::env::current_exe().expect("this program's path"))
            .env("PROBE", format!("{setup}:replay:1"))
            .output()
            .expect("the probe runs");
        let printed = String::from_utf8_lossy(&run.stdout);
        let bytes = printed
            .lines()
            .find_map(|l| l.strip_prefix("record bytes: "));
        println!("| {setup} | {} |", bytes.unwrap_or("?"));
    }
}

/// The chart of BENCHMARKS.md: each store's instructions per request against bare and its floor.
fn draw(measured: &std::collections::HashMap<(&str, &str), i64>) {
    let names = [
        "bare",
        "memory",
        "redis-floor",
        "redis",
        "postgres-floor",
        "postgres",
    ];
    let groups: Vec<(&str, Vec<f64>)> = ["new-key", "replay"]
        .into_iter()
        .map(|workload| {
            let values = names
                .iter()
                .map(|name| measured.get(&(*name, workload)).map_or(0.0, |&v| v as f64))
                .collect();
            (workload, values)
        })
        .collect();
    chart::bars(
        "instructions-per-request.svg",
        "Instructions per request (callgrind): each store against bare and its floor",
        "Ir per request",
        &names,
        &groups,
    );
}

/// Every case once, natively, with a few requests: each answer is checked, nothing counted.
fn quick() {
    let exe = std::env::current_exe().expect("this program's path");
    for (setup, workload) in cases() {
        let case = format!("{setup}:{}:20", workload.name());
        let run = Command::new(&exe)
            .env("PROBE", &case)
            .output()
            .expect("the probe runs");
        assert!(
            run.status.success(),
            "{case} failed:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
        println!("{case}: answered as expected");
    }
}

/// The instructions of a whole run of `case` with `requests` requests, under callgrind.
fn count(case: &str, requests: u64) -> u64 {
    callgrind::instructions(("PROBE", &format!("{case}:{requests}")), true)
}

/// A key that seals, as an application's would be (its bytes do not change the cost).
fn keys() -> SealKeys {
    SealKeys::new([SealKey::new("2026-12", [7; 32]).expect("a key")]).expect("keys")
}

/// The store servers a case runs on, each its own process on a free port.
#[derive(Default)]
struct Servers {
    redis: Option<test_servers::redis_server::RedisServer>,
    postgres: Option<test_servers::postgres_server::PostgresServer>,
}

impl Servers {
    fn for_setup(name: &str) -> Self {
        Servers {
            redis: name
                .starts_with("redis")
                .then(test_servers::redis_server::RedisServer::start),
            postgres: name
                .starts_with("postgres")
                .then(test_servers::postgres_server::PostgresServer::start),
        }
    }

    fn redis_url(&self) -> String {
        self.redis.as_ref().expect("a redis-server").url()
    }

    fn postgres_url(&self) -> String {
        self.postgres.as_ref().expect("a PostgreSQL server").url()
    }
}

/// The floors' records live as long as the layer's default dedup window.
const WINDOW_MS: u64 = 24 * 60 * 60 * 1000;

/// The app of `setup`, and the store under any seal (to read a record back as stored), boxed. The
/// app holds the store itself: a `BoxStore` would box each call's future (the `boxed` case).
async fn setup(name: &str, servers: &Servers) -> (Router, Option<BoxStore>) {
    let counter = || std::sync::Arc::new(AtomicU64::new(0));
    match name {
        "bare" | "memory" | "boxed" => {
            let variant = Variant::ALL.into_iter().find(|v| v.name() == name);
            (app(variant.expect("a variant")), None)
        }
        "redis-floor" => {
            let client = redis::Client::open(servers.redis_url()).expect("a redis client");
            let connection = client
                .get_multiplexed_async_connection()
                .await
                .expect("a multiplexed connection");
            let floor = floor::redis::redis_app(connection, WINDOW_MS, counter(), counter());
            (floor.with_state(()), None)
        }
        "postgres-floor" => {
            let url = servers.postgres_url();
            // The store's own table, so the floor's rows pay for its constraints and index.
            let store = PgStore::connect(&url)
                .expect("a store")
                .with_sweep_interval(None);
            store.migrate().await.expect("the store's table");
            let pool = floor::postgres::pool(&url).await.expect("a pool");
            let floor = floor::postgres::postgres_app(pool, WINDOW_MS, counter(), counter());
            (floor.with_state(()), None)
        }
        "postgres" => {
            let store = PgStore::connect(&servers.postgres_url())
                .expect("a store")
                .with_sweep_interval(None);
            store.migrate().await.expect("the store's table");
            (layered(store.clone()), Some(BoxStore::new(store)))
        }
        // A quota per scope that is never reached: what keeping the budgets costs a request.
        "memory-quota" => {
            let layer = IdempotencyLayer::new(ScopeQuota::new(MemoryStore::new(), 1 << 50));
            (layered_with(layer), None)
        }
        "memory-sealed" => {
            let store = MemoryStore::new();
            let app = layered(SealedStore::new(store.clone(), keys()));
            (app, Some(BoxStore::new(store)))
        }
        "redis" | "redis-sealed" => {
            let store = RedisStore::from_url(&servers.redis_url()).expect("a store");
            let app = match name {
                "redis" => layered(store.clone()),
                _ => layered(SealedStore::new(store.clone(), keys())),
            };
            (app, Some(BoxStore::new(store)))
        }
        _ => panic!("unknown store {name:?}"),
    }
}

/// Runs `setup:workload:requests` once, checking every answer; prints the bytes the replay key's
/// record takes in the store.
fn run_case(case: &str) {
    let mut parts = case.split(':');
    let (Some(name), Some(workload), Some(requests)) = (parts.next(), parts.next(), parts.next())
    else {
        panic!("PROBE is store:workload:requests, e.g. memory:new-key:500; got {case:?}");
    };
    let workload =
        Workload::parse(workload).unwrap_or_else(|| panic!("unknown workload {workload:?}"));
    let requests: u64 = requests.parse().expect("a number of requests");
    let servers = Servers::for_setup(name);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (app, store) = setup(name, &servers).await;
        let expected = match (name, workload) {
            ("bare", _) | (_, Workload::NewKey | Workload::Replay) => StatusCode::CREATED,
            (_, Workload::Conflict) => StatusCode::CONFLICT,
        };
        match workload {
            Workload::Replay => {
                let first = call(&app, post_request(REPLAY_KEY, false)).await;
                assert_eq!(first, StatusCode::CREATED, "priming the replay key");
            }
            Workload::Conflict if name != "bare" => app::hold(&app).await,
            _ => {}
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut key = String::with_capacity(32);
        for _ in 0..requests {
            let key = match workload {
                Workload::NewKey => {
                    key.clear();
                    key.push_str("probe-new-");
                    key.push_str(&NEXT.fetch_add(1, Ordering::Relaxed).to_string());
                    key.as_str()
                }
                Workload::Replay => REPLAY_KEY,
                Workload::Conflict => app::HELD_KEY,
            };
            let status = call(&app, post_request(key, false)).await;
            assert_eq!(status, expected, "{case}");
        }
        if let (Some(store), Workload::Replay) = (store, workload) {
            let id = RecordId::new(b"", REPLAY_KEY);
            let fingerprint = Fingerprint::from_bytes([0; 32]);
            if let Ok(Claim::Existing(Record::Completed(done))) =
                store.claim(&id, &fingerprint, Duration::from_secs(1)).await
            {
                println!(
                    "record bytes: {}",
                    done.encode().expect("an encoding").len()
                );
            }
        }
    });
}
