//! The API under test as the checks see it: requests built from the config, answers read whole,
//! and every exchange kept for the report.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use tokio::time::Instant;

use crate::config::{Config, Prepared, UNIQUE};
use crate::report::Exchange;

/// How many bytes of a body an exchange keeps.
const BODY_EXCERPT: usize = 300;

/// How many characters of a body a line of the report quotes.
const BODY_QUOTE: usize = 120;

/// Which tenant's credentials a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tenant {
    A,
    B,
}

/// The body and extra headers of one kind of request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The config's `body`.
    Valid,
    /// `[invalid]`.
    Invalid,
    /// `[server_error]`.
    ServerError,
}

/// One request to send.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub tenant: Tenant,
    /// The key header's value; none sends no key header.
    pub key: Option<Vec<u8>>,
    pub kind: Kind,
    pub body: Vec<u8>,
}

/// An answer, read whole (up to the config's `max_body_bytes`).
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// When the request left.
    pub sent: Instant,
    /// When the last byte of the body came.
    pub done: Instant,
}

/// Why a check did not pass: what is wrong, or why it does not apply.
#[derive(Debug)]
pub(crate) enum Finding {
    Fail(Vec<Problem>),
    NotApplicable(String),
}

/// One thing a check found wrong, and what may lie behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    pub text: String,
    pub hint: Hint,
}

/// A suspicion about a problem's cause that the whole run can confirm: when every check that
/// relies on a setting fails the same way, the setting is named once as their cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Hint {
    /// No such suspicion.
    None,
    /// An answer lacked the configured replay header.
    ReplayHeaderAbsent,
    /// The request a check starts from was answered with this status instead of a 2xx.
    Refused(u16),
}

impl Problem {
    pub(crate) fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            hint: Hint::None,
        }
    }

    pub(crate) fn hinted(hint: Hint, text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            hint,
        }
    }
}

/// What tells one execution from another: the created object's id when the config names where it
/// is, else the whole body.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Identity {
    Id(String),
    /// No id at the configured pointer: the body, compared whole.
    NoId(Vec<u8>),
    Body(Vec<u8>),
}

impl Identity {
    /// How `self` and `other`, which are not equal but may read alike, differ.
    pub(crate) fn difference(&self, other: &Self) -> Option<String> {
        match (self, other) {
            (Self::Body(a) | Self::NoId(a), Self::Body(b) | Self::NoId(b)) => body_difference(a, b),
            _ => None,
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Id(id) => write!(f, "id {id}"),
            Self::NoId(body) => write!(f, "no id: body {}", quote(body, body.len())),
            Self::Body(body) => write!(f, "body {}", quote(body, body.len())),
        }
    }
}

/// The API: the config, checked, and one client for every request.
#[derive(Debug)]
pub(crate) struct Api {
    pub config: Config,
    pub prepared: Prepared,
    client: reqwest::Client,
    /// How many 2xx answers came, and how many had an id at the configured pointer.
    answered: AtomicUsize,
    with_id: AtomicUsize,
}

impl Api {
    pub(crate) fn new(config: Config, prepared: Prepared, client: reqwest::Client) -> Arc<Self> {
        Arc::new(Self {
            config,
            prepared,
            client,
            answered: AtomicUsize::new(0),
            with_id: AtomicUsize::new(0),
        })
    }

    /// How many 2xx answers the run got, and how many had an id at the configured pointer.
    pub(crate) fn ids_found(&self) -> (usize, usize) {
        (
            self.answered.load(Ordering::Relaxed),
            self.with_id.load(Ordering::Relaxed),
        )
    }

    /// A fresh key, written as the config says.
    pub(crate) fn fresh_key(&self) -> Vec<u8> {
        self.write_key(&format!("conformance-{}", unique()))
    }

    /// `key` written as the config says.
    pub(crate) fn write_key(&self, key: &str) -> Vec<u8> {
        self.config.key_format.write(key).into_bytes()
    }

    /// A call of `kind` as `tenant` under `key`, its body rendered with a fresh value.
    pub(crate) fn call(&self, kind: Kind, tenant: Tenant, key: Option<Vec<u8>>) -> Call {
        let template = match kind {
            Kind::Valid => &self.config.body,
            Kind::Invalid => (self.config.invalid.as_ref()).map_or(&self.config.body, |v| &v.body),
            Kind::ServerError => {
                (self.config.server_error.as_ref()).map_or(&self.config.body, |v| &v.body)
            }
        };
        Call {
            tenant,
            key,
            kind,
            body: template.replace(UNIQUE, &unique()).into_bytes(),
        }
    }

