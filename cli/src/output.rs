//! What the tool prints: a table for people, one JSON object for scripts.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tower_idempotency::operator;
use tower_idempotency::record::RecordId;
use tower_idempotency::store::{CompletedView, ForgetOutcome, InFlightView, Inspected};

/// The key a report is about.
pub(crate) struct Report<'a> {
    scope: &'a [u8],
    key: &'a str,
    id: &'a RecordId,
}

impl<'a> Report<'a> {
    pub(crate) fn new(scope: &'a [u8], key: &'a str, id: &'a RecordId) -> Self {
        Self { scope, key, id }
    }

    /// The fields every answer starts with: the key, its scope, its record id.
    fn head(&self) -> Map<String, Value> {
        let mut map = Map::new();
        map.insert("key".into(), self.key.into());
        map.insert("scope".into(), bytes_json(self.scope));
        map.insert("scope_hex".into(), hex(self.scope).into());
        map.insert("record_id".into(), self.id.to_string().into());
        map
    }

    pub(crate) fn lookup_json(&self, found: Option<&Inspected>, body: bool) -> Value {
        let mut map = self.head();
        match found {
            None => {
                map.insert("state".into(), "absent".into());
            }
            Some(record) => map.extend(record_json(record, body)),
        }
        Value::Object(map)
    }

    pub(crate) fn forget_json(&self, outcome: &ForgetOutcome, forced: bool) -> Value {
        let mut map = self.head();
        let (result, was) = match outcome {
            ForgetOutcome::Forgotten(was) => ("forgotten", Some(record_json(was, false))),
            ForgetOutcome::Refused(view) => (
                "refused",
                Some(record_json(&Inspected::InFlight(view.clone()), false)),
            ),
            _ => ("absent", None),
        };
        map.insert("result".into(), result.into());
        map.insert("forced".into(), forced.into());
        map.insert("record".into(), was.map_or(Value::Null, Value::Object));
        Value::Object(map)
    }

    /// `forget`'s audit line as one JSON object: what the library's WARN line says (the record
    /// id and its tag, the state it was in, forced or not, the reason; never the raw key or
    /// scope), with the time and the result, for a log pipeline that reads stderr.
    pub(crate) fn forget_audit(
        &self,
        outcome: &ForgetOutcome,
        forced: bool,
        reason: &str,
    ) -> Value {
        let (level, result, state) = match outcome {
            ForgetOutcome::Forgotten(was) => ("WARN", "forgotten", Some(was.state())),
            ForgetOutcome::Refused(_) => ("INFO", "refused", Some("in_flight")),
            _ => ("INFO", "absent", None),
        };
        json!({
            "time": rfc3339(SystemTime::now()),
            "level": level,
            "event": "forget",
            "message": format!("forget by an operator: {result}"),
            "result": result,
            "record_id": self.id.to_string(),
            "key_tag": self.id.tag().to_string(),
            "scope_tag": operator::scope_tag(self.scope).to_string(),
            "state": state,
            "forced": forced,
            "reason": reason,
        })
    }

    fn table_head(&self) -> String {
        let scope = if self.scope.is_empty() {
            "(empty)".to_owned()
        } else {
            match std::str::from_utf8(self.scope) {
                Ok(text) => format!("{text:?} (hex {})", hex(self.scope)),
                Err(_) => format!("hex {}", hex(self.scope)),
            }
        };
        let mut out = String::new();
        row(&mut out, "key", &format!("{:?}", self.key));
        row(&mut out, "scope", &scope);
        row(&mut out, "record id", &self.id.to_string());
        out
    }

    pub(crate) fn lookup_table(&self, found: Option<&Inspected>, body: bool) -> String {
        let mut out = self.table_head();
        match found {
            None => row(&mut out, "state", "absent (no live record: the key is new)"),
            Some(record) => record_table(&mut out, record, body),
        }
        out
    }

    pub(crate) fn forget_table(&self, outcome: &ForgetOutcome) -> String {
        let mut out = self.table_head();
        match outcome {
            ForgetOutcome::Forgotten(was) => {
                row(
                    &mut out,
                    "result",
                    "forgotten: the next request with the key runs",
                );
                out.push_str("was:\n");
                record_table(&mut out, was, false);
            }
            ForgetOutcome::Refused(view) => {
                row(
                    &mut out,
                    "result",
                    "refused: the key is in flight (--force to forget it all the same)",
                );
                record_table(&mut out, &Inspected::InFlight(view.clone()), false);
            }
            _ => row(&mut out, "result", "absent: nothing to forget"),
        }
        out
    }
}

fn record_json(record: &Inspected, body: bool) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("state".into(), record.state().into());
    map.insert(
        "fingerprint".into(),
        hex(record.fingerprint().as_bytes()).into(),
    );
    match record {
        Inspected::InFlight(view) => in_flight_json(&mut map, view),
        Inspected::Completed(view) => completed_json(&mut map, view, body),
        _ => {}
    }
    map
}

fn in_flight_json(map: &mut Map<String, Value>, view: &InFlightView) {
    map.insert("fence".into(), view.fence.get().into());
    map.insert("claimed_at".into(), rfc3339(view.claimed_at()).into());
    map.insert("lease_ends".into(), rfc3339(view.lease_ends).into());
}

