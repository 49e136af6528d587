//! The benchmarks of tower-idempotency, as `[[bench]]` targets of this package: see its
//! `Cargo.toml` for what each measures and how to run it.
