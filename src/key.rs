//! The `Idempotency-Key` header: parsing and validation.
//!
//! Two forms are accepted and mean the same key:
//! - the IETF draft's quoted sf-string, `"8e03978e-40d5-43e8-bc93-6894a57f9324"` (with `\"` and `\\`
//!   escapes), parsed by the [`sfv`] crate;
//! - Stripe's bare form, `8e03978e-40d5-43e8-bc93-6894a57f9324`, checked character by character (a
//!   bare key is not an sf-token: a UUID may start with a digit).
//!
//! After unquoting, a key is 1 to 255 characters, each visible ASCII (`0x21..=0x7E`). A bare key may
//! not contain `"` or `,`. Anything else is rejected with a [`KeyError`].

use std::fmt;

use http::HeaderValue;

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as the client sent it (unquoted).
///
/// The layer puts it in the extensions of every request it protects, so a handler can read it (and,
/// with the `axum` feature, extract it) to derive the idempotency key of a downstream call.
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse(&HeaderValue::from_static("order-42")).unwrap();
/// let quoted = IdempotencyKey::parse(&HeaderValue::from_static("\"order-42\"")).unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42");
///
/// assert!(IdempotencyKey::parse(&HeaderValue::from_static("a, b")).is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Repr);

#[derive(Clone)]
enum Repr {
    /// A bare key: the header value itself, shared without a copy.
    Header(HeaderValue),
    /// An unquoted sf-string.
    Owned(Box<str>),
}

/// Why a header value is not a valid idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The value is longer than [`MAX_KEY_LEN`] characters.
    #[error("the idempotency key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    /// The value holds a byte that is not visible ASCII (a control character, a space, non-ASCII).
    #[error("the idempotency key may only hold visible ASCII characters (0x21 to 0x7E)")]
    InvalidCharacter,
    /// A bare value holds `,`: a list of keys.
    #[error("the idempotency key is a list; send exactly one key")]
    List,
    /// A value that starts with `"` is not exactly one sf-string.
    #[error("the quoted idempotency key is not one valid structured-field string")]
    InvalidQuoted,
    /// The request carries more than one key header.
    #[error("the request carries more than one idempotency key header")]
    Multiple,
}

impl IdempotencyKey {
    /// Parses one header value, in the quoted or the bare form.
    ///
    /// # Errors
    /// A [`KeyError`] when the value is not one valid key.
    pub fn parse(value: &HeaderValue) -> Result<Self, KeyError> {
        let bytes = value.as_bytes();
        let trimmed = bytes.trim_ascii();
        if trimmed.first() == Some(&b'"') {
            return parse_quoted(trimmed);
        }
        if trimmed.contains(&b',') {
            return Err(KeyError::List);
        }
        validate(trimmed)?;
        if trimmed.contains(&b'"') {
            return Err(KeyError::InvalidCharacter);
        }
        if trimmed.len() == bytes.len() {
            Ok(Self(Repr::Header(value.clone())))
        } else {
            // Validated visible ASCII above, so this is valid UTF-8.
            let text = std::str::from_utf8(trimmed).map_err(|_| KeyError::InvalidCharacter)?;
            Ok(Self(Repr::Owned(text.into())))
        }
    }

    /// Parses every value of the key header of a request: exactly one value is a key, none is
    /// `Ok(None)`, more than one is [`KeyError::Multiple`].
    ///
    /// # Errors
    /// A [`KeyError`] for more than one header or an invalid value.
    pub fn from_headers(
        headers: &http::HeaderMap,
        name: &http::HeaderName,
    ) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Multiple);
        }
        Self::parse(first).map(Some)
    }

    /// The key as the client meant it, without quotes or escapes.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only visible ASCII passes `parse`, so `to_str` cannot fail here.
            Repr::Header(value) => value.to_str().unwrap_or_default(),
            Repr::Owned(text) => text,
        }
    }

    /// Derives a stable key for a downstream call (a payment provider's own idempotency key) from
    /// this key and a namespace, such as the account or the provider's name: 64 hex characters.
    ///
    /// The same key and namespace always give the same result; different namespaces give unrelated
    /// results, so a key cannot be used to guess another account's downstream key.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tower_idempotency::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(&HeaderValue::from_static("order-42")).unwrap();
    /// assert_eq!(key.derive("acct_1"), key.derive("acct_1"));
    /// assert_ne!(key.derive("acct_1"), key.derive("acct_2"));
    /// assert_eq!(key.derive("acct_1").len(), 64);
    /// ```
    pub fn derive(&self, namespace: &str) -> String {
        let mut hasher = blake3::Hasher::new_derive_key("tower-idempotency downstream key v1");
        hasher.update(&(namespace.len() as u64).to_le_bytes());
        hasher.update(namespace.as_bytes());
        hasher.update(self.as_str().as_bytes());
        hasher.finalize().to_hex().to_string()
    }
}

