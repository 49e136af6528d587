//! The canonical form of a JSON body (RFC 8785, JCS): object members sorted, no insignificant
//! whitespace, strings and numbers written one way. Two bodies with the same canonical form are
//! the same JSON value, so a client that re-serialises a retry (another key order, other spacing,
//! `1.0` for `1`, `\u0041` for `A`) sends the same request.
//!
//! Only where that is true: a body the canonical form would not keep whole is left to its bytes.
//! That is invalid JSON, an object with a duplicate member name (parsers disagree on which value
//! counts), and a number that is not exactly the double JCS writes (an integer past 2^53, a
//! decimal with more digits than a double holds), since an application that reads numbers
//! exactly would see two different requests where JCS sees one.

use std::fmt;

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Whether a request's `Content-Type` is JSON: `application/json`, or an `application/*+json`
/// type such as `application/merge-patch+json`, whatever its parameters.
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    let subtype = subtype.to_ascii_lowercase();
    kind.eq_ignore_ascii_case("application") && (subtype == "json" || subtype.ends_with("+json"))
}

/// The RFC 8785 form of `body`, or `None` when the body is not JSON that the canonical form keeps
/// whole (see the module docs).
pub(crate) fn canonical(body: &[u8]) -> Option<Vec<u8>> {
    let Strict(value) = serde_json::from_slice(body).ok()?;
    if !numbers_are_exact(body) {
        return None;
    }
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// A JSON value parsed like `serde_json::Value`, except that a duplicate member name is an error.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number that is not finite"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let Strict(value) = map.next_value()?;
            if members.insert(name, value).is_some() {
                return Err(de::Error::custom("a duplicate member name"));
            }
        }
        Ok(Value::Object(members))
    }
}

/// Whether every number in `json` (valid JSON) is exactly the double that JCS writes for it.
fn numbers_are_exact(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        match json[i] {
            b'"' => {
                // Skip the string: a backslash escapes the next byte.
                i += 1;
                while i < json.len() && json[i] != b'"' {
                    i += if json[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < json.len()
                    && matches!(json[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                // Number tokens are ASCII, so this slice is valid UTF-8.
                let token = std::str::from_utf8(&json[start..i]).unwrap_or_default();
                if !is_exact(token) {
                    return false;
                }
            }
            _ => i += 1,
        }
    }
    true
}

/// Whether the decimal `token` has the value of the nearest double, written shortest.
fn is_exact(token: &str) -> bool {
    let Ok(double) = token.parse::<f64>() else {
        return false;
    };
    double.is_finite()
        && decimal(token).is_some()
        && decimal(token) == decimal(&format!("{double:e}"))
}

/// A decimal number as (negative, significant digits, exponent) with no leading or trailing zero
/// digit, so that equal values compare equal; zero is `(false, "", 0)`.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i64>().ok()?),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    let significant = digits.trim_end_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    let trailing = i64::try_from(digits.len() - significant.len()).ok()?;
    let frac_len = i64::try_from(frac.len()).ok()?;
    let exponent = exponent.checked_sub(frac_len)?.checked_add(trailing)?;
    Some((negative, significant.to_owned(), exponent))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn canon(json: &str) -> Option<String> {
        canonical(json.as_bytes()).map(|bytes| String::from_utf8(bytes).expect("UTF-8"))
    }

    #[test]
    fn member_order_spacing_and_escapes_do_not_count() {
        let expected = Some(r#"{"a":[1,"A"],"b":{"c":null,"d":true}}"#.to_owned());
        assert_eq!(canon(r#"{"b":{"d":true,"c":null},"a":[1,"A"]}"#), expected);
        assert_eq!(
            canon("{ \"a\" : [ 1.0 , \"\\u0041\" ] ,\n \"b\" : { \"c\" : null , \"d\" : true } }"),
            expected
        );
        assert_eq!(canon("1e2"), Some("100".into()));
        assert_eq!(canon("-0"), Some("0".into()));
    }

    #[test]
    fn members_sort_by_utf16_code_units_not_utf8_bytes() {
        // U+1F600 is D83D DE00 in UTF-16, before U+FB33; in UTF-8 (F0.. against EF..) it is after.
        let input = "{\"\u{fb33}\":1,\"\u{1f600}\":2,\"\\r\":3,\"1\":4}";
        assert_eq!(
            canon(input),
            Some("{\"\\r\":3,\"1\":4,\"\u{1f600}\":2,\"\u{fb33}\":1}".into())
        );
    }

    #[test]
    fn what_the_canonical_form_would_not_keep_is_left_to_the_bytes() {
        assert_eq!(canon("{\"a\":1"), None, "invalid JSON");
        assert_eq!(canon("{\"a\":1,\"a\":2}"), None, "a duplicate member name");
        assert_eq!(
            canon("[{\"x\":{\"a\":1,\"a\":1}}]"),
            None,
            "a nested duplicate"
        );
        assert_eq!(canon("9007199254740993"), None, "an integer past 2^53");
        assert_eq!(
            canon("0.10000000000000000001"),
            None,
            "more digits than a double"
        );
        assert_eq!(canon("1e400"), None, "past the doubles");
        assert_eq!(canon("9007199254740992"), Some("9007199254740992".into()));
        assert_eq!(canon("0.1"), Some("0.1".into()));
        assert_eq!(
            canon("[\"\\\"9007199254740993\"]"),
            Some("[\"\\\"9007199254740993\"]".into()),
            "a string is no number"
        );
    }

    #[test]
    fn decimals_compare_by_value() {
        assert_eq!(decimal("1.50"), decimal("15e-1"));
        assert_eq!(decimal("0.000"), decimal("0"));
        assert_eq!(decimal("-0"), decimal("0"));
        assert_ne!(decimal("1.5"), decimal("-1.5"));
        assert_eq!(
            decimal("1.5e-9223372036854775808"),
            None,
            "an exponent out of range"
        );
    }

    #[test]
    fn json_content_types() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
            is_json(&headers)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/merge-patch+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!with("application/jsonx"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
