//! What the tests share: the deliberately broken server.
#![allow(
    dead_code,
    reason = "every test binary that says `mod support;` compiles all of it, and each uses a part"
)]

pub(crate) mod broken_server;

use std::collections::BTreeSet;
use std::path::PathBuf;

use tower_idempotency_conformance::{Config, Report};

/// The config of the tests against the broken server, as the command line reads it.
pub(crate) fn config_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/broken.toml")
}

/// That config, for `server`.
pub(crate) fn config(server: &broken_server::Server) -> Config {
    let mut config = Config::load(config_path()).expect("tests/broken.toml is valid");
    config.base_url = server.url();
    config
}

/// Runs every check against a server with `bug`, with the config `adjust` leaves.
pub(crate) async fn report(bug: broken_server::Bug, adjust: impl FnOnce(&mut Config)) -> Report {
    let server = broken_server::Server::start(bug).await;
    let mut config = config(&server);
    adjust(&mut config);
    let report = tower_idempotency_conformance::run(&config)
        .await
        .expect("the server answers");
    println!("{bug:?}:\n{}", report.table());
    assert_eq!(
        report.checks.len(),
        tower_idempotency_conformance::CHECKS.len()
    );
    report
}

/// The checks that failed.
pub(crate) fn failing(report: &Report) -> BTreeSet<&'static str> {
    report.failed().map(|check| check.name).collect()
}
