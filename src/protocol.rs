//! The behaviour contract, in numbered sections that the code, the tests and the contract suite
//! cite (`§5.3`, `§10.1`, ...): `docs/PROTOCOL.md` in the crate's sources, published here so that
//! its sections can be read, and linked, on docs.rs.
#![doc = include_str!("../docs/PROTOCOL.md")]
