//! The responses the layer makes itself: RFC 9457 `application/problem+json` by default, or the
//! API's own error format through a [`RenderProblem`]
//! ([`IdempotencyLayer::render_problems`](crate::IdempotencyLayer::render_problems)).
//!
//! Each kind has a stable `type` URI (this page, with the kind's anchor), a `title`, a `detail`,
//! the `status`, `Cache-Control: no-store`, and the anchor in the [`IDEMPOTENCY_PROBLEM`] header
//! (`Idempotency-Problem: in-flight`); every such response carries its [`ProblemKind`]
//! (and its [`Outcome`](crate::Outcome)) in its extensions, whatever renders it. Statuses are the
//! IETF draft's by default and can be changed with
//! [`IdempotencyLayer::problem_status`](crate::IdempotencyLayer::problem_status).
//!
//! ### missing-key
//! 400: the request needs an `Idempotency-Key` header and has none.
//!
//! ### invalid-key
//! 400: the key is not 1 to 255 visible ASCII characters in the quoted or bare form, or the request
//! has more than one key header, or a list of keys.
//!
//! ### body-too-large
//! 413: the request body is over the limit. Nothing was claimed.
//!
//! ### body-unreadable
//! 400: the request body could not be read. Nothing was claimed.
//!
//! ### in-flight
//! 409 with `Retry-After`: a request with this key is still being processed.
//!
//! ### mismatch
//! 422: the key was used for a different request (method, path, query, body or a fingerprinted
//! header differ). Use a new key for a new request.
//!
//! ### not-replayable
//! 409 without `Retry-After`: the request with this key completed, but its response could not be
//! stored (larger than the response limit, or failing while it was produced), so it cannot be
//! replayed. The operation ran once; look its result up.
//!
//! ### store-unavailable
//! 503 with `Retry-After`: the idempotency store could not be reached in time (or is full), so the
//! request was not run.
//!
//! ### handler-failed
//! 500: the handler failed or panicked. Nothing was stored; a retry runs it again. (When the
//! handler did return a response but its body failed while it was read, the operation is taken as
//! completed: a retry gets not-replayable, never a second run.)
//!
//! ### commit-rejected
//! 422 without `Retry-After`: the handler ran in a transaction that commits with the request's
//! record (`PgTx`), and the database refused that commit for a reason that sending the request
//! again cannot fix: the handler's writes broke an integrity constraint (a deferred foreign key, a
//! unique key), held invalid data, or named an object that does not exist. Nothing was done, and
//! the key is free again: the same request with this key is refused the same way until the data it
//! conflicts with changes, and may then be sent again.
//!
//! ### record-unreadable
//! 500 without `Retry-After`: the key holds a record whose response cannot be trusted: sealed
//! (`SealedStore`) and it does not open (its bytes were changed, it was moved from another key or
//! scope, or the key that sealed it was retired), or in clear where sealed records are required.
//! It is not replayed, and the request is not run again: the operation may have run once. Not a
//! 503: sending the request again gets the same answer until the record expires or the key that
//! sealed it is restored.

use std::borrow::Cow;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

/// The header in which the layer names the kind of each problem it answers with over HTTP: the
/// anchor of the kind's `type` URI (`in-flight`, `not-replayable`, ...), whatever renders the
/// body, so that a client tells the kinds apart without reading it. A `409` is `in-flight` (ask
/// again) or `not-replayable` (asking again cannot help: the operation ran once and its response
/// is not kept), and only this header or the body's `type` says which.
///
/// ```
/// assert_eq!(tower_idempotency::problem::IDEMPOTENCY_PROBLEM, "idempotency-problem");
/// ```
pub const IDEMPOTENCY_PROBLEM: HeaderName = HeaderName::from_static("idempotency-problem");

macro_rules! type_uri {
    ($anchor:literal) => {
        concat!(
            "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/index.html#",
            $anchor
        )
    };
}

