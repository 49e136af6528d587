//! Commands from concurrent requests, sent to Redis together.
//!
//! Each request's command would otherwise be its own write to the socket and its own read by
//! Redis: on a busy server, most of a round trip's cost is those system calls, on both sides.
//! Commands queued while other requests are still being polled go out as one pipeline instead:
//! one write, one read by Redis, one reply read back. Order is kept: a command queued after
//! another is sent after it.
//!
//! A command sent while nothing else is on its way to Redis goes out at once, on its own, from
//! its caller's task: with nothing to batch it with, the batch's task and its yield would only
//! add work and a scheduler turn. Once a command or a batch is on its way, the next commands queue
//! for a batch, as above.
//!
//! A claim whose caller stops waiting (its timeout, or its client went away and the request was
//! dropped) may still claim its key. The pipeline then releases that claim, fenced by its token,
//! behind the claim on the same connection, so the key is not held for a request that
//! will never run until its lease runs out. A command whose caller is gone before it is sent is
//! not sent at all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::Poll;
use std::time::Duration;

use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::{self, Cmd, RedisError, RedisResult, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::calls::claimed_fence;
use tower_idempotency::record::ClaimToken;

/// How long a release behind an abandoned claim waits for its answer (nobody else waits for it).
const RELEASE_BOUND: Duration = Duration::from_secs(30);

/// A claim's Redis key and token: what releasing it takes.
pub(super) type ClaimRef = (String, ClaimToken);

/// The commands waiting for the next pipeline.
#[derive(Default)]
pub(super) struct Batch {
    queue: Mutex<Vec<Queued>>,
    /// Commands sent on their own and batches started (from their first command queued) whose
    /// answers have not arrived.
    on_the_way: AtomicUsize,
}

/// A command or batch on its way to Redis, counted until it is dropped.
pub(super) struct OnTheWay<'a>(&'a AtomicUsize);

impl Drop for OnTheWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Queued {
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
    /// For a claim's `SET`: the claim to release if its caller stops waiting.
    claim: Option<ClaimRef>,
}

/// A batch taken from the queue, ready to be sent.
pub(super) struct Pipeline {
    pipe: redis::Pipeline,
    replies: Vec<oneshot::Sender<RedisResult<Value>>>,
    claims: Vec<Option<ClaimRef>>,
}

