//! Claim: a protected request's body is read and fingerprinted and its key claimed; what the
//! store answers decides the rest (run the handler, answer from the record, or the store's
//! failure: fail open or closed).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response};
use http_body_util::LengthLimitError;
use tokio::time::Instant;

use super::body_reader::collect_limited;
use super::wait::Settled;
use super::{Claimed, Covered, Handler, ReadableBody, Shared, StorableBody};
use super::{finish, too_large, whole_seconds};
use crate::body::{RequestBody, ResponseBody};
use crate::error_chain::{ErrorChain, panic_message};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::outcome::Outcome;
use crate::problem::ProblemKind;
use crate::record::{InFlight, Record, RecordId};
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
            let fingerprint = config.fingerprint(&parts, &body);
            let claim = self.claim_or_wait(&id, &fingerprint).await;
            // Only a request that reaches the handler is put back together: a replay, a 409 or a
            // 422 answers without it.
            let request = move || {
                parts.extensions.insert(key);
                Request::from_parts(parts, RequestBody::buffered(body))
            };
            match claim {
                Ok(Claim::Claimed(token)) => {
                    let claimed = Claimed {
                        id,
                        token,
                        fingerprint,
                    };
                    self.run_claimed(inner, request(), claimed).await
                }
                Ok(Claim::Existing(record)) => self.answer_existing(record, &fingerprint),
                // A record is there: neither a store failure (fail-open would run the request
                // over it) nor anything to replay.
                Err(StoreError::Unreadable(err)) => self.record_unreadable(&*err),
                // Past its quota, a request is never run unprotected: it would count for nothing.
                Err(StoreError::QuotaExceeded { retry_after }) => self.quota_exceeded(retry_after),
                // The breaker logs its own changes: no warning per request.
                Err(StoreError::CircuitOpen { .. }) if config.fail_open => {
                    self.run_unprotected(inner, request()).await
                }
                Err(StoreError::CircuitOpen { retry_after }) => self.circuit_open(retry_after),
                // A record is there that this release cannot decode (a newer release's kind, or
                // damage): not a store failure, so never run over it, fail-open or not; a 503, as
                // an instance that reads it may answer the retry.
                Err(err @ StoreError::Codec(_)) => {
                    self.warn_of_store_failure(&err, Outcome::StoreUnavailable);
                    self.store_unavailable(err)
                }
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

    /// Claims `id`, waiting (when the layer waits) while the same request is in flight: returns
    /// the claim, or the record to answer from. Past `deadline`, the in-flight record, with the
    /// lease that is left.
    pub(super) async fn claim_or_wait(
        self: &Arc<Self>,
        id: &RecordId,
        fingerprint: &Fingerprint,
    ) -> Result<Claim, StoreError> {
        // When the wait started, and its bound (the clock is read only when waiting is on).
        let wait = self.config.wait.map(|bound| (Instant::now(), bound));
        loop {
            let claim = self.store.claim(id, fingerprint, self.config.lease).await?;
            let (Some((started, bound)), Claim::Existing(Record::InFlight(in_flight))) =
                (wait, &claim)
            else {
                return Ok(claim);
            };
            if in_flight.fingerprint != *fingerprint {
                return Ok(claim);
            }
            tracing::debug!(target: "tower_idempotency", "waiting for the request in flight");
            // Boxed: the wait is opt-in and rare, and its state would otherwise be carried in
            // every request's future.
            let waited = Box::pin(self.wait_on(id, fingerprint, started + bound)).await;
            match waited {
                Some(Settled::Record(record)) => return Ok(Claim::Existing(record)),
                Some(Settled::Free) => continue,
                None => {
                    let lease_remaining =
                        in_flight.lease_remaining.saturating_sub(started.elapsed());
                    return Ok(Claim::Existing(Record::InFlight(InFlight {
                        fingerprint: *fingerprint,
                        lease_remaining,
                    })));
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
        self.problem_with(ProblemKind::StoreUnavailable, detail, retry_after)
    }

    /// The 503 of a request that the open circuit breaker kept from the store: `left` is the
    /// cool-down left (zero while a probe runs).
    fn circuit_open<B>(&self, left: Duration) -> Response<ResponseBody<B>> {
        let detail = "the idempotency store has been failing, so this request was not sent to it \
             and was not run; retry after the time given, with the same key";
        let retry_after = Some(whole_seconds(left));
        let (response, _) =
            self.unfinished_problem(ProblemKind::StoreUnavailable, detail, retry_after);
        finish(response, Outcome::CircuitOpen)
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
            self.problem(ProblemKind::HandlerFailed, "the request failed")
        })
    }
}