/// The kinds of problem the layer answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// No key on a request that requires one (400).
    MissingKey,
    /// The key header is not one valid key (400).
    InvalidKey,
    /// The request body is over the limit (413).
    BodyTooLarge,
    /// The request body could not be read (400).
    BodyUnreadable,
    /// The key's first request is still running (409 with `Retry-After`).
    InFlight,
    /// The key was used for a different request (422).
    Mismatch,
    /// The key's request completed, but its response was not stored (409).
    NotReplayable,
    /// The store is unreachable, slow or full (503 with `Retry-After`).
    StoreUnavailable,
    /// The handler failed or panicked (500).
    HandlerFailed,
    /// The handler's transaction was refused at commit for a reason that sending the request
    /// again cannot fix (422); nothing was done.
    CommitRejected,
    /// The key's record cannot be opened or trusted (500): it is not replayed, and the request
    /// is not run again.
    RecordUnreadable,
    /// The request's scope has written its quota of records through this instance, and its key
    /// has no record (`store::ScopeQuota`, feature `scope-quota`): 429, with a `Retry-After` of
    /// when its budget has room again. Nothing was claimed.
    QuotaExceeded,
}

impl ProblemKind {
    pub(crate) const ALL: [ProblemKind; 12] = [
        ProblemKind::MissingKey,
        ProblemKind::InvalidKey,
        ProblemKind::BodyTooLarge,
        ProblemKind::BodyUnreadable,
        ProblemKind::InFlight,
        ProblemKind::Mismatch,
        ProblemKind::NotReplayable,
        ProblemKind::StoreUnavailable,
        ProblemKind::HandlerFailed,
        ProblemKind::CommitRejected,
        ProblemKind::RecordUnreadable,
        ProblemKind::QuotaExceeded,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The outcome of a request the layer answers with this kind: those refused before any
    /// claim are `Rejected`.
    pub(crate) fn outcome(self) -> crate::Outcome {
        use crate::Outcome;
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey => Outcome::Rejected,
            ProblemKind::BodyTooLarge | ProblemKind::BodyUnreadable => Outcome::Rejected,
            ProblemKind::InFlight => Outcome::InFlight,
            ProblemKind::Mismatch => Outcome::Mismatch,
            ProblemKind::NotReplayable => Outcome::NotReplayable,
            ProblemKind::StoreUnavailable => Outcome::StoreUnavailable,
            ProblemKind::HandlerFailed => Outcome::HandlerFailed,
            ProblemKind::CommitRejected => Outcome::CommitRejected,
            ProblemKind::RecordUnreadable => Outcome::RecordUnreadable,
            ProblemKind::QuotaExceeded => Outcome::QuotaExceeded,
        }
    }

    /// The default status: the IETF draft's where it names one.
    pub fn default_status(self) -> StatusCode {
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            // Not 409 (a client retries that: the first request may still run) nor a 5xx: the
            // request's own data is refused, so it is an answer, and clients do not retry it.
            ProblemKind::CommitRejected => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::InFlight | ProblemKind::NotReplayable => StatusCode::CONFLICT,
            ProblemKind::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            // A 5xx that clients do not retry for ever: not 503, which says "later".
            ProblemKind::HandlerFailed | ProblemKind::RecordUnreadable => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The anchor of [`type_uri`](Self::type_uri): the kind's name in the
    /// [`IDEMPOTENCY_PROBLEM`] header.
    pub(crate) fn anchor(self) -> &'static str {
        let uri = self.type_uri();
        &uri[uri.rfind('#').map_or(0, |at| at + 1)..]
    }

