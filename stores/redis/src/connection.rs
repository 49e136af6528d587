//! Where the store's commands go: one Redis server, or a Redis Cluster.
//!
//! On one server the store shares one multiplexed connection from its pool between requests, and
//! pipelines the commands of concurrent requests (see `batch`). On a cluster it uses redis-rs's
//! cluster connection, which routes each command by its key's slot, follows `MOVED` and `ASK`
//! redirections, refreshes the slot map after them and reconnects to nodes that closed their
//! connections. It is not batched: a pipeline must stay within one slot, and the cluster
//! connection already multiplexes the commands of concurrent requests on one connection per node.
//!
//! On either, a call that times out leads to a fresh connection: on one server the next call takes
//! one from the pool; on a cluster a new cluster connection (and slot map) is built in the
//! background ([`Cluster::timed_out`]), since a node that stops answering without closing its
//! connections is otherwise never left.
//!
//! On one server, a kept connection can also die while nobody uses it (Redis restarted, or closed
//! it as idle). A command given to it then fails with a broken pipe, and the error does not say
//! whether the command was written first: redis-rs reports a connection that was dead before the
//! command and one that died with the command on its way alike. So a command is never sent again
//! after such an error; instead, a connection that has been quiet for [`QUIET`] is checked before
//! a command goes on it ([`Single::checked`]): a `PING` whose answer nobody waits for is handed to
//! it first, and if even that cannot be handed over, the connection was dead before the command,
//! which goes, once, on a fresh connection from the pool.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use deadpool_redis::Pool;
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::ClusterClient;
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::{
    self, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};
use tokio::sync::watch;

use super::batch::Batch;

/// How the store reaches Redis.
pub(super) enum Backend {
    /// One server (a master, perhaps with replicas).
    Single(Box<Single>),
    /// A Redis Cluster.
    Cluster(Box<Cluster>),
}

impl Backend {
    /// After a call on lane `lane` failed with `err`: on one server, drops the lane's connection
    /// when `err` says it is broken or timed out, so that the next call takes a fresh one from
    /// the pool; on a cluster, rebuilds the lane's connection in the background after a timeout
    /// (a cluster connection repairs itself after the other errors).
    pub(super) fn forget_if_broken(&self, lane: usize, err: &RedisError) {
        match self {
            Backend::Single(single) => {
                if err.is_io_error()
                    || err.is_connection_dropped()
                    || err.is_connection_refusal()
                    || err.is_timeout()
                    || err.is_unrecoverable_error()
                {
                    single.lanes.lane(lane).take();
                }
            }
            Backend::Cluster(cluster) => {
                if err.is_timeout() {
                    cluster.timed_out(lane);
                }
            }
        }
    }
}

/// How many connections the replication wait spreads its commands over. `WAIT` blocks its
/// connection on the server until the replicas answer, so on one shared connection every
/// request would queue behind the one waiting; lanes let that many wait at once.
pub(super) const WAIT_LANES: usize = 8;

/// Connections made on first use, one per lane: lane 0 for everything, the others only for the
/// replication wait.
pub(super) struct Lanes<T> {
    lanes: [Mutex<Option<T>>; WAIT_LANES],
    next: AtomicUsize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Self {
            lanes: std::array::from_fn(|_| Mutex::new(None)),
            next: AtomicUsize::new(0),
        }
    }
}

impl<T> Lanes<T> {
    /// Lane 0, or with `spread` the next of the first `limit` lanes in turn.
    pub(super) fn pick(&self, spread: bool, limit: usize) -> usize {
        let lanes = limit.clamp(1, WAIT_LANES);
        if spread && lanes > 1 {
            self.next.fetch_add(1, Ordering::Relaxed) % lanes
        } else {
            0
        }
    }

    /// Lane `i`'s connection, if made.
    pub(super) fn lane(&self, i: usize) -> MutexGuard<'_, Option<T>> {
        lock(&self.lanes[i % WAIT_LANES])
    }
}

/// How long a kept connection may go without a command before the next one on it is checked
/// ([`Single::checked`]): shorter than a Redis restart takes (stopping, starting and listening
/// again: over 100 ms in the tests), so that a connection a restart closed is always quiet by the
/// time Redis answers again. One used more often is taken as alive: if it died since its last
/// command (closed by a client kill, or a restart faster than this), that command fails, and the
/// connection is replaced for the next. A connection used less often costs Redis at most ten
/// `PING`s a second, each in the same write as a command: never a round trip.
pub(super) const QUIET: Duration = Duration::from_millis(100);

