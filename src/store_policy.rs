//! Which responses are stored for replay: the [`StorePolicy`] hook, its default, and the policy
//! that stores every 4xx.

use http::StatusCode;
use http::response::Parts;

/// Decides whether a response is stored for replay (`docs/PROTOCOL.md` §8.1), from its status,
/// headers and extensions. A response it refuses releases the claim: a retry runs the handler
/// again. `Cache-Control: no-store` is never stored, whatever the policy says.
///
/// Implemented for closures `Fn(&http::response::Parts) -> bool`, by [`DefaultStorePolicy`] and
/// by [`Every4xxStorePolicy`]; set it with
/// [`IdempotencyLayer::store_policy`](crate::IdempotencyLayer::store_policy).
///
/// ```
/// use http::StatusCode;
/// use http::response::Parts;
/// use tower_idempotency::{DefaultStorePolicy, StorePolicy};
///
/// // Store what the default stores, except a 410: this API revives what it deleted.
/// let policy = |head: &Parts| head.status != StatusCode::GONE && DefaultStorePolicy.store(head);
/// let (head, ()) = http::Response::builder().status(410).body(()).unwrap().into_parts();
/// assert!(!policy.store(&head));
/// ```
pub trait StorePolicy: Send + Sync + 'static {
    /// Whether the response with this head is stored.
    fn store(&self, response: &Parts) -> bool;
}

impl<F> StorePolicy for F
where
    F: Fn(&Parts) -> bool + Send + Sync + 'static,
{
    fn store(&self, response: &Parts) -> bool {
        self(response)
    }
}

/// The 4xx statuses that refuse the request as it was sent, before the handler acted on it
/// (PROTOCOL §8.1): it failed validation (400, 411, 413, 414, 415, 422, 431), authentication or
/// authorization (401, 403, 407), addressed nothing that can act (404, 405, 421), or failed a
/// precondition its headers state (406, 412, 417, 428), which the fingerprint does not cover.
/// The corrected retry under the same key must run.
const REFUSED_AS_SENT: [u16; 17] = [
    400, 401, 403, 404, 405, 406, 407, 411, 412, 413, 414, 415, 417, 421, 422, 428, 431,
];

/// The 4xx statuses that a retry of the very same request may well change (PROTOCOL §8.1): a
/// timeout, a conflict with another request, too early, too many requests.
const MAY_CHANGE: [u16; 4] = [408, 409, 425, 429];

/// The default store policy, Stripe's rule: a request that failed validation or authentication
/// before the handler acted is not stored, so its corrected retry under the same key runs.
///
/// Stored: every 2xx and 3xx, and the 4xx that are a decided outcome, such as `402` (a declined
/// card: the handler acted, and a retry must not charge again), `410` (gone for good: a retry
/// would get it again) and any 4xx not named below. Not stored: 1xx and 5xx; the 4xx that refuse
/// the request as it was sent (400, 401, 403, 404, 405, 406, 407, 411, 412, 413, 414, 415, 417,
/// 421, 422, 428, 431); and those a retry may well change (408, 409, 425, 429). PROTOCOL §8.1
/// gives the reason for each.
///
/// [`Every4xxStorePolicy`] stores every 4xx but 408, 409, 425 and 429, as this default did up to
/// 0.1. A policy of your own can start from either.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::DefaultStorePolicy;
///
/// assert!(DefaultStorePolicy::stores(StatusCode::CREATED));
/// assert!(DefaultStorePolicy::stores(StatusCode::PAYMENT_REQUIRED));
/// assert!(!DefaultStorePolicy::stores(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!DefaultStorePolicy::stores(StatusCode::UNAUTHORIZED));
/// assert!(!DefaultStorePolicy::stores(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!DefaultStorePolicy::stores(StatusCode::SERVICE_UNAVAILABLE));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

impl DefaultStorePolicy {
    /// Whether the default policy stores a response with `status`: it looks at nothing else.
    pub fn stores(status: StatusCode) -> bool {
        Every4xxStorePolicy::stores(status) && !REFUSED_AS_SENT.contains(&status.as_u16())
    }
}

impl StorePolicy for DefaultStorePolicy {
    fn store(&self, response: &Parts) -> bool {
        Self::stores(response.status)
    }
}

/// A store policy that stores every 2xx, 3xx and 4xx response except 408, 409, 425 and 429; 1xx
/// and 5xx are not. The default up to 0.1: choose it where a 4xx can follow an effect of the
/// handler, so that a retry must get it again. A validation error is then stored for the whole
/// dedup window, and the corrected request under the same key gets a `422` mismatch: clients
/// must use a new key after a 4xx (PROTOCOL §8.1).
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::{Every4xxStorePolicy, IdempotencyLayer, MemoryStore};
///
/// assert!(Every4xxStorePolicy::stores(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!Every4xxStorePolicy::stores(StatusCode::CONFLICT));
/// let layer = IdempotencyLayer::new(MemoryStore::new()).store_policy(Every4xxStorePolicy);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Every4xxStorePolicy;

impl Every4xxStorePolicy {
    /// Whether this policy stores a response with `status`: it looks at nothing else.
    pub fn stores(status: StatusCode) -> bool {
        (200..500).contains(&status.as_u16()) && !MAY_CHANGE.contains(&status.as_u16())
    }
}

impl StorePolicy for Every4xxStorePolicy {
    fn store(&self, response: &Parts) -> bool {
        Self::stores(response.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::text::{PROTOCOL, section, table_rows};

    /// Whether the row's first cell (`402`, `2xx, 3xx`, `any other 4xx`) covers `status`, and
    /// how closely: a status named outright wins over its class.
    fn covers(cell: &str, status: u16) -> Option<u8> {
        cell.split(", ").map(str::trim).find_map(|name| {
            let name = name.trim_matches('`');
            if name == status.to_string() {
                Some(2)
            } else if name.trim_start_matches("any other ") == format!("{}xx", status / 100) {
                Some(1)
            } else {
                None
            }
        })
    }

    /// PROTOCOL §8.1's table says, for every status from 100 to 599, what the default stores.
    #[test]
    fn the_protocol_table_is_the_default_policy() {
        let rows = table_rows(section(PROTOCOL, "### 8.1"));
        assert!(rows.len() > 2, "§8.1 has a table: {rows:?}");
        for code in 100..600 {
            let status = StatusCode::from_u16(code).expect("a status");
            let row = (rows.iter().skip(1))
                .filter_map(|row| covers(row[0], code).map(|rank| (rank, row)))
                .max_by_key(|(rank, _)| *rank)
                .map(|(_, row)| row)
                .unwrap_or_else(|| panic!("§8.1's table has no row for {code}"));
            let documented = match row[1] {
                "yes" => true,
                "no" => false,
                other => panic!("§8.1: stored is yes or no, not {other:?}"),
            };
            assert_eq!(
                documented,
                DefaultStorePolicy::stores(status),
                "§8.1's table and DefaultStorePolicy disagree on {code}: {row:?}"
            );
        }
    }

    /// The two policies differ exactly on the 4xx that refuse the request as it was sent.
    #[test]
    fn every_4xx_stores_what_the_default_refuses_as_sent() {
        for code in 100..600 {
            let status = StatusCode::from_u16(code).expect("a status");
            let expected = DefaultStorePolicy::stores(status) || REFUSED_AS_SENT.contains(&code);
            assert_eq!(Every4xxStorePolicy::stores(status), expected, "{code}");
        }
        for code in [402, 410, 451] {
            let status = StatusCode::from_u16(code).expect("a status");
            assert!(DefaultStorePolicy::stores(status), "{code}");
        }
    }
}
