//! The layer's cost in instructions per request, in process, counted by callgrind: unlike time,
//! instructions do not move with the machine's other load, so a change of a few hundred shows.
//!
//! ```sh
//! cargo bench --bench instructions                 # every case; needs valgrind and redis-server
//! PROBE=memory:new-key:500 cargo bench --bench instructions   # one case, without valgrind
//! ```
//!
//! The requests are those of `benches/layer.rs` (`benches/app`): an axum `Router` driven with
//! `oneshot` on a current-thread runtime, one request at a time, a 64-byte JSON body and a
//! 203-byte JSON `201`. Per request = (Ir of 2,500 requests − Ir of 500) / 2,000, each count a
//! whole run of this program under `valgrind --tool=callgrind`: start-up, the first requests'
//! allocations and the runtime's set-up cancel out. Every answer's status is checked. The stores:
//! `memory`, `boxed` (the same behind `BoxStore`), `redis` (a `redis-server` of its own, whose
//! instructions are not counted: only the application's), and each `-sealed` behind `SealedStore`
//! (feature `seal`). A second table gives the bytes a stored record takes, plain and sealed.

#[allow(dead_code, reason = "shared with benches/layer.rs")]
mod app;

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use app::{REPLAY_KEY, Variant, app, call, layered, post_request};
use axum::Router;
use axum::http::StatusCode;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{BoxStore, Fingerprint, MemoryStore, Record, RecordId};
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
/// requests with 201, as it answers a replay's).
const CASES: [(&str, Workload); 13] = [
    ("bare", Workload::NewKey),
    ("bare", Workload::Replay),
    ("bare", Workload::Conflict),
    ("memory", Workload::NewKey),
    ("memory", Workload::Replay),
    ("memory", Workload::Conflict),
    ("boxed", Workload::NewKey),
    ("memory-sealed", Workload::NewKey),
    ("memory-sealed", Workload::Replay),
    ("redis", Workload::NewKey),
    ("redis", Workload::Replay),
    ("redis-sealed", Workload::NewKey),
    ("redis-sealed", Workload::Replay),
];

fn main() {
    if let Ok(case) = std::env::var("PROBE") {
        return run_case(&case);
    }
    println!("| case | Ir per request | over bare |");
    println!("|---|---:|---:|");
    let mut bare = std::collections::HashMap::new();
    for (setup, workload) in CASES {
        let case = format!("{setup}:{}", workload.name());
        let per_request = (count(&case, MANY) - count(&case, FEW)) / (MANY - FEW);
        let over = match bare.get(workload.name()) {
            Some(&bare) if setup != "bare" => format!("{:+}", per_request as i64 - bare),
            _ => String::new(),
        };
        if setup == "bare" {
            bare.insert(workload.name(), per_request as i64);
        }
        println!("| {case} | {per_request} | {over} |");
    }
    println!();
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

/// The instructions of a whole run of `case` with `requests` requests, under callgrind.
fn count(case: &str, requests: u64) -> u64 {
    let exe = std::env::current_exe().expect("this program's path");
    let out = std::env::temp_dir().join(format!("instructions-{}.callgrind", std::process::id()));
    let run = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(&exe)
        .env("PROBE", format!("{case}:{requests}"))
        .output()
        .expect("valgrind runs (apt-get install valgrind)");
    let _ = std::fs::remove_file(&out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "{case} under callgrind failed:\n{stderr}"
    );
    // callgrind's last words: "==<pid>== Collected : <Ir>".
    stderr
        .lines()
        .find_map(|line| line.split("Collected : ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no instruction count from callgrind:\n{stderr}"))
}

/// A key that seals, as an application's would be (its bytes do not change the cost).
fn keys() -> SealKeys {
    SealKeys::new([SealKey::new("2026-12", [7; 32]).expect("a key")]).expect("keys")
}

/// The app of `setup`, and the store under any seal (to read a record back as stored).
fn setup(
    name: &str,
    redis: Option<&test_servers::redis_server::RedisServer>,
) -> (Router, Option<BoxStore>) {
    let inner = match (name, redis) {
        ("bare" | "memory" | "boxed", _) => {
            let variant = Variant::ALL.into_iter().find(|v| v.name() == name);
            return (app(variant.expect("a variant")), None);
        }
        ("memory-sealed", _) => BoxStore::new(MemoryStore::new()),
        (_, Some(server)) => BoxStore::new(RedisStore::from_url(&server.url()).expect("a store")),
        _ => panic!("unknown store {name:?}"),
    };
    let app = match name {
        "redis" => layered(inner.clone()),
        _ => layered(SealedStore::new(inner.clone(), keys())),
    };
    (app, Some(inner))
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
    let server = name
        .starts_with("redis")
        .then(test_servers::redis_server::RedisServer::start);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (app, store) = setup(name, server.as_ref());
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
