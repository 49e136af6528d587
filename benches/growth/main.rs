//! What a request and a record cost as the records grow to millions.
//!
//! ```sh
//! cargo bench -p benches --bench growth                          # everything; valgrind, redis-server, PostgreSQL
//! GROWTH=memory cargo bench -p benches --bench growth             # one part: memory, redis or postgres
//! GROWTH_QUICK=1 cargo bench -p benches --bench growth            # the CI smoke: small, checks answers only
//! BENCH_CHARTS=$PWD/docs/bench cargo bench -p benches --bench growth  # and redraws the charts
//! ```
//!
//! - **memory**: a `MemoryStore` prefilled with 100 k, 1 M and 5 M live records
//!   (`GROWTH_MEMORY_RECORDS=100000,1000000,5000000`), each through the store's own claim and
//!   completion, with the record a layer writes for the charge of `benches/app` (201, JSON, 203
//!   bytes). Then new keys through the layer, as in `benches/instructions.rs`: instructions per new
//!   key, counted by callgrind over 2,000 requests after 500 uncounted ones, with the prefill not
//!   instrumented at all (`--instr-atstart=no`, and callgrind's client requests around the counted
//!   requests: `support/callgrind.rs`); and resident bytes per record, the growth of this
//!   process's resident set (`/proc/self/statm`) over the prefill, in a native run. Before the
//!   counted requests the run waits out the prefill's leases (30 s), so that at every size the
//!   store calls find the same backlog of due lease items to collect. Check: each figure within
//!   20% from the smallest to the largest size, or the bench fails.
//! - **redis**: the bytes a record takes in Redis (`MEMORY USAGE key SAMPLES 0`, the mean over 200
//!   records written by the layer) for JSON responses of 200 B, 2 KiB and 20 KiB, beside the
//!   stored value's length (`STRLEN`) and the server's `used_memory` growth per record (the
//!   keyspace's own entries included). Target, from 2 KiB up: at most 1.1 × the response + 100 B.
//! - **postgres**: `growth/postgres.rs`, a table of a million records
//!   churning under a window of minutes, swept by the store's `DELETE` or kept in partitions
//!   dropped whole.
//!
//! `GROWTH_QUICK=1` runs each part small and natively (no valgrind): every answer is checked,
//! no figure is. A run started by `cargo test --benches` (no `--bench` argument) does nothing.

mod postgres;

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::routing::post;
use benches::app::{CHARGE, PATH, call, layered, post_request};
use benches::support::{callgrind, chart};
use chart::Series;
use tower_idempotency::record::{Completed, Fingerprint, RecordId, StoredResponse};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_redis::RedisStore;

/// New keys sent before the count starts, and counted.
const WARM_UP: u64 = 500;
const COUNTED: u64 = 2_000;
/// The layer's default lease and dedup window, which the prefill's records get too.
const LEASE: Duration = Duration::from_secs(30);
const WINDOW: Duration = Duration::from_secs(24 * 60 * 60);
/// How much a figure may grow from the smallest store to the largest.
const FLAT: f64 = 1.2;

fn main() -> ExitCode {
    if let Ok(probe) = std::env::var("GROWTH_PROBE") {
        memory_probe(&probe);
    }
    if !std::env::args().any(|arg| arg == "--bench") {
        println!(
            "benches/growth: run it with `cargo bench -p benches --bench growth` (skipped: no --bench)"
        );
        return ExitCode::SUCCESS;
    }
    let quick = std::env::var_os("GROWTH_QUICK").is_some();
    let parts = std::env::var("GROWTH").unwrap_or_else(|_| "memory,redis,postgres".into());
    let mut ok = true;
    for part in parts.split(',').map(str::trim) {
        ok &= match part {
            "memory" => memory(quick),
            "redis" => redis(quick),
            "postgres" => postgres::run(quick),
            other => panic!("GROWTH lists memory, redis and postgres, not {other:?}"),
        };
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("\nFAILED: see the lines marked FAILED above");
        ExitCode::FAILURE
    }
}

