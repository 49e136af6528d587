//! Replay: a request whose key already holds a record is answered from it without running the
//! handler: the stored response (byte for byte, marked `Idempotent-Replayed`), 409 while the first
//! request runs, 422 for another request, or a 500 when the record cannot be trusted.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Response};

#[cfg(feature = "trace-origin")]
use super::trace_origin::show_origin;
use super::{IDEMPOTENT_REPLAYED, Shared, finish, whole_seconds};
use crate::body::ResponseBody;
use crate::error_chain::ErrorChain;
use crate::fingerprint::Fingerprint;
use crate::outcome::Outcome;
use crate::problem::ProblemKind;
use crate::record::{Completed, Payload, Record};
use crate::store::Store;

impl<St: Store> Shared<St> {
    /// Answers from the record already under the key: 422 for another request, 409 while it
    /// runs, and the stored response (or a not-replayable problem) once it completed.
    pub(super) fn answer_existing<B>(
        &self,
        record: Record,
        fingerprint: &Fingerprint,
    ) -> Response<ResponseBody<B>> {
        #[cfg(feature = "trace-origin")]
        if let Record::Completed(Completed {
            origin: Some(origin),
            ..
        }) = &record
        {
            show_origin(origin);
        }
        if record.fingerprint() != fingerprint {
            let detail = "this Idempotency-Key was used for a different request (method, path, query or body); \
                 use a new key for a new request";
            return self.problem(ProblemKind::Mismatch, detail);
        }
        match record {
            Record::InFlight(in_flight) => {
                let lease_end = whole_seconds(in_flight.lease_remaining);
                let retry_after = whole_seconds(self.config.retry_after).min(lease_end);
                let detail =
                    "a request with this Idempotency-Key is still being processed; retry later";
                let mut response =
                    self.problem_with(ProblemKind::InFlight, detail, Some(retry_after));
                // The run completes no earlier than now, and its record is kept a dedup window
                // from its completion: a retry before now plus the window is recognised (§8.7).
                self.stamp_retention(response.headers_mut());
                response
            }
            Record::Completed(Completed {
                response: Some(Payload::Sealed(sealed)),
                ..
            }) => {
                let err = format!(
                    "a sealed record (key {:?}) reached a layer whose store does not open it",
                    sealed.key_id
                );
                self.record_unreadable(&*Box::<dyn std::error::Error + Send + Sync>::from(err))
            }
            Record::Completed(Completed {
                response: Some(Payload::Plain(stored)),
                ..
            }) => {
                let (status, mut headers, body, trailers) = match Arc::try_unwrap(stored) {
                    // Decoded for this request (every store of the workspace decodes its bytes per
                    // claim, the memory store too): moved, not copied.
                    Ok(stored) => (stored.status, stored.headers, stored.body, stored.trailers),
                    // Still held elsewhere (a `ReplayCache`'s copy, or a store that keeps typed
                    // records): copied, with room for the marker.
                    Err(stored) => {
                        let mut headers = HeaderMap::with_capacity(stored.headers.len() + 1);
                        for (name, value) in &stored.headers {
                            headers.append(name, value.clone());
                        }
                        let trailers = stored.trailers.clone();
                        (stored.status, headers, stored.body.clone(), trailers)
                    }
                };
                headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                let trailers = trailers.map(Box::new);
                let mut response = Response::new(ResponseBody::with_trailers(body, trailers));
                *response.status_mut() = status;
                *response.headers_mut() = headers;
                finish(response, Outcome::Replayed)
            }
            Record::Completed(Completed { response: None, .. }) => {
                let detail = "the request with this Idempotency-Key completed, but its response could not be stored \
                     (too large, or it failed while it was produced), so it cannot be replayed";
                self.problem(ProblemKind::NotReplayable, detail)
            }
        }
    }

    /// The 500 of a record that cannot be opened or trusted: not replayed, and the request not run.
    /// Logged at ERROR once per interval, with why (never the record's contents or a key): it
    /// means tampering, a retired key, or a writer without the keys.
    pub(super) fn record_unreadable<B>(
        &self,
        err: &(dyn std::error::Error + Send + Sync + 'static),
    ) -> Response<ResponseBody<B>> {
        if let Some(held_back) = self.throttles.unreadable_records.admit() {
            tracing::error!(
                target: "tower_idempotency",
                error = %ErrorChain(err),
                held_back,
                "an idempotency record cannot be opened; it is not replayed and its request is not run"
            );
        }
        let detail = "the stored response for this Idempotency-Key cannot be read, so it is not replayed; \
             the request was not run again";
        self.problem(ProblemKind::RecordUnreadable, detail)
    }
}
