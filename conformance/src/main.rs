//! `idempotency-conformance`: runs the checks against the API a config file describes.

use std::io::{ErrorKind, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tower_idempotency_conformance::{Config, run};

/// Checks an HTTP API's Idempotency-Key support from the outside: replays, concurrent
/// duplicates, key reuse, missing and malformed keys, tenant scope, stored errors, retention.
///
/// Exit status: 0 when every check passed (warnings included) or did not apply, 1 when one
/// failed, 2 when the config is bad, the API unreachable or the report unwritable.
#[derive(Debug, Parser)]
#[command(name = "idempotency-conformance", version)]
struct Args {
    /// The config file (TOML) describing the endpoint.
    config: PathBuf,
    /// The base URL to test, instead of the file's `base_url`.
    #[arg(long, value_name = "URL")]
    base_url: Option<String>,
    /// Prints the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also writes the report as JUnit XML to FILE.
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(err) => return bad(&err.to_string()),
    };
    if let Some(base_url) = args.base_url {
        config.base_url = base_url;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return bad(&format!("cannot start the runtime: {err}")),
    };
    let report = match runtime.block_on(run(&config)) {
        Ok(report) => report,
        Err(err) => return bad(&err.to_string()),
    };
    // The report file first: a reader that stops reading (`| head`) must not cost it.
    if let Some(path) = args.junit
        && let Err(err) = std::fs::write(&path, report.junit())
    {
        return bad(&format!("cannot write {}: {err}", path.display()));
    }
    let text = if args.json {
        report.json() + "\n"
    } else {
        report.table()
    };
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        // Whoever reads stdout has seen what it wanted: the verdict is the exit status.
        Err(err) if err.kind() != ErrorKind::BrokenPipe => {
            bad(&format!("cannot write the report: {err}"))
        }
        _ => ExitCode::from(report.exit_code()),
    }
}

/// Says what is wrong, and exits with status 2.
fn bad(message: &str) -> ExitCode {
    eprintln!("idempotency-conformance: {message}");
    ExitCode::from(2)
}
