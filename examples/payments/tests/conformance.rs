//! The conformance runner (`conformance/`) against the payments server as users run it: the
//! package's binary on a free port, its records in memory, PostgreSQL and Redis, checked over
//! HTTP with the runner's sample config for it (`conformance/examples/payments.toml`). Every check
//! passes, but the retention check, which does not apply: the server sends no retention header.

mod support;

use std::path::Path;

use support::process::Server;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency_conformance::{Config, Verdict, run};

/// Runs every check against `server`: none fails, and only the retention check does not apply.
async fn conforms(store: &str, server: &Server) {
    let sample =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/examples/payments.toml");
    let mut config = Config::load(sample).expect("the sample config is valid");
    config.base_url = server.url();
    let report = run(&config).await.expect("the server answers");
    println!("payments server on {store}:\n{}", report.table());
    assert_eq!(
        report.summary.fail,
        0,
        "{}\nthe server's log:\n{}",
        report.table(),
        server.stderr_text()
    );
    let not_applicable: Vec<_> = (report.checks.iter())
        .filter_map(|check| match &check.verdict {
            Verdict::NotApplicable { reason } => Some((check.name, reason.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        not_applicable,
        [("retention", "no retention_header configured")]
    );
    assert_eq!(report.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_conforms_on_memory() {
    conforms("memory", &Server::start(&[])).await;
}

/// The money and the records in PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_conforms_on_postgres() {
    let database = PostgresServer::start();
    let server = Server::start(&[("DATABASE_URL", &database.url())]);
    conforms("postgres", &server).await;
}

/// The records in Redis, beside the memory ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_conforms_with_records_in_redis() {
    let redis = RedisServer::start();
    conforms("redis", &Server::start(&[("REDIS_URL", &redis.url())])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_conforms_with_records_in_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls().join(",");
    let server = Server::start(&[("REDIS_CLUSTER_URLS", &urls)]);
    conforms("redis cluster", &server).await;
}
