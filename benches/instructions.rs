//! The layer's cost in instructions per request, in process, counted by callgrind: unlike time,
//! instructions do not move with the machine's other load, so a change of a few hundred shows.
//!
//! ```sh
//! cargo bench --bench instructions                 # every case; needs valgrind
//! PROBE=memory:new-key:500 cargo bench --bench instructions   # one case, without valgrind
//! ```
//!
//! The requests are those of `benches/layer.rs` (`benches/app`): an axum `Router` driven with
//! `oneshot` on a current-thread runtime, one request at a time, a 64-byte JSON body and a
//! 203-byte JSON `201`. Per request = (Ir of 2,500 requests − Ir of 500) / 2,000, each count a
//! whole run of this program under `valgrind --tool=callgrind`: start-up, the first requests'
//! allocations and the runtime's set-up cancel out. Every answer's status is checked.

#[allow(dead_code, reason = "shared with benches/layer.rs")]
mod app;

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use app::{REPLAY_KEY, Variant, app, call, post_request};
use axum::http::StatusCode;

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
const CASES: [(Variant, Workload); 7] = [
    (Variant::Bare, Workload::NewKey),
    (Variant::Bare, Workload::Replay),
    (Variant::Bare, Workload::Conflict),
    (Variant::Memory, Workload::NewKey),
    (Variant::Memory, Workload::Replay),
    (Variant::Memory, Workload::Conflict),
    (Variant::Boxed, Workload::NewKey),
];

fn main() {
    if let Ok(case) = std::env::var("PROBE") {
        return run_case(&case);
    }
    println!("| case | Ir per request | over bare |");
    println!("|---|---:|---:|");
    let mut bare = std::collections::HashMap::new();
    for (variant, workload) in CASES {
        let case = format!("{}:{}", variant.name(), workload.name());
        let per_request = (count(&case, MANY) - count(&case, FEW)) / (MANY - FEW);
        let over = match bare.get(workload.name()) {
            Some(&bare) if variant != Variant::Bare => format!("{:+}", per_request as i64 - bare),
            _ => String::new(),
        };
        if variant == Variant::Bare {
            bare.insert(workload.name(), per_request as i64);
        }
        println!("| {case} | {per_request} | {over} |");
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

/// Runs `variant:workload:requests` once, checking every answer.
fn run_case(case: &str) {
    let mut parts = case.split(':');
    let (Some(variant), Some(workload), Some(requests)) =
        (parts.next(), parts.next(), parts.next())
    else {
        panic!("PROBE is variant:workload:requests, e.g. memory:new-key:500; got {case:?}");
    };
    let variant = Variant::ALL
        .into_iter()
        .find(|v| v.name() == variant)
        .unwrap_or_else(|| panic!("unknown variant {variant:?}"));
    let workload =
        Workload::parse(workload).unwrap_or_else(|| panic!("unknown workload {workload:?}"));
    let requests: u64 = requests.parse().expect("a number of requests");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let app = app(variant);
        let expected = match (variant, workload) {
            (Variant::Bare, _) | (_, Workload::NewKey | Workload::Replay) => StatusCode::CREATED,
            (_, Workload::Conflict) => StatusCode::CONFLICT,
        };
        match workload {
            Workload::Replay => {
                let first = call(&app, post_request(REPLAY_KEY, false)).await;
                assert_eq!(first, StatusCode::CREATED, "priming the replay key");
            }
            Workload::Conflict if variant != Variant::Bare => app::hold(&app).await,
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
    });
}