/// Record counts from `GROWTH_MEMORY_RECORDS`, or the defaults.
fn memory_sizes(quick: bool) -> Vec<u64> {
    match std::env::var("GROWTH_MEMORY_RECORDS") {
        Ok(list) => list
            .split(',')
            .map(|n| n.trim().parse().expect("GROWTH_MEMORY_RECORDS: numbers"))
            .collect(),
        Err(_) if quick => vec![1_000, 10_000],
        Err(_) => vec![100_000, 1_000_000, 5_000_000],
    }
}

/// The memory store's part: runs this program once per size natively (resident bytes) and once
/// under callgrind (instructions), and checks that both stay flat.
fn memory(quick: bool) -> bool {
    println!("## MemoryStore: cost per new key and bytes per record against live records\n");
    let exe = std::env::current_exe().expect("this program's path");
    let mut rows = Vec::new();
    for records in memory_sizes(quick) {
        let started = Instant::now();
        let native = Command::new(&exe)
            .env(
                "GROWTH_PROBE",
                format!("{records}:{}", if quick { 0 } else { 1 }),
            )
            .output()
            .expect("the probe runs");
        let printed = String::from_utf8_lossy(&native.stdout);
        assert!(
            native.status.success(),
            "the memory probe at {records} records failed:\n{printed}\n{}",
            String::from_utf8_lossy(&native.stderr)
        );
        let field = |name: &str| -> f64 {
            printed
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name:?} in:\n{printed}"))
        };
        let resident = field("resident bytes per record:");
        let accounted = field("store bytes per record:");
        let prefill_ns = field("prefill ns per record:");
        let instructions = if quick {
            None
        } else {
            Some(count_new_keys(records))
        };
        println!(
            "{records:>9} records: {} Ir per new key, {resident:.0} resident bytes per record \
             ({accounted:.0} counted by the store), prefill {:.2} µs per record natively ({:.0} s)",
            instructions.map_or("-".into(), |i| format!("{i:.0}")),
            prefill_ns / 1e3,
            started.elapsed().as_secs_f64()
        );
        rows.push((records, instructions, resident, accounted));
    }
    println!();
    println!(
        "| live records | Ir per new key | resident bytes per record | bytes per record, as the store counts them |"
    );
    println!("|---:|---:|---:|---:|");
    for (records, instructions, resident, accounted) in &rows {
        println!(
            "| {} | {} | {resident:.0} | {accounted:.0} |",
            chart::count(*records as f64),
            instructions.map_or("-".into(), |i| format!("{i:.0}"))
        );
    }
    println!();
    if quick {
        println!("(quick: answers checked, no figure)\n");
        return true;
    }
    let spread = |values: Vec<f64>| {
        let lo = values.iter().copied().fold(f64::MAX, f64::min);
        let hi = values.iter().copied().fold(f64::MIN, f64::max);
        hi / lo
    };
    let ir_spread = spread(rows.iter().filter_map(|r| r.1).collect());
    let rss_spread = spread(rows.iter().map(|r| r.2).collect());
    let mut ok = true;
    for (what, spread) in [
        ("Ir per new key", ir_spread),
        ("resident bytes per record", rss_spread),
    ] {
        let verdict = if spread <= FLAT {
            "flat"
        } else {
            "FAILED: not flat"
        };
        ok &= spread <= FLAT;
        println!("{what}: largest / smallest = {spread:.3} (at most {FLAT}): {verdict}");
    }
    println!();
    chart::lines(
        "memory-growth-instructions.svg",
        "MemoryStore: instructions per new key (callgrind)",
        "live records",
        "Ir per new key",
        true,
        &[Series {
            name: "memory layer, new key".into(),
            points: rows
                .iter()
                .filter_map(|r| Some((r.0 as f64, r.1?)))
                .collect(),
        }],
    );
    chart::lines(
        "memory-growth-bytes.svg",
        "MemoryStore: bytes per live record",
        "live records",
        "bytes per record",
        true,
        &[
            Series {
                name: "resident (RSS growth / records)".into(),
                points: rows.iter().map(|r| (r.0 as f64, r.2)).collect(),
            },
            Series {
                name: "as the store counts them (used_bytes)".into(),
                points: rows.iter().map(|r| (r.0 as f64, r.3)).collect(),
            },
        ],
    );
    ok
}

