#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs, missing_debug_implementations, rust_2018_idioms)]

mod api;
mod checks;
mod config;
mod report;

use std::sync::Arc;

use tokio::time::Instant;

pub use checks::{CHECKS, Check};
pub use config::{Config, ConfigError, KeyFormat, UNIQUE, Variant};
pub use report::{CheckResult, Exchange, Report, Summary, Verdict};

use api::{Api, Finding, Probe, error_chain};

/// Why a run could not start: the config, or an API that does not answer at all. A check that
/// gets no answer once the run has started is a failure in the [`Report`], not this.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The config cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP client could not be built (the TLS roots).
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    /// Nothing answered at the endpoint's URL.
    #[error("{url} is unreachable: {reason}")]
    Unreachable {
        /// The endpoint's URL.
        url: String,
        /// Why: refused, timed out, not resolved...
        reason: String,
    },
}

/// Runs every check in [`CHECKS`] against the API that `config` describes, and reports each
/// verdict. The checks run one after another, each with fresh keys; the last one
/// (`replay-after-pause`) sends its first request before the others and its retry once
/// [`Config::pause`] has passed, so a run takes about the longer of the pause and the other
/// checks.
///
/// ```no_run
/// use tower_idempotency_conformance::{Config, run};
///
/// # async fn check() -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = Config::load("conformance/examples/payments.toml")?;
/// config.base_url = "http://127.0.0.1:3000".into();
/// let report = run(&config).await?;
/// print!("{}", report.table());
/// assert_eq!(report.failed().count(), 0);
/// # Ok(())
/// # }
/// ```
pub async fn run(config: &Config) -> Result<Report, RunError> {
    let prepared = config.prepare()?;
    let client = reqwest::Client::builder()
        .timeout(config.timeout)
        .connect_timeout(config.timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|err| RunError::Client(error_chain(&err)))?;
    let endpoint = format!("{} {}", prepared.method, prepared.url);
    // Anything that answers (a 404, a 401) will do: only no answer at all stops the run.
    if let Err(err) = client.head(prepared.url.clone()).send().await {
        return Err(RunError::Unreachable {
            url: prepared.url.to_string(),
            reason: error_chain(&err),
        });
    }
    let api = Api::new(config.clone(), prepared, client);

    let mut pause = Probe::new(api.clone());
    let pause_until = Instant::now() + config.pause;
    let pause_started = checks::pause_start(&mut pause).await;

    let mut results = Vec::with_capacity(CHECKS.len());
    results.push(one(&api, checks::REPLAY, checks::replay).await);
    results.push(one(&api, checks::CONCURRENT, checks::concurrent).await);
    results.push(one(&api, checks::KEY_REUSE, checks::key_reuse).await);
    results.push(one(&api, checks::MISSING_KEY, checks::missing_key).await);
    results.push(one(&api, checks::MALFORMED_KEY, checks::malformed_key).await);
    results.push(one(&api, checks::TENANT_SCOPE, checks::tenant_scope).await);
    results.push(one(&api, checks::SERVER_ERROR, checks::server_error).await);
    results.push(one(&api, checks::VALIDATION, checks::validation).await);
    results.push(one(&api, checks::RETENTION, checks::retention).await);
    let outcome = checks::pause_end(&mut pause, pause_started, pause_until).await;
    results.push(result(checks::PAUSE, pause, outcome));
    Ok(Report::new(endpoint, results))
}

/// Runs `check` with a probe of its own.
async fn one<F>(api: &Arc<Api>, check: Check, run: F) -> CheckResult
where
    F: AsyncFnOnce(&mut Probe) -> checks::Outcome,
{
    let mut probe = Probe::new(api.clone());
    let outcome = run(&mut probe).await;
    result(check, probe, outcome)
}

fn result(check: Check, probe: Probe, outcome: checks::Outcome) -> CheckResult {
    let verdict = match outcome {
        Ok(detail) => Verdict::Pass { detail },
        Err(Finding::Fail(detail)) => Verdict::Fail {
            detail,
            exchanges: probe.seen,
        },
        Err(Finding::NotApplicable(reason)) => Verdict::NotApplicable { reason },
    };
    CheckResult {
        name: check.name,
        title: check.title,
        citation: check.citation,
        verdict,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_readme_describes_every_check() {
        let readme = include_str!("../README.md");
        for check in crate::CHECKS {
            assert!(
                readme.contains(&format!("| `{}` |", check.name)),
                "{}",
                check.name
            );
        }
    }
}
