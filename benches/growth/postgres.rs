//! Postgres under churn: a table of `rows` live records whose keys expire and are replaced
//! continuously under a window of minutes, kept in bounds one of two ways:
//!
//! - `delete`: the store's own table (`PgStore::migrate`) and its own sweep, the batched `DELETE`
//!   of `stores/postgres/src/sweep.rs`, run through `PgStore::sweep` every few seconds;
//! - `partitions`: the same columns in a table partitioned by `expires_at` into slices of a
//!   quarter of the window; a slice whose every row has expired is detached (`CONCURRENTLY`) and
//!   dropped whole. This variant is SQL of the bench's own: a partitioned table cannot have a
//!   unique index on `id` alone (it must include the partition key), so the store's claim, which
//!   relies on one, would need a different design (see BENCHMARKS.md).
//!
//! The churn is written in bulk: a steady state of `rows` live rows is reached at once by a
//! prefill whose expiry times spread evenly over the window, and a writer inserts completed rows
//! at the rate they expire (`rows / window` per second, in batches five times a second), so that
//! the table sees, in minutes, the traffic of a window of a day. Meanwhile a probe claims and
//! completes fresh keys (`claim_per_second`) with the statements of the Postgres floor
//! (`benches/floor/postgres.rs`, the same shape as the store's), timing each claim. Every
//! sample (a tenth of the run) gives the claim latency (p50, p99), the table's size (indexes and
//! TOAST included, partitions summed), its dead tuples (`pg_stat_user_tables`), the rows present
//! that have expired (the sweep's backlog), and the sweep's work so far.
//!
//! ```sh
//! GROWTH=postgres cargo bench -p benches --bench growth
//! # knobs (defaults shown): live rows, window and run (seconds), probe claims per second
//! GROWTH_PG_ROWS=1000000 GROWTH_PG_WINDOW=120 GROWTH_PG_RUN=300 GROWTH_PG_CLAIMS=50 \
//!     GROWTH_PG_SWEEP_EVERY=5 GROWTH=postgres cargo bench -p benches --bench growth
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::{self, PgPool, Row, postgres::PgPoolOptions};
use tower_idempotency_postgres::PgStore;

use benches::support::chart::{self, Series};
use test_servers::postgres_server::PostgresServer;

/// The stored record's bytes: the size of the charge's completed record in the store (see
/// `benches/instructions.rs`'s table of record bytes).
const RECORD_BYTES: usize = 281;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Delete,
    Partitions,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Delete => "delete",
            Variant::Partitions => "partitions",
        }
    }

    fn table(self) -> &'static str {
        match self {
            Variant::Delete => "churn_delete",
            Variant::Partitions => "churn_partitions",
        }
    }
}

struct Settings {
    rows: u64,
    window: Duration,
    run: Duration,
    claims_per_second: u64,
    sweep_every: Duration,
    quick: bool,
}

impl Settings {
    fn from_env(quick: bool) -> Self {
        let number = |name: &str, default: u64, quick_default: u64| -> u64 {
            match std::env::var(name) {
                Ok(value) => value.parse().unwrap_or_else(|_| panic!("{name}: a number")),
                Err(_) if quick => quick_default,
                Err(_) => default,
            }
        };
        Settings {
            rows: number("GROWTH_PG_ROWS", 1_000_000, 2_000),
            window: Duration::from_secs(number("GROWTH_PG_WINDOW", 120, 4)),
            run: Duration::from_secs(number("GROWTH_PG_RUN", 300, 8)),
            claims_per_second: number("GROWTH_PG_CLAIMS", 50, 20),
            sweep_every: Duration::from_secs(number("GROWTH_PG_SWEEP_EVERY", 5, 1)),
            quick,
        }
    }

    /// The rows that expire, and are written, per second.
    fn rate(&self) -> f64 {
        self.rows as f64 / self.window.as_secs_f64()
    }