    /// The stable `type` URI of this kind.
    pub fn type_uri(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => type_uri!("missing-key"),
            ProblemKind::InvalidKey => type_uri!("invalid-key"),
            ProblemKind::BodyTooLarge => type_uri!("body-too-large"),
            ProblemKind::BodyUnreadable => type_uri!("body-unreadable"),
            ProblemKind::InFlight => type_uri!("in-flight"),
            ProblemKind::Mismatch => type_uri!("mismatch"),
            ProblemKind::NotReplayable => type_uri!("not-replayable"),
            ProblemKind::StoreUnavailable => type_uri!("store-unavailable"),
            ProblemKind::HandlerFailed => type_uri!("handler-failed"),
            ProblemKind::CommitRejected => type_uri!("commit-rejected"),
            ProblemKind::RecordUnreadable => type_uri!("record-unreadable"),
            ProblemKind::QuotaExceeded => type_uri!("quota-exceeded"),
        }
    }

    /// A short, human title.
    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::MissingKey => "Idempotency-Key is missing",
            ProblemKind::InvalidKey => "Idempotency-Key is invalid",
            ProblemKind::BodyTooLarge => "Request body is too large",
            ProblemKind::BodyUnreadable => "Request body could not be read",
            ProblemKind::InFlight => "A request with this Idempotency-Key is in progress",
            ProblemKind::Mismatch => "Idempotency-Key reused for a different request",
            ProblemKind::NotReplayable => {
                "The response for this Idempotency-Key cannot be replayed"
            }
            ProblemKind::StoreUnavailable => "Idempotency store unavailable",
            ProblemKind::HandlerFailed => "The request failed",
            ProblemKind::CommitRejected => "The request's changes were rejected",
            ProblemKind::RecordUnreadable => {
                "The stored response for this Idempotency-Key cannot be read"
            }
            ProblemKind::QuotaExceeded => "Too many requests stored for this account",
        }
    }
}

/// A problem the layer answers with, before it is rendered: what a [`RenderProblem`] has in hand.
///
/// The status is the one the layer sends (the kind's default, or the one set with
/// [`IdempotencyLayer::problem_status`](crate::IdempotencyLayer::problem_status)); `detail` is a
/// human sentence whose wording is not stable; `retry_after` is the `Retry-After` the layer sends
/// with it, in whole seconds, when there is one (`in-flight` and `store-unavailable`).
#[derive(Debug, Clone)]
pub struct Problem {
    kind: ProblemKind,
    status: StatusCode,
    /// The layer's own details are static text: no allocation for a 409.
    detail: Cow<'static, str>,
    retry_after: Option<u64>,
}

impl Problem {
    pub(crate) fn new(
        kind: ProblemKind,
        status: StatusCode,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            kind,
            status,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub(crate) fn with_retry_after(mut self, seconds: Option<u64>) -> Self {
        self.retry_after = seconds;
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The status the response has.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// A human sentence saying what happened and what to do; never the key, the request body or a
    /// handler's error. Its wording is not stable: match on [`Problem::kind`].
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `Retry-After` the response carries, in whole seconds: on `in-flight` and
    /// `store-unavailable`, `None` on every other kind.
    pub fn retry_after(&self) -> Option<u64> {
        self.retry_after
    }

    /// The kind's stable `type` URI ([`ProblemKind::type_uri`]).
    pub fn type_uri(&self) -> &'static str {
        self.kind.type_uri()
    }

    /// The kind's title ([`ProblemKind::title`]).
    pub fn title(&self) -> &'static str {
        self.kind.title()
    }
}

