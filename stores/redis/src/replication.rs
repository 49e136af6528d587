//! The optional replication wait (`RedisStore::with_replication_wait`), and the release of a
//! claim whose answer nobody will read.

use std::time::Duration;

use deadpool_redis::redis::{self, Cmd, Value};

use super::RedisStore;
use super::batch::{ClaimRef, release_eval};
use super::calls::millis;

/// How many replicas must acknowledge a claim or a completion, and how long to wait for them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Replication {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

impl Replication {
    /// `cmd`, then `WAIT`, as one pipeline: the cluster connection sends a pipeline to the node
    /// of its first keyed command, so the `WAIT` counts the replicas of the key's own master.
    pub(super) fn pipeline(&self, cmd: Cmd) -> redis::Pipeline {
        let mut pipe = redis::Pipeline::with_capacity(2);
        pipe.add_command(cmd);
        pipe.cmd("WAIT")
            .arg(self.replicas)
            .arg(millis(self.timeout));
        pipe
    }

    /// How many replicas the `WAIT` of [`Replication::pipeline`] counted.
    pub(super) fn acked(answer: &Value) -> u32 {
        match answer {
            Value::Int(n) => u32::try_from(*n).unwrap_or(0),
            _ => 0,
        }
    }
}

/// Releases a claim's key, fenced by its token, when dropped armed: a claim sent outside a batch
/// whose caller stopped waiting (a timeout, a dropped request) or that was refused afterwards
/// (too few replicas) must not hold its key for a request that will never run. Where the `SET`
/// did not claim, the fenced release does nothing.
pub(super) struct ReleaseOnDrop {
    store: RedisStore,
    claim: Option<ClaimRef>,
}

impl ReleaseOnDrop {
    pub(super) fn new(store: &RedisStore, claim: ClaimRef) -> Self {
        Self {
            store: store.clone(),
            claim: Some(claim),
        }
    }

    /// The claim stands: nothing to release.
    pub(super) fn disarm(mut self) {
        self.claim = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let cmd = release_eval(store.inner.release.source, claim);
        runtime.spawn(async move {
            // Bounded by the store's timeout, like every direct call.
            let _ = store.direct::<i64>(cmd).await;
        });
    }
}
