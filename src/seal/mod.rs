//! Records sealed at rest (feature `seal`): [`SealedStore`] encrypts and authenticates every
//! stored response under the application's [`SealKeys`] before it reaches the store it wraps, and
//! opens it again on the way back. A store's readers (a replica, a backup, `redis-cli`) see no
//! response; its writers cannot forge one, change one, or move one to another key or scope: a
//! record that does not open is never replayed, and its request is answered
//! `500 record-unreadable` (`docs/PROTOCOL.md` §5.4, §7, §12).
//!
//! ```
//! use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! let keys = SealKeys::new([SealKey::new("2025-01", [7; 32])?])?;
//! let layer = IdempotencyLayer::new(SealedStore::new(MemoryStore::new(), keys));
//! # let _ = layer;
//! # Ok::<(), tower_idempotency::seal::SealKeyError>(())
//! ```

mod keys;
mod store;

pub use keys::{OpenError, SealKey, SealKeyError, SealKeys};
pub use store::SealedStore;