impl Batch {
    /// Counts a command to be sent on its own, if nothing else is on its way: it would have no
    /// company in a batch.
    pub(super) fn alone(&self) -> Option<OnTheWay<'_>> {
        (self.on_the_way.load(Ordering::Acquire) == 0).then(|| self.count())
    }

    fn count(&self) -> OnTheWay<'_> {
        self.on_the_way.fetch_add(1, Ordering::AcqRel);
        OnTheWay(&self.on_the_way)
    }

    /// The count of the batch that [`Batch::push`] started (its first command), for the task that
    /// sends it to hold until the answers arrive.
    pub(super) fn started(&self) -> OnTheWay<'_> {
        OnTheWay(&self.on_the_way)
    }

    /// Queues `cmd`. Returns where its answer will arrive, and whether it is the first of a new
    /// batch, which is then counted as on its way: the caller starts the task that takes and
    /// sends the batch, and holds [`Batch::started`].
    pub(super) fn push(
        &self,
        cmd: Cmd,
        claim: Option<ClaimRef>,
    ) -> (oneshot::Receiver<RedisResult<Value>>, bool) {
        let (reply, answer) = oneshot::channel();
        let mut queue = self.lock();
        queue.push(Queued { cmd, reply, claim });
        let first = queue.len() == 1;
        if first {
            self.on_the_way.fetch_add(1, Ordering::AcqRel);
        }
        (answer, first)
    }

    /// Takes every queued command whose caller still waits, in order.
    pub(super) fn take(&self) -> Pipeline {
        let queued = {
            let mut queue = self.lock();
            // The next batch is likely about as large: spare it the regrowth.
            let capacity = queue.len();
            std::mem::replace(&mut *queue, Vec::with_capacity(capacity))
        };
        let mut pipe = redis::Pipeline::with_capacity(queued.len());
        // Each command gets its own answer, errors included, rather than the first error for all.
        pipe.ignore_errors();
        let mut replies = Vec::with_capacity(queued.len());
        let mut claims = Vec::with_capacity(queued.len());
        for Queued { cmd, reply, claim } in queued {
            if reply.is_closed() {
                continue;
            }
            pipe.add_command(cmd);
            replies.push(reply);
            claims.push(claim);
        }
        Pipeline {
            pipe,
            replies,
            claims,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Queued>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Pipeline {
    /// Answers every command with the error that kept the batch from being sent (nothing was
    /// sent, so nothing was claimed): each call fails as it would have alone. Returns it.
    pub(super) fn fail(self, err: RedisError) -> RedisError {
        for reply in self.replies {
            let _ = reply.send(Err(err.clone()));
        }
        err
    }

    /// Sends the batch, answered by `deadline`, and hands each command its answer (or the error
    /// that failed the batch), releasing (with `release`, the fenced release script) the claims
    /// whose callers stopped waiting. Returns the error that failed the whole batch, for the
    /// caller to act on.
    pub(super) async fn send(
        self,
        connection: MultiplexedConnection,
        deadline: Instant,
        release: &'static str,
    ) -> Option<RedisError> {
        let Self {
            pipe,
            mut replies,
            mut claims,
        } = self;
        if replies.is_empty() {
            return None;
        }
        let mut sending = connection.clone();
        let query = tokio::time::timeout_at(
            deadline,
            pipe.query_async::<Vec<RedisResult<Value>>>(&mut sending),
        );
        let answers = {
            let mut query = std::pin::pin!(query);
            loop {
                let event = std::future::poll_fn(|cx| {
                    // The pipeline first: it is on the connection before any release.
                    if let Poll::Ready(answers) = query.as_mut().poll(cx) {
                        return Poll::Ready(Event::Answered(answers));
                    }
                    // A claim whose caller stopped waiting. Each open claim's channel holds this
                    // task's waker, rather than a future of its own per claim.
                    for (i, reply) in replies.iter_mut().enumerate() {
                        if claims[i].is_some() && reply.poll_closed(cx).is_ready() {
                            return Poll::Ready(Event::Left(i));
                        }
                    }
                    Poll::Pending
                })
                .await;
                match event {
                    Event::Answered(answers) => break answers,
                    Event::Left(i) => {
                        if let Some(claim) = claims[i].take() {
                            release_behind(&connection, claim, release);
                        }
                    }
                }
            }
        };
        let failure = match answers {
            Ok(Ok(answers)) if answers.len() == replies.len() => {
                for ((reply, claim), answer) in replies.into_iter().zip(claims).zip(answers) {
                    // The claim script answers with the record now under the key: this
                    // claim's when it carries the claim's token.
                    let claimed = claim.as_ref().is_some_and(|(_, token)| {
                        matches!(&answer, Ok(Value::BulkString(record))
                            if claimed_fence(record, token).is_some())
                    });
                    if reply.send(answer).is_err()
                        && claimed
                        && let Some(claim) = claim
                    {
                        release_behind(&connection, claim, release);
                    }
                }
                return None;
            }
            Ok(Ok(answers)) => RedisError::from((
                redis::ErrorKind::Parse,
                "a pipeline's answer count does not match its commands",
                format!("{} commands, {} answers", replies.len(), answers.len()),
            )),
            Ok(Err(err)) => err,
            Err(_) => RedisError::from(super::calls::io_timeout()),
        };
        // Nobody will run these claims (their callers answer 503): release them behind the SETs.
        for (reply, claim) in replies.into_iter().zip(claims) {
            let _ = reply.send(Err(failure.clone()));
            if let Some(claim) = claim {
                release_behind(&connection, claim, release);
            }
        }
        Some(failure)
    }
}

/// What a pipeline in flight waits for next.
enum Event<A> {
    /// Redis answered the pipeline (or its deadline passed).
    Answered(A),
    /// The caller of the claim at this index stopped waiting.
    Left(usize),
}

/// The fenced release of `claim` as one `EVAL` of the release script's `source`: it needs no
/// script cache, so it is one command wherever it is sent.
pub(super) fn release_eval(source: &str, (key, token): ClaimRef) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(source)
        .arg(1)
        .arg(key)
        .arg(token.as_bytes().as_slice());
    cmd
}

/// Releases a claim sent on its own behind its `SET`, on the same connection, when dropped armed:
/// its caller stopped waiting, the call failed with the `SET` perhaps run, or too few replicas
/// acknowledged it.
pub(super) struct ReleaseBehind<C: ConnectionLike + Clone + Send + 'static> {
    connection: C,
    claim: Option<ClaimRef>,
    release: &'static str,
}