/// Instructions per new key with `records` live records: one run under callgrind, instrumented
/// only around the counted requests.
fn count_new_keys(records: u64) -> f64 {
    let collected = callgrind::instructions(("GROWTH_PROBE", &format!("{records}:1")), false);
    collected as f64 / COUNTED as f64
}

/// This process's resident bytes (`/proc/self/statm`'s second field, in pages).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("resident pages");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).expect("a page size")
}

/// The record a layer writes for the charge handler's answer.
fn charge_record(fingerprint: Fingerprint) -> Completed {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Completed::with_response(
        fingerprint,
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: CHARGE.into(),
            trailers: None,
        },
    )
}

/// `GROWTH_PROBE=records:wait`: prefills a memory store, prints its bytes per record, waits out
/// the prefill's leases when `wait` is 1, then sends new keys through the layer, the counted ones
/// between callgrind's client requests. Exits without dropping the store.
fn memory_probe(probe: &str) -> ! {
    let (records, wait) = probe.split_once(':').expect("GROWTH_PROBE is records:wait");
    let records: u64 = records.parse().expect("a number of records");
    let wait = wait == "1";
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        // No bound that millions of records could reach: the bench measures growth, not refusal.
        let store = MemoryStore::with_capacity(1 << 44);
        let app = layered(store.clone());
        let before = resident_bytes();
        let started = Instant::now();
        for i in 0..records {
            let id = RecordId::new(b"", &format!("prefill-{i}"));
            let mut bytes = [0; 32];
            bytes[..8].copy_from_slice(&i.to_le_bytes());
            let fingerprint = Fingerprint::from_bytes(bytes);
            let Ok(Claim::Claimed(token)) = store.claim(&id, &fingerprint, LEASE).await else {
                panic!("prefill: record {i} was not claimed");
            };
            let written = store
                .complete(&id, &token, &charge_record(fingerprint), WINDOW)
                .await;
            assert!(
                matches!(written, Ok(true)),
                "prefill: record {i} was not completed"
            );
        }
        let prefill = started.elapsed();
        let grown = resident_bytes().saturating_sub(before);
        println!(
            "resident bytes per record: {}",
            grown as f64 / records as f64
        );
        println!(
            "store bytes per record: {}",
            store.used_bytes() as f64 / records as f64
        );
        println!(
            "prefill ns per record: {}",
            prefill.as_nanos() as f64 / records as f64
        );
        if wait {
            // Every prefilled claim's lease item comes due, at every size alike.
            tokio::time::sleep(LEASE + Duration::from_secs(1)).await;
        }
        let mut key = String::with_capacity(32);
        let mut send = async |n: u64| {
            for i in 0..n {
                key.clear();
                key.push_str("growth-new-");
                key.push_str(&i.to_string());
                key.push_str(if n == WARM_UP { "w" } else { "c" });
                let status = call(&app, post_request(&key, false)).await;
                assert_eq!(status, StatusCode::CREATED, "a new key");
            }
        };
        send(WARM_UP).await;
        callgrind::start_instrumentation();
        send(COUNTED).await;
        callgrind::stop_instrumentation();
        let live = store.len() as u64;
        assert_eq!(live, records + WARM_UP + COUNTED, "every record is live");
    });
    // Dropping millions of records would only take time.
    std::process::exit(0)
}

