//! `ResponseFuture`: buffers the body, runs the attempts (tower's `Retry` under the overall
//! deadline), and reports how the response came about.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower::retry::Retry;
use tower::retry::future::ResponseFuture as RetryFuture;
use tower::timeout::Timeout;
use tower_service::Service;

use super::BoxError;
use super::error::Error;
use super::info::Attempts;
use super::policy::{AttemptPolicy, NotReplayable, RetentionPassed};
use tower_idempotency::IDEMPOTENT_REPLAYED;

/// What the future reports when the operation ends, and the bounds it runs within.
pub(crate) struct Operation {
    pub(crate) attempts: Arc<AtomicU32>,
    pub(crate) key: Option<HeaderValue>,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    pub(crate) body_limit: usize,
}

type Attempting<S> = Retry<AttemptPolicy, Timeout<S>>;

pin_project! {
    /// The future of [`IdempotentRetry`](super::IdempotentRetry): the response, with its
    /// [`Attempts`] in the extensions, or the [`Error`] of the last attempt.
    pub struct ResponseFuture<S, B, ResBody>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
        S: Clone,
        S::Error: Into<BoxError>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S, B, ResBody>,
        operation: Operation,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, ResBody>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
        S: Clone,
        S::Error: Into<BoxError>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        /// Reading the caller's body into memory, so that every attempt can send it.
        Buffering {
            #[pin]
            body: Collect<Limited<B>>,
            next: Option<(Parts, Attempting<S>)>,
        },
        /// The attempts and the waits between them.
        Sending {
            #[pin]
            attempts: tokio::time::Timeout<RetryFuture<AttemptPolicy, Timeout<S>, Request<Full<Bytes>>>>,
        },
    }
}

impl<S, B, ResBody> ResponseFuture<S, B, ResBody>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    pub(crate) fn new(request: Request<B>, retry: Attempting<S>, operation: Operation) -> Self {
        let (parts, body) = request.into_parts();
        Self {
            state: State::Buffering {
                body: Limited::new(body, operation.body_limit).collect(),
                next: Some((parts, retry)),
            },
            operation,
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B, ResBody>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResBody>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Buffering { body, next } => {
                    let body = match ready!(body.poll(cx)) {
                        Ok(collected) => collected.to_bytes(),
                        Err(err) if err.is::<LengthLimitError>() => {
                            let limit = this.operation.body_limit;
                            return Poll::Ready(Err(Error::BodyTooLarge { limit }));
                        }
                        Err(err) => return Poll::Ready(Err(Error::Body(err))),
                    };
                    let (parts, mut retry) = next.take().expect("polled after completion");
                    let request = Request::from_parts(parts, Full::new(body));
                    // `Retry::call` without `poll_ready`: the service is the one `IdempotentRetry`
                    // readied before its `call`.
                    let attempts =
                        tokio::time::timeout_at(this.operation.deadline, retry.call(request));
                    this.state.set(State::Sending { attempts });
                }
                StateProj::Sending { attempts } => {
                    let result = ready!(attempts.poll(cx));
                    return Poll::Ready(this.operation.finish(result));
                }
            }
        }
    }
}

impl Operation {
    /// The caller's answer: the response with its [`Attempts`], or the error with the count.
    fn finish<ResBody>(
        &self,
        result: Result<Result<Response<ResBody>, BoxError>, tokio::time::error::Elapsed>,
    ) -> Result<Response<ResBody>, Error> {
        let attempts = self.attempts.load(Ordering::SeqCst);
        let timed_out = || Error::TimedOut {
            attempts,
            elapsed: self.started.elapsed(),
        };
        match result {
            Ok(Ok(mut response)) => {
                let replayed = response
                    .headers()
                    .get(IDEMPOTENT_REPLAYED)
                    .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"));
                response.extensions_mut().insert(Attempts {
                    count: attempts,
                    replayed,
                    key: self.key.clone(),
                });
                Ok(response)
            }
            Ok(Err(err)) if err.is::<tower::timeout::error::Elapsed>() => Err(timed_out()),
            Ok(Err(err)) if err.is::<RetentionPassed>() => {
                let expires = err.downcast_ref::<RetentionPassed>().map(|passed| passed.0);
                match (self.key.clone(), expires) {
                    (Some(key), Some(expires)) => Err(Error::RetentionPassed {
                        key,
                        expires,
                        attempts,
                    }),
                    _ => Err(Error::Transport {
                        attempts,
                        source: err,
                    }),
                }
            }
            Ok(Err(err)) if err.is::<NotReplayable>() => match self.key.clone() {
                Some(key) => Err(Error::NotReplayable { key, attempts }),
                None => Err(Error::Transport {
                    attempts,
                    source: err,
                }),
            },
            Ok(Err(source)) => Err(Error::Transport { attempts, source }),
            // The overall deadline, during an attempt.
            Err(_) => Err(timed_out()),
        }
    }
}

impl<S, B, ResBody> fmt::Debug for ResponseFuture<S, B, ResBody>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("attempts", &self.operation.attempts.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}
