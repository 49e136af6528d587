//! The store contract and the layer over a store (crate `tower-idempotency-test`) on the stores
//! that need no server: `MemoryStore`, plain and sealed; a store written with the public API
//! alone; a store chosen at run time (`BoxStore`, `Arc`).

mod boxed;
mod external;
mod memory;
mod sealed;