/// Renders the layer's own responses (its [`Problem`]s) in an API's error format: the body and
/// the headers that go with it, per problem.
///
/// The layer sets the rest, whatever the renderer does: the status ([`Problem::status`]),
/// `Cache-Control: no-store`, the [`IDEMPOTENCY_PROBLEM`] header, the `Retry-After` of
/// [`Problem::retry_after`], and the
/// [`ProblemKind`] and [`Outcome`](crate::Outcome) in the response's extensions. The default is
/// [`ProblemJson`], RFC 9457 `application/problem+json`.
///
/// Implemented for every `Fn(&Problem) -> RenderedProblem + Send + Sync + 'static`, and for types
/// of your own. A plain-text renderer:
///
/// ```
/// use axum::{Router, body::Body, routing::post};
/// use http::{HeaderValue, Request, StatusCode, header::CONTENT_TYPE};
/// use http_body_util::BodyExt;
/// use tower::ServiceExt;
/// use tower_idempotency::problem::{Problem, ProblemKind, RenderedProblem};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let plain_text = |problem: &Problem| {
///     let text = format!("{}: {}\n", problem.title(), problem.detail());
///     RenderedProblem::new(HeaderValue::from_static("text/plain; charset=utf-8"), text)
/// };
/// let app = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .route_layer(IdempotencyLayer::new(MemoryStore::new()).render_problems(plain_text));
///
/// // No key: the layer's 400, in the API's format.
/// let request = Request::post("/v1/charges").body(Body::empty()).unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()[CONTENT_TYPE], "text/plain; charset=utf-8");
/// assert_eq!(response.extensions().get::<ProblemKind>(), Some(&ProblemKind::MissingKey));
/// let body = response.into_body().collect().await.unwrap().to_bytes();
/// assert!(body.starts_with(b"Idempotency-Key is missing: "));
/// # }
/// ```
///
/// A renderer for an API whose errors are `{"error": {"type", "code", "message"}}` can keep the
/// RFC 9457 members beside its own (a problem document may carry extension members), so that
/// clients of either format understand it; the payments example (`examples/payments/src/error.rs`) does
/// so for Stripe's SDKs.
pub trait RenderProblem: Send + Sync + 'static {
    /// The body and headers of `problem`'s response.
    fn render(&self, problem: &Problem) -> RenderedProblem;
}

impl<F> RenderProblem for F
where
    F: Fn(&Problem) -> RenderedProblem + Send + Sync + 'static,
{
    fn render(&self, problem: &Problem) -> RenderedProblem {
        self(problem)
    }
}

/// The body and headers a [`RenderProblem`] made for one [`Problem`].
///
/// ```
/// use http::{HeaderName, HeaderValue};
/// use tower_idempotency::problem::RenderedProblem;
///
/// let rendered = RenderedProblem::new(HeaderValue::from_static("application/json"), "{}")
///     .header(HeaderName::from_static("x-error-code"), HeaderValue::from_static("in_flight"));
/// assert_eq!(rendered.headers()["content-type"], "application/json");
/// assert_eq!(rendered.body(), "{}");
/// ```
#[derive(Debug, Clone)]
pub struct RenderedProblem {
    headers: HeaderMap,
    body: Bytes,
}

impl RenderedProblem {
    /// A body of the given `Content-Type`.
    pub fn new(content_type: HeaderValue, body: impl Into<Bytes>) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, content_type);
        Self {
            headers,
            body: body.into(),
        }
    }

    /// Adds a header value (after those of the same name). `Cache-Control`, `Retry-After` and
    /// [`IDEMPOTENCY_PROBLEM`] are the layer's: it replaces them.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// The headers so far.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

/// The default [`RenderProblem`]: an RFC 9457 `application/problem+json` document with `type`,
/// `title`, `status` and `detail` (the [module documentation](self) lists the kinds).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemJson;

impl RenderProblem for ProblemJson {
    fn render(&self, problem: &Problem) -> RenderedProblem {
        // The layer's own details are static text, written as they are, as titles and types are.
        let detail = match &problem.detail {
            Cow::Borrowed(text) => Text::Plain(text),
            Cow::Owned(text) => Text::Any(text),
        };
        let body = problem_document(
            problem.type_uri(),
            problem.title(),
            problem.status(),
            detail,
        );
        RenderedProblem::new(HeaderValue::from_static(PROBLEM_JSON), body)
    }
}

const PROBLEM_JSON: &str = "application/problem+json";

