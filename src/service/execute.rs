//! Execute and persist: a claimed request's handler runs under a renewed lease (detached from its
//! client if the client goes away), then its result is stored, or its claim released, before the
//! answer goes out; a failed write is retried in the background.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::FutureExt;
use http::{Request, Response};

use super::capture::{Handled, capture, replayable_headers};
use super::{Claimed, Handler, Shared, StorableBody, finish, whole_seconds};
use crate::body::{RequestBody, ResponseBody};
use crate::error_chain::{ErrorChain, panic_message};
use crate::held_claim::{CheckHeld, HeldClaim};
use crate::lease;
use crate::outcome::Outcome;
use crate::problem::ProblemKind;
use crate::record::{ClaimToken, Completed, Payload, RecordId, StoredResponse, TraceOrigin};
use crate::store::{Store, StoreError};

impl<St: Store> Shared<St> {
    /// Runs a claimed request to its answer. The handler runs in this request's task; if the
    /// client goes away first, the rest of the work moves to a task of its own, so the handler
    /// still runs to completion and its result is stored for the client's retry.
    pub(super) fn run_claimed<S, ReqBody, ResBody>(
        self: Arc<Self>,
        inner: S,
        request: Request<RequestBody<ReqBody>>,
        claimed: Claimed,
    ) -> impl Future<Output = Response<ResponseBody<ResBody>>> + Send + 'static
    where
        S: Handler<ReqBody, ResBody>,
        ReqBody: Send + 'static,
        ResBody: StorableBody,
    {
        // The handler's work and what follows it are boxed apart: each box stays under 1 KiB,
        // which allocators serve from their fast per-thread caches, where one box of both would
        // not be.
        let mut request = request;
        // Taken here, in the request's span, and kept as a pointer: the boxes below stay small.
        #[cfg(feature = "trace-origin")]
        let origin = self.origin_of(request.headers()).map(Arc::new);
        #[cfg(not(feature = "trace-origin"))]
        let origin = None;
        let held = HeldClaim::new(claimed.id, claimed.token, self.clone());
        request.extensions_mut().insert(held);
        (self.store).prepare(&claimed.id, &claimed.token, request.extensions_mut());
        let work = Box::pin(self.clone().run(inner, request));
        let execute = Box::pin(self.clone().execute(work, claimed, origin));
        self.background.detachable(execute)
    }

    /// Calls the handler and reads its response.
    async fn run<S, ReqBody, ResBody>(
        self: Arc<Self>,
        mut inner: S,
        request: Request<RequestBody<ReqBody>>,
    ) -> Result<Handled<ResBody>, String>
    where
        S: Handler<ReqBody, ResBody>,
        ResBody: StorableBody,
    {
        let response = inner.call(request).await.map_err(|err| err.to_string())?;
        Ok(capture(&self.config, response).await)
    }

