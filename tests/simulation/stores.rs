//! The simulation's worlds over `RedisStore` and `PgStore`, each on a server of its own, on real
//! time, before the seeds on the memory store (`SIM_STORES=0` leaves them out): the same generator, fault injector, checker and oracle as on the
//! memory store, slower (a run takes seconds, not a millisecond), so fewer seeds, run side by
//! side. Real time makes a seed's history vary from run to run; the guarantees must hold all the
//! same. The oracle's model knows when each store call took effect only between its sending and
//! its answer, and each record's expiry to within a few milliseconds beyond that (`world.rs`
//! says of what): a store answer outside that fails the run, as a broken guarantee does.

use std::time::Duration;

use crate::backend::Backend;
use crate::bugs::Bug;
use crate::{checker, handler, world};
use deadpool_redis::redis;
use sqlx::postgres::PgPoolOptions;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_server::RedisServer;
use tower_idempotency::BoxStore;
use tower_idempotency::record::RecordId;
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

/// The lease on real time: short, so that a run's leases run out in seconds.
const LEASE: Duration = Duration::from_millis(400);
/// Seeds per store, run side by side (`SIM_SEEDS` sets another number).
const SEEDS: u64 = 100;

/// Runs the seeds over the backends `backend` makes (one per seed, so that runs never share
/// records), and fails on any violation, naming the seed.
async fn simulate<F, Fut>(name: &str, backend: F)
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Backend>,
{
    let bug = Bug::from_env();
    handler::quiet_flaky_panics();
    let seeds =
        std::env::var("SIM_SEEDS").map_or(SEEDS, |n| n.parse().expect("SIM_SEEDS is a number"));
    let mut runs = tokio::task::JoinSet::new();
    for seed in 0..seeds {
        let backend = backend(seed).await;
        runs.spawn(async move { (seed, world::world(seed, bug, backend, LEASE).await) });
    }
    let (mut faults, mut violations, mut calls, mut answers) = (0, Vec::new(), 0, 0);
    while let Some(run) = runs.join_next().await {
        let (seed, history) = run.expect("a run");
        faults += history.faults.values().sum::<u64>();
        for violation in checker::check(&history).violations {
            violations.push(format!("seed {seed}: {violation}"));
        }
        (calls, answers) = (
            calls + history.oracle.calls,
            answers + history.oracle.answers,
        );
        // Every store answer too: the model knows each expiry to within a band (`world.rs`), and
        // an answer outside it fails the run.
        for violation in &history.oracle.violations {
            violations.push(format!("seed {seed}: {violation}"));
        }
    }
    println!(
        "simulation on {name}: {seeds} seeds, {faults} faults, {calls} store calls and {answers} \
         answers checked, {} violations",
        violations.len()
    );
    assert!(
        violations.is_empty(),
        "PROTOCOL.md §9.10: guarantees broken on {name}:\n{}",
        violations.join("\n")
    );
    assert!(faults > 0, "the runs met faults");
}

/// Runs the worlds on Redis, then on PostgreSQL; panics on a broken guarantee.
pub(crate) fn run() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(redis_keeps_the_guarantees_under_the_simulations_faults());
    runtime.block_on(postgres_keeps_the_guarantees_under_the_simulations_faults());
}

async fn redis_keeps_the_guarantees_under_the_simulations_faults() {
    let server = RedisServer::start();
    let url = server.url();
    simulate("Redis", |seed| {
        let url = url.clone();
        async move {
            let prefix = format!("sim{seed}:");
            let store = RedisStore::from_url(&url)
                .expect("a store")
                .with_prefix(prefix.clone());
            let client = redis::Client::open(url.as_str()).expect("a client");
            let evicting = (client.clone(), prefix.clone());
            Backend {
                store: BoxStore::new(store),
                evict: Box::new(move |id: RecordId| {
                    let (client, key) = (evicting.0.clone(), format!("{}{{{id}}}", evicting.1));
                    Box::pin(async move {
                        let mut conn = client
                            .get_multiplexed_async_connection()
                            .await
                            .expect("a connection");
                        let _: i64 = redis::cmd("DEL")
                            .arg(key)
                            .query_async(&mut conn)
                            .await
                            .expect("the record evicted");
                    })
                }),
                // This run's records only: the other runs share the server.
                forget: Box::new(move || {
                    let (client, pattern) = (client.clone(), format!("{prefix}*"));
                    Box::pin(async move {
                        let mut conn = client
                            .get_multiplexed_async_connection()
                            .await
                            .expect("a connection");
                        let keys: Vec<String> = redis::cmd("KEYS")
                            .arg(&pattern)
                            .query_async(&mut conn)
                            .await
                            .expect("the run's keys");
                        if !keys.is_empty() {
                            let _: i64 = redis::cmd("DEL")
                                .arg(keys)
                                .query_async(&mut conn)
                                .await
                                .expect("the run's keys deleted");
                        }
                    })
                }),
                real_time: true,
                releases_behind: true,
            }
        }
    })
    .await;
}

async fn postgres_keeps_the_guarantees_under_the_simulations_faults() {
    let server = PostgresServer::start();
    // One pool for every run, as the server takes at most 100 connections.
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect(&server.url())
        .await
        .expect("a pool");
    simulate("PostgreSQL", |seed| {
        let pool = pool.clone();
        async move {
            let table = format!("sim_{seed}");
            let store = PgStore::new(pool).with_table(&table);
            store.migrate().await.expect("the run's table");
            let pool = store.pool().clone();
            let (evicting, delete) = (pool.clone(), format!("DELETE FROM {table} WHERE id = $1"));
            Backend {
                store: BoxStore::new(store),
                evict: Box::new(move |id: RecordId| {
                    let (pool, delete) = (evicting.clone(), delete.clone());
                    Box::pin(async move {
                        sqlx::query(&delete)
                            .bind(id.as_bytes().as_slice())
                            .execute(&pool)
                            .await
                            .expect("the record evicted");
                    })
                }),
                forget: Box::new(move || {
                    let (pool, truncate) = (pool.clone(), format!("TRUNCATE {table}"));
                    Box::pin(async move {
                        sqlx::query(&truncate)
                            .execute(&pool)
                            .await
                            .expect("the run's records forgotten");
                    })
                }),
                real_time: true,
                releases_behind: false,
            }
        }
    })
    .await;
}