fn validate(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(())
}

fn parse_quoted(value: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let item: sfv::Item = sfv::Parser::new(value)
        .parse()
        .map_err(|_| KeyError::InvalidQuoted)?;
    if !item.params.is_empty() {
        return Err(KeyError::InvalidQuoted);
    }
    let text = item
        .bare_item
        .as_string()
        .ok_or(KeyError::InvalidQuoted)?
        .as_str();
    validate(text.as_bytes())?;
    Ok(IdempotencyKey(Repr::Owned(text.into())))
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey")
            .field(&self.as_str())
            .finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq for Repr {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Repr {}

impl std::hash::Hash for Repr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl Repr {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Repr::Header(value) => value.as_bytes(),
            Repr::Owned(text) => text.as_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse(&HeaderValue::from_bytes(bytes).expect("a header value"))
    }

    #[test]
    fn bare_and_quoted_are_one_key() {
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        let bare = parse(uuid.as_bytes()).unwrap();
        let quoted = parse(format!("\"{uuid}\"").as_bytes()).unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(bare.as_str(), uuid);
        assert_eq!(quoted.as_str(), uuid);
    }

    #[test]
    fn quoted_escapes_are_unescaped() {
        let key = parse(br#""a\"b\\c""#).unwrap();
        assert_eq!(key.as_str(), r#"a"b\c"#);
    }

    #[test]
    fn a_bare_key_may_start_with_a_digit_and_hold_token_excluded_characters() {
        for ok in ["1abc", "a/b:c", "{}[]()<>?@=;", "~!#$%&'*+-.^_`|"] {
            assert_eq!(parse(ok.as_bytes()).unwrap().as_str(), ok, "{ok}");
        }
    }

    #[test]
    fn length_bounds() {
        assert_eq!(parse(b"a").unwrap().as_str(), "a");
        let max = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parse(max.as_bytes()).unwrap().as_str(), max);
        let over = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(parse(over.as_bytes()), Err(KeyError::TooLong));
        assert_eq!(
            parse(format!("\"{over}\"").as_bytes()),
            Err(KeyError::TooLong)
        );
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn invalid_forms_are_rejected() {
        let cases: &[(&[u8], KeyError)] = &[
            (b"a b", KeyError::InvalidCharacter),
            (b"a\tb", KeyError::InvalidCharacter),
            ("caf\u{e9}".as_bytes(), KeyError::InvalidCharacter),
            (b"\xff\xfe", KeyError::InvalidCharacter),
            (b"a,b", KeyError::List),
            (b"a, b", KeyError::List),
            (b"ab\"c", KeyError::InvalidCharacter),
            (b"\"unterminated", KeyError::InvalidQuoted),
            (b"\"a\", \"b\"", KeyError::InvalidQuoted),
            (b"\"a\";p=1", KeyError::InvalidQuoted),
            (b"\"a b\"", KeyError::InvalidCharacter),
            (b"\"a\\x\"", KeyError::InvalidQuoted),
        ];
        for (value, expected) in cases {
            assert_eq!(
                parse(value).as_ref().err(),
                Some(expected),
                "{:?}",
                String::from_utf8_lossy(value)
            );
        }
    }

    #[test]
    fn multiple_headers_are_rejected() {
        let name = http::HeaderName::from_static("idempotency-key");
        let mut headers = http::HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers, &name), Ok(None));
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, &name)
                .unwrap()
                .unwrap()
                .as_str(),
            "a"
        );
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, &name),
            Err(KeyError::Multiple)
        );
    }
}
