//! The benchmarks of tower-idempotency, as `[[bench]]` targets of this package: see its
//! `Cargo.toml` for what each measures and how to run it.
//!
//! What several benches share lives here: the in-process app ([`app`]), the store floors
//! ([`floor`]) and the callgrind and chart helpers ([`support`]).

pub mod app;
pub mod floor;
pub mod support;