    /// Sends `call`; the exchange as the report shows it, and the answer.
    pub(crate) async fn send(&self, step: &str, call: &Call) -> (Exchange, Result<Answer, String>) {
        let prepared = &self.prepared;
        let mut headers = prepared.common.clone();
        let tenant = match call.tenant {
            Tenant::A => &prepared.tenant_a,
            Tenant::B => prepared.tenant_b.as_ref().unwrap_or(&prepared.tenant_a),
        };
        headers.extend(tenant.clone());
        let extra = match call.kind {
            Kind::Valid => None,
            Kind::Invalid => prepared.invalid.as_ref(),
            Kind::ServerError => prepared.server_error.as_ref(),
        };
        if let Some(extra) = extra {
            headers.extend(extra.clone());
        }
        let mut key_shown = None;
        if let Some(key) = &call.key {
            key_shown = Some(shorten(&String::from_utf8_lossy(key)));
            match HeaderValue::from_bytes(key) {
                Ok(value) => {
                    headers.insert(prepared.key_header.clone(), value);
                }
                Err(err) => {
                    return (
                        self.exchange(step, call, key_shown, None),
                        Err(err.to_string()),
                    );
                }
            }
        }
        let request = (self.client)
            .request(prepared.method.clone(), prepared.url.clone())
            .headers(headers)
            .body(call.body.clone());
        let sent = Instant::now();
        let answer = match request.send().await {
            Ok(response) => self.read(response, sent).await,
            Err(err) => Err(self.why(&err)),
        };
        if let Ok(answer) = &answer
            && answer.status.is_success()
        {
            self.answered.fetch_add(1, Ordering::Relaxed);
            if self.id(answer).is_some() {
                self.with_id.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut exchange = self.exchange(step, call, key_shown, answer.as_ref().ok());
        if let Err(err) = &answer {
            exchange.error = Some(err.clone());
        }
        (exchange, answer)
    }

    /// The answer of `response`, its body read up to the config's `max_body_bytes`: an API that
    /// sends more (or never stops) gets an error, not the runner's memory.
    async fn read(&self, mut response: reqwest::Response, sent: Instant) -> Result<Answer, String> {
        let limit = self.config.max_body_bytes;
        let status = response.status();
        let headers = response.headers().clone();
        let mut body = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if body.len() + chunk.len() > limit {
                        return Err(format!(
                            "{status}, and its body is longer than max_body_bytes ({limit} \
                             bytes): the read stopped there"
                        ));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(err) => {
                    return Err(format!(
                        "{status}, and its body could not be read whole ({} bytes came): {}",
                        body.len(),
                        self.why(&err)
                    ));
                }
            }
        }
        Ok(Answer {
            status,
            headers,
            body,
            sent,
            done: Instant::now(),
        })
    }

    /// Why a request got no (complete) answer, on one line.
    fn why(&self, err: &reqwest::Error) -> String {
        if err.is_timeout() {
            format!(
                "no complete answer within timeout_ms ({} ms)",
                self.config.timeout.as_millis()
            )
        } else {
            error_chain(err)
        }
    }

    fn exchange(
        &self,
        step: &str,
        call: &Call,
        key: Option<String>,
        answer: Option<&Answer>,
    ) -> Exchange {
        let prepared = &self.prepared;
        let mut relevant: Vec<&HeaderName> = vec![&header::CONTENT_TYPE, &header::RETRY_AFTER];
        relevant.extend(&prepared.replay_header);
        relevant.extend(&prepared.retention_header);
        relevant.extend(&prepared.compare_headers);
        let mut headers = Vec::new();
        if let Some(answer) = answer {
            for (name, value) in &answer.headers {
                if relevant.contains(&name) {
                    headers.push((
                        name.to_string(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    ));
                }
            }
        }
        Exchange {
            step: step.to_owned(),
            method: prepared.method.to_string(),
            path: prepared.url.path().to_owned(),
            tenant: match call.tenant {
                Tenant::A => 'a',
                Tenant::B => 'b',
            },
            key,
            status: answer.map(|answer| answer.status.as_u16()),
            headers,
            body: answer
                .map(|answer| excerpt(&answer.body))
                .unwrap_or_default(),
            body_bytes: answer.map_or(0, |answer| answer.body.len()),
            elapsed_ms: answer.map(|answer| {
                u64::try_from((answer.done - answer.sent).as_millis()).unwrap_or(u64::MAX)
            }),
            error: None,
        }
    }

    /// Whether `answer` carries the replay header; none when the config names no such header.
    pub(crate) fn replayed(&self, answer: &Answer) -> Option<bool> {
        (self.prepared.replay_header.as_ref()).map(|name| answer.headers.contains_key(name))
    }

    /// The created object's id in `answer`, when the config names where it is.
    pub(crate) fn id(&self, answer: &Answer) -> Option<String> {
        let pointer = self.config.id_pointer.as_deref()?;
        let json: Value = serde_json::from_slice(&answer.body).ok()?;
        match json.pointer(pointer)? {
            Value::String(id) => Some(id.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        }
    }

    /// What tells one execution from another: the id when the config names one, else the whole
    /// body.
    pub(crate) fn identity(&self, answer: &Answer) -> Identity {
        match (&self.config.id_pointer, self.id(answer)) {
            (Some(_), Some(id)) => Identity::Id(id),
            (Some(_), None) => Identity::NoId(answer.body.clone()),
            (None, _) => Identity::Body(answer.body.clone()),
        }
    }
}

/// A check in progress: what it sent and saw, for the report.
#[derive(Debug)]
pub(crate) struct Probe {
    pub api: Arc<Api>,
    pub seen: Vec<Exchange>,
}

impl Probe {
    pub(crate) fn new(api: Arc<Api>) -> Self {
        Self {
            api,
            seen: Vec::new(),
        }
    }

    /// Sends `call` and keeps the exchange; no answer is a failure.
    pub(crate) async fn send(&mut self, step: &str, call: &Call) -> Result<Answer, Finding> {
        let (exchange, answer) = self.api.send(step, call).await;
        self.seen.push(exchange);
        answer.map_err(|err| {
            Finding::Fail(vec![Problem::new(format!(
                "the {step} request got no answer: {err}"
            ))])
        })
    }

    /// Sends `call`, which must be answered `2xx`: the request every check starts from.
    pub(crate) async fn send_ok(&mut self, step: &str, call: &Call) -> Result<Answer, Finding> {
        let answer = self.send(step, call).await?;
        let status = answer.status.as_u16();
        if answer.status.is_redirection() {
            let location = (answer.headers.get(header::LOCATION))
                .map(|to| format!(" to {}", String::from_utf8_lossy(to.as_bytes())))
                .unwrap_or_default();
            return Err(Finding::Fail(vec![Problem::hinted(
                Hint::Refused(status),
                format!(
                    "the {step} request was redirected ({status}{location}): the runner follows \
                     no redirect; set base_url and path to where the API answers"
                ),
            )]));
        }
        if !answer.status.is_success() {
            return Err(Finding::Fail(vec![Problem::hinted(
                Hint::Refused(status),
                format!(
                    "the {step} request was answered {status}, not 2xx: check the endpoint, its \
                     body template and the credentials"
                ),
            )]));
        }
        if self.api.replayed(&answer) == Some(true) {
            return Err(Finding::Fail(vec![Problem::new(format!(
                "the {step} request, with a fresh key, carries the replay header {}",
                self.api.config.replay_header.as_deref().unwrap_or_default()
            ))]));
        }
        Ok(answer)
    }
}

/// A fresh value: 32 hex digits.
pub(crate) fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The first bytes of `body`, as text.
pub(crate) fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(BODY_EXCERPT)]).into_owned()
}

