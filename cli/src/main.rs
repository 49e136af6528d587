//! `tower-idempotency`: look up or forget one idempotency key (see the crate's documentation).

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser;
use tower_idempotency_cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The forget's WARN line, with the operator's reason, is the audit trail: to stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_max_level(tracing::Level::INFO)
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: could not start the runtime: {err}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(tower_idempotency_cli::run(cli))
}
