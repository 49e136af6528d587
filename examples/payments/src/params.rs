//! Request parameters as Stripe's SDKs send them, `application/x-www-form-urlencoded`, or as JSON.
//!
//! A form body is `key=value` pairs, percent-encoded (`+` for a space), in the order the client
//! wrote them; Stripe's nested form names one entry of a map: `metadata[order_id]=6735`. Numbers
//! and booleans are text (`amount=2000`, `capture=false`). A parameter the endpoint does not know
//! is refused (`parameter_unknown`), as Stripe does.
//!
//! The body is chosen by its `Content-Type`: a form when it says
//! `application/x-www-form-urlencoded`, JSON otherwise. Either way the idempotency layer has
//! already fingerprinted the raw bytes (PROTOCOL.md §4): a retry must send the same bytes, as an SDK
//! does, and the same charge written another way (JSON instead of a form, the parameters in
//! another order) is another request under the key.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use axum::http::header::CONTENT_TYPE;

use super::error::{ApiError, quote};

/// The longest metadata a charge may carry, as Stripe bounds it: keys, characters of a key,
/// characters of a value.
pub const METADATA_KEYS: usize = 50;
pub const METADATA_KEY_CHARS: usize = 40;
pub const METADATA_VALUE_CHARS: usize = 500;

/// Whether the body is a form (`application/x-www-form-urlencoded`), from its `Content-Type`.
pub fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|essence| {
            essence
                .trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
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
            match name
                .strip_prefix("metadata[")
                .and_then(|n| n.strip_suffix(']'))
            {
                Some(key) => {
                    form.metadata.insert(key.to_owned(), value.into_owned());
                }
                None => {
                    form.params.insert(name.into_owned(), value.into_owned());
                }
            }
        }
        form
    }

    /// A text parameter.
    pub fn text(&mut self, name: &'static str) -> Option<String> {
        self.params.remove(name)
    }

    /// An integer parameter; 400 `parameter_invalid` when it is not one.
    pub fn integer(&mut self, name: &'static str) -> Result<Option<i64>, ApiError> {
        self.params
            .remove(name)
            .map(|value| {
                value.parse().map_err(|_| {
                    ApiError::invalid_param(name, format!("`{name}` must be an integer"))
                })
            })
            .transpose()
    }

    /// A boolean parameter, `true` or `false`; 400 `parameter_invalid` otherwise.
    pub fn boolean(&mut self, name: &'static str) -> Result<Option<bool>, ApiError> {
        self.params
            .remove(name)
            .map(|value| match value.as_str() {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(ApiError::invalid_param(
                    name,
                    format!("`{name}` must be `true` or `false`"),
                )),
            })
            .transpose()
    }

    /// The `metadata[...]` entries, if any were sent.
    pub fn metadata(&mut self) -> Option<BTreeMap<String, String>> {
        let metadata = std::mem::take(&mut self.metadata);
        (!metadata.is_empty()).then_some(metadata)
    }

    /// Refuses a parameter that no call above took: 400 `parameter_unknown`.
    pub fn finish(self) -> Result<(), ApiError> {
        let unknown = self.params.into_keys().next().or_else(|| {
            self.metadata
                .into_keys()
                .next()
                .map(|k| format!("metadata[{k}]"))
        });
        match unknown {
            None => Ok(()),
            Some(name) => Err(ApiError::invalid_request(
                "parameter_unknown",
                format!("received unknown parameter: {}", quote(&name)),
            )),
        }
    }
}

/// Checks metadata against Stripe's bounds ([`METADATA_KEYS`], [`METADATA_KEY_CHARS`],
/// [`METADATA_VALUE_CHARS`]), which also keep every charge within the response the idempotency
/// layer stores.
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
            return bad(format!(
                "a `metadata` value must be at most {METADATA_VALUE_CHARS} characters"
            ));
        }
    }
    Ok(())
}
