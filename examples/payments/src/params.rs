//! Request parameters as Stripe's SDKs send them (`application/x-www-form-urlencoded`), or JSON.
//!
//! A form is percent-encoded `key=value` pairs (`+` a space); `metadata[order_id]=6735` is one
//! entry of a map; numbers and booleans are text (`amount=2000`, `capture=false`). An unknown
//! parameter is refused (`parameter_unknown`), as Stripe does. The layer fingerprinted the raw
//! bytes (PROTOCOL.md §4): the same charge written another way (JSON, another order) is another
//! request under the key, so a retry must send the same bytes, as an SDK does.

use std::collections::BTreeMap;
use std::str::FromStr;

use axum::http::HeaderMap;
use axum::http::header::CONTENT_TYPE;

use super::error::{ApiError, quote};

/// Stripe's bounds on metadata: keys, characters of a key, characters of a value.
pub const METADATA_KEYS: usize = 50;
pub const METADATA_KEY_CHARS: usize = 40;
pub const METADATA_VALUE_CHARS: usize = 500;

/// Whether the body is a form, by its `Content-Type` (otherwise it is read as JSON).
pub fn is_form(headers: &HeaderMap) -> bool {
    let content_type = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let essence = content_type.unwrap_or("").split(';').next().unwrap_or("");
    essence
        .trim()
        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
}

/// A form body's parameters, taken one by one by the endpoint; what is left is unknown.
#[derive(Debug, Default)]
pub struct Form {
    params: BTreeMap<String, String>,
    metadata: BTreeMap<String, String>,
}

impl Form {
    /// The parameters of `body`. A name given twice keeps its last value.
    pub fn parse(body: &[u8]) -> Self {
        let mut form = Self::default();
        for (name, value) in form_urlencoded::parse(body) {
            let value = value.into_owned();
            match name
                .strip_prefix("metadata[")
                .and_then(|n| n.strip_suffix(']'))
            {
                Some(key) => form.metadata.insert(key.to_owned(), value),
                None => form.params.insert(name.into_owned(), value),
            };
        }
        form
    }

    /// A text parameter.
    pub fn text(&mut self, name: &'static str) -> Option<String> {
        self.params.remove(name)
    }

    /// An integer parameter; 400 `parameter_invalid` when it is not one.
    pub fn integer(&mut self, name: &'static str) -> Result<Option<i64>, ApiError> {
        self.parsed(name, format!("`{name}` must be an integer"))
    }

    /// A boolean parameter, `true` or `false`; 400 `parameter_invalid` otherwise.
    pub fn boolean(&mut self, name: &'static str) -> Result<Option<bool>, ApiError> {
        self.parsed(name, format!("`{name}` must be `true` or `false`"))
    }

    /// A parameter as `T` parses it (`bool`: only `true` or `false`); 400 `parameter_invalid`
    /// with `bad` otherwise.
    fn parsed<T: FromStr>(
        &mut self,
        name: &'static str,
        bad: String,
    ) -> Result<Option<T>, ApiError> {
        let parse = |v: String| v.parse().map_err(|_| ApiError::invalid_param(name, bad));
        self.params.remove(name).map(parse).transpose()
    }

    /// The `metadata[...]` entries, if any were sent.
    pub fn metadata(&mut self) -> Option<BTreeMap<String, String>> {
        let metadata = std::mem::take(&mut self.metadata);
        (!metadata.is_empty()).then_some(metadata)
    }

    /// Refuses a parameter that no call above took: 400 `parameter_unknown`.
    pub fn finish(self) -> Result<(), ApiError> {
        let metadata = self.metadata.into_keys().map(|k| format!("metadata[{k}]"));
        match self.params.into_keys().chain(metadata).next() {
            None => Ok(()),
            Some(name) => Err(ApiError::invalid_request(
                "parameter_unknown",
                format!("received unknown parameter: {}", quote(&name)),
            )),
        }
    }
}

/// Checks metadata against Stripe's bounds, which also keep every charge within the response the
/// idempotency layer stores.
pub fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ApiError> {
    let bad = |message: String| Err(ApiError::invalid_param("metadata", message));
    if metadata.len() > METADATA_KEYS {
        return bad(format!("`metadata` may have at most {METADATA_KEYS} keys"));
    }
    for (key, value) in metadata {
        if key.is_empty() || key.chars().count() > METADATA_KEY_CHARS {
            return bad(format!(
                "a `metadata` key must be 1 to {METADATA_KEY_CHARS} characters"
            ));
        }
        if value.chars().count() > METADATA_VALUE_CHARS {
            let max = METADATA_VALUE_CHARS;
            return bad(format!(
                "a `metadata` value must be at most {max} characters"
            ));
        }
    }
    Ok(())
}
