//! Shared test code: the `redis-server` and PostgreSQL fixtures, and the store contract suite
//! under the path test files name it by (`support::contract`).
//!
//! Every test binary that says `mod support;` compiles all of it, and none uses every item: the
//! modules allow dead code.

pub mod contract;
pub mod postgres_server;
pub mod redis_cluster;
pub mod redis_harness;
pub mod redis_server;
