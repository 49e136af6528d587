//! Who a record belongs to: [`RecordId`] names it, [`ClaimToken`] fences the writes of the claim
//! that made it, and its [`Fence`] numbers the claims of a key.

use std::cell::Cell;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::hex::Hex;

/// The identity of a record: a 128-bit digest of the scope and the key.
///
/// Two scopes never share an id for the same key, and the id reveals neither.
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::record::RecordId;
/// use tower_idempotency::IdempotencyKey;
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

    /// The id's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.id
    }

    /// A tag of the id's scope: ids of one scope share it (ids of different scopes almost never
    /// do). For per-scope accounting in a store.
    pub(crate) const fn scope_tag(&self) -> u64 {
        self.scope
    }

    /// A short, non-reversible tag of the id for logs: the first 8 hex characters.
    ///
    /// ```
    /// use tower_idempotency::record::RecordId;
    ///
    /// let id = RecordId::new(b"acct_1", "order-42");
    /// assert_eq!(id.tag().to_string(), id.to_string()[..8]);
    /// ```
    pub fn tag(&self) -> impl fmt::Display + '_ {
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

/// A claim's token: its [`Fence`] and a part unique to the claim. Complete, renew and release do
/// nothing unless the record still carries the token of the claim that makes them (§5.3).
///
/// Bytes 0..8 are the fence, big-endian, so tokens sort by their fence; bytes 8..16 tell apart
/// claims that a store gave the same fence (never two claims of one key).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimToken([u8; 16]);

impl ClaimToken {
    /// A new token carrying `fence`, its other half unique in this process and (with overwhelming
    /// probability) across processes: a random per-process value plus a counter.
    ///
    /// ```
    /// use tower_idempotency::record::{ClaimToken, Fence};
    ///
    /// let token = ClaimToken::new(Fence::new(7));
    /// assert_eq!(token.fence(), Fence::new(7));
    /// assert_ne!(token, ClaimToken::new(Fence::new(7)), "two claims, two tokens");
    /// ```
    pub fn new(fence: Fence) -> Self {
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
        token[..8].copy_from_slice(&fence.0.to_be_bytes());
        token[8..].copy_from_slice(&seed.wrapping_add(count).to_le_bytes());
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

    /// The claim's fence number: larger than that of every earlier claim of the same key (§5.3).
    pub fn fence(&self) -> Fence {
        let mut fence = [0; 8];
        fence.copy_from_slice(&self.0[..8]);
        Fence(u64::from_be_bytes(fence))
    }

    /// The same claim with the fence a store chose for it: stores that number claims themselves
    /// (Redis, PostgreSQL) send the token's unique half and learn the fence from the answer.
    ///
    /// ```
    /// use tower_idempotency::record::{ClaimToken, Fence};
    ///
    /// let token = ClaimToken::new(Fence::new(1)).with_fence(Fence::new(9));
    /// assert_eq!(token.fence(), Fence::new(9));
    /// ```
    #[must_use]
    pub fn with_fence(mut self, fence: Fence) -> Self {
        self.0[..8].copy_from_slice(&fence.0.to_be_bytes());
        self
    }

    /// The half that tells claims apart, without the fence (bytes 8..16): what a store that
    /// numbers claims itself matches a release or renewal on.
    ///
    /// ```
    /// use tower_idempotency::record::{ClaimToken, Fence};
    ///
    /// let token = ClaimToken::new(Fence::new(1));
    /// assert_eq!(token.with_fence(Fence::new(2)).unique_half(), token.unique_half());
    /// ```
    pub fn unique_half(&self) -> &[u8] {
        &self.0[8..]
    }
}

/// A claim's fence number: every claim of a key gets a larger one than every earlier claim of that
/// key, so a run that took a key over after a lease ran out carries a larger number than the run it
/// displaced (§5.3).
///
/// A handler passes it with each effect outside the layer's store (a row in another table, a call
/// to a provider); the effect's store keeps the largest fence it has seen for the operation and
/// refuses a smaller one, so a stale run cannot act after a newer one took over
/// ([`HeldClaim`](crate::HeldClaim)). Equal fences are the same claim: a write sent again is not
/// stale.
///
/// The crate's stores make it from the store's own clock, in microseconds since the Unix epoch,
/// and one more than the key's previous fence where that is larger: it survives a store that
/// forgot the key (a restart, a failover, a swept row) as long as that clock does not go back.
///
/// ```
/// use tower_idempotency::record::Fence;
///
/// let first = Fence::new(1_700_000_000_000_000);
/// // A takeover within the same microsecond still gets a larger fence.
/// assert!(Fence::following(Some(first), first.get()) > first);
/// assert_eq!(first.to_string(), "1700000000000000");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Fence(u64);

impl Fence {
    /// A fence of the given number: as read back from an effect's own store.
    pub const fn new(number: u64) -> Self {
        Self(number)
    }