/// Text for a JSON string: the layer's own, with nothing to escape, or any other.
#[derive(Clone, Copy)]
enum Text<'a> {
    Plain(&'a str),
    Any(&'a str),
}

/// A problem document: its members sorted by name, as they have always been written. `type_uri`
/// and `title` are the layer's own text.
fn problem_document(type_uri: &str, title: &str, status: StatusCode, detail: Text<'_>) -> Vec<u8> {
    let (Text::Plain(detail_text) | Text::Any(detail_text)) = detail;
    let mut body = Vec::with_capacity(48 + type_uri.len() + title.len() + detail_text.len());
    body.push(b'{');
    if !detail_text.is_empty() {
        body.extend_from_slice(b"\"detail\":");
        push_json_string(&mut body, detail);
        body.push(b',');
    }
    body.extend_from_slice(b"\"status\":");
    body.extend_from_slice(status.as_str().as_bytes());
    body.extend_from_slice(b",\"title\":");
    push_json_string(&mut body, Text::Plain(title));
    body.extend_from_slice(b",\"type\":");
    push_json_string(&mut body, Text::Plain(type_uri));
    body.push(b'}');
    body
}

/// Whether `text` holds a byte a JSON string must escape.
fn needs_escape(text: &str) -> bool {
    // No early exit: the whole scan vectorizes, and the text is short.
    (text.bytes()).fold(false, |any, b| {
        any | (b < 0x20) | (b == b'"') | (b == b'\\')
    })
}

/// Appends `text` as a JSON string: the layer's own text and text with nothing to escape is
/// copied as it is (serde_json escapes byte by byte, most of a 409's rendering), anything else
/// goes through serde_json.
fn push_json_string(body: &mut Vec<u8>, text: Text<'_>) {
    let plain = match text {
        Text::Plain(text) => {
            debug_assert!(
                !needs_escape(text),
                "the layer's own text needs escaping: {text:?}"
            );
            text
        }
        Text::Any(text) if !needs_escape(text) => text,
        Text::Any(text) => {
            // Writing a string to a `Vec` cannot fail.
            let _ = serde_json::to_writer(&mut *body, text);
            return;
        }
    };
    body.push(b'"');
    body.extend_from_slice(plain.as_bytes());
    body.push(b'"');
}

/// The response of `problem`, rendered by `renderer`, with what the layer always sets.
pub(crate) fn respond(problem: &Problem, renderer: &dyn RenderProblem) -> Response<Bytes> {
    let RenderedProblem { headers, body } = renderer.render(problem);
    let mut response = Response::new(body);
    *response.status_mut() = problem.status;
    *response.headers_mut() = headers;
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        IDEMPOTENCY_PROBLEM,
        HeaderValue::from_static(problem.kind.anchor()),
    );
    match problem.retry_after {
        Some(seconds) => headers.insert(RETRY_AFTER, HeaderValue::from(seconds)),
        None => headers.remove(RETRY_AFTER),
    };
    response.extensions_mut().insert(problem.kind);
    response
}