    /// A quarter of the window: the width of a partition.
    fn slice(&self) -> Duration {
        self.window / 4
    }
}

/// One sample of a run.
#[derive(Clone, Debug, Default)]
struct Sample {
    at: f64,
    p50_us: f64,
    p99_us: f64,
    claims: usize,
    table_bytes: i64,
    live_tuples: i64,
    dead_tuples: i64,
    expired_present: i64,
    written: u64,
    /// Rows deleted by the sweep, or partitions dropped.
    removed: u64,
    /// Seconds spent sweeping or dropping so far.
    removing_s: f64,
}

/// The Postgres part: both variants, one after the other, each on a server of its own.
pub(crate) fn run(quick: bool) -> bool {
    let settings = Settings::from_env(quick);
    println!(
        "## PgStore under churn: {} live rows, a window of {} s ({:.0} rows/s written and expiring), {} s per variant{}\n",
        settings.rows,
        settings.window.as_secs(),
        settings.rate(),
        settings.run.as_secs(),
        if quick { " (quick)" } else { "" }
    );
    let mut results = Vec::new();
    let mut ok = true;
    for variant in [Variant::Delete, Variant::Partitions] {
        let server = PostgresServer::start_with(&["-c", "max_connections=50"]);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let samples = runtime.block_on(churn(&server.url(), variant, &settings));
        match samples {
            Ok(samples) => results.push((variant, samples)),
            Err(err) => {
                println!("FAILED: {}: {err}", variant.name());
                ok = false;
            }
        }
        runtime.shutdown_timeout(Duration::from_secs(5));
    }
    for (variant, samples) in &results {
        println!("\n{} ({}):", variant.name(), variant.table());
        println!(
            "| at (s) | claim p50 (ms) | claim p99 (ms) | table (MiB) | live tuples | dead tuples | expired rows present | rows written | {} | busy removing (s) |",
            if *variant == Variant::Delete {
                "rows swept"
            } else {
                "partitions dropped"
            }
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for s in samples {
            println!(
                "| {:.1} | {:.2} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {:.1} |",
                s.at,
                s.p50_us / 1e3,
                s.p99_us / 1e3,
                s.table_bytes as f64 / (1024.0 * 1024.0),
                s.live_tuples,
                s.dead_tuples,
                s.expired_present,
                s.written,
                s.removed,
                s.removing_s
            );
        }
    }
    println!();
    for (variant, samples) in &results {
        // The first sample after a window has passed, against the last: a window in, every
        // prefilled row has expired once.
        let settled: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.at >= settings.window.as_secs_f64() * 0.5)
            .collect();
        let (Some(first), Some(last)) = (settled.first(), settled.last()) else {
            continue;
        };
        let p50s: Vec<f64> = settled.iter().map(|s| s.p50_us).collect();
        let lo = p50s.iter().copied().fold(f64::MAX, f64::min);
        let hi = p50s.iter().copied().fold(0.0, f64::max);
        let max_size = settled.iter().map(|s| s.table_bytes).max().unwrap_or(0);
        let max_dead = settled.iter().map(|s| s.dead_tuples).max().unwrap_or(0);
        let max_backlog = settled.iter().map(|s| s.expired_present).max().unwrap_or(0);
        println!(
            "{}: claim p50 {:.2}..{:.2} ms over the run (largest / smallest {:.2}; flat within 20%: {}); table {:.0} → {:.0} MiB (largest {:.0}); dead tuples at most {}; expired rows present at most {} ({:.1} s of expiries); {:.1} s of {:.0} s spent removing",
            variant.name(),
            lo / 1e3,
            hi / 1e3,
            hi / lo.max(1.0),
            if hi <= lo * 1.2 { "yes" } else { "no" },
            first.table_bytes as f64 / 1048576.0,
            last.table_bytes as f64 / 1048576.0,
            max_size as f64 / 1048576.0,
            max_dead,
            max_backlog,
            max_backlog as f64 / settings.rate(),
            last.removing_s,
            last.at,
        );
        if settings.quick {
            // Answers, not figures: the probe's claims all succeeded (checked as they ran), and
            // the rows that expired were removed at least once.
            if last.removed == 0 {
                println!("FAILED: {}: nothing was removed", variant.name());
                ok = false;
            }
        }
    }
    println!();
    let series = |f: fn(&Sample) -> f64| -> Vec<Series> {
        results
            .iter()
            .map(|(variant, samples)| Series {
                name: variant.name().to_owned(),
                points: samples.iter().map(|s| (s.at, f(s))).collect(),
            })
            .collect()
    };
    chart::lines(
        "postgres-churn-latency.svg",
        "PgStore under churn: claim latency, median of each tenth of the run",
        "seconds into the run",
        "ms",
        false,
        &series(|s| s.p50_us / 1e3),
    );
    chart::lines(
        "postgres-churn-p99.svg",
        "PgStore under churn: claim latency, 99th percentile of each tenth of the run",
        "seconds into the run",
        "ms",
        false,
        &series(|s| s.p99_us / 1e3),
    );
    chart::lines(
        "postgres-churn-size.svg",
        "PgStore under churn: table size (MiB, indexes included)",
        "seconds into the run",
        "MiB",
        false,
        &series(|s| s.table_bytes as f64 / 1048576.0),
    );
    chart::lines(
        "postgres-churn-dead.svg",
        "PgStore under churn: dead tuples and expired rows present",
        "seconds into the run",
        "rows",
        false,
        &series(|s| s.dead_tuples as f64)
            .into_iter()
            .map(|mut s| {
                s.name.push_str(" dead tuples");
                s
            })
            .chain(
                series(|s| s.expired_present as f64)
                    .into_iter()
                    .map(|mut s| {
                        s.name.push_str(" expired present");
                        s
                    }),
            )
            .collect::<Vec<_>>(),
    );
    ok
}

