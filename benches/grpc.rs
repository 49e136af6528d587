//! The gRPC mode's cost in instructions per call, in process, counted by callgrind, as
//! `benches/instructions.rs` counts HTTP's: a tonic service (`payments.v1.Payments` of
//! `examples/grpc.rs`, the `grpc-payments` crate) driven with `oneshot` on a current-thread runtime, one unary
//! `CreateCharge` at a time, its answer read whole, trailers included. Per call = (Ir of 2,500
//! calls − Ir of 500) / 2,000. Cases: `bare` (the tonic server alone) and `memory` (behind the
//! layer in gRPC mode over a `MemoryStore`), each with a new key per call and with one key
//! replayed. A second table gives the bytes of a replay against the first answer: headers
//! (names and values), message, trailers, and the record as stored.
//!
//! ```sh
//! cargo bench -p benches --bench grpc         # needs valgrind
//! PROBE=memory:replay:500 cargo bench -p benches --bench grpc   # one case, no valgrind
//! ```

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::record::{Fingerprint, Record, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

use benches::support::callgrind;
use grpc_payments::{CREATE_CHARGE, CreateChargeRequest, Ledger, PaymentsServer};

const FEW: u64 = 500;
const MANY: u64 = 2_500;
const REPLAY_KEY: &str = "replayed-key";
const CASES: [&str; 4] = [
    "bare:new-key",
    "bare:replay",
    "memory:new-key",
    "memory:replay",
];

fn main() {
    if let Ok(case) = std::env::var("PROBE") {
        return run_case(&case);
    }
    println!("| case | Ir per call | over bare |");
    println!("|---|---:|---:|");
    let mut bare = std::collections::HashMap::new();
    for case in CASES {
        let per_call = (count(case, MANY) - count(case, FEW)) / (MANY - FEW);
        let (setup, workload) = case.split_once(':').expect("setup:workload");
        let over = match bare.get(workload) {
            Some(&bare) if setup != "bare" => format!("{:+}", per_call as i64 - bare),
            _ => String::new(),
        };
        if setup == "bare" {
            bare.insert(workload, per_call as i64);
        }
        println!("| {case} | {per_call} | {over} |");
    }
    println!();
    let run = Command::new(std::env::current_exe().expect("this program's path"))
        .env("PROBE", "memory:replay:1")
        .output()
        .expect("the probe runs");
    print!("{}", String::from_utf8_lossy(&run.stdout));
}

/// The instructions of a whole run of `case` with `calls` calls, under callgrind.
fn count(case: &str, calls: u64) -> u64 {
    callgrind::instructions(("PROBE", &format!("{case}:{calls}")), true)
}

/// A unary `CreateCharge` call with `key`, its message framed as gRPC sends it.
fn call(key: &str) -> Request<Full<Bytes>> {
    let message = CreateChargeRequest {
        amount: 1000,
        currency: "EUR".into(),
        description: "order 42, 2 items".into(),
    }
    .encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(message.len() as u32);
    framed.put_slice(&message);
    Request::post(CREATE_CHARGE)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(Full::new(framed.freeze()))
        .expect("a request")
}

/// An answer read whole: its headers, message bytes and trailers.
struct Answer {
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

async fn send<S, B>(service: &S, key: &str) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(call(key)).await.expect("an answer");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("the body");
    let trailers = collected.trailers().cloned();
    let answer = Answer {
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    };
    let status = answer.trailers.as_ref().and_then(|t| t.get("grpc-status"));
    assert_eq!(
        status.map(|s| s.as_bytes()),
        Some(&b"0"[..]),
        "an OK answer"
    );
    answer
}

fn fields(map: &HeaderMap) -> (usize, usize) {
    (
        map.len(),
        map.iter().map(|(n, v)| n.as_str().len() + v.len()).sum(),
    )
}

/// Runs `setup:workload:calls` once, checking every answer; with one call of `memory:replay`,
/// prints the bytes of the first answer and of its replay.
fn run_case(case: &str) {
    let mut parts = case.split(':');
    let (Some(setup), Some(workload), Some(calls)) = (parts.next(), parts.next(), parts.next())
    else {
        panic!("PROBE is setup:workload:calls, e.g. memory:replay:500; got {case:?}");
    };
    let calls: u64 = calls.parse().expect("a number of calls");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let server = PaymentsServer::new(Ledger::default());
        let store = MemoryStore::new();
        let layer = IdempotencyLayer::new(store.clone())
            .single_tenant()
            .grpc([CREATE_CHARGE]);
        let protected = layer.layer(server.clone());
        let first = match setup {
            "bare" => send(&server, REPLAY_KEY).await,
            "memory" => send(&protected, REPLAY_KEY).await,
            _ => panic!("unknown setup {setup:?}"),
        };
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut key = String::with_capacity(32);
        let mut last = None;
        for _ in 0..calls {
            let key = match workload {
                "new-key" => {
                    key.clear();
                    key.push_str("probe-new-");
                    key.push_str(&NEXT.fetch_add(1, Ordering::Relaxed).to_string());
                    key.as_str()
                }
                "replay" => REPLAY_KEY,
                _ => panic!("unknown workload {workload:?}"),
            };
            last = Some(match setup {
                "bare" => send(&server, key).await,
                _ => send(&protected, key).await,
            });
        }
        if (setup, workload, calls) == ("memory", "replay", 1) {
            let replay = last.expect("the replay");
            assert!(replay.headers.contains_key("idempotent-replayed"));
            println!(
                "| answer | headers (count, bytes) | message bytes | trailers (count, bytes) |"
            );
            println!("|---|---:|---:|---:|");
            for (name, answer) in [("first", &first), ("replay", &replay)] {
                let (hn, hb) = fields(&answer.headers);
                let (tn, tb) = answer.trailers.as_ref().map_or((0, 0), fields);
                println!(
                    "| {name} | {hn}, {hb} | {} | {tn}, {tb} |",
                    answer.body.len()
                );
            }
            assert_eq!(replay.body, first.body, "the message, byte for byte");
            assert_eq!(
                replay.trailers, first.trailers,
                "the trailers, byte for byte"
            );
            let id = RecordId::new(b"", REPLAY_KEY);
            let fingerprint = Fingerprint::from_bytes([0; 32]);
            if let Ok(Claim::Existing(Record::Completed(done))) =
                store.claim(&id, &fingerprint, Duration::from_secs(1)).await
            {
                let bytes = done.encode().expect("an encoding").len();
                println!();
                println!("record bytes, as stored (kind 5): {bytes}");
            }
        }
    });
}