/// A problem with only a status, `about:blank` (a scope function's bare-status rejection, the key
/// extractor's wiring error): always `application/problem+json`.
pub(crate) fn about_blank(status: StatusCode) -> Response<Bytes> {
    let title = status.canonical_reason().unwrap_or("Error");
    let body = problem_document("about:blank", title, status, Text::Plain(""));
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::text::{PROTOCOL, section, table_rows};

    /// PROTOCOL §7.2's table has a row per kind, and no other, each with the kind's status,
    /// anchor and title.
    #[test]
    fn the_protocol_lists_every_kind_as_the_code_answers_it() {
        let rows = table_rows(section(PROTOCOL, "### 7.2"));
        let documented: Vec<Vec<String>> = (rows.iter().skip(1))
            .map(|row| {
                row[..4]
                    .iter()
                    .map(|cell| cell.trim_matches('`').to_owned())
                    .collect()
            })
            .collect();
        let emitted: Vec<Vec<String>> = (ProblemKind::ALL.iter())
            .map(|kind| {
                let uri = kind.type_uri();
                vec![
                    format!("{kind:?}"),
                    kind.default_status().as_u16().to_string(),
                    uri[uri.find('#').expect("an anchor") + 1..].to_owned(),
                    kind.title().to_owned(),
                ]
            })
            .collect();
        assert_eq!(documented, emitted);
    }

    /// The document is what serde_json writes for the same members, whatever the text holds.
    #[test]
    fn problem_documents_are_json_as_serde_json_writes_it() {
        for text in [
            "plain text",
            "\u{7f} alone",
            "a \"quote\", a \\ and a\ttab",
            "\u{1}\u{7f} é ☃",
            "",
        ] {
            let body = problem_document(
                "https://example.com/t",
                "t",
                StatusCode::CONFLICT,
                Text::Any(text),
            );
            let mut expected = serde_json::Map::new();
            if !text.is_empty() {
                expected.insert("detail".into(), text.into());
            }
            expected.insert("status".into(), 409.into());
            expected.insert("title".into(), "t".into());
            expected.insert("type".into(), "https://example.com/t".into());
            let expected = serde_json::to_vec(&expected).unwrap();
            assert_eq!(
                String::from_utf8(body).unwrap(),
                String::from_utf8(expected).unwrap()
            );
        }
    }

    #[test]
    fn problem_json_has_the_rfc_9457_members() {
        let problem = Problem::new(ProblemKind::InFlight, StatusCode::CONFLICT, "wait")
            .with_retry_after(Some(1));
        let response = respond(&problem, &ProblemJson);
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        assert_eq!(response.headers()[IDEMPOTENCY_PROBLEM], "in-flight");
        assert_eq!(response.headers().len(), 4);
        assert_eq!(
            response.extensions().get::<ProblemKind>(),
            Some(&ProblemKind::InFlight)
        );
        // The exact bytes: the members in this order, nothing else.
        assert_eq!(
            std::str::from_utf8(response.body()).unwrap(),
            concat!(
                r#"{"detail":"wait","status":409,"#,
                r#""title":"A request with this Idempotency-Key is in progress","#,
                r#""type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/index.html#in-flight"}"#
            )
        );
    }

    #[test]
    fn the_problem_header_names_each_kind_by_its_anchor() {
        for kind in ProblemKind::ALL {
            let problem = Problem::new(kind, kind.default_status(), "d");
            let response = respond(&problem, &ProblemJson);
            let named = response.headers()[IDEMPOTENCY_PROBLEM].to_str().unwrap();
            assert!(!named.is_empty() && !named.contains('#'), "{kind:?}");
            assert_eq!(kind.type_uri(), format!("{}{named}", type_uri!("")));
        }
    }

    #[test]
    fn the_layer_owns_cache_control_and_retry_after() {
        let render = |_: &Problem| {
            RenderedProblem::new(HeaderValue::from_static("text/plain"), "x")
                .header(CACHE_CONTROL, HeaderValue::from_static("max-age=60"))
                .header(RETRY_AFTER, HeaderValue::from_static("600"))
                .header(IDEMPOTENCY_PROBLEM, HeaderValue::from_static("in-flight"))
                .header(
                    HeaderName::from_static("x-extra"),
                    HeaderValue::from_static("kept"),
                )
        };
        let mismatch = Problem::new(ProblemKind::Mismatch, StatusCode::CONFLICT, "d");
        let response = respond(&mismatch, &render);
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        assert!(!response.headers().contains_key(RETRY_AFTER));
        let named = response.headers().get_all(IDEMPOTENCY_PROBLEM);
        assert_eq!(named.iter().collect::<Vec<_>>(), ["mismatch"]);
        assert_eq!(response.headers()["x-extra"], "kept");
        let in_flight = Problem::new(ProblemKind::InFlight, StatusCode::CONFLICT, "d")
            .with_retry_after(Some(2));
        let response = respond(&in_flight, &render);
        assert_eq!(
            response
                .headers()
                .get_all(RETRY_AFTER)
                .iter()
                .collect::<Vec<_>>(),
            ["2"]
        );
    }

    #[test]
    fn about_blank_has_no_detail() {
        let response = about_blank(StatusCode::UNAUTHORIZED);
        assert_eq!(
            std::str::from_utf8(response.body()).unwrap(),
            r#"{"status":401,"title":"Unauthorized","type":"about:blank"}"#
        );
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
    }

    #[test]
    fn every_kind_has_a_distinct_type() {
        let types: std::collections::HashSet<_> =
            ProblemKind::ALL.iter().map(|k| k.type_uri()).collect();
        assert_eq!(types.len(), ProblemKind::ALL.len());
        for (i, kind) in ProblemKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
