//! Shared test code: the store contract suite, and the `redis-server` and PostgreSQL fixtures.
//!
//! Every test binary that says `mod support;` compiles all of it, and none uses every item: the
//! modules allow dead code.

pub mod contract;
pub mod postgres_server;
pub mod redis_server;
