#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod api;
mod checks;
mod config;
mod report;

use std::sync::Arc;

use tokio::time::Instant;

pub use checks::{CHECKS, Check};
pub use config::{Config, ConfigError, KeyFormat, UNIQUE, Variant};
pub use report::{Cause, CheckResult, Exchange, Report, Summary, Verdict};

use api::{Api, Finding, Hint, Probe, error_chain};

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

    let mut ran = Vec::with_capacity(CHECKS.len());
    ran.push(one(&api, checks::REPLAY, checks::replay).await);
    ran.push(one(&api, checks::CONCURRENT, checks::concurrent).await);
    ran.push(one(&api, checks::KEY_REUSE, checks::key_reuse).await);
    ran.push(one(&api, checks::MISSING_KEY, checks::missing_key).await);
    ran.push(one(&api, checks::MALFORMED_KEY, checks::malformed_key).await);
    ran.push(one(&api, checks::TENANT_SCOPE, checks::tenant_scope).await);
    ran.push(one(&api, checks::SERVER_ERROR, checks::server_error).await);
    ran.push(one(&api, checks::VALIDATION, checks::validation).await);
    ran.push(one(&api, checks::RETENTION, checks::retention).await);
    let outcome = checks::pause_end(&mut pause, pause_started, pause_until).await;
    ran.push((checks::PAUSE, pause, outcome));
    Ok(judge(&api, endpoint, ran))
}

/// Whether the status that refused a check's request says the request as configured is wrong (a
/// redirect, a bad request, credentials, a path or method, a content type), rather than a server
/// that is busy (429) or failing (5xx), which is no setting's fault.
fn points_at_the_config(status: u16) -> bool {
    matches!(
        status,
        300..=399 | 400 | 401 | 403 | 404 | 405 | 406 | 411 | 413 | 415 | 422
    )
}

/// One check run: the check, what it sent and saw, and its outcome.
type Ran = (Check, Probe, checks::Outcome);

/// Runs `check` with a probe of its own.
async fn one<F>(api: &Arc<Api>, check: Check, run: F) -> Ran
where
    F: AsyncFnOnce(&mut Probe) -> checks::Outcome,
{
    let mut probe = Probe::new(api.clone());
    let outcome = run(&mut probe).await;
    (check, probe, outcome)
}

/// The report of a run: each check's verdict, with the causes that several failures share named
/// once, and what the run noticed about the config.
fn judge(api: &Api, endpoint: String, ran: Vec<Ran>) -> Report {
    let seen = |name: &reqwest::header::HeaderName| {
        (ran.iter())
            .flat_map(|(_, probe, _)| &probe.seen)
            .any(|exchange| {
                exchange
                    .headers
                    .iter()
                    .any(|(header, _)| header == name.as_str())
            })
    };
    let replay_header_seen = api.prepared.replay_header.as_ref().is_none_or(seen);
    let mut causes: Vec<(Hint, Cause)> = Vec::new();
    let mut hinted = |hint: Hint, check: &'static str| {
        let text = match hint {
            Hint::ReplayHeaderAbsent if !replay_header_seen => format!(
                "replay_header = {:?}: no answer of the run carried it; is it the header the \
                 API sets on replays?",
                api.config.replay_header.as_deref().unwrap_or_default()
            ),
            Hint::Refused(status) if points_at_the_config(status) => format!(
                "requests these checks need to run were answered {status}{}: the endpoint refuses \
                 the configured request; check base_url, path, method, body, content_type, the \
                 credentials and key_format (\"{}\")",
                if (300..400).contains(&status) {
                    " (a redirect, which the runner does not follow)"
                } else {
                    ""
                },
                match api.config.key_format {
                    KeyFormat::Bare => "bare",
                    KeyFormat::String => "string",
                }
            ),
            _ => return None,
        };
        match causes.iter_mut().find(|(seen, _)| *seen == hint) {
            Some((_, cause)) => cause.checks.push(check),
            None => causes.push((
                hint,
                Cause {
                    cause: text.clone(),
                    checks: vec![check],
                },
            )),
        }
        Some(text)
    };
    let mut checks = Vec::with_capacity(ran.len());
    for (check, probe, outcome) in ran {
        let verdict = match outcome {
            Ok(seen) if seen.warnings.is_empty() => Verdict::Pass {
                detail: seen.detail,
            },
            Ok(seen) => Verdict::Warn {
                detail: seen.detail,
                warnings: seen.warnings,
            },
            Err(Finding::Fail(problems)) => {
                let cause = (problems.iter()).find_map(|problem| hinted(problem.hint, check.name));
                let problems: Vec<String> = problems.into_iter().map(|p| p.text).collect();
                Verdict::Fail {
                    detail: problems.first().cloned().unwrap_or_default(),
                    problems,
                    cause,
                    exchanges: probe.seen,
                }
            }
            Err(Finding::NotApplicable(reason)) => Verdict::NotApplicable { reason },
        };
        checks.push(CheckResult {
            name: check.name,
            title: check.title,
            citation: check.citation,
            verdict,
        });
    }
    // A cause is one when it lies behind more than one failure; alone, its check says enough.
    let causes: Vec<Cause> = (causes.into_iter())
        .map(|(_, cause)| cause)
        .filter(|cause| cause.checks.len() > 1)
        .collect();
    for check in &mut checks {
        if let Verdict::Fail { cause, .. } = &mut check.verdict
            && !causes.iter().any(|c| Some(&c.cause) == cause.as_ref())
        {
            *cause = None;
        }
    }
    let mut notes = Vec::new();
    let (answered, with_id) = api.ids_found();
    if let Some(pointer) = &api.config.id_pointer
        && answered > 0
        && with_id == 0
    {
        notes.push(format!(
            "id_pointer = {pointer:?} found nothing in any of the {answered} 2xx answers: \
             executions were told apart by their whole bodies"
        ));
    }
    Report::new(endpoint, checks, causes, notes)
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