/// The shared state of one run's tasks.
#[derive(Default)]
struct Counters {
    written: AtomicU64,
    removed: AtomicU64,
    removing_us: AtomicU64,
    stop: AtomicBool,
    latencies: std::sync::Mutex<Vec<u64>>,
    failures: std::sync::Mutex<Vec<String>>,
}

async fn churn(url: &str, variant: Variant, settings: &Settings) -> Result<Vec<Sample>, String> {
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let table = variant.table();
    let store = match variant {
        Variant::Delete => {
            let store = PgStore::new(pool.clone())
                .with_table(table)
                .with_sweep_interval(None);
            store.migrate().await.map_err(|e| format!("migrate: {e}"))?;
            Some(store)
        }
        Variant::Partitions => {
            sqlx::query(&format!(
                "CREATE TABLE {table} (
    id bytea NOT NULL CHECK (octet_length(id) = 16),
    fingerprint bytea NOT NULL CHECK (octet_length(fingerprint) = 32),
    token bytea NOT NULL CHECK (octet_length(token) = 16),
    completed bytea,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (id, expires_at)
) PARTITION BY RANGE (expires_at)"
            ))
            .execute(&pool)
            .await
            .map_err(|e| format!("create: {e}"))?;
            maintain_partitions(&pool, table, settings.window, true).await?;
            None
        }
    };

    // The prefill: `rows` completed rows whose expiry spreads over the next window.
    let started = Instant::now();
    let chunk = 100_000u64.min(settings.rows);
    let mut done = 0;
    while done < settings.rows {
        let n = chunk.min(settings.rows - done);
        sqlx::query(&insert_sql(table))
            .bind(n as i64)
            .bind(settings.window.as_millis() as f64 / settings.rows as f64)
            .bind(done as i64)
            .bind(None::<f64>)
            .execute(&pool)
            .await
            .map_err(|e| format!("prefill: {e}"))?;
        done += n;
    }
    sqlx::query(&format!("VACUUM ANALYZE {table}"))
        .execute(&pool)
        .await
        .map_err(|e| format!("vacuum: {e}"))?;
    println!(
        "{}: prefilled {} rows in {:.1} s",
        variant.name(),
        settings.rows,
        started.elapsed().as_secs_f64()
    );

    let counters = Arc::new(Counters::default());
    let mut tasks = Vec::new();
    // The writer: what expires is replaced, five times a second.
    {
        let (pool, counters) = (pool.clone(), counters.clone());
        let per_tick = (settings.rate() / 5.0).ceil().max(1.0) as i64;
        let window_ms = settings.window.as_millis() as f64;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            while !counters.stop.load(Ordering::Relaxed) {
                tick.tick().await;
                // Every row of the batch expires a window from now: a step of zero.
                let written = sqlx::query(&insert_sql(table))
                    .bind(per_tick)
                    .bind(0.0f64)
                    .bind(0i64)
                    .bind(window_ms)
                    .execute(&pool)
                    .await;
                match written {
                    Ok(done) => {
                        counters
                            .written
                            .fetch_add(done.rows_affected(), Ordering::Relaxed);
                    }
                    Err(err) => counters
                        .failures
                        .lock()
                        .unwrap()
                        .push(format!("writer: {err}")),
                }
            }
        }));
    }
    // The sweep, or the partitions' upkeep.
    {
        let (pool, counters) = (pool.clone(), counters.clone());
        let every = match variant {
            Variant::Delete => settings.sweep_every,
            Variant::Partitions => settings.slice() / 4,
        };
        let window = settings.window;
        tasks.push(tokio::spawn(async move {
            while !counters.stop.load(Ordering::Relaxed) {
                tokio::time::sleep(every).await;
                let started = Instant::now();
                let removed = match &store {
                    Some(store) => store.sweep().await.map_err(|e| format!("sweep: {e}")),
                    None => maintain_partitions(&pool, table, window, false).await,
                };
                counters
                    .removing_us
                    .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                match removed {
                    Ok(n) => {
                        counters.removed.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(err) => counters.failures.lock().unwrap().push(err),
                }
            }
        }));
    }
    // The probe: fresh keys claimed and completed, each claim timed.
    {
        let (pool, counters) = (pool.clone(), counters.clone());
        let per_second = settings.claims_per_second.max(1);
        let window_ms = settings.window.as_millis() as i64;
        let lease_ms = (settings.window / 4).as_millis().min(30_000) as i64;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / per_second as u32);
            let mut n = 0u64;
            while !counters.stop.load(Ordering::Relaxed) {
                tick.tick().await;
                n += 1;
                if let Err(err) = probe(&pool, variant, n, lease_ms, window_ms, &counters).await {
                    counters.failures.lock().unwrap().push(err);
                }
            }
        }));
    }

    let mut samples = Vec::new();
    let run_started = Instant::now();
    let every = settings.run / 10;
    for _ in 0..10 {
        tokio::time::sleep(every).await;
        let latencies = std::mem::take(&mut *counters.latencies.lock().unwrap());
        let sample = measure(&pool, table, variant, &latencies, run_started, &counters).await?;
        println!(
            "  {} {:>6.1} s: claim p50 {:.2} ms p99 {:.2} ms ({} claims), table {:.1} MiB, live {} dead {} expired present {}, written {}, removed {} ({:.1} s)",
            variant.name(),
            sample.at,
            sample.p50_us / 1e3,
            sample.p99_us / 1e3,
            sample.claims,
            sample.table_bytes as f64 / 1048576.0,
            sample.live_tuples,
            sample.dead_tuples,
            sample.expired_present,
            sample.written,
            sample.removed,
            sample.removing_s
        );
        samples.push(sample);
    }
    counters.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    let failures = counters.failures.lock().unwrap().clone();
    if !failures.is_empty() {
        return Err(format!(
            "{} failures, the first: {}",
            failures.len(),
            failures[0]
        ));
    }
    let expected = (settings.rate() * settings.run.as_secs_f64() * 0.5) as u64;
    if counters.written.load(Ordering::Relaxed) < expected.min(1) {
        return Err("the writer wrote nothing".into());
    }
    pool.close().await;
    Ok(samples)
}

