//! Claim and replay: a protected request's body is read and fingerprinted, its key claimed, and
//! an existing record answered from (a replay, a 409 or a 422) without running the handler.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::LengthLimitError;

use super::body_reader::collect_limited;
use super::{Covered, Handler, IDEMPOTENT_REPLAYED, ReadableBody, Shared, StorableBody};
use super::{finish, too_large, whole_seconds};
use crate::body::{RequestBody, ResponseBody};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::outcome::Outcome;
use crate::problem::ProblemKind;
use crate::record::{Completed, Payload, Record, RecordId};
use crate::report::{ErrorChain, panic_message};
use crate::store::{Claim, Store, StoreError};

impl<St: Store> Shared<St> {
    /// Buffers and fingerprints a request with a key, claims the key, and answers from the record
    /// or runs the handler.
    ///
    /// An `async` block rather than an `async fn`: an `async fn` keeps a second copy of its
    /// arguments (the request's parts are over 200 bytes) in its state, and this state is boxed
    /// once per request, where a box over 1 KiB misses the allocator's per-thread cache.
    pub(super) fn protect<S, ReqBody, ResBody>(
        self: Arc<Self>,
        inner: S,
        parts: http::request::Parts,
        body: ReqBody,
        key: IdempotencyKey,
        id: RecordId,
    ) -> impl Future<Output = Response<ResponseBody<ResBody>>>
    where
        S: Handler<ReqBody, ResBody>,
        ReqBody: ReadableBody,
        ResBody: StorableBody,
    {
        let mut parts = parts;
        async move {
            let config = &self.config;
            let body = match collect_limited(body, config.request_body_limit).await {
                Ok(body) => body,
                Err(err) if err.is::<LengthLimitError>() => {
                    return self.problem(ProblemKind::BodyTooLarge, too_large(config));
                }
                Err(err) => {
                    let detail = format!("the request body could not be read: {err}");
                    return self.problem(ProblemKind::BodyUnreadable, detail);
                }
            };
            let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
            let allow_listed = &config.fingerprint_headers;
            let fingerprint = config
                .canonical_json
                .then(|| Fingerprint::of_json(method, uri, headers, allow_listed, &body))
                .flatten()
                .unwrap_or_else(|| Fingerprint::of(method, uri, headers, allow_listed, &body));
            let claim = self.claim_or_wait(&id, &fingerprint).await;
            // Only a request that reaches the handler is put back together: a replay, a 409 or a
            // 422 answers without it.
            let request = move || {
                parts.extensions.insert(key);
                Request::from_parts(parts, RequestBody::buffered(body))
            };
            match claim {
                Ok(Claim::Claimed(token)) => {
                    self.run_claimed(inner, request(), id, token, fingerprint)
                        .await
                }
                Ok(Claim::Existing(record)) => self.answer_existing(record, &fingerprint),
                // A record is there: neither a store failure (fail-open would run the request
                // over it) nor anything to replay.
                Err(StoreError::Unreadable(err)) => self.record_unreadable(&*err),
                Err(err) if config.fail_open => {
                    self.warn_of_store_failure(&err, Outcome::FailedOpen);
                    self.run_unprotected(inner, request()).await
                }
                Err(err) => {
                    self.warn_of_store_failure(&err, Outcome::StoreUnavailable);
                    self.store_unavailable(err)
                }
            }
        }
    }

    /// Warns of a claim-time store failure, once per interval: it repeats with every request for
    /// as long as the store is away or full.
    fn warn_of_store_failure(&self, err: &StoreError, outcome: Outcome) {
        let Some(held_back) = self.throttles.store_failures.admit() else {
            return;
        };
        let message = if outcome == Outcome::FailedOpen {
            "idempotency store failed; running requests without protection (fail-open)"
        } else {
            "idempotency store failed at claim time; refusing requests (fail-closed)"
        };
        tracing::warn!(
            target: "tower_idempotency",
            %outcome,
            error = %ErrorChain(err),
            held_back,
            "{message}"
        );
    }

    /// The 500 of a record that cannot be opened or trusted: not replayed, and the request not run.
    /// Logged at ERROR once per interval, with why (never the record's contents or a key): it
    /// means tampering, a retired key, or a writer without the keys.
    fn record_unreadable<B>(
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
        let detail = String::from(
            "the stored response for this Idempotency-Key cannot be read, so it is not replayed; \
             the request was not run again",
        );
        self.problem(ProblemKind::RecordUnreadable, detail)
    }

    /// The 503 of a claim the store failed or refused: the request was not run.
    fn store_unavailable<B>(&self, err: StoreError) -> Response<ResponseBody<B>> {
        let config = &self.config;
        let (detail, retry_after) = match err {
            StoreError::Full { retry_after } => (
                "the idempotency store has no room for this request's record; the request was \
                 not run",
                retry_after.unwrap_or(config.retry_after),
            ),
            _ => (
                "the idempotency store is unavailable; the request was not run",
                config.retry_after,
            ),
        };
        let retry_after = Some(whole_seconds(retry_after));
        self.problem_with(ProblemKind::StoreUnavailable, detail.into(), retry_after)
    }

    /// Runs a request without protection (fail-open), turning a failure into a 500 problem. Boxed,
    /// so that the inner service's future does not swell every protected request's future.
    fn run_unprotected<S, ReqBody, ResBody>(
        self: Arc<Self>,
        mut inner: S,
        request: Request<RequestBody<ReqBody>>,
    ) -> Covered<ResBody>
    where
        S: Handler<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: Send + 'static,
    {
        Box::pin(async move {
            let run = AssertUnwindSafe(inner.call(request)).catch_unwind().await;
            let failure = match run {
                Ok(Ok(response)) => {
                    return finish(response.map(ResponseBody::inner), Outcome::FailedOpen);
                }
                Ok(Err(err)) => format!("the handler failed: {err}"),
                Err(panic) => format!("the handler panicked: {}", panic_message(&*panic)),
            };
            tracing::error!(target: "tower_idempotency", error = %failure, "the unprotected request failed");
            self.problem(
                ProblemKind::HandlerFailed,
                String::from("the request failed"),
            )
        })
    }

    /// Answers from the record already under the key: 422 for another request, 409 while it
    /// runs, and the stored response (or a not-replayable problem) once it completed.
    fn answer_existing<B>(
        &self,
        record: Record,
        fingerprint: &Fingerprint,
    ) -> Response<ResponseBody<B>> {
        if record.fingerprint() != fingerprint {
            let detail = String::from(
                "this Idempotency-Key was used for a different request (method, path, query or body); \
                 use a new key for a new request",
            );
            return self.problem(ProblemKind::Mismatch, detail);
        }
        match record {
            Record::InFlight(in_flight) => {
                let lease_end = whole_seconds(in_flight.lease_remaining);
                let retry_after = whole_seconds(self.config.retry_after).min(lease_end);
                let detail = String::from(
                    "a request with this Idempotency-Key is still being processed; retry later",
                );
                self.problem_with(ProblemKind::InFlight, detail, Some(retry_after))
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
                    // Decoded for this request (a shared store): moved, not copied.
                    Ok(stored) => (stored.status, stored.headers, stored.body, stored.trailers),
                    // Shared with the store (the memory store): copied, with room for the marker.
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
                let detail = String::from(
                    "the request with this Idempotency-Key completed, but its response could not be stored \
                     (too large, or it failed while it was produced), so it cannot be replayed",
                );
                self.problem(ProblemKind::NotReplayable, detail)
            }
        }
    }
}
