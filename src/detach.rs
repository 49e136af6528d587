//! Detached execution: a claimed request's work outlives its client, and shutdown waits for it.
//!
//! A claimed handler runs in its request's task; when the client goes away first, the rest of the
//! work moves to a task of its own ([`Detachable`]), so that its result is stored for the client's
//! retry. Store writes that failed are retried on tasks of their own. [`Background`] counts all of
//! that work, and [`Shutdown`] waits for it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TrackedFuture;
use tracing::Instrument;
use tracing::instrument::Instrumented;

/// The work a layer runs beyond its requests' lifetimes, counted for [`Shutdown`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Background {
    tracker: TaskTracker,
}

impl Background {
    /// Runs `work` in the current task (in the current span), moving it to a task of its own if
    /// the caller stops waiting before it finished. The work is boxed by the caller, so moving it
    /// is cheap.
    pub(crate) fn detachable<W>(&self, work: W) -> Detachable<TrackedFuture<Instrumented<W>>>
    where
        W: Future + Unpin + Send + 'static,
        W::Output: Send + 'static,
    {
        let work = self
            .tracker
            .track_future(work.instrument(tracing::Span::current()));
        Detachable { work: Some(work) }
    }

    /// Runs `work` on a task of its own (in the current span).
    pub(crate) fn spawn<W>(&self, work: W)
    where
        W: Future<Output = ()> + Send + 'static,
    {
        self.tracker
            .spawn(work.instrument(tracing::Span::current()));
    }

    pub(crate) fn shutdown(&self) -> Shutdown {
        Shutdown {
            tracker: self.tracker.clone(),
        }
    }
}

/// Waits for the layer's detached handler work; from
/// [`IdempotencyLayer::shutdown_handle`](crate::IdempotencyLayer::shutdown_handle).
#[derive(Debug, Clone)]
pub struct Shutdown {
    tracker: TaskTracker,
}

impl Shutdown {
    /// Waits until every handler the layer started has finished and its result is stored. Call it
    /// after the server stopped accepting requests, and bound it with `tokio::time::timeout`: a
    /// result whose store write failed is retried for as long as the store stays away.
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// How many detached tasks are running now: handlers whose client went away, and store writes
    /// being retried.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }
}

/// Work running in the current task, handed to a task of its own when dropped before it finished,
/// so that a client that goes away never cancels the work (its answer is then dropped).
pub(crate) struct Detachable<W>
where
    W: Future + Unpin + Send + 'static,
    W::Output: Send + 'static,
{
    work: Option<W>,
}

impl<W> Future for Detachable<W>
where
    W: Future + Unpin + Send + 'static,
    W::Output: Send + 'static,
{
    type Output = W::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<W::Output> {
        let Some(work) = self.work.as_mut() else {
            panic!("Detachable polled after completion");
        };
        let output = std::task::ready!(Pin::new(work).poll(cx));
        self.work = None;
        Poll::Ready(output)
    }
}

impl<W> Drop for Detachable<W>
where
    W: Future + Unpin + Send + 'static,
    W::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(work)),
                // No runtime to move it to: the runtime itself is going away with its tasks.
                Err(_) => tracing::warn!(
                    target: "tower_idempotency",
                    "dropped outside a tokio runtime: the detached work is lost; its claim's lease will run out"
                ),
            }
        }
    }
}

impl<W> fmt::Debug for Detachable<W>
where
    W: Future + Unpin + Send + 'static,
    W::Output: Send + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detachable")
            .field("running", &self.work.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work that finished in its request's task is done with: dropping its future hands nothing
    /// to a new task, and shutdown no longer counts it.
    #[tokio::test]
    async fn finished_work_is_not_handed_on() {
        let background = Background::default();
        let shutdown = background.shutdown();
        let work = background.detachable(Box::pin(async { 7 }));
        assert_eq!(shutdown.running(), 1);
        assert_eq!(work.await, 7);
        assert_eq!(shutdown.running(), 0, "finished work is counted no more");
    }

    /// Work whose caller stopped waiting goes on in a task of its own, counted until it ends.
    #[tokio::test]
    async fn unfinished_work_is_handed_to_a_task_of_its_own() {
        let background = Background::default();
        let shutdown = background.shutdown();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let work = background.detachable(Box::pin(async move {
            let _ = rx.await;
            let _ = done_tx.send(());
        }));
        drop(work);
        assert_eq!(shutdown.running(), 1, "the work goes on, counted");
        tx.send(()).expect("the work waits");
        done_rx
            .await
            .expect("the work ran to its end in a task of its own");
        shutdown.wait().await;
    }
}