impl<C: ConnectionLike + Clone + Send + 'static> ReleaseBehind<C> {
    pub(super) fn new(connection: &C, claim: ClaimRef, release: &'static str) -> Self {
        Self {
            connection: connection.clone(),
            claim: Some(claim),
            release,
        }
    }

    /// The caller has the answer: nothing to release.
    pub(super) fn disarm(mut self) {
        self.claim = None;
    }
}

impl<C: ConnectionLike + Clone + Send + 'static> Drop for ReleaseBehind<C> {
    fn drop(&mut self) {
        // Without a runtime the release cannot be sent: the claim's lease runs out instead.
        if let Some(claim) = self.claim.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            release_behind(&self.connection, claim, self.release);
        }
    }
}

/// Releases `claim` on `connection`, behind the pipeline that sent its `SET`. `EVAL`, not
/// `EVALSHA`: a `NOSCRIPT` fallback would be a second, later command. Fenced by the claim's token,
/// the release does nothing where the `SET` did not claim.
fn release_behind<C: ConnectionLike + Clone + Send + 'static>(
    connection: &C,
    (key, token): ClaimRef,
    release: &'static str,
) {
    let mut connection = connection.clone();
    let cmd = release_eval(release, (key, token));
    tokio::spawn(async move {
        let _ = tokio::time::timeout(RELEASE_BOUND, cmd.query_async::<i64>(&mut connection)).await;
    });
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};
    use std::time::SystemTime;

    use deadpool_redis::redis::aio::MultiplexedConnection;
    use test_servers::redis_server::RedisServer;
    use tower_idempotency::record::{Fence, Fingerprint, layout};

    use super::*;
    use crate::scripts::{CLAIM, Lua, RELEASE};

    /// How long a claim's lease runs here: far longer than any test, so a key still claimed at
    /// the end was never released.
    const LEASE_MS: &str = "30000";

    /// A server with the claim script loaded (the store's claims name it by its hash), and a
    /// multiplexed connection to it, as the store keeps one.
    async fn server() -> (RedisServer, MultiplexedConnection) {
        let server = RedisServer::start();
        let loaded = server.command(&["SCRIPT", "LOAD", CLAIM]);
        assert_eq!(loaded.as_string(), Some(Lua::new(CLAIM).hash));
        let client = redis::Client::open(server.url()).expect("a valid url");
        let connection = client
            .get_multiplexed_async_connection()
            .await
            .expect("a connection");
        (server, connection)
    }

    /// The claim script's command on `key`, as the store builds it, and the claim to release.
    fn claim(key: &str) -> (Cmd, ClaimRef) {
        let token = ClaimToken::new(Fence::new(0));
        let record =
            layout::in_flight(&token, &Fingerprint::from_bytes([7; 32]), SystemTime::now());
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(Lua::new(CLAIM).hash)
            .arg(1)
            .arg(key)
            .arg(record)
            .arg(LEASE_MS);
        (cmd, (key.to_owned(), token))
    }

    /// Polls `future` once, as its task would when woken.
    async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    }

    /// Whether `key` still holds a record after `bound` (false as soon as it holds none): a
    /// release behind is sent by a task of its own, and lands a moment after the pipeline's
    /// answer.
    async fn still_claimed(server: &RedisServer, key: &str, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        loop {
            if server.command(&["EXISTS", key]).as_integer() == Some(0) {
                return false;
            }
            if Instant::now() >= deadline {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A caller that leaves just as its claim's answer arrives (its request dropped, or its
    /// timeout passed, between the batch task's last look at it and the answer) is found gone as
    /// the answer is handed over; its claim is released behind it all the same (PROTOCOL.md
    /// §10.6), or the key stays claimed by nobody for a whole lease and every retry gets a 409.
    /// Redis is paused until the caller has left, and the batch task is polled by hand: its next
    /// look comes once both happened.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_whose_caller_left_as_its_answer_arrived_is_released() {
        let (server, connection) = server().await;
        let batch = Batch::default();
        let (cmd, claimed) = claim("left-at-the-answer");
        let (answer, _) = batch.push(cmd, Some(claimed));
        let deadline = Instant::now() + Duration::from_secs(5);
        let send = batch.take().send(connection.clone(), deadline, RELEASE);
        let mut send = std::pin::pin!(send);
        server.pause();
        let first = poll_once(send.as_mut()).await;
        assert!(first.is_pending(), "the pipeline is on its way: {first:?}");
        drop(answer);
        server.resume();
        // Redis answers in order: once a `PING` sent behind the pipeline is answered, so is it.
        let pong: String = redis::cmd("PING")
            .query_async(&mut connection.clone())
            .await
            .expect("PONG");
        assert_eq!(pong, "PONG");
        let next = poll_once(send.as_mut()).await;
        assert!(
            matches!(next, Poll::Ready(None)),
            "the batch task's next look finds the answer: {next:?}"
        );
        assert!(
            !still_claimed(&server, "left-at-the-answer", Duration::from_secs(2)).await,
            "§10.6: the claim of a caller that left is released behind it"
        );
    }

    /// The claim whose caller left while the batch waited for its connection is released
    /// behind the pipeline (PROTOCOL.md §10.6), never before it: a release that reaches Redis
    /// first finds nothing, and the claim then holds its key for a whole lease, every retry
    /// getting a 409. The batch task may be held up at any moment (the OS, a busy worker); here
    /// it is held right after it handed out that release, until Redis ran it: the pipeline must
    /// be on the connection by then.
    ///
    /// The hold is a waker whose drop waits for the release: the channel of the claim still
    /// waited for holds it, and the batch task replaces it with its own at its first look at
    /// that claim, after its look at the one whose caller left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_behind_reaches_redis_after_its_claim() {
        let (server, connection) = server().await;
        let batch = Batch::default();
        let (cmd, claimed) = claim("left");
        let (gone, _) = batch.push(cmd, Some(claimed));
        let (cmd, claimed) = claim("waiting");
        let (answer, _) = batch.push(cmd, Some(claimed));
        let mut pipeline = batch.take();
        drop(gone);
        let client = redis::Client::open(server.url()).expect("a valid url");
        let hold = Waker::from(Arc::new(HoldUntilReleased(client)));
        assert!(
            pipeline.replies[1]
                .poll_closed(&mut Context::from_waker(&hold))
                .is_pending()
        );
        drop(hold);
        let deadline = Instant::now() + Duration::from_secs(5);
        let failure = pipeline.send(connection, deadline, RELEASE).await;
        assert!(failure.is_none(), "{failure:?}");
        let answer = answer
            .await
            .expect("an answer")
            .expect("the claim's record");
        assert!(matches!(answer, Value::BulkString(_)), "{answer:?}");
        assert!(
            !still_claimed(&server, "left", Duration::from_secs(2)).await,
            "§10.6: the claim of a caller that left is released behind it"
        );
        assert!(
            still_claimed(&server, "waiting", Duration::ZERO).await,
            "the claim still waited for stands"
        );
    }

    /// Holds the thread that drops it until Redis ran an `EVAL` (a release behind: the claims
    /// here are `EVALSHA`s), for at most 2 s.
    struct HoldUntilReleased(redis::Client);

    impl Wake for HoldUntilReleased {
        fn wake(self: Arc<Self>) {}
    }

    impl Drop for HoldUntilReleased {
        fn drop(&mut self) {
            let released = || {
                let mut connection = self.0.get_connection().ok()?;
                let stats: String = redis::cmd("INFO")
                    .arg("commandstats")
                    .query(&mut connection)
                    .ok()?;
                stats
                    .lines()
                    .any(|line| line.starts_with("cmdstat_eval:"))
                    .then_some(())
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while released().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
