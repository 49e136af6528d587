//! What is retried: the answers and failures after which the same request, sent again with the
//! same key, may succeed, and how long the server asked to wait.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, Response, StatusCode, header};
use tower_idempotency::problem::IDEMPOTENCY_PROBLEM;

use super::BoxError;

/// Why an attempt is retried; its name is the `reason` field of the retry event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The inner service failed: no connection, a reset, a response cut off. The request may or
    /// may not have reached the server; the key makes sending it again safe either way.
    Transport,
    /// The attempt ran out of its own time: done, not done or still running, nobody knows.
    Timeout,
    /// 409: the key's first request is still running on the server.
    InFlight,
    /// 429: the server asked for fewer requests.
    RateLimited,
    /// 503: the server (or its store) is away for now.
    Unavailable,
    /// 502 or 504: a gateway lost or timed out on the upstream.
    Gateway,
    /// Another 5xx (not 501 or 505): the server failed; with the key, a retry replays or reruns.
    ServerError,
    /// gRPC `ABORTED`: the key's first call is still running, or the server hit a conflict.
    #[cfg_attr(not(feature = "grpc"), allow(dead_code, reason = "a gRPC answer's"))]
    Aborted,
}

impl Reason {
    /// The name in the retry event.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Transport => "transport",
            Reason::Timeout => "timeout",
            Reason::InFlight => "in_flight",
            Reason::RateLimited => "rate_limited",
            Reason::Unavailable => "unavailable",
            Reason::Gateway => "gateway",
            Reason::ServerError => "server_error",
            Reason::Aborted => "aborted",
        }
    }
}

/// A retryable outcome: why, and the wait the server asked for, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retryable {
    pub(crate) reason: Reason,
    pub(crate) retry_after: Option<Duration>,
}

/// Whether an attempt's outcome is worth another attempt; `None` for a final answer.
pub(crate) fn classify<B>(result: &Result<Response<B>, BoxError>) -> Option<Retryable> {
    match result {
        Ok(response) => {
            // A gRPC answer is judged by its `grpc-status` (`client::grpc`), not its HTTP 200.
            #[cfg(feature = "grpc")]
            if let Some(answer) = response.extensions().get::<super::grpc::GrpcAnswer>() {
                return answer.retryable();
            }
            let reason = retryable_status(response.status())?;
            Some(Retryable {
                reason,
                retry_after: retry_after(response.headers(), SystemTime::now()),
            })
        }
        Err(err) => Some(Retryable {
            reason: if is_timeout(err.as_ref()) {
                Reason::Timeout
            } else {
                Reason::Transport
            },
            retry_after: None,
        }),
    }
}

/// The statuses that say "not done, or not known to be done: ask again". Every other status is
/// a decided answer: 4xx are the request's own fault (another attempt gets the same answer, or
/// with 422 a key reused for another request), 501 and 505 are the server's fixed limits.
pub(crate) fn retryable_status(status: StatusCode) -> Option<Reason> {
    match status {
        StatusCode::CONFLICT => Some(Reason::InFlight),
        StatusCode::TOO_MANY_REQUESTS => Some(Reason::RateLimited),
        StatusCode::SERVICE_UNAVAILABLE => Some(Reason::Unavailable),
        StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => Some(Reason::Gateway),
        StatusCode::NOT_IMPLEMENTED | StatusCode::HTTP_VERSION_NOT_SUPPORTED => None,
        status if status.is_server_error() => Some(Reason::ServerError),
        _ => None,
    }
}

/// The kind's name in the server layer's `Idempotency-Problem` header: the anchor of
/// `ProblemKind::NotReplayable`'s `type` URI.
const NOT_REPLAYABLE: &str = "not-replayable";

/// Whether the answer is the server layer's `not-replayable` (whatever its status, by default a
/// `409`): the key's operation ran once and its response is not kept, so no retry can get it. The
/// layer names the kind in a header; its `409` in flight, or another server's `409`, is retried.
pub(crate) fn not_replayable(headers: &HeaderMap) -> bool {
    (headers.get_all(IDEMPOTENCY_PROBLEM).iter()).any(|value| {
        value
            .as_bytes()
            .eq_ignore_ascii_case(NOT_REPLAYABLE.as_bytes())
    })
}

/// Methods that are idempotent by definition (RFC 9110 §9.2.2): retried with or without a key.
pub(crate) fn idempotent_by_definition(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::PUT | Method::DELETE | Method::OPTIONS
    )
}

/// `Retry-After` as delay-seconds or an HTTP date (RFC 9110 §10.2.3), from `now`; a date in the
/// past is no wait. An unreadable value is ignored: the backoff decides.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether the failure, or one of its sources, is a timeout: tower's per-attempt `Elapsed`, or an
/// I/O timeout from the connector.
fn is_timeout(err: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(err) = next {
        if err.is::<tower::timeout::error::Elapsed>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::TimedOut
        {
            return true;
        }
        next = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn the_retry_table() {
        let retried = [
            (409, Reason::InFlight),
            (429, Reason::RateLimited),
            (503, Reason::Unavailable),
            (502, Reason::Gateway),
            (504, Reason::Gateway),
            (500, Reason::ServerError),
            (507, Reason::ServerError),
            (599, Reason::ServerError),
        ];
        for (code, reason) in retried {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(retryable_status(status), Some(reason), "{code}");
        }
        for code in [
            200, 201, 204, 301, 304, 400, 401, 402, 403, 404, 405, 408, 410, 412, 413, 415, 422,
            425, 451, 501, 505,
        ] {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(retryable_status(status), None, "{code}");
        }
    }

    #[test]
    fn not_replayable_is_told_from_the_other_409s() {
        use tower_idempotency::problem::ProblemKind;
        let anchor = ProblemKind::NotReplayable.type_uri().rsplit('#').next();
        assert_eq!(anchor, Some(NOT_REPLAYABLE), "the layer's name for it");
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(IDEMPOTENCY_PROBLEM, HeaderValue::from_static(value));
            not_replayable(&headers)
        };
        assert!(with("not-replayable"));
        assert!(with("Not-Replayable"));
        assert!(!with("in-flight"));
        assert!(!with("not-replayable-yet"));
        assert!(!not_replayable(&HeaderMap::new()), "a bare 409");
    }

    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_str(value).unwrap());
            retry_after(&headers, now)
        };
        assert_eq!(with("3"), Some(Duration::from_secs(3)));
        assert_eq!(with(" 0 "), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(with(&later), Some(Duration::from_secs(7)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(with(&earlier), Some(Duration::ZERO), "a past date: no wait");
        assert_eq!(with("-1"), None);
        assert_eq!(with("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn timeouts_are_told_from_other_failures() {
        let elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert!(is_timeout(elapsed.as_ref()));
        let io: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(is_timeout(io.as_ref()));
        let refused: BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!is_timeout(refused.as_ref()));
    }
}