/// $1 rows, $2 ms between two rows' expiry, $3 the first row's number, $4 (optional) ms added to
/// every row's expiry: completed rows of random ids, as the store writes them.
fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (id, fingerprint, token, completed, expires_at)
SELECT decode(md5(random()::text || g::text), 'hex'),
       decode(repeat('ab', 32), 'hex'),
       decode(md5(g::text), 'hex'),
       convert_to(repeat('r', {RECORD_BYTES}), 'UTF8'),
       statement_timestamp() + (($3 + g) * $2 + COALESCE($4::float8, 0)) * interval '1 millisecond'
FROM generate_series(1, $1) AS g"
    )
}

/// Creates the partitions from the current slice to two windows ahead, and (unless `first`)
/// detaches and drops those whose every row has expired. Returns how many it dropped.
async fn maintain_partitions(
    pool: &PgPool,
    table: &str,
    window: Duration,
    first: bool,
) -> Result<u64, String> {
    let slice_ms = (window / 4).as_millis() as i64;
    let now_ms: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM statement_timestamp()) * 1000)::int8")
            .fetch_one(pool)
            .await
            .map_err(|e| format!("now: {e}"))?;
    let current = now_ms / slice_ms;
    // A claim's lease and a completion's window end at most a window (and the writer's batch)
    // ahead: two windows of slices cover them.
    let ahead = 2 * (window.as_millis() as i64 / slice_ms) + 1;
    for n in current..=current + ahead {
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {table}_{n} PARTITION OF {table}
FOR VALUES FROM (to_timestamp({lo}::float8 / 1000)) TO (to_timestamp({hi}::float8 / 1000))",
            lo = n * slice_ms,
            hi = (n + 1) * slice_ms,
        ))
        .execute(pool)
        .await
        .map_err(|e| format!("create partition: {e}"))?;
    }
    if first {
        return Ok(0);
    }
    let partitions: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = $1",
    )
    .bind(table)
    .fetch_all(pool)
    .await
    .map_err(|e| format!("list partitions: {e}"))?;
    let mut dropped = 0;
    for name in partitions {
        let Some(n) = name
            .strip_prefix(table)
            .and_then(|rest| rest.strip_prefix('_'))
            .and_then(|n| n.parse::<i64>().ok())
        else {
            continue;
        };
        // Every row of slice n expires before (n + 1) × slice: gone once the current slice is
        // past it.
        if n < current {
            for statement in [
                format!("ALTER TABLE {table} DETACH PARTITION {name} CONCURRENTLY"),
                format!("DROP TABLE {name}"),
            ] {
                sqlx::raw_sql(&statement)
                    .execute(pool)
                    .await
                    .map_err(|e| format!("{statement}: {e}"))?;
            }
            dropped += 1;
        }
    }
    Ok(dropped)
}

