//! The retention header: on a protected response, first or replayed, the moment its key's record
//! expires, so that a client knows until when a retry with the key is recognised.
//!
//! The layer writes the header into the response before the record is stored, so the stored
//! response carries it and every replay repeats the same moment: no store has to keep or return
//! a record's expiry. The moment is the completion's wall-clock time plus the dedup window,
//! rounded down to the second; the store counts the window from its write, a moment later, so the
//! record is kept at least until the stated time. A `409` while the key's run is in flight states
//! now plus the window: that run completes no earlier than now, so its record is kept at least
//! until then.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderName, HeaderValue};

/// The last second an HTTP-date can write (9999-12-31T23:59:59Z): a longer window is stated as it.
const LAST_HTTP_DATE: u64 = 253_402_300_799;

/// The retention header's default name.
///
/// ```
/// assert_eq!(tower_idempotency::IDEMPOTENCY_KEY_EXPIRES, "idempotency-key-expires");
/// ```
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

/// How the retention header writes its moment (see
/// [`IdempotencyLayer::retention_header`](crate::IdempotencyLayer::retention_header)).
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use tower_idempotency::RetentionFormat;
///
/// let at = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
/// assert_eq!(RetentionFormat::HttpDate.format(at), "Thu, 01 Jan 2026 00:00:00 GMT");
/// assert_eq!(RetentionFormat::StructuredDate.format(at), "@1767225600");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetentionFormat {
    /// An HTTP-date (RFC 9110 §5.6.7, IMF-fixdate), as `Expires` and `Retry-After` write one:
    /// every HTTP client library parses it.
    HttpDate,
    /// A structured-field Date (RFC 9651 §3.3.7): `@` and the seconds since the Unix epoch, the form
    /// new HTTP fields are defined in.
    StructuredDate,
}

impl RetentionFormat {
    /// `at`, in this format, rounded down to the second (and to the end of year 9999 at most).
    pub fn format(self, at: SystemTime) -> HeaderValue {
        let seconds = at
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs()
            .min(LAST_HTTP_DATE);
        let text = match self {
            RetentionFormat::HttpDate => {
                httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(seconds))
            }
            RetentionFormat::StructuredDate => format!("@{seconds}"),
        };
        // Both forms are ASCII letters, digits, spaces, commas, colons and `@`.
        HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static("@0"))
    }
}

/// The retention header as configured: its name and format.
#[derive(Clone, Debug)]
pub(crate) struct Retention {
    pub(crate) header: HeaderName,
    pub(crate) format: RetentionFormat,
}

impl Retention {
    /// Writes the header for a record kept for `window` from now into `headers`, replacing any
    /// value the handler set.
    pub(crate) fn stamp(&self, headers: &mut http::HeaderMap, window: Duration) {
        let last = UNIX_EPOCH + Duration::from_secs(LAST_HTTP_DATE);
        let expires = SystemTime::now().checked_add(window).unwrap_or(last);
        headers.insert(self.header.clone(), self.format.format(expires));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_formats_round_down_to_the_second() {
        let at = UNIX_EPOCH + Duration::from_millis(784_111_777_999);
        assert_eq!(
            RetentionFormat::HttpDate.format(at),
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        assert_eq!(RetentionFormat::StructuredDate.format(at), "@784111777");
    }

    #[test]
    fn a_window_past_the_calendar_is_capped_not_a_panic() {
        let retention = Retention {
            header: IDEMPOTENCY_KEY_EXPIRES,
            format: RetentionFormat::HttpDate,
        };
        let mut headers = http::HeaderMap::new();
        retention.stamp(&mut headers, Duration::MAX);
        assert_eq!(
            headers[IDEMPOTENCY_KEY_EXPIRES],
            "Fri, 31 Dec 9999 23:59:59 GMT"
        );
        retention.stamp(&mut headers, Duration::from_secs(LAST_HTTP_DATE * 2));
        assert_eq!(
            headers[IDEMPOTENCY_KEY_EXPIRES],
            "Fri, 31 Dec 9999 23:59:59 GMT"
        );
    }
}
