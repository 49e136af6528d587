//! The optional replication wait (`RedisStore::with_replication_wait`).

use std::time::Duration;

use deadpool_redis::redis::{self, Cmd, Value};

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
