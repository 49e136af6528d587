//! What the bench prints: each run's checks, the results table with ratios over rounds, and the
//! machine it ran on.

use std::path::Path;
use std::process::Command;

use super::settings::{Settings, Variant, Workload};
use super::wrk::wrk_version;
use super::{Sample, Server};

/// Checks one run's answers; prints a loud MISMATCH for each problem.
pub(crate) fn check(settings: &Settings, sample: &Sample, server: &Server, when: &str) -> bool {
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

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

pub(crate) fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The median of per-round ratios to bare, with their range when there are several rounds: on a
/// shared machine, rounds differ by more than small changes do, and the range says by how much.
pub(crate) fn ratio_text(ratios: Vec<f64>) -> String {
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

pub(crate) fn print_report(settings: &Settings, samples: &[Sample], wrk: &Path) {
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
        "| workload | server | req/s | vs bare (range) | vs floor (range) | p50 | p99 | server CPU/req | +CPU vs bare | store CPU/req | store round trips/req | wrk CPU/req (sleeps/req) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
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
            let (store_cpu, round_trips) = match variant.server() {
                Some(store) => (
                    format!(
                        "{:.1} µs ({})",
                        med(&list, |s| s.store.cpu_us),
                        store.name()
                    ),
                    format!("{:.2}", med(&list, |s| s.store.round_trips)),
                ),
                None => ("—".to_string(), "—".to_string()),
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
                "| {} | {} | {} | {} | {} | {:.2} ms | {:.2} ms | {:.1} µs | {} | {} | {} | {:.1} µs ({:.3}) |",
                workload.name(),
                label,
                thousands(med(&list, |s| s.rps)),
                vs_bare,
                vs_floor,
                med(&list, |s| s.wrk.p50_us as f64) / 1000.0,
                med(&list, |s| s.wrk.p99_us as f64) / 1000.0,
                cpu,
                extra_cpu,
                store_cpu,
                round_trips,
                med(&list, |s| s.client_cpu_us),
                med(&list, |s| s.client_sleeps)
            );
        }
    }
    println!();
    println!(
        "wrk -t{} -c{} -d{}s --latency, loopback, keep-alive; server: axum on a {}-worker tokio \
         runtime in the bench process (`server CPU` is that whole process, per request); \
         Redis (no persistence) and PostgreSQL (fsync off) on the same machine (`store CPU` is \
         the Redis server's, or the PostgreSQL server's processes'). wrk corrects its latencies \
         for coordinated omission: one stall of D adds about D / (mean interval) samples. \
         `wrk CPU` is the load generator's, on the same cores: with every core shared, a ratio is \
         about (bare's server + wrk CPU) / (the variant's). `sleeps` is how often wrk found no \
         response waiting and slept: each time, the server's next write had to wake it, which \
         costs the server's CPU too, so a server slower than wrk pays more per request than its \
         own work.",
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
    println!("## Store calls per request (round 1)");
    println!();
    println!(
        "Redis: raw INFO commandstats, which counts the calls inside scripts too (each script: one \
         GET, then its SET or DEL); round trips = all - get - del - evalsha's SET. `eval` is the \
         release of a claim abandoned when wrk closed its connections mid-request. Postgres: \
         pg_stat_statements by the statement's first words; each statement is one round trip."
    );
    for &workload in &settings.workloads {
        for sample in samples
            .iter()
            .filter(|s| s.workload == workload && s.variant.server().is_some() && s.round == 1)
        {
            let calls: Vec<_> = sample
                .store
                .calls
                .iter()
                .map(|(name, per)| format!("{name} {per:.3}"))
                .collect();
            println!(
                "{:<9} {:<14} {}  => round trips {:.3}/req",
                workload.name(),
                sample.variant.name(),
                calls.join(", "),
                // `+ 0.0` prints a count of no calls as 0.000, not -0.000.
                sample.store.round_trips + 0.0
            );
        }
    }
}

pub(crate) fn thousands(value: f64) -> String {
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

pub(crate) fn print_machine(wrk: &Path) {
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

pub(crate) fn machine_line() -> String {
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

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
