//! The bench's knobs: which servers (variants) and workloads run, for how long, from the
//! environment.

/// The memory store's byte cap. `MemoryStore::new()` caps records at 256 MiB and answers 503 when
/// full; the new-key workload stores one ~450-byte record per request, so a long or fast run would
/// end up measuring 503s. The bench lifts the cap (same code path otherwise) and prints what the
/// store holds at the end.
pub(crate) const MEMORY_CAPACITY: usize = usize::MAX / 2;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Variant {
    Bare,
    Memory,
    /// The memory store with the replay cache.
    MemoryCache,
    /// The Redis store's calls made by hand, with no layer (`floor`).
    RedisFloor,
    Redis,
    /// The Redis store with the replay cache.
    RedisCache,
    /// The Postgres store's statements made by hand, with no layer (`postgres_floor`); with the
    /// `postgres` feature only.
    PostgresFloor,
    /// With the `postgres` feature only.
    Postgres,
}

impl Variant {
    pub(crate) const ALL: &[Variant] = &[
        Variant::Bare,
        Variant::Memory,
        Variant::MemoryCache,
        Variant::RedisFloor,
        Variant::Redis,
        Variant::RedisCache,
        Variant::PostgresFloor,
        Variant::Postgres,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Variant::Bare => "bare",
            Variant::Memory => "memory",
            Variant::MemoryCache => "memory+cache",
            Variant::RedisFloor => "redis-floor",
            Variant::Redis => "redis",
            Variant::RedisCache => "redis+cache",
            Variant::PostgresFloor => "postgres-floor",
            Variant::Postgres => "postgres",
        }
    }

    /// Whether the server answers as a layer does (replays, 409): all but bare.
    pub(crate) fn layered(self) -> bool {
        self != Variant::Bare
    }

    /// The floor of the variant's store: the same store calls made by hand.
    pub(crate) fn floor(self) -> Option<Variant> {
        match self {
            Variant::Redis | Variant::RedisCache => Some(Variant::RedisFloor),
            Variant::Postgres => Some(Variant::PostgresFloor),
            _ => None,
        }
    }

    /// The store server the variant talks to, if any (its CPU and calls are counted).
    pub(crate) fn server(self) -> Option<StoreServer> {
        match self {
            Variant::Redis | Variant::RedisCache | Variant::RedisFloor => Some(StoreServer::Redis),
            Variant::Postgres | Variant::PostgresFloor => Some(StoreServer::Postgres),
            _ => None,
        }
    }
}

/// The replay cache's bounds in the `+cache` variants: room for every replay key, far from full.
pub(crate) const REPLAY_CACHE_ENTRIES: usize = 10_000;
pub(crate) const REPLAY_CACHE_BYTES: usize = 64 << 20;

/// A store server the bench starts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum StoreServer {
    Redis,
    Postgres,
}

impl StoreServer {
    pub(crate) fn name(self) -> &'static str {
        match self {
            StoreServer::Redis => "redis",
            StoreServer::Postgres => "postgres",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Workload {
    Replay,
    NewKey,
    Conflict,
}

impl Workload {
    pub(crate) const ALL: [Workload; 3] = [Workload::Replay, Workload::NewKey, Workload::Conflict];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::Replay => "replay",
            Workload::NewKey => "new-key",
            Workload::Conflict => "conflict",
        }
    }

    /// The status every response of this workload must have.
    pub(crate) fn expected_status(self, variant: Variant) -> u16 {
        match (self, variant.layered()) {
            (Workload::Conflict, true) => 409,
            _ => 201,
        }
    }
}

/// The bench's knobs, from the environment.
#[derive(Debug)]
pub(crate) struct Settings {
    pub seconds: u64,
    pub rounds: usize,
    pub warmup: u64,
    pub connections: u32,
    pub threads: u32,
    pub server_threads: usize,
    pub workloads: Vec<Workload>,
    pub variants: Vec<Variant>,
    /// The layers' dedup window, in seconds (default: the layer's own, 24 h).
    pub dedup_window: u64,
    /// The memory store's byte cap (default: lifted, see `MEMORY_CAPACITY`).
    pub memory_capacity: usize,
}

