//! The simulated payment provider as a program of its own, shaped like stripe-mock: every
//! instance of the payments server calls it over HTTP (`PROVIDER_URL`), as they would call a
//! real provider. Its payments and keys are in its memory (`src/provider/mod.rs`).
//!
//! ```text
//! cargo run -p example-payments --bin provider
//! # provider listening on http://127.0.0.1:12111
//! PROVIDER_URL=http://127.0.0.1:12111 cargo run -p example-payments
//! ```
//!
//! `ADDR` sets where it listens (`127.0.0.1:12111`), `PSP_LATENCY_MS` its delay per call (0).
//! SIGTERM or Ctrl-C stops it once the calls in flight are answered.

use std::io::IsTerminal;
use std::process::ExitCode;

use example_payments::provider::{Provider, WINDOW};
use example_payments::{config, report};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", report(&*err));
            ExitCode::FAILURE
        }
    }
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:12111".into());
    let latency = config::env_millis("PSP_LATENCY_MS")?.unwrap_or_default();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|err| format!("cannot listen on {addr}: {err}"))?;
    let signal = config::shutdown_signal()?;
    println!("provider listening on http://{}", listener.local_addr()?);
    let router = Provider::new(latency, WINDOW).router();
    axum::serve(listener, router)
        .with_graceful_shutdown(signal)
        .await?;
    Ok(())
}
