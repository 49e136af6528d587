//! [`TraceOrigin`]: the W3C trace context of the execution that completed a record, so that a
//! replay's logs and traces point at the run that wrote it (`docs/PROTOCOL.md` §5.6, §12.1).

use std::fmt;

use crate::hex::Hex;

/// The longest `tracestate` a record keeps, in bytes: the 512 that W3C Trace Context asks every
/// vendor to pass on. A longer one is cut to its leading list members that fit.
pub const MAX_TRACESTATE_LEN: usize = 512;

/// The most list members a `tracestate` has (W3C Trace Context).
const MAX_TRACESTATE_MEMBERS: usize = 32;

/// The longest `traceparent` read: 55 bytes for version `00`, and room for the fields a later
/// version appends. A longer value is ignored unread.
const MAX_TRACEPARENT_LEN: usize = 256;

/// The trace context of the execution that completed a record: its W3C `traceparent` (trace id,
/// parent span id, flags) and `tracestate`, when the layer records origins
/// (`IdempotencyLayer::trace_origin`, feature `trace-origin`). A replay logs it
/// and, with the feature `opentelemetry`, links its span to that span.
///
/// It only holds what is valid: ids that are lowercase hex and not all zero, and a `tracestate`
/// of well-formed list members, at most [`MAX_TRACESTATE_LEN`] bytes.
///
/// ```
/// use tower_idempotency::record::TraceOrigin;
///
/// let origin = TraceOrigin::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
/// assert_eq!(origin.trace_id()[0], 0x4b);
/// assert_eq!(origin.span_id()[7], 0xb7);
/// assert_eq!(origin.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// // A malformed traceparent is no origin: never stored, never an error.
/// assert!(TraceOrigin::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
/// assert!(TraceOrigin::parse("not a traceparent").is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceOrigin {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
    state: Option<Box<str>>,
}

impl TraceOrigin {
    /// The origin of a span: `None` when either id is all zeros (no span).
    ///
    /// ```
    /// use tower_idempotency::record::TraceOrigin;
    ///
    /// let origin = TraceOrigin::new([1; 16], [2; 8], 1).unwrap();
    /// assert_eq!(origin.flags(), 1);
    /// assert!(TraceOrigin::new([0; 16], [2; 8], 1).is_none());
    /// ```
    pub fn new(trace_id: [u8; 16], span_id: [u8; 8], flags: u8) -> Option<Self> {
        (trace_id != [0; 16] && span_id != [0; 8]).then_some(Self {
            trace_id,
            span_id,
            flags,
            state: None,
        })
    }

    /// The origin a W3C `traceparent` value names, or `None` when it is not a valid one: version
    /// `00` exactly (55 bytes), or a later version (not `ff`) whose first 55 bytes read as
    /// version `00` and are followed by `-` or nothing; lowercase hex; ids not all zeros; at most
    /// 256 bytes. Surrounding spaces and tabs are ignored. It never panics.
    ///
    /// ```
    /// use tower_idempotency::record::TraceOrigin;
    ///
    /// assert!(TraceOrigin::parse("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01").is_none());
    /// let later = TraceOrigin::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x");
    /// assert_eq!(later.unwrap().to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    /// ```
    pub fn parse(traceparent: &str) -> Option<Self> {
        let value = traceparent.trim_matches([' ', '\t']).as_bytes();
        if value.len() < 55 || value.len() > MAX_TRACEPARENT_LEN {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        let later_version = match version {
            0xff => return None,
            0 => false,
            _ => true,
        };
        if (value.len() > 55 && (!later_version || value[55] != b'-'))
            || value[2] != b'-'
            || value[35] != b'-'
            || value[52] != b'-'
        {
            return None;
        }
        let mut trace_id = [0; 16];
        for (n, byte) in trace_id.iter_mut().enumerate() {
            *byte = hex_byte(&value[3 + 2 * n..5 + 2 * n])?;
        }
        let mut span_id = [0; 8];
        for (n, byte) in span_id.iter_mut().enumerate() {
            *byte = hex_byte(&value[36 + 2 * n..38 + 2 * n])?;
        }
        let flags = hex_byte(&value[53..55])?;
        Self::new(trace_id, span_id, flags)
    }

    /// The origin of a request: its `traceparent` header, with its `tracestate` (every
    /// `tracestate` line, joined by commas, as [`with_tracestate`](Self::with_tracestate) keeps
    /// it). `None` without a `traceparent`, with more than one, or with one that is not valid
    /// ([`parse`](Self::parse)).
    ///
    /// ```
    /// use http::HeaderMap;
    /// use tower_idempotency::record::TraceOrigin;
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse()?);
    /// headers.append("tracestate", "congo=t61rcWkgMzE".parse()?);
    /// headers.append("tracestate", "rojo=00f067aa0ba902b7".parse()?);
    /// let origin = TraceOrigin::from_headers(&headers).unwrap();
    /// assert_eq!(origin.tracestate(), Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
    /// # Ok::<(), http::header::InvalidHeaderValue>(())
    /// ```
    #[cfg(feature = "trace-origin")]
    #[cfg_attr(docsrs, doc(cfg(feature = "trace-origin")))]
    pub fn from_headers(headers: &http::HeaderMap) -> Option<Self> {
        let mut parents = headers.get_all("traceparent").iter();
        let (Some(parent), None) = (parents.next(), parents.next()) else {
            return None;
        };
        let origin = Self::parse(parent.to_str().ok()?)?;
        let mut state = String::new();
        for line in headers.get_all("tracestate") {
            let Ok(line) = line.to_str() else {
                return Some(origin);
            };
            // Never more than a bounded amount of text is joined, whatever the request sent.
            if state.len() + line.len() > 8 * MAX_TRACESTATE_LEN {
                return Some(origin);
            }
            if !state.is_empty() {
                state.push(',');
            }
            state.push_str(line);
        }
        Some(origin.with_tracestate(&state))
    }

