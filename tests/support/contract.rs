//! The store contract suite, as the crate exports it (`tower_idempotency::testing`, feature
//! `test-util`), under the path and macro name that test files use: `support::contract::Harness`
//! and a crate-level `store_contract!(harness, <#[tokio::test] attributes>)`.

#[allow(
    unused_imports,
    reason = "each test binary uses a part of the suite, some none of it"
)]
pub use tower_idempotency::testing::*;

/// `tower_idempotency::store_contract!`, callable as `store_contract!` in a test file that says
/// `mod support;`.
#[macro_export]
macro_rules! store_contract {
    ($($args:tt)*) => {
        ::tower_idempotency::store_contract!($($args)*);
    };
}
