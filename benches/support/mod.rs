//! What the callgrind benches share: the client requests that count only the measured part, and
//! the charts of BENCHMARKS.md.

pub mod callgrind;
pub mod chart;
