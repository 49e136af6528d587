//! The server's retention header: the moment the server forgets an operation's key, after which
//! a retry with the key would run the operation again.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName};

/// The moment `headers` state under `name`: an HTTP-date (`Fri, 02 Jan 2026 10:00:00 GMT`) or a
/// structured-field Date (`@1767348000`, seconds since the Unix epoch), the two forms the server
/// layer writes. An unreadable value states nothing.
pub(crate) fn expires(headers: &HeaderMap, name: &HeaderName) -> Option<SystemTime> {
    let value = headers.get(name)?.to_str().ok()?.trim();
    match value.strip_prefix('@') {
        Some(seconds) if !seconds.is_empty() && seconds.bytes().all(|b| b.is_ascii_digit()) => {
            let seconds = seconds.parse::<u64>().ok()?;
            UNIX_EPOCH.checked_add(Duration::from_secs(seconds))
        }
        Some(_) => None,
        None => httpdate::parse_http_date(value).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn both_forms_and_nothing_else() {
        let name = HeaderName::from_static("idempotency-key-expires");
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(&name, HeaderValue::from_str(value).unwrap());
            expires(&headers, &name)
        };
        let at = UNIX_EPOCH + Duration::from_secs(1_767_348_000);
        assert_eq!(with("Fri, 02 Jan 2026 10:00:00 GMT"), Some(at));
        assert_eq!(with("@1767348000"), Some(at));
        assert_eq!(with(" @1767348000 "), Some(at));
        for bad in [
            "@",
            "@-1",
            // Rust's integer parser takes a sign; a structured-field Date has none.
            "@+1767348000",
            "@1.5",
            "@ 1",
            "1767348000",
            "tomorrow",
            "@99999999999999999999",
        ] {
            assert_eq!(with(bad), None, "{bad}");
        }
        assert_eq!(expires(&HeaderMap::new(), &name), None);
    }
}