impl Settings {
    pub(crate) fn from_env() -> Result<Self, String> {
        let nproc = std::thread::available_parallelism().map_or(2, usize::from);
        let settings = Settings {
            seconds: env_number("BENCH_SECONDS", 5)?,
            rounds: env_number("BENCH_ROUNDS", 5)?,
            warmup: env_number("BENCH_WARMUP", 1)?,
            connections: env_number("BENCH_CONNECTIONS", 32)?,
            threads: env_number("BENCH_THREADS", 1)?,
            server_threads: env_number("BENCH_SERVER_THREADS", nproc)?,
            workloads: env_list("BENCH_WORKLOADS", &Workload::ALL, Workload::name)?,
            variants: env_list("BENCH_VARIANTS", Variant::ALL, Variant::name)?,
            dedup_window: env_number("BENCH_DEDUP_WINDOW", 24 * 60 * 60)?,
            memory_capacity: env_number("BENCH_MEMORY_CAPACITY", MEMORY_CAPACITY)?,
        };
        if settings.seconds == 0 || settings.rounds == 0 {
            return Err("BENCH_SECONDS and BENCH_ROUNDS must be at least 1".into());
        }
        if settings.threads == 0 || settings.connections < settings.threads {
            return Err("BENCH_THREADS must be at least 1 and at most BENCH_CONNECTIONS".into());
        }
        if settings.server_threads == 0 {
            return Err("BENCH_SERVER_THREADS must be at least 1".into());
        }
        if settings.workloads.is_empty() || settings.variants.is_empty() {
            return Err("BENCH_WORKLOADS or BENCH_VARIANTS names nothing".into());
        }
        Ok(settings)
    }

    /// The exact command that reproduces this run.
    pub(crate) fn command(&self) -> String {
        let workloads: Vec<_> = self.workloads.iter().map(|w| w.name()).collect();
        let variants = if self.variants.len() == Variant::ALL.len() {
            String::new()
        } else {
            let names: Vec<_> = self.variants.iter().map(|v| v.name()).collect();
            format!("BENCH_VARIANTS={} ", names.join(","))
        };
        let mut variants = variants;
        if self.dedup_window != 24 * 60 * 60 {
            variants.push_str(&format!("BENCH_DEDUP_WINDOW={} ", self.dedup_window));
        }
        if self.memory_capacity != MEMORY_CAPACITY {
            variants.push_str(&format!("BENCH_MEMORY_CAPACITY={} ", self.memory_capacity));
        }
        format!(
            "BENCH_SECONDS={} BENCH_ROUNDS={} BENCH_WARMUP={} BENCH_CONNECTIONS={} BENCH_THREADS={} \
             BENCH_SERVER_THREADS={} BENCH_WORKLOADS={} {variants}cargo bench -p benches --bench http",
            self.seconds,
            self.rounds,
            self.warmup,
            self.connections,
            self.threads,
            self.server_threads,
            workloads.join(",")
        )
    }

    pub(crate) fn estimated_seconds(&self) -> u64 {
        let runs = (self.workloads.len() * self.variants.len()) as u64;
        runs * (self.warmup + self.seconds * self.rounds as u64)
            + runs * (self.rounds as u64 + 1) / 2
    }
}

pub(crate) fn env_number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(value) => value
            .trim()
            .parse()
            .map_err(|_| format!("{name}={value:?} is not a valid number")),
    }
}

/// A comma-separated subset of `all` from the environment (default: all), in `all`'s order.
fn env_list<T: Copy + PartialEq>(
    name: &str,
    all: &[T],
    label: fn(T) -> &'static str,
) -> Result<Vec<T>, String> {
    let Ok(list) = std::env::var(name) else {
        return Ok(all.to_vec());
    };
    let wanted: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    let known: Vec<_> = all.iter().map(|t| label(*t)).collect();
    if let Some(unknown) = wanted.iter().find(|n| !known.contains(n)) {
        return Err(format!(
            "{name}: unknown name {unknown:?} (known: {})",
            known.join(", ")
        ));
    }
    Ok(all
        .iter()
        .copied()
        .filter(|t| wanted.contains(&label(*t)))
        .collect())
}