    /// This origin with the W3C `tracestate` `state`, bounded: its list members (`key=value`,
    /// separated by commas; empty ones skipped) are kept in order while they fit in
    /// [`MAX_TRACESTATE_LEN`] bytes. A `tracestate` with a malformed member or more than 32
    /// members is not kept (W3C Trace Context: the whole header is then invalid), nor is an
    /// empty one.
    ///
    /// ```
    /// use tower_idempotency::record::TraceOrigin;
    ///
    /// let origin = TraceOrigin::new([1; 16], [2; 8], 1).unwrap();
    /// assert_eq!(origin.clone().with_tracestate(" a=1 ,, b=2").tracestate(), Some("a=1,b=2"));
    /// assert_eq!(origin.with_tracestate("no equals sign").tracestate(), None);
    /// ```
    pub fn with_tracestate(mut self, state: &str) -> Self {
        self.state = bounded_tracestate(state);
        self
    }

    /// The trace id.
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([1; 16], [2; 8], 0).unwrap().trace_id(), [1; 16]);
    /// ```
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The id of the span that ran the request: the caller's span when it came from a
    /// `traceparent` header, the request's own span when it came from OpenTelemetry.
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([1; 16], [2; 8], 0).unwrap().span_id(), [2; 8]);
    /// ```
    pub fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    /// The trace flags (bit 0: sampled).
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([1; 16], [2; 8], 1).unwrap().flags() & 1, 1);
    /// ```
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The `tracestate` kept with it, if any.
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([1; 16], [2; 8], 1).unwrap().tracestate(), None);
    /// ```
    pub fn tracestate(&self) -> Option<&str> {
        self.state.as_deref()
    }

    /// The trace id as 32 lowercase hex characters, as logs and trace viewers show it.
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([0xab; 16], [2; 8], 1).unwrap().trace_id_hex(), "ab".repeat(16));
    /// ```
    pub fn trace_id_hex(&self) -> String {
        Hex(&self.trace_id).to_string()
    }

    /// The span id as 16 lowercase hex characters.
    ///
    /// ```
    /// # use tower_idempotency::record::TraceOrigin;
    /// assert_eq!(TraceOrigin::new([1; 16], [0xcd; 8], 1).unwrap().span_id_hex(), "cd".repeat(8));
    /// ```
    pub fn span_id_hex(&self) -> String {
        Hex(&self.span_id).to_string()
    }

    /// The bytes its fields take in a record's encoding (its extension's value): ids, flags, the
    /// tracestate's length and the tracestate.
    pub(crate) fn encoded_len(&self) -> usize {
        16 + 8 + 1 + 2 + self.state.as_ref().map_or(0, |s| s.len())
    }

    /// A decoded origin's fields, checked as [`new`](Self::new) and
    /// [`with_tracestate`](Self::with_tracestate) check them: `None` when they are not valid.
    pub(crate) fn from_parts(
        trace_id: [u8; 16],
        span_id: [u8; 8],
        flags: u8,
        state: &[u8],
    ) -> Option<Self> {
        let mut origin = Self::new(trace_id, span_id, flags)?;
        if !state.is_empty() {
            let state = std::str::from_utf8(state).ok()?;
            let kept = bounded_tracestate(state)?;
            if *kept != *state {
                return None;
            }
            origin.state = Some(kept);
        }
        Some(origin)
    }
}