/// One server: the pool, the connections taken from it and kept (each lane its own: returned to
/// the pool, a connection would be handed to the next lane again), when each lane's connection
/// was last handed out, and the batch of queued commands (always on lane 0).
pub(super) struct Single {
    pub(super) pool: Pool,
    pub(super) lanes: Lanes<deadpool_redis::Connection>,
    pub(super) batch: Batch,
    /// When each lane's connection was last handed out, in milliseconds since `born`.
    used: [AtomicU64; WAIT_LANES],
    born: Instant,
    /// Held while a lane takes a connection from the pool: one at a time per lane. The lanes may
    /// keep every connection of the pool, so a second call taking one for the same lane would
    /// wait for a connection that no lane gives back.
    pub(super) taking: [tokio::sync::Mutex<()>; WAIT_LANES],
}

/// A cluster: the client made from the seed nodes, and its connections once made. Shared with
/// the tasks that (re)build the connections.
pub(super) struct Cluster {
    shared: Arc<ClusterShared>,
}

struct ClusterShared {
    client: ClusterClient,
    lanes: [ClusterLane; WAIT_LANES],
    next: AtomicUsize,
}

/// One lane's cluster connection, and its building.
struct ClusterLane {
    /// The connection calls use; receivers wait here for one being built.
    made: watch::Sender<Made>,
    /// A build is under way: one at a time per lane.
    building: AtomicBool,
    /// When the last build after a timeout started: timeouts rebuild at most every
    /// [`REBUILD_EVERY`].
    last_rebuild: Mutex<Option<Instant>>,
}

/// A lane's connection.
#[derive(Clone)]
enum Made {
    /// None made yet.
    Nothing,
    Ready(ClusterConnection),
    /// The last build failed, and no connection was made before it.
    Failed(RedisError),
}

/// How often timeouts may rebuild a lane's cluster connection: each build connects to every node
/// and reads the slot map, and a node that does not answer makes every call time out.
const REBUILD_EVERY: Duration = Duration::from_secs(1);

/// The most a build may take, a node that never answers included; past it, the build is given
/// up and the next call or timeout starts another.
const BUILD_BOUND: Duration = Duration::from_secs(30);

impl Single {
    pub(super) fn new(pool: Pool) -> Self {
        Self {
            pool,
            lanes: Lanes::default(),
            batch: Batch::default(),
            used: std::array::from_fn(|_| AtomicU64::new(0)),
            born: Instant::now(),
            taking: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
        }
    }

    /// Lane `lane`'s kept connection, if it has one that is fit for a command: used within
    /// [`QUIET`], or quiet longer and still open. A dead one is dropped (back to the pool, which
    /// discards it when it fails its check) and `None` returned: the caller takes a fresh one,
    /// and the command was given to no connection yet.
    ///
    /// The check hands the connection a `PING` whose answer nobody waits for, which fails only
    /// when the connection's task has ended (it read the end of the connection, or an error):
    /// then no command can have gone on it since. Its answer is read and dropped by redis-rs;
    /// it goes out in the same write as the command behind it.
    pub(super) async fn checked(&self, lane: usize) -> Option<MultiplexedConnection> {
        let mut kept = MultiplexedConnection::clone(self.lanes.lane(lane).as_ref()?);
        let now = self.now();
        let last = self.used[lane % WAIT_LANES].load(Ordering::Acquire);
        if now.saturating_sub(last) >= millis(QUIET) {
            let mut ping = redis::cmd("PING");
            ping.set_no_response(true);
            if kept.send_packed_command(&ping).await.is_err() {
                self.lanes.lane(lane).take();
                return None;
            }
        }
        self.used_now(lane);
        Some(kept)
    }

    /// Records that lane `lane`'s connection is handed out now.
    pub(super) fn used_now(&self, lane: usize) {
        let used = &self.used[lane % WAIT_LANES];
        let now = self.now();
        // Most calls find it already set within the millisecond: no write.
        if used.load(Ordering::Relaxed) < now {
            used.fetch_max(now, Ordering::AcqRel);
        }
    }

    /// Milliseconds since the store was made.
    fn now(&self) -> u64 {
        millis(self.born.elapsed())
    }