fn completed_json(map: &mut Map<String, Value>, view: &CompletedView, body: bool) {
    map.insert("fence".into(), json!(view.fence.map(|fence| fence.get())));
    map.insert("claimed_at".into(), json!(view.claimed_at().map(rfc3339)));
    map.insert("expires".into(), rfc3339(view.expires).into());
    map.insert("status".into(), json!(view.status().map(|s| s.as_u16())));
    map.insert("body_len".into(), json!(view.body_len()));
    map.insert("sealed_under".into(), json!(view.sealed_under()));
    map.insert(
        "origin".into(),
        view.completed
            .origin
            .as_deref()
            .map_or(Value::Null, |origin| {
                json!({
                    "traceparent": origin.to_string(),
                    "trace_id": origin.trace_id_hex(),
                    "span_id": origin.span_id_hex(),
                    "tracestate": origin.tracestate(),
                })
            }),
    );
    if let (true, Some(response)) = (body, view.completed.plain()) {
        let headers = response
            .headers
            .iter()
            .map(|(name, value)| json!({"name": name.as_str(), "value": bytes_json(value.as_bytes())}))
            .collect::<Vec<_>>();
        map.insert("headers".into(), headers.into());
        map.insert("body".into(), bytes_json(&response.body));
    }
}

fn record_table(out: &mut String, record: &Inspected, body: bool) {
    let state = match record.state() {
        "in_flight" => "in flight (a request holds the key)",
        "tombstone" => "tombstone (ran; its response could not be stored, so it is not replayed)",
        _ => "completed (its response is replayed)",
    };
    row(out, "state", state);
    match record {
        Inspected::InFlight(view) => {
            row(out, "claimed at", &rfc3339(view.claimed_at()));
            row(out, "lease ends", &rfc3339(view.lease_ends));
            row(out, "fence", &view.fence.to_string());
        }
        Inspected::Completed(view) => {
            if let Some(status) = view.status() {
                row(out, "status", &status.to_string());
            }
            if let Some(key) = view.sealed_under() {
                row(out, "response", &format!("sealed under key {key:?}"));
            }
            if let Some(len) = view.body_len() {
                row(out, "body", &format!("{len} bytes"));
            }
            match view.claimed_at() {
                Some(at) => row(out, "claimed at", &rfc3339(at)),
                None => row(out, "claimed at", "not kept by this store once completed"),
            }
            row(
                out,
                "completed at",
                "not kept by the store (expires less the layer's dedup window)",
            );
            row(out, "expires", &rfc3339(view.expires));
            match view.fence {
                Some(fence) => row(out, "fence", &fence.to_string()),
                None => row(out, "fence", "not kept by this store once completed"),
            }
            match (view.completed.origin.as_deref(), view.sealed_under()) {
                (Some(origin), _) => {
                    row(out, "origin", &origin.to_string());
                    if let Some(state) = origin.tracestate() {
                        row(out, "tracestate", state);
                    }
                }
                (None, Some(_)) => row(
                    out,
                    "origin",
                    "sealed with the response (--seal-keys-env opens both)",
                ),
                (None, None) => row(
                    out,
                    "origin",
                    "none recorded (the layer's trace_origin is off, or the run had no trace)",
                ),
            }
        }
        _ => {}
    }
    row(out, "fingerprint", &hex(record.fingerprint().as_bytes()));
    if let (true, Inspected::Completed(view)) = (body, record)
        && let Some(response) = view.completed.plain()
    {
        out.push_str("headers:\n");
        for (name, value) in &response.headers {
            let _ = writeln!(out, "  {name}: {}", text_or_hex(value.as_bytes()));
        }
        out.push_str("body:\n");
        let _ = writeln!(out, "{}", text_or_hex(&response.body));
    }
}

fn row(out: &mut String, name: &str, value: &str) {
    let _ = writeln!(out, "{name:<12} {value}");
}

/// Bytes for JSON: a string when they are UTF-8, else `{"hex": ".."}`.
fn bytes_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.into(),
        Err(_) => json!({ "hex": hex(bytes) }),
    }
}

/// Bytes for a table: the text when it is UTF-8, else its hex.
fn text_or_hex(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => format!("(not UTF-8) hex {}", hex(bytes)),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

/// `time` as RFC 3339 in UTC, to the millisecond: `2025-01-31T12:00:00.123Z`.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// The date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// An error with its chain of sources, on one line, each cause once: a source whose text ends
/// the error's before it is not written again (redis-rs and deadpool repeat theirs), as the
/// library's own log lines do.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    tower_idempotency::error_chain::ErrorChain(err).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_chain_names_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("the store failed: {0}")]
        struct Repeats(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("lookup failed")]
        struct Outer(#[source] Repeats);
        let io = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert_eq!(
            chain(&Outer(Repeats(io))),
            "lookup failed: the store failed: broken pipe"
        );
    }

    #[test]
    fn times_print_as_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_millis(951_782_400_123);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.123Z");
        let later = UNIX_EPOCH + Duration::from_secs(1_767_225_599);
        assert_eq!(rfc3339(later), "2025-12-31T23:59:59.000Z");
    }
}
