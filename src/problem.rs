//! The responses the layer makes itself: RFC 9457 `application/problem+json`.
//!
//! Each kind has a stable `type` URI (this page, with the kind's anchor), a `title`, a `detail`,
//! the `status`, and `Cache-Control: no-store`. Statuses are the IETF draft's by default and can be
//! changed with [`IdempotencyLayer::problem_status`](crate::IdempotencyLayer::problem_status).
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
//! stored (larger than the response limit, carrying trailers, or failing while it was produced), so
//! it cannot be replayed. The operation ran once; look its result up.
//!
//! ### store-unavailable
//! 503 with `Retry-After`: the idempotency store could not be reached in time (or is full), so the
//! request was not run.
//!
//! ### handler-failed
//! 500: the handler failed or panicked. Nothing was stored; a retry runs it again. (When the
//! handler did return a response but its body failed while it was read, the operation is taken as
//! completed: a retry gets not-replayable, never a second run.)

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

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
}

impl ProblemKind {
    pub(crate) const ALL: [ProblemKind; 9] = [
        ProblemKind::MissingKey,
        ProblemKind::InvalidKey,
        ProblemKind::BodyTooLarge,
        ProblemKind::BodyUnreadable,
        ProblemKind::InFlight,
        ProblemKind::Mismatch,
        ProblemKind::NotReplayable,
        ProblemKind::StoreUnavailable,
        ProblemKind::HandlerFailed,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The default status: the IETF draft's where it names one.
    pub fn default_status(self) -> StatusCode {
        match self {
            ProblemKind::MissingKey | ProblemKind::InvalidKey | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::InFlight | ProblemKind::NotReplayable => StatusCode::CONFLICT,
            ProblemKind::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::HandlerFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
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
        }
    }
}

/// A problem response, ready to send.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) type_uri: &'static str,
    pub(crate) title: &'static str,
    pub(crate) status: StatusCode,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<u64>,
}

impl Problem {
    pub(crate) fn new(kind: ProblemKind, status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            type_uri: kind.type_uri(),
            title: kind.title(),
            status,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// A problem with only a status (an application's scope rejection).
    pub(crate) fn status(status: StatusCode) -> Self {
        Self {
            type_uri: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status,
            detail: String::new(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub(crate) fn into_response(self) -> Response<Bytes> {
        let mut body = serde_json::json!({
            "type": self.type_uri,
            "title": self.title,
            "status": self.status.as_u16(),
        });
        if !self.detail.is_empty() {
            body["detail"] = self.detail.into();
        }
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_has_the_rfc_9457_members() {
        let response = Problem::new(ProblemKind::InFlight, StatusCode::CONFLICT, "wait")
            .retry_after(1)
            .into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["type"], ProblemKind::InFlight.type_uri());
        assert_eq!(body["status"], 409);
        assert_eq!(body["detail"], "wait");
        assert!(body["title"].as_str().is_some_and(|t| !t.is_empty()));
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