    /// Runs a claimed request's work to completion, renewing the lease meanwhile, then stores or
    /// releases. An `async` block, not an `async fn`, for the reason `protect` gives.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would keep a second copy of its arguments in its state"
    )]
    fn execute<W, ResBody: StorableBody>(
        self: Arc<Self>,
        work: Pin<Box<W>>,
        claimed: Claimed,
        origin: Option<Arc<TraceOrigin>>,
    ) -> impl Future<Output = Response<ResponseBody<ResBody>>>
    where
        W: Future<Output = Result<Handled<ResBody>, String>>,
    {
        async move {
            let config = &self.config;
            let result = self
                .held(&claimed)
                .renewing(AssertUnwindSafe(work).catch_unwind())
                .await;

            // What to store (a response, or `None` for a tombstone) and what to answer, or why the
            // claim is released instead. The answer's outcome is counted once the write decided
            // it: a completion that does not commit answers otherwise.
            let (stored, response) = match result {
                Ok(Ok(Handled::Buffered(mut parts, body, trailers))) => {
                    self.stamp_retention(&mut parts.headers);
                    let stored = StoredResponse {
                        status: parts.status,
                        headers: replayable_headers(&parts.headers, config.keep_set_cookie),
                        body: body.clone(),
                        trailers: trailers.as_deref().cloned(),
                    };
                    let body = ResponseBody::with_trailers(body, trailers);
                    let response = Response::from_parts(parts, body);
                    (Some(Arc::new(stored)), (response, Outcome::Executed))
                }
                Ok(Ok(Handled::Unstorable(mut response))) => {
                    self.stamp_retention(response.headers_mut());
                    (None, (response, Outcome::Executed))
                }
                Ok(Ok(Handled::BodyFailed(err))) => {
                    // The handler ran: keep a tombstone so a retry does not run it again.
                    tracing::error!(
                        target: "tower_idempotency",
                        error = %err,
                        "the response body failed while it was read; keeping a tombstone"
                    );
                    let detail = "the response failed while it was produced; the operation may have completed, \
                         so a retry with this key will not run it again";
                    let problem = self.unfinished_problem(ProblemKind::HandlerFailed, detail, None);
                    (None, problem)
                }
                Ok(Ok(Handled::NotStored(response))) => {
                    let response = finish(response.map(ResponseBody::inner), Outcome::NotStored);
                    return self.release(&claimed, response).await;
                }
                Ok(Ok(Handled::Declined(response))) => {
                    let response = finish(response, Outcome::NotStored);
                    return self.release(&claimed, response).await;
                }
                Ok(Err(err)) => {
                    let failure = format!("the handler failed: {err}");
                    return self.fail(&claimed, failure).await;
                }
                Err(panic) => {
                    let failure = format!("the handler panicked: {}", panic_message(&*panic));
                    return self.fail(&claimed, failure).await;
                }
            };
            // Boxed: held across the store's write, it would carry a record's fields in this
            // future's state, which then outgrows the allocator's per-thread cache (1 KiB).
            let completed = Box::new(Completed {
                fingerprint: claimed.fingerprint,
                response: stored.map(Payload::Plain),
                origin,
            });
            self.complete(&claimed, completed, response).await
        }
    }

    /// States when the record about to be written expires, if the retention header is on: a
    /// dedup window from now. On a `409` in flight, the earliest its record can expire.
    pub(super) fn stamp_retention(&self, headers: &mut http::HeaderMap) {
        if let Some(retention) = &self.config.retention {
            retention.stamp(headers, self.config.dedup_window);
        }
    }

    /// The handler failed or panicked: a 500 problem, and the claim is released.
    async fn fail<B>(
        self: &Arc<Self>,
        claimed: &Claimed,
        failure: String,
    ) -> Response<ResponseBody<B>> {
        tracing::error!(target: "tower_idempotency", error = %failure, "releasing the claim");
        let detail = "the request failed; it was not stored, and a retry runs it again";
        let response = self.problem(ProblemKind::HandlerFailed, detail);
        self.release(claimed, response).await
    }

    /// Stores the result, then answers: after the write, so that a retry that follows the response
    /// finds it. A failed write answers at once and is retried on a task of its own. A completion
    /// whose transaction did not commit took the handler's writes in it along, and is not
    /// retried: the client is told so, and whether sending it again can help
    /// ([`StoreError::Aborted`], a 503 to retry with the same key) or not
    /// ([`StoreError::Rejected`], a 422).
    async fn complete<B>(
        self: &Arc<Self>,
        claimed: &Claimed,
        completed: Box<Completed>,
        (response, outcome): (Response<ResponseBody<B>>, Outcome),
    ) -> Response<ResponseBody<B>> {
        let ttl = self.config.dedup_window;
        let Claimed { id, token, .. } = claimed;
        let written = self.store.complete(id, token, &completed, ttl).await;
        self.notify_waiters(id);
        if let Err(StoreError::Rejected(err)) = &written {
            tracing::error!(
                target: "tower_idempotency",
                error = %ErrorChain(&**err),
                "the handler's transaction was rejected at commit; its writes were rolled back and the claim released"
            );
            let detail = "the request's changes were rejected when they were committed (they conflict with \
                 data the server holds, or are invalid), so nothing was done; the key is free \
                 again, and the same request is rejected the same way until that data changes";
            return self.problem(ProblemKind::CommitRejected, detail);
        }
        if let Err(StoreError::Aborted(err)) = &written {
            tracing::error!(
                target: "tower_idempotency",
                error = %ErrorChain(&**err),
                "the handler's transaction did not commit with its record; answering that it rolled back"
            );
            // Only the writes in the transaction are known to be undone: a call the handler made
            // to another service (a payment provider) may have happened, and its retry learns it.
            let detail = "the request's writes could not be committed with its idempotency record \
                 and were rolled back; anything it did outside that transaction may have happened: \
                 retry with the same key to learn the outcome";
            let retry_after = Some(whole_seconds(self.config.retry_after));
            return self.problem_with(ProblemKind::StoreUnavailable, detail, retry_after);
        }
        self.after_write(claimed, Some(*completed), written);
        finish(response, outcome)
    }

    /// Releases the claim, then answers, like [`Shared::complete`].
    async fn release<B>(self: &Arc<Self>, claimed: &Claimed, response: Response<B>) -> Response<B> {
        let released = self.store.release(&claimed.id, &claimed.token).await;
        self.notify_waiters(&claimed.id);
        self.after_write(claimed, None, released);
        response
    }

    /// Logs a lost claim, and hands a failed write (a completion, or a release when `completed` is
    /// `None`) to a task that retries it: a completion for as long as the claim can still be ours
    /// (up to the dedup window), a release for up to a lease.
    fn after_write(
        self: &Arc<Self>,
        claimed: &Claimed,
        completed: Option<Completed>,
        written: Result<bool, StoreError>,
    ) {
        let what = if completed.is_some() {
            "complete"
        } else {
            "release"
        };
        match written {
            Ok(true) => {}
            Ok(false) => lease::not_written(what),
            Err(err) => {
                tracing::warn!(
                    target: "tower_idempotency",
                    operation = what,
                    error = %ErrorChain(&err),
                    "store write failed; answering now and retrying the write"
                );
                let (shared, claimed) = (self.clone(), *claimed);
                let retry = async move {
                    let held = shared.held(&claimed);
                    let (store, Claimed { id, token, .. }) = (&shared.store, &claimed);
                    match &completed {
                        Some(done) => {
                            let ttl = shared.config.dedup_window;
                            held.complete_with(ttl, 1, || store.complete(id, token, done, ttl))
                                .await
                        }
                        None => held.release_with(1, || store.release(id, token)).await,
                    };
                };
                self.background.spawn(retry);
            }
        }
    }
}

/// A handler's [`HeldClaim`] asks through the service's store, with the layer's lease: asking
/// renews it.
impl<St: Store> CheckHeld for Shared<St> {
    fn still_held<'a>(
        &'a self,
        id: &'a RecordId,
        token: &'a ClaimToken,
    ) -> Pin<Box<dyn Future<Output = Result<bool, StoreError>> + Send + 'a>> {
        Box::pin(self.store.renew(id, token, self.config.lease))
    }
}
