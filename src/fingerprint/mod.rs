//! The request fingerprint: what makes a retry "the same request".
//!
//! A blake3 hash over length-prefixed fields: the method, the path and query, the body bytes, and the
//! values of an allow-list of request headers (none by default). Length prefixes keep field
//! boundaries unambiguous: moving a byte from the path into the body changes the fingerprint.
//!
//! Optionally (feature `canonical-json`), a JSON body counts by its canonical form instead of its
//! bytes, hashed in a domain of its own.

#[cfg(feature = "canonical-json")]
mod json;

use std::fmt;

use http::{HeaderMap, HeaderName, Method, Uri};

use crate::hex::Hex;

/// The blake3 key-derivation context of fingerprints over a canonical JSON body.
#[cfg(feature = "canonical-json")]
const CANONICAL_JSON_CONTEXT: &str = "tower-idempotency 2026-01 request fingerprint, RFC 8785 body";

/// A request's fingerprint: 32 bytes of blake3.
///
/// ```
/// use http::{HeaderMap, Method, Uri};
/// use tower_idempotency::record::Fingerprint;
///
/// let uri: Uri = "/v1/charges?expand=source".parse().unwrap();
/// let a = Fingerprint::of(&Method::POST, &uri, &HeaderMap::new(), &[], b"{\"amount\":100}");
/// let b = Fingerprint::of(&Method::POST, &uri, &HeaderMap::new(), &[], b"{\"amount\":200}");
/// assert_ne!(a, b);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a request from its method, URI (path and query), the allow-listed headers and
    /// the body. Every value of each allow-listed header is included, in order.
    pub fn of(
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        allow_listed: &[HeaderName],
        body: &[u8],
    ) -> Self {
        Self::hash(
            blake3::Hasher::new(),
            method,
            uri,
            headers,
            allow_listed,
            body,
        )
    }

    /// Fingerprints a request like [`Fingerprint::of`], but with a JSON body counted by its RFC 8785
    /// canonical form: member order, insignificant whitespace, string escapes and number spelling
    /// (`1.0`, `1e0`, `1`) do not count. `None` when the request is not JSON (its `Content-Type` is
    /// not `application/json` or `application/*+json`) or its body is not JSON that the canonical
    /// form keeps whole: invalid, with a duplicate member name, or with a number that a double does
    /// not hold exactly. The canonical form is hashed in a domain of its own, so it never equals a
    /// byte fingerprint: the same bytes sent as another content type are another request.
    ///
    /// ```
    /// use http::{HeaderMap, HeaderValue, Method, Uri, header::CONTENT_TYPE};
    /// use tower_idempotency::record::Fingerprint;
    ///
    /// let uri = Uri::from_static("/v1/charges");
    /// let mut json = HeaderMap::new();
    /// json.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    /// let of = |body: &str| Fingerprint::of_json(&Method::POST, &uri, &json, &[], body.as_bytes());
    ///
    /// assert_eq!(of(r#"{"amount":100,"currency":"eur"}"#), of(r#"{ "currency": "eur", "amount": 1e2 }"#));
    /// assert_ne!(of(r#"{"amount":100}"#), of(r#"{"amount":200}"#));
    /// assert_eq!(of("{not json"), None);
    /// ```
    #[cfg(feature = "canonical-json")]
    #[cfg_attr(docsrs, doc(cfg(feature = "canonical-json")))]
    pub fn of_json(
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        allow_listed: &[HeaderName],
        body: &[u8],
    ) -> Option<Self> {
        if !json::is_json(headers) {
            return None;
        }
        let canonical = json::canonical(body)?;
        let hasher = blake3::Hasher::new_derive_key(CANONICAL_JSON_CONTEXT);
        Some(Self::hash(
            hasher,
            method,
            uri,
            headers,
            allow_listed,
            &canonical,
        ))
    }

    fn hash(
        mut hasher: blake3::Hasher,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        allow_listed: &[HeaderName],
        body: &[u8],
    ) -> Self {
        field(&mut hasher, method.as_str().as_bytes());
        let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
        field(&mut hasher, path_and_query.as_bytes());
        field(&mut hasher, body);
        for name in allow_listed {
            field(&mut hasher, name.as_str().as_bytes());
            let values = headers.get_all(name);
            hasher.update(&(values.iter().count() as u64).to_le_bytes());
            for value in values {
                field(&mut hasher, value.as_bytes());
            }
        }
        Self(*hasher.finalize().as_bytes())
    }

    /// Rebuilds a fingerprint from its bytes (as a store reads it back).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The fingerprint's bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

fn field(hasher: &mut blake3::Hasher, bytes: &[u8]) {
    hasher.update(&(bytes.len() as u64).to_le_bytes());
    hasher.update(bytes);
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({}..)", Hex(&self.0[..8]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn fp(
        method: Method,
        uri: &str,
        headers: &HeaderMap,
        allow: &[HeaderName],
        body: &[u8],
    ) -> Fingerprint {
        Fingerprint::of(&method, &uri.parse().unwrap(), headers, allow, body)
    }

    #[test]
    fn each_field_counts() {
        let none = HeaderMap::new();
        let base = fp(Method::POST, "/a?x=1", &none, &[], b"body");
        assert_eq!(base, fp(Method::POST, "/a?x=1", &none, &[], b"body"));
        assert_ne!(base, fp(Method::PATCH, "/a?x=1", &none, &[], b"body"));
        assert_ne!(base, fp(Method::POST, "/b?x=1", &none, &[], b"body"));
        assert_ne!(base, fp(Method::POST, "/a?x=2", &none, &[], b"body"));
        assert_ne!(base, fp(Method::POST, "/a?x=1", &none, &[], b"bodY"));
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let none = HeaderMap::new();
        assert_ne!(
            fp(Method::POST, "/ab", &none, &[], b"c"),
            fp(Method::POST, "/a", &none, &[], b"bc")
        );
    }

    #[test]
    fn the_authority_does_not_count() {
        let none = HeaderMap::new();
        assert_eq!(
            fp(Method::POST, "http://a.example/p?q", &none, &[], b""),
            fp(Method::POST, "/p?q", &none, &[], b"")
        );
    }

    #[test]
    fn only_allow_listed_headers_count() {
        let ct = http::header::CONTENT_TYPE;
        let mut json = HeaderMap::new();
        json.insert(&ct, HeaderValue::from_static("application/json"));
        let mut form = HeaderMap::new();
        form.insert(
            &ct,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        assert_eq!(
            fp(Method::POST, "/", &json, &[], b""),
            fp(Method::POST, "/", &form, &[], b"")
        );
        let allow = [ct];
        assert_ne!(
            fp(Method::POST, "/", &json, &allow, b""),
            fp(Method::POST, "/", &form, &allow, b"")
        );
        assert_ne!(
            fp(Method::POST, "/", &json, &allow, b""),
            fp(Method::POST, "/", &HeaderMap::new(), &allow, b"")
        );
    }
}
