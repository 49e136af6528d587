//! Response capture: reading the handler's response into a record (within the response limit),
//! or deciding that it is not to be stored.

use bytes::Bytes;
use http::header::{CACHE_CONTROL, DATE, SET_COOKIE};
use http::response::Parts as ResponseParts;
use http::{HeaderMap, Response};
use http_body::Body;
use http_body_util::BodyExt;

use super::StorableBody;
use super::body_reader::Chunks;
use crate::body::ResponseBody;
use crate::config::Config;

/// What running the handler produced, before it is stored.
pub(super) enum Handled<B> {
    /// The store policy or `Cache-Control: no-store` says: do not store; release the claim.
    NotStored(Response<B>),
    /// The whole body and its trailers, within the response limit. (The trailers boxed: a future
    /// that holds this stays under the allocator's per-thread cache size.)
    Buffered(ResponseParts, Bytes, Option<Box<HeaderMap>>),
    /// Read whole, but the protocol mode does not store it (a gRPC status that a retry may change):
    /// deliver it, release the claim.
    Declined(Response<ResponseBody<B>>),
    /// The body (with its trailers) outgrew the response limit: deliver it, keep a tombstone.
    Unstorable(Response<ResponseBody<B>>),
    /// The body failed while it was read; the handler did run.
    BodyFailed(String),
}

/// Reads the response body and its trailers up to the response limit (trailers count against it,
/// name and value bytes), or decides that it is not to be stored.
pub(super) async fn capture<B: StorableBody>(config: &Config, response: Response<B>) -> Handled<B> {
    let (parts, body) = response.into_parts();
    let no_store = parts.headers.get_all(CACHE_CONTROL).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|d| d.trim().eq_ignore_ascii_case("no-store"))
        })
    });
    if no_store || !config.store_policy.store(&parts) {
        return Handled::NotStored(Response::from_parts(parts, body));
    }
    let limit = config.response_body_limit;
    let mut body = Box::pin(body);
    if body.size_hint().lower() > limit as u64 {
        return Handled::Unstorable(Response::from_parts(
            parts,
            ResponseBody::chained(Bytes::new(), None, body),
        ));
    }
    let mut chunks = Chunks::default();
    let mut trailers = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(err)) => return Handled::BodyFailed(err.to_string()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    chunks.push(data);
                    if chunks.len > limit {
                        let prefix = chunks.into_bytes();
                        let body = ResponseBody::chained(prefix, None, body);
                        return Handled::Unstorable(Response::from_parts(parts, body));
                    }
                }
                Err(frame) => {
                    let Ok(fields) = frame.into_trailers() else {
                        // A frame neither data nor trailers: skipped, as hyper skips it.
                        continue;
                    };
                    if chunks.len + fields_len(&fields) > limit {
                        let (prefix, fields) = (chunks.into_bytes(), Some(Box::new(fields)));
                        let body = ResponseBody::chained(prefix, fields, body);
                        return Handled::Unstorable(Response::from_parts(parts, body));
                    }
                    // Trailers end a body (http-body): a server sends nothing after them.
                    trailers = Some(Box::new(fields));
                    break;
                }
            },
        }
    }
    let bytes = chunks.into_bytes();
    if let Some(mode) = &config.protocol_mode
        && !mode.stores(&parts, trailers.as_deref(), &*config.store_policy)
    {
        let body = ResponseBody::with_trailers(bytes, trailers);
        return Handled::Declined(Response::from_parts(parts, body));
    }
    Handled::Buffered(parts, bytes, trailers)
}

/// The bytes trailers count for against the response limit: their names and values.
fn fields_len(fields: &HeaderMap) -> usize {
    (fields.iter())
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum()
}

/// The headers of a response that a replay repeats: every value in order, minus hop-by-hop
/// headers, `Date`, and (unless kept) `Set-Cookie`.
pub(super) fn replayable_headers(headers: &HeaderMap, keep_set_cookie: bool) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let hop_by_hop = matches!(
            name.as_str(),
            "connection" | "keep-alive" | "transfer-encoding" | "te" | "trailer" | "upgrade"
        ) || name.as_str().starts_with("proxy-");
        if hop_by_hop || name == DATE || (name == SET_COOKIE && !keep_set_cookie) {
            continue;
        }
        out.append(name, value.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue};

    use super::*;

    #[test]
    fn replay_drops_hop_by_hop_date_and_cookies_and_keeps_repeats() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "close"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("upgrade", "h2c"),
            ("proxy-authenticate", "Basic"),
            ("date", "Wed, 02 Dec 2026 10:00:00 GMT"),
            ("set-cookie", "a=1"),
            ("x-repeat", "1"),
            ("x-repeat", "2"),
            ("content-type", "application/json"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        let kept = replayable_headers(&headers, false);
        let names: Vec<_> = kept.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-repeat", "content-type"]);
        assert_eq!(
            kept.get_all("x-repeat").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert!(replayable_headers(&headers, true).contains_key(SET_COOKIE));
    }
}