/// One probe: a fresh key claimed (timed) and completed, with the floor's statements (on the
/// partitioned table, the same statement but for its conflict target).
async fn probe(
    pool: &PgPool,
    variant: Variant,
    n: u64,
    lease_ms: i64,
    window_ms: i64,
    counters: &Counters,
) -> Result<(), String> {
    let table = variant.table();
    let conflict = match variant {
        // The primary key is the claim's arbiter.
        Variant::Delete => {
            "ON CONFLICT (id) DO UPDATE SET token = excluded.token, completed = NULL,
        expires_at = excluded.expires_at WHERE r.expires_at <= statement_timestamp()"
        }
        // No unique index on `id` alone: nothing arbitrates two claims of one key in two slices.
        Variant::Partitions => "ON CONFLICT DO NOTHING",
    };
    let claim = format!(
        "WITH live AS (
    SELECT completed FROM {table} WHERE id = $1 AND expires_at > statement_timestamp()
), claimed AS (
    INSERT INTO {table} AS r (id, fingerprint, token, expires_at)
    SELECT $1, $2, int8send((extract(epoch FROM statement_timestamp()) * 1000000)::int8) || $3,
        statement_timestamp() + $4::int8 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT FROM live)
    {conflict}
    RETURNING token
)
SELECT true AS claimed, token FROM claimed
UNION ALL SELECT false, NULL FROM live"
    );
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&n.to_le_bytes());
    key[8..].copy_from_slice(&(std::process::id() as u64 ^ 0x5eed).to_le_bytes());
    let started = Instant::now();
    let row = sqlx::query(&claim)
        .bind(&key[..])
        .bind(&[0u8; 32][..])
        .bind(&n.to_le_bytes()[..])
        .bind(lease_ms)
        .fetch_one(pool)
        .await
        .map_err(|e| format!("claim: {e}"))?;
    let elapsed = started.elapsed();
    let claimed: bool = row.try_get("claimed").map_err(|e| format!("claim: {e}"))?;
    let token: Option<Vec<u8>> = row.try_get("token").map_err(|e| format!("claim: {e}"))?;
    let (true, Some(token)) = (claimed, token) else {
        return Err(format!("probe {n}: a fresh key was not claimed"));
    };
    counters
        .latencies
        .lock()
        .unwrap()
        .push(elapsed.as_micros() as u64);
    let completed = sqlx::query(&format!(
        "UPDATE {table} SET completed = $3,
    expires_at = statement_timestamp() + $4::int8 * interval '1 millisecond'
WHERE id = $1 AND token = $2 AND completed IS NULL"
    ))
    .bind(&key[..])
    .bind(&token[..])
    .bind(&[b'r'; RECORD_BYTES][..])
    .bind(window_ms)
    .execute(pool)
    .await
    .map_err(|e| format!("complete: {e}"))?;
    if completed.rows_affected() != 1 {
        return Err(format!("probe {n}: the completion wrote nothing"));
    }
    Ok(())
}

