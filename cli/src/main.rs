//! `idempotency-keys`: look up or forget one idempotency key (see the crate's documentation).

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser;
use tower_idempotency_cli::{Cli, Exit};
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = cli.check() {
        err.exit();
    }
    // The forget's WARN line, with the operator's reason, is the audit trail: to stderr. With
    // `--json` the tool writes it there as one JSON object instead, so the text line is left out.
    let text_audit = !cli.json();
    let filter = tracing_subscriber::filter::filter_fn(move |meta| {
        *meta.level() <= tracing::Level::INFO
            && (text_audit || meta.module_path() != Some("tower_idempotency::operator"))
    });
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter),
    );
    // Set directly, not with `init()`: where another crate of a build turns on
    // tracing-subscriber's `tracing-log`, `init()` also routes the `log` crate, and the audit line
    // was lost.
    let _ = tracing::subscriber::set_global_default(subscriber);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: could not start the runtime: {err}");
            return Exit::Store.into();
        }
    };
    runtime.block_on(tower_idempotency_cli::run(cli))
}