/// The W3C `traceparent` of this origin, version `00`.
impl fmt::Display for TraceOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{}",
            Hex(&self.trace_id),
            Hex(&self.span_id),
            Hex(&[self.flags])
        )
    }
}

/// Two lowercase hex digits as a byte.
fn hex_byte(digits: &[u8]) -> Option<u8> {
    let digit = |d: u8| match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    };
    Some(digit(digits[0])? << 4 | digit(digits[1])?)
}

/// `state`'s well-formed list members that fit in [`MAX_TRACESTATE_LEN`], joined by commas; `None`
/// when one is malformed, there are more than 32, or none.
fn bounded_tracestate(state: &str) -> Option<Box<str>> {
    let mut kept = String::new();
    let mut members = 0;
    for member in state.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        members += 1;
        if members > MAX_TRACESTATE_MEMBERS || !is_list_member(member) {
            return None;
        }
        let len = kept.len() + usize::from(!kept.is_empty()) + member.len();
        if len <= MAX_TRACESTATE_LEN {
            if !kept.is_empty() {
                kept.push(',');
            }
            kept.push_str(member);
        }
    }
    (!kept.is_empty()).then(|| kept.into_boxed_str())
}

/// A `tracestate` list member: `key=value`, the key of lowercase letters, digits and `_-*/`
/// (with at most one `@` for a tenant), the value of printable ASCII without `,` and `=`, not
/// ending in a space.
fn is_list_member(member: &str) -> bool {
    let Some((key, value)) = member.split_once('=') else {
        return false;
    };
    let key_ok = (1..=256).contains(&key.len())
        && key.bytes().filter(|&b| b == b'@').count() <= 1
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b));
    let value_ok = (1..=256).contains(&value.len())
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=');
    key_ok && value_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_reads_and_writes_back() {
        let origin = TraceOrigin::parse(VALID).expect("valid");
        assert_eq!(origin.to_string(), VALID);
        assert_eq!(origin.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(origin.span_id_hex(), "00f067aa0ba902b7");
        assert_eq!(origin.flags(), 1);
        assert_eq!(TraceOrigin::parse(&format!(" {VALID}\t")), Some(origin));
    }

    #[test]
    fn malformed_traceparents_are_no_origin_and_never_panic() {
        let cases = [
            String::new(),
            "00".into(),
            VALID[..54].into(),
            format!("{VALID}0"),
            format!("{VALID}-extra"),
            VALID.replace("00-4b", "ff-4b"),
            VALID.replace("4bf9", "4BF9"),
            VALID.replace("4bf9", "4bg9"),
            VALID.replacen('-', "_", 1),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g".into(),
            format!("01-{}-extra{}", &VALID[3..55], "x".repeat(300)),
            "é".repeat(30),
        ];
        for case in &cases {
            assert_eq!(TraceOrigin::parse(case), None, "{case:?}");
        }
        // Every prefix and every one-byte change of a valid value: an origin or none, no panic.
        for n in 0..VALID.len() {
            assert_eq!(TraceOrigin::parse(&VALID[..n]), None);
            for b in [b'0', b'-', b'z', 0xc3] {
                let mut bytes = VALID.as_bytes().to_vec();
                bytes[n] = b;
                if let Ok(text) = std::str::from_utf8(&bytes) {
                    let _ = TraceOrigin::parse(text);
                }
            }
        }
        // A later version may carry more fields after a dash.
        let later = format!("cc-{}-more", &VALID[3..]);
        assert_eq!(
            TraceOrigin::parse(&later).map(|o| o.to_string()).as_deref(),
            Some(VALID)
        );
    }

    #[cfg(feature = "trace-origin")]
    #[test]
    fn headers_give_an_origin_only_with_one_valid_traceparent() {
        let mut headers = HeaderMap::new();
        assert_eq!(TraceOrigin::from_headers(&headers), None);
        headers.insert("tracestate", "a=1".parse().unwrap());
        assert_eq!(TraceOrigin::from_headers(&headers), None, "no traceparent");
        headers.insert("traceparent", VALID.parse().unwrap());
        let origin = TraceOrigin::from_headers(&headers).expect("valid");
        assert_eq!(origin.tracestate(), Some("a=1"));
        headers.append("traceparent", VALID.parse().unwrap());
        assert_eq!(
            TraceOrigin::from_headers(&headers),
            None,
            "two traceparents"
        );
    }

    #[test]
    fn tracestate_is_bounded_by_whole_members_and_dropped_when_malformed() {
        let origin = TraceOrigin::new([1; 16], [2; 8], 1).unwrap();
        let member = |n: usize| format!("k{n:02}={}", "v".repeat(60));
        let long: Vec<_> = (0..20).map(member).collect();
        let kept = origin.clone().with_tracestate(&long.join(","));
        let kept = kept.tracestate().expect("the leading members");
        assert!(kept.len() <= MAX_TRACESTATE_LEN, "{}", kept.len());
        assert_eq!(kept, long[..kept.split(',').count()].join(","));
        assert_eq!(
            kept.split(',').count(),
            7,
            "seven 64-byte members and their commas"
        );

        let too_many: Vec<_> = (0..33).map(|n| format!("k{n}=v")).collect();
        for bad in [
            too_many.join(","),
            "a=1,b".into(),
            "A=1".into(),
            "a=b=c".into(),
            "a=\u{7f}".into(),
            ",".into(),
            String::new(),
        ] {
            assert_eq!(
                origin.clone().with_tracestate(&bad).tracestate(),
                None,
                "{bad:?}"
            );
        }
        assert!(
            TraceOrigin::from_parts([1; 16], [2; 8], 1, b"a=1, b=2").is_none(),
            "not as kept"
        );
        assert!(TraceOrigin::from_parts([1; 16], [2; 8], 1, b"a=1,b=2").is_some());
    }

    #[test]
    fn the_flags_are_read_as_sent() {
        let unsampled = VALID.replace("-01", "-00");
        let origin = TraceOrigin::parse(&unsampled).expect("valid");
        assert_eq!(origin.flags(), 0);
        assert_eq!(origin.to_string(), unsampled);
        let other = TraceOrigin::parse(&VALID.replace("-01", "-a3")).expect("valid");
        assert_eq!(other.flags(), 0xa3);
    }

    #[test]
    fn tracestate_members_are_kept_while_they_fit_the_byte_bound() {
        let origin = TraceOrigin::parse(VALID).expect("valid");
        let member = |key: char, len: usize| format!("{key}={}", "v".repeat(len - 2));
        let (a, b, c) = (member('a', 255), member('b', 256), member('c', 257));
        let exact = origin.clone().with_tracestate(&format!("{a},{b}"));
        assert_eq!(exact.tracestate().map(str::len), Some(MAX_TRACESTATE_LEN));
        let over = origin.with_tracestate(&format!("{a},{c},b=1"));
        assert_eq!(over.tracestate(), Some(format!("{a},b=1").as_str()));
    }

    #[test]
    fn a_separator_out_of_place_is_no_origin() {
        for at in [2, 35, 52] {
            let mut bytes = VALID.as_bytes().to_vec();
            bytes[at] = b'0';
            let value = String::from_utf8(bytes).expect("ASCII");
            assert_eq!(TraceOrigin::parse(&value), None, "{value}");
        }
    }

    #[test]
    fn a_later_version_is_read_up_to_the_bound() {
        let longest = format!("01-{}-{}", &VALID[3..55], "x".repeat(200));
        assert_eq!(longest.len(), MAX_TRACEPARENT_LEN);
        assert_eq!(
            TraceOrigin::parse(&longest).map(|o| o.to_string()),
            Some(VALID.into())
        );
        assert_eq!(TraceOrigin::parse(&format!("{longest}x")), None);
    }

    #[cfg(feature = "trace-origin")]
    #[test]
    fn tracestate_lines_are_joined_up_to_their_bound() {
        let with_lines = |lines: &[String]| {
            let mut headers = HeaderMap::new();
            headers.insert("traceparent", VALID.parse().expect("a value"));
            for line in lines {
                headers.append("tracestate", line.parse().expect("a value"));
            }
            TraceOrigin::from_headers(&headers).expect("an origin")
        };
        let (first, second) = (
            format!("a={}", "1".repeat(98)),
            format!("b={}", "2".repeat(98)),
        );
        let origin = with_lines(&[first.clone(), second.clone()]);
        assert_eq!(
            origin.tracestate(),
            Some(format!("{first},{second}").as_str())
        );

        // One line exactly as long as the joined text may be: read, its first members kept.
        let members: Vec<String> = (0..32)
            .map(|n| format!("k{n:02}={}", "v".repeat(if n == 31 { 124 } else { 123 })))
            .collect();
        let line = members.join(",");
        assert_eq!(line.len(), 8 * MAX_TRACESTATE_LEN);
        let origin = with_lines(&[line]);
        assert_eq!(origin.tracestate(), Some(members[..4].join(",").as_str()));
    }
}