async fn measure(
    pool: &PgPool,
    table: &str,
    variant: Variant,
    latencies: &[u64],
    run_started: Instant,
    counters: &Counters,
) -> Result<Sample, String> {
    let mut sorted = latencies.to_vec();
    sorted.sort_unstable();
    let quantile = |q: f64| -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
    };
    // The table, or every partition of it.
    let relations = match variant {
        Variant::Delete => format!("SELECT '{table}'::regclass AS r"),
        Variant::Partitions => {
            format!("SELECT relid AS r FROM pg_partition_tree('{table}') WHERE isleaf")
        }
    };
    let row = sqlx::query(&format!(
        "WITH rels AS ({relations})
SELECT COALESCE(sum(pg_total_relation_size(r)), 0)::int8 AS bytes,
       COALESCE(sum(s.n_live_tup), 0)::int8 AS live,
       COALESCE(sum(s.n_dead_tup), 0)::int8 AS dead
FROM rels LEFT JOIN pg_stat_user_tables s ON s.relid = rels.r"
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| format!("sample: {e}"))?;
    let expired: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE expires_at <= statement_timestamp()"
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| format!("sample: {e}"))?;
    Ok(Sample {
        at: run_started.elapsed().as_secs_f64(),
        p50_us: quantile(0.5),
        p99_us: quantile(0.99),
        claims: sorted.len(),
        table_bytes: row.try_get("bytes").map_err(|e| e.to_string())?,
        live_tuples: row.try_get("live").map_err(|e| e.to_string())?,
        dead_tuples: row.try_get("dead").map_err(|e| e.to_string())?,
        expired_present: expired,
        written: counters.written.load(Ordering::Relaxed),
        removed: counters.removed.load(Ordering::Relaxed),
        removing_s: counters.removing_us.load(Ordering::Relaxed) as f64 / 1e6,
    })
}
