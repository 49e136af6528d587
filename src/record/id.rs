//! Who a record belongs to: [`RecordId`] names it, [`ClaimToken`] fences the writes of the claim
//! that made it.

use std::cell::Cell;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::hex::Hex;
use crate::key::IdempotencyKey;

/// The identity of a record: a 128-bit digest of the scope and the key.
///
/// Two scopes never share an id for the same key, and the id reveals neither.
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::{IdempotencyKey, RecordId};
///
/// let key = IdempotencyKey::parse(&HeaderValue::from_static("k")).unwrap();
/// assert_ne!(RecordId::new(b"acct_1", key.as_str()), RecordId::new(b"acct_2", key.as_str()));
/// assert_eq!(RecordId::new(b"acct_1", "k").to_string().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordId {
    id: [u8; 16],
    /// A tag of the scope alone, so that a store in this process can account records per scope
    /// (the memory store's per-scope limit). Not part of any stored key: the id alone names the
    /// record.
    scope: u64,
}

impl RecordId {
    /// The id of an HTTP request's `key` inside `scope`.
    pub fn new(scope: &[u8], key: &str) -> Self {
        static KEY: LazyLock<[u8; 32]> =
            LazyLock::new(|| blake3::derive_key("tower-idempotency record id v1", b""));
        Self::derive(&KEY, scope, key)
    }

    /// The id of a queue message's `message_id` inside `scope` (a consumer group). Ids of messages
    /// and of HTTP keys never collide, even with the same scope and text.
    pub fn for_message(scope: &[u8], message_id: &str) -> Self {
        static KEY: LazyLock<[u8; 32]> =
            LazyLock::new(|| blake3::derive_key("tower-idempotency message id v1", b""));
        Self::derive(&KEY, scope, message_id)
    }

    fn derive(domain: &[u8; 32], scope: &[u8], key: &str) -> Self {
        // The domain key is derived once per kind, not per record.
        let mut hasher = blake3::Hasher::new_keyed(domain);
        hasher.update(&(scope.len() as u64).to_le_bytes());
        hasher.update(scope);
        hasher.update(key.as_bytes());
        let mut id = [0; 16];
        id.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        // The tag never leaves the process: a keyed SipHash with a per-process random key is
        // cheaper than a second blake3 output, and no scope can be chosen to collide with another.
        static SCOPE_TAGS: LazyLock<RandomState> = LazyLock::new(RandomState::new);
        Self {
            id,
            scope: SCOPE_TAGS.hash_one(scope),
        }
    }

    /// The id of an [`IdempotencyKey`] inside `scope`.
    pub fn for_key(scope: &[u8], key: &IdempotencyKey) -> Self {
        Self::new(scope, key.as_str())
    }

    /// The id's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.id
    }

    /// A tag of the id's scope: ids of one scope share it (ids of different scopes almost never
    /// do). For per-scope accounting in a store.
    pub(crate) const fn scope_tag(&self) -> u64 {
        self.scope
    }

    /// A short, non-reversible tag of the id for logs (the first 8 hex characters).
    pub fn short(&self) -> String {
        self.tag().to_string()
    }

    /// [`RecordId::short`] without the allocation, for log fields.
    pub(crate) fn tag(&self) -> Hex<'_> {
        Hex(&self.id[..4])
    }
}

/// Hashes the id alone: it already names the record (and so its scope), and the memory store's
/// maps hash one per request.
impl std::hash::Hash for RecordId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As one integer: an array would be hashed with its length first, 24 bytes, not 16.
        state.write_u128(u128::from_le_bytes(self.id));
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Hex(&self.id).fmt(f)
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({self})")
    }
}

/// A claim's fencing token: unique per claim. Complete, renew and release do nothing unless the
/// record still carries the token of the claim that makes them.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimToken([u8; 16]);

impl ClaimToken {
    /// A new token, unique in this process and (with overwhelming probability) across processes:
    /// a random per-process prefix and a counter.
    pub fn generate() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let seed = *SEED.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u128(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos(),
            );
            hasher.write_u32(std::process::id());
            hasher.finish()
        });
        // Each thread takes a block of counter values at a time, so that threads claiming at once
        // do not all contend on one atomic; values stay unique in the process.
        const BLOCK: u64 = 1 << 16;
        thread_local! {
            static NEXT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        }
        let count = NEXT.with(|next| {
            let (mut count, mut end) = next.get();
            if count == end {
                count = COUNTER.fetch_add(BLOCK, Ordering::Relaxed);
                end = count + BLOCK;
            }
            next.set((count + 1, end));
            count
        });
        let mut token = [0; 16];
        token[..8].copy_from_slice(&seed.to_le_bytes());
        token[8..].copy_from_slice(&count.to_le_bytes());
        Self(token)
    }

    /// Rebuilds a token from its bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The token's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClaimToken({})", Hex(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_never_collide_with_http_keys() {
        assert_ne!(
            RecordId::new(b"ledger", "evt_1"),
            RecordId::for_message(b"ledger", "evt_1")
        );
        assert_eq!(
            RecordId::for_message(b"ledger", "evt_1"),
            RecordId::for_message(b"ledger", "evt_1")
        );
    }

    #[test]
    fn ids_print_as_32_hex_digits_and_tag_with_their_first_8() {
        let id = RecordId::new(b"acct_1", "k");
        let printed = id.to_string();
        assert_eq!(printed.len(), 32);
        assert!(
            printed
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(id.short(), printed[..8]);
    }

    #[test]
    fn tokens_are_unique_across_threads() {
        // More than one counter block per thread, from threads running at once.
        const PER_THREAD: usize = 150_000;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..PER_THREAD)
                        .map(|_| ClaimToken::generate())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let tokens: std::collections::HashSet<_> = threads
            .into_iter()
            .flat_map(|thread| thread.join().unwrap())
            .collect();
        assert_eq!(tokens.len(), 4 * PER_THREAD);
    }
}