/// `body` as one line between backticks: line breaks and other control characters escaped, cut
/// after [`BODY_QUOTE`] characters. When it is cut, or is the start of a longer body of `whole`
/// bytes, the whole length follows.
pub(crate) fn quote(body: &[u8], whole: usize) -> String {
    let text = String::from_utf8_lossy(body);
    let mut line = String::from("`");
    let mut cut = false;
    for (n, c) in text.chars().enumerate() {
        if n == BODY_QUOTE {
            cut = true;
            break;
        }
        match c {
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            '\t' => line.push_str("\\t"),
            c if c.is_control() => line.push_str(&c.escape_unicode().to_string()),
            c => line.push(c),
        }
    }
    line.push('`');
    if cut || whole > body.len() {
        line.push_str(&format!("... ({} bytes)", whole.max(body.len())));
    }
    line
}

/// `key`, shortened to its start and length when it is long.
fn shorten(key: &str) -> String {
    if key.chars().count() <= 64 {
        return key.to_owned();
    }
    let start: String = key.chars().take(24).collect();
    format!("{start}... ({} bytes)", key.len())
}

/// An error and its sources, on one line.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
}

/// Where two bodies first differ, with a little of each around it; none when they are equal.
pub(crate) fn body_difference(first: &[u8], then: &[u8]) -> Option<String> {
    if first == then {
        return None;
    }
    let at = first.iter().zip(then).take_while(|(a, b)| a == b).count();
    let around = |body: &[u8]| {
        let start = at.saturating_sub(20);
        let end = (at + 40).min(body.len());
        let around = &body[start.min(end)..end];
        quote(around, around.len())
    };
    Some(format!(
        "the bodies differ from byte {at} ({} and {} bytes): first {}, then {}",
        first.len(),
        then.len(),
        around(first),
        around(then)
    ))
}