    /// The fence's number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The fence of a new claim made at `now_micros` (the store's clock, in microseconds since
    /// the Unix epoch) on a key whose last claim, if the store still knows it, had `previous`:
    /// the later of the two, so it grows even when the clock has not moved.
    pub const fn following(previous: Option<Fence>, now_micros: u64) -> Self {
        match previous {
            Some(Fence(previous)) if previous >= now_micros => Self(previous.saturating_add(1)),
            _ => Self(now_micros),
        }
    }

    /// The next fence of this process: this machine's clock in microseconds since the Unix epoch,
    /// and always larger than the last fence it gave. For stores whose records live in the
    /// process (as [`MemoryStore`](crate::MemoryStore)'s do); a shared store numbers claims with
    /// its own clock ([`Fence::following`]).
    ///
    /// ```
    /// use tower_idempotency::record::Fence;
    ///
    /// let first = Fence::next_in_process();
    /// assert!(Fence::next_in_process() > first);
    /// ```
    pub fn next_in_process() -> Self {
        static LAST: AtomicU64 = AtomicU64::new(0);
        let now = unix_micros(SystemTime::now());
        let previous = LAST
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(Self::following(Some(Self(last)), now).0)
            })
            .unwrap_or_else(|last| last);
        Self::following(Some(Self(previous)), now)
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Microseconds since the Unix epoch at `time` (0 before it).
fn unix_micros(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros().try_into().unwrap_or(u64::MAX))
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
        assert_eq!(id.tag().to_string(), printed[..8]);
    }

    #[test]
    fn tokens_are_unique_across_threads() {
        // More than one counter block per thread, from threads running at once.
        const PER_THREAD: usize = 150_000;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..PER_THREAD)
                        .map(|_| ClaimToken::new(Fence::new(1)))
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

#[cfg(test)]
mod fence_tests {
    use super::*;

    #[test]
    fn ids_tokens_and_fences_show_themselves() {
        let id = RecordId::new(b"acct_1", "k");
        assert_eq!(format!("{id:?}"), format!("RecordId({id})"));
        let token = ClaimToken::from_bytes([0xab; 16]);
        assert_eq!(
            format!("{token:?}"),
            format!("ClaimToken({})", "ab".repeat(16))
        );
        assert_eq!(
            token.fence().to_string(),
            u64::from_be_bytes([0xab; 8]).to_string()
        );
    }

    #[test]
    fn a_token_carries_its_fence_and_sorts_by_it() {
        let low = ClaimToken::new(Fence::new(5));
        let high = ClaimToken::new(Fence::new(6));
        assert_eq!(low.fence(), Fence::new(5));
        assert!(
            low.as_bytes() < high.as_bytes(),
            "big-endian: bytes sort as fences do"
        );
        let moved = low.with_fence(Fence::new(9));
        assert_eq!(moved.fence(), Fence::new(9));
        assert_eq!(moved.unique_half(), low.unique_half());
    }

    #[test]
    fn process_fences_grow_even_when_the_clock_does_not() {
        let fences: Vec<_> = (0..10_000).map(|_| Fence::next_in_process()).collect();
        assert!(fences.windows(2).all(|pair| pair[0] < pair[1]));
        let now = unix_micros(SystemTime::now());
        assert!(
            fences[0].get() + 60_000_000 > now,
            "near the clock, not a bare counter"
        );
    }

    #[test]
    fn following_takes_the_clock_or_one_past_the_previous() {
        assert_eq!(Fence::following(None, 10), Fence::new(10));
        assert_eq!(Fence::following(Some(Fence::new(3)), 10), Fence::new(10));
        assert_eq!(Fence::following(Some(Fence::new(10)), 10), Fence::new(11));
        assert_eq!(
            Fence::following(Some(Fence::new(u64::MAX)), 1),
            Fence::new(u64::MAX)
        );
    }
}