    /// The lane to send on next: never more lanes than the pool has connections.
    pub(super) fn pick(&self, spread: bool) -> usize {
        self.lanes.pick(spread, self.pool.status().max_size)
    }
}

impl Cluster {
    pub(super) fn new(client: ClusterClient) -> Self {
        Self {
            shared: Arc::new(ClusterShared {
                client,
                lanes: std::array::from_fn(|_| ClusterLane {
                    made: watch::Sender::new(Made::Nothing),
                    building: AtomicBool::new(false),
                    last_rebuild: Mutex::new(None),
                }),
                next: AtomicUsize::new(0),
            }),
        }
    }

    /// The lane to send on next: lane 0, or with `spread` the next lane in turn.
    pub(super) fn pick(&self, spread: bool) -> usize {
        if spread {
            self.shared.next.fetch_add(1, Ordering::Relaxed) % WAIT_LANES
        } else {
            0
        }
    }

    /// Lane `lane`'s cluster connection, made the first time (by a task of its own, so that a
    /// build slower than one call's bound still completes for the calls after it). It is kept
    /// while it answers: it repairs itself (slot refreshes after `MOVED`, reconnections to nodes
    /// that closed their connections), and one slow node must not cost the connections to the
    /// others. It is replaced after a timeout ([`Cluster::timed_out`]).
    pub(super) async fn connection(&self, lane: usize) -> RedisResult<ClusterConnection> {
        let state = &self.shared.lanes[lane % WAIT_LANES];
        let mut made = state.made.subscribe();
        if let Made::Ready(connection) = &*made.borrow_and_update() {
            return Ok(connection.clone());
        }
        self.shared.build(lane, false);
        loop {
            // The sender lives as long as `self`: it is never closed while this waits.
            if made.changed().await.is_err() {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "the cluster connection went away",
                )));
            }
            match &*made.borrow_and_update() {
                Made::Ready(connection) => return Ok(connection.clone()),
                Made::Failed(err) => return Err(err.clone()),
                Made::Nothing => {}
            }
        }
    }

    /// A call on lane `lane` got no answer in time. redis-rs's cluster connection refreshes its
    /// slot map after `MOVED` and reconnects a node that closed its connection, but a node that
    /// stops answering with its connections open (a frozen process, a hung machine, a partition)
    /// does neither: every command for its slots would wait on it, its replica promoted or not,
    /// until the kernel gives up on the connection, minutes later. So a timeout builds a fresh
    /// connection in the background (a new slot map, read from the nodes that answer), at most
    /// every [`REBUILD_EVERY`], and calls move to it once it is made; until then, and if the
    /// build fails, they keep the one they have.
    pub(super) fn timed_out(&self, lane: usize) {
        self.shared.build(lane, true);
    }
}

impl ClusterShared {
    /// Starts building lane `lane`'s connection, unless a build is under way (or, `after_timeout`,
    /// one started less than [`REBUILD_EVERY`] ago).
    fn build(self: &Arc<Self>, lane: usize, after_timeout: bool) {
        let lane = lane % WAIT_LANES;
        let state = &self.lanes[lane];
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if after_timeout {
            let mut last = lock(&state.last_rebuild);
            if last.is_some_and(|at| at.elapsed() < REBUILD_EVERY) {
                return;
            }
            if state.building.swap(true, Ordering::AcqRel) {
                return;
            }
            *last = Some(Instant::now());
        } else if state.building.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = Arc::clone(self);
        runtime.spawn(async move {
            let build = shared.client.get_async_connection();
            let made = tokio::time::timeout(BUILD_BOUND, build)
                .await
                .unwrap_or_else(|_| {
                    Err(RedisError::from((
                        ErrorKind::Io,
                        "the cluster connection was not made in time",
                    )))
                });
            let state = &shared.lanes[lane];
            match made {
                Ok(connection) => {
                    state.made.send_replace(Made::Ready(connection));
                }
                // A connection that works for some slots is better than none: kept.
                Err(err) => state.made.send_modify(|made| {
                    if !matches!(made, Made::Ready(_)) {
                        *made = Made::Failed(err);
                    }
                }),
            }
            state.building.store(false, Ordering::Release);
        });
    }
}

/// A connection of either kind, for commands sent outside a batch.
#[derive(Clone)]
pub(super) enum Connection {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
