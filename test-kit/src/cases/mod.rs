//! The cases of the contract, each a `pub async fn case<H: Harness>(h: H)` that panics when the
//! store breaks a rule: [`store_contract!`](crate::store_contract) runs them all, one test each.
//! Each names the rules it checks as `PROTOCOL.md §N.M` (`docs/PROTOCOL.md` in the crate's
//! repository).
//!
//! Store-level cases (`store_*`) call the [`Store`](tower_idempotency::store::Store) methods
//! directly; the others drive an [`IdempotencyLayer`](tower_idempotency::IdempotencyLayer) over the
//! store.

mod fence;
mod layer;
mod operator;
mod options;
mod origin;
mod seal;
mod store;
mod trailers;
mod wait;

pub use fence::*;
pub use layer::*;
pub use operator::*;
pub use options::*;
pub use origin::*;
pub use seal::*;
pub use store::*;
pub use trailers::*;
pub use wait::*;
