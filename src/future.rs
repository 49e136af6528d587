//! `ResponseFuture`: the future [`Idempotency`](crate::Idempotency) returns.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use tracing::instrument::Instrumented;

use crate::body::ResponseBody;
use crate::outcome::Outcome;

pub(crate) type Covered<B> = Pin<Box<dyn Future<Output = Response<ResponseBody<B>>> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// A request the layer does not protect polls the inner service's future directly; a protected
    /// one polls the layer's own work (buffering, claiming, replaying, or waiting for the detached
    /// handler). Dropping it never cancels a handler that has started: that runs to completion and
    /// its result is stored.
    pub struct ResponseFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B> {
        Passthrough { #[pin] future: F, outcome: Option<Outcome> },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Covered { future: Instrumented<Covered<B>> },
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(crate) fn passthrough(future: F, outcome: Option<Outcome>) -> Self {
        Self {
            kind: Kind::Passthrough { future, outcome },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn covered(future: Instrumented<Covered<B>>) -> Self {
        Self {
            kind: Kind::Covered { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future, outcome } => {
                let mut response = std::task::ready!(future.poll(cx))?.map(ResponseBody::inner);
                if let Some(outcome) = outcome.take() {
                    response.extensions_mut().insert(outcome);
                }
                Poll::Ready(Ok(response))
            }
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Covered { future } => Pin::new(future).poll(cx).map(Ok),
        }
    }
}

impl<F, B> fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Ready { .. } => "Ready",
            Kind::Covered { .. } => "Covered",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