/// Whether `value` is a valid `Retry-After` (RFC 9110 §10.2.3): delta-seconds or an HTTP-date.
pub(crate) fn valid_retry_after(value: &HeaderValue) -> bool {
    let Ok(text) = value.to_str() else {
        return false;
    };
    let text = text.trim();
    (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
        || httpdate::parse_http_date(text).is_ok()
}

/// The moment a retention header states: an HTTP-date (RFC 9110 §5.6.7) or a structured Date
/// (RFC 9651 §3.3.7, `@` and seconds since the epoch).
pub(crate) fn retention_moment(value: &HeaderValue) -> Result<SystemTime, String> {
    let text = value
        .to_str()
        .map_err(|_| "is not visible ASCII".to_owned())?
        .trim();
    if let Some(seconds) = text.strip_prefix('@') {
        let digits = seconds.strip_prefix('-').unwrap_or(seconds);
        let valid = (1..=15).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit());
        let seconds: i64 = (valid.then(|| seconds.parse().ok()).flatten())
            .ok_or_else(|| format!("{text:?} is not a structured Date (`@` and whole seconds)"))?;
        return Ok(if seconds >= 0 {
            UNIX_EPOCH + Duration::from_secs(seconds.unsigned_abs())
        } else {
            UNIX_EPOCH - Duration::from_secs(seconds.unsigned_abs())
        });
    }
    httpdate::parse_http_date(text).map_err(|_| {
        format!("{text:?} is neither an HTTP-date nor a structured Date (`@` seconds)")
    })
}

/// The server's clock at `answer`: its `Date` header, or ours when it has none.
pub(crate) fn server_now(answer: &Answer) -> SystemTime {
    (answer.headers.get(header::DATE))
        .and_then(|date| date.to_str().ok())
        .and_then(|date| httpdate::parse_http_date(date).ok())
        .unwrap_or_else(SystemTime::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str) -> HeaderValue {
        HeaderValue::from_str(text).unwrap()
    }

    #[test]
    fn retry_after_forms() {
        assert!(valid_retry_after(&value("1")));
        assert!(valid_retry_after(&value("120")));
        assert!(valid_retry_after(&value("Fri, 02 Jan 2026 10:00:00 GMT")));
        assert!(!valid_retry_after(&value("")));
        assert!(!valid_retry_after(&value("1.5")));
        assert!(!valid_retry_after(&value("-1")));
        assert!(!valid_retry_after(&value("soon")));
    }

    #[test]
    fn retention_forms() {
        let at = |text| retention_moment(&value(text));
        assert_eq!(
            at("@1767348000").unwrap(),
            UNIX_EPOCH + Duration::from_secs(1_767_348_000)
        );
        assert_eq!(
            at("Fri, 02 Jan 2026 10:00:00 GMT").unwrap(),
            UNIX_EPOCH + Duration::from_secs(1_767_348_000)
        );
        assert!(at("@-5").unwrap() < UNIX_EPOCH);
        for bad in [
            "@",
            "@1.5",
            "@--1",
            "@1e9",
            "86400",
            "tomorrow",
            "@99999999999999999",
        ] {
            assert!(at(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn differences() {
        assert_eq!(body_difference(b"same", b"same"), None);
        let text = body_difference(b"{\"at\":1}", b"{\"at\":2}").unwrap();
        assert!(text.contains("from byte 6"), "{text}");
        assert!(
            body_difference(b"ab", b"abc")
                .unwrap()
                .contains("from byte 2")
        );
    }

    #[test]
    fn excerpts_and_keys() {
        assert_eq!(excerpt(b"short"), "short");
        assert_eq!(excerpt(&[b'x'; 400]).len(), 300);
        assert_eq!(quote(b"{\"a\":\n1}\x01", 9), "`{\"a\":\\n1}\\u{1}`");
        assert_eq!(quote(b"abc", 900), "`abc`... (900 bytes)");
        let long = quote(&[b'x'; 400], 400);
        assert_eq!(long, format!("`{}`... (400 bytes)", "x".repeat(120)));
        assert_eq!(shorten("k"), "k");
        assert!(shorten(&"k".repeat(300)).ends_with("... (300 bytes)"));
    }
}
