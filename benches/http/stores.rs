//! The store servers the bench starts, and what each did during one run: its processes' CPU time
//! and its calls per request, by kind, with the round trips they make.

use std::collections::BTreeMap;

use super::postgres_stats::PostgresStats;
use super::process::{CpuClocks, resident_kib};
use super::settings::StoreServer;
use test_servers::redis_server::RedisServer;

/// Redis commands the harness itself sends (left out of the per-request counts).
const HARNESS_COMMANDS: &[&str] = &["info", "config|resetstat", "dbsize"];

/// The bench's store servers.
pub(crate) struct StoreServers<'a> {
    pub redis: &'a RedisServer,
    pub redis_pid: u32,
    pub postgres: &'a PostgresStats,
    pub runtime: &'a tokio::runtime::Runtime,
}

/// What a store server did during one run, per request.
#[derive(Debug, Clone, Default)]
pub(crate) struct StoreUse {
    pub cpu_us: f64,
    /// Calls by kind: Redis commands (those run inside scripts included, as Redis counts them) or
    /// Postgres statements.
    pub calls: BTreeMap<String, f64>,
    pub round_trips: f64,
    /// The Redis server's resident memory at the end of the run, in KiB.
    pub resident_kib: Option<u64>,
}

/// A run in progress: the CPU time its store server had used when it started.
pub(crate) struct Started {
    server: StoreServer,
    cpu_ns: u64,
}

impl StoreServers<'_> {
    /// Resets `server`'s counters and notes its CPU time, before a run.
    pub(crate) fn start(&self, server: StoreServer, clocks: &CpuClocks) -> Result<Started, String> {
        match server {
            StoreServer::Redis => self.redis.config_resetstat(),
            StoreServer::Postgres => self.reset_postgres()?,
        }
        Ok(Started {
            server,
            cpu_ns: self.cpu_ns(server, clocks),
        })
    }

    /// What the server did since `started`, per request of `requests`.
    pub(crate) fn finish(
        &self,
        started: Started,
        clocks: &CpuClocks,
        requests: f64,
    ) -> Result<StoreUse, String> {
        let cpu_ns = self.cpu_ns(started.server, clocks);
        let (calls, round_trips) = match started.server {
            StoreServer::Redis => self.redis_calls(requests),
            StoreServer::Postgres => self.postgres_calls(requests)?,
        };
        let resident_kib = match started.server {
            StoreServer::Redis => resident_kib(Some(self.redis_pid)),
            StoreServer::Postgres => None,
        };
        Ok(StoreUse {
            cpu_us: cpu_ns.saturating_sub(started.cpu_ns) as f64 / 1e3 / requests,
            calls,
            round_trips,
            resident_kib,
        })
    }

    fn cpu_ns(&self, server: StoreServer, clocks: &CpuClocks) -> u64 {
        match server {
            StoreServer::Redis => clocks.process_ns(Some(self.redis_pid)),
            StoreServer::Postgres => clocks.tree_ns(self.postgres.postmaster),
        }
    }

    /// Redis commands per request, and the round trips they make: all calls but those run inside
    /// scripts (every `GET`, `SET`, `TIME` and `DEL`: each store call is a script).
    fn redis_calls(&self, requests: f64) -> (BTreeMap<String, f64>, f64) {
        let calls: BTreeMap<String, f64> = self
            .redis
            .info_commandstats()
            .iter()
            .filter(|(name, _)| !HARNESS_COMMANDS.contains(&name.as_str()))
            .map(|(name, calls)| (name.clone(), *calls as f64 / requests))
            .collect();
        let total: f64 = calls.values().sum();
        let of = |name: &str| calls.get(name).copied().unwrap_or(0.0);
        let inside_scripts = of("get") + of("set") + of("time") + of("del");
        // Never below zero: rounding of a run that made no call at all.
        let round_trips = (total - inside_scripts).max(0.0);
        (calls, round_trips)
    }

    /// Postgres statements per request: each is one round trip (a statement prepared on its
    /// connection before is bound and run in one).
    fn postgres_calls(&self, requests: f64) -> Result<(BTreeMap<String, f64>, f64), String> {
        let counts = self.runtime.block_on(self.postgres.calls())?;
        let calls: BTreeMap<String, f64> = counts
            .into_iter()
            .map(|(kind, n)| (kind, n as f64 / requests))
            .collect();
        let round_trips = calls.values().sum();
        Ok((calls, round_trips))
    }

    fn reset_postgres(&self) -> Result<(), String> {
        self.runtime.block_on(self.postgres.reset())
    }
}