/// A JSON document of exactly `size` bytes: charge objects of varied ids and amounts, as a list
/// endpoint would answer, padded to the byte with random hex digits (the 200-byte one is all
/// padding: no charge object fits).
fn json_of(size: usize) -> String {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let tail = r#"],"has_more":false,"pad":""}"#;
    let mut json = String::from(r#"{"object":"list","data":["#);
    loop {
        let object = format!(
            r#"{}{{"id":"ch_{:016x}{:08x}","object":"charge","amount":{},"currency":"eur","status":"succeeded","customer":"cus_{:012x}","created":{}}}"#,
            if json.ends_with('[') { "" } else { "," },
            next(),
            next() as u32,
            next() % 100_000,
            next() & 0xffff_ffff_ffff,
            1_679_090_539 + next() % 10_000_000,
        );
        if json.len() + object.len() + tail.len() > size {
            break;
        }
        json.push_str(&object);
    }
    // Padded with hex digits, as random as the ids: no easier to compress than the rest.
    let pad = size.saturating_sub(json.len() + tail.len());
    json.push_str(r#"],"has_more":false,"pad":""#);
    while json.len() < size - 2 {
        let digits = format!("{:016x}", next());
        let room = size - 2 - json.len();
        json.push_str(&digits[..room.min(16)]);
    }
    debug_assert!(pad == 0 || json.len() == size - 2);
    json.push_str(r#""}"#);
    assert!(json.len() == size || size < 80, "a {size}-byte document");
    json
}

/// Microseconds to compress and to decompress `bytes` with lz4_flex's block format, the calls
/// `RedisStore::with_compression` makes on a completion and on a replay: the mean of `rounds`.
fn lz4_cost(bytes: &[u8], rounds: u32) -> (f64, f64) {
    let started = std::time::Instant::now();
    let mut block = Vec::new();
    for _ in 0..rounds {
        block = std::hint::black_box(lz4_flex::block::compress(std::hint::black_box(bytes)));
    }
    let compress = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
    let started = std::time::Instant::now();
    for _ in 0..rounds {
        let back = lz4_flex::block::decompress(std::hint::black_box(&block), bytes.len());
        assert_eq!(back.expect("it decompresses").len(), bytes.len());
    }
    let decompress = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
    (compress, decompress)
}

/// A row of the Redis part: response size, compressed, MEMORY USAGE, STRLEN, used_memory growth
/// (bytes per record), µs per new key and replay.
type RedisRow = (usize, bool, f64, f64, f64, f64);

/// One series of the Redis chart: `value` over the response's size, per byte of it.
fn points(
    rows: &[RedisRow],
    compressed: bool,
    value: impl Fn(&RedisRow) -> f64,
) -> Vec<(f64, f64)> {
    rows.iter()
        .filter(|r| r.1 == compressed)
        .map(|r| (r.0 as f64, value(r) / r.0 as f64))
        .collect()
}

/// The Redis part: bytes per record for three response sizes, stored as they are and compressed.
fn redis(quick: bool) -> bool {
    println!("## RedisStore: bytes per record against the response's size\n");
    let server = test_servers::redis_server::RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let records: usize = if quick { 5 } else { 200 };
    let mut rows = Vec::new();
    // Each size as stored, then with `with_compression(1024)`.
    let settings = [200usize, 2048, 20_480]
        .into_iter()
        .flat_map(|size| [(size, None), (size, Some(1024))]);
    for (size, compression) in settings {
        server.flushall();
        let body = json_of(size);
        let lz4 = compression.map(|_| lz4_cost(body.as_bytes(), if quick { 10 } else { 2_000 }));
        let store = RedisStore::from_url(&server.url()).expect("a store");
        let store = match compression {
            Some(threshold) => store.with_compression(threshold),
            None => store,
        };
        let app: Router = Router::new()
            .route(
                PATH,
                post(move || {
                    let body = body.clone();
                    async move {
                        (
                            StatusCode::CREATED,
                            [(header::CONTENT_TYPE, "application/json")],
                            body,
                        )
                    }
                }),
            )
            .layer(IdempotencyLayer::new(store))
            .with_state(());
        let used = || -> i64 {
            let info = server
                .command(&["INFO", "memory"])
                .as_string()
                .expect("INFO");
            info.lines()
                .find_map(|l| l.strip_prefix("used_memory:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("used_memory")
        };
        let before = used();
        let started = std::time::Instant::now();
        runtime.block_on(async {
            for i in 0..records {
                let key = format!("growth-redis-{size}-{i}");
                assert_eq!(
                    call(&app, post_request(&key, false)).await,
                    StatusCode::CREATED
                );
                // The replay answers from the stored record: it holds the whole response.
                assert_eq!(
                    call(&app, post_request(&key, false)).await,
                    StatusCode::CREATED
                );
            }
        });
        // Wall time of a new key and its replay, one at a time: the store's round trips and, with
        // compression, compressing and decompressing the record.
        let micros = started.elapsed().as_secs_f64() * 1e6 / records as f64;
        let grown = used() - before;
        let keys = server.keys();
        assert_eq!(keys.len(), records, "one key per record");
        let (mut usage, mut length) = (0i64, 0i64);
        for key in &keys {
            usage += server
                .command(&["MEMORY", "USAGE", key, "SAMPLES", "0"])
                .as_integer()
                .expect("MEMORY USAGE");
            length += server
                .command(&["STRLEN", key])
                .as_integer()
                .expect("STRLEN");
        }
        let n = records as f64;
        let compressed = compression.is_some();
        if let Some((compress, decompress)) = lz4 {
            println!(
                "{size:>6} B response: LZ4 (lz4_flex's block, as the store calls it) {compress:.2} µs to compress, {decompress:.2} µs to decompress, natively"
            );
        }
        let row = (
            size,
            compressed,
            usage as f64 / n,
            length as f64 / n,
            grown as f64 / n,
            micros,
        );
        println!(
            "{size:>6} B response{}: MEMORY USAGE {:.0} B per record ({:.2} × the response), value {:.0} B, used_memory +{:.0} B per record, {micros:.0} µs per new key and replay",
            if compressed { ", compressed" } else { "" },
            row.2,
            row.2 / size as f64,
            row.3,
            row.4
        );
        rows.push(row);
    }
    println!();
    println!(
        "| response | compressed | MEMORY USAGE per record | × response | stored value (STRLEN) | used_memory growth per record | µs per new key and replay | target (≥ 2 KiB): 1.1 × response + 100 B |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---|");
    for &(size, compressed, usage, length, grown, micros) in &rows {
        let target = 1.1 * size as f64 + 100.0;
        let verdict = match size {
            s if s < 2048 => "-".to_owned(),
            _ if usage <= target => format!("{target:.0}: met"),
            _ => format!("{target:.0}: NOT met (+{:.0} B)", usage - target),
        };
        println!(
            "| {size} B | {} | {usage:.0} | {:.2} | {length:.0} | {grown:.0} | {micros:.0} | {verdict} |",
            if compressed { "yes (> 1 KiB)" } else { "no" },
            usage / size as f64
        );
    }
    println!();
    chart::lines(
        "redis-bytes-per-record.svg",
        "RedisStore: bytes per record ÷ the response's bytes",
        "JSON response (bytes)",
        "× the response",
        true,
        &[
            Series {
                name: "MEMORY USAGE".into(),
                points: points(&rows, false, |r| r.2),
            },
            Series {
                name: "MEMORY USAGE, compressed over 1 KiB".into(),
                points: points(&rows, true, |r| r.2),
            },
            Series {
                name: "the stored value (STRLEN)".into(),
                points: points(&rows, false, |r| r.3),
            },
            Series {
                name: "target: 1.1 × response + 100 B".into(),
                points: points(&rows, false, |r| 1.1 * r.0 as f64 + 100.0),
            },
        ],
    );
    // A target, not a check: missing it is a finding to report, not a broken bench.
    true
}
