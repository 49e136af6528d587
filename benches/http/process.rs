//! CPU time and resident memory of the bench's process and of the store servers' processes, and
//! what its exited child processes (the load generator) used.

/// CPU time of a process, in nanoseconds.
pub(crate) struct CpuClocks {
    ticks_per_second: u64,
}

impl CpuClocks {
    pub(crate) fn detect() -> Self {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        CpuClocks {
            ticks_per_second: u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100),
        }
    }

    pub(crate) fn describe(&self) -> String {
        let precise = Self::clock_ns(None).is_some();
        format!(
            "{} (fallback: /proc/<pid>/stat utime+stime at {} ticks/s)",
            if precise {
                "process CPU clocks (clock_gettime, ns)"
            } else {
                "process CPU clocks unavailable"
            },
            self.ticks_per_second
        )
    }

    /// The CPU time (user + system, all threads, exited ones included) of this process (`None`)
    /// or of `pid`.
    pub(crate) fn process_ns(&self, pid: Option<u32>) -> u64 {
        Self::clock_ns(pid)
            .or_else(|| self.proc_stat_ns(pid))
            .unwrap_or(0)
    }

    fn clock_ns(pid: Option<u32>) -> Option<u64> {
        let mut clock: libc::clockid_t = libc::CLOCK_PROCESS_CPUTIME_ID;
        if let Some(pid) = pid {
            let pid = libc::pid_t::try_from(pid).ok()?;
            // SAFETY: `clock` is a valid place for the clock id.
            if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
                return None;
            }
        }
        let mut time = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `time` is a valid timespec to write to.
        if unsafe { libc::clock_gettime(clock, &mut time) } != 0 {
            return None;
        }
        Some(u64::try_from(time.tv_sec).ok()? * 1_000_000_000 + u64::try_from(time.tv_nsec).ok()?)
    }

    fn proc_stat_ns(&self, pid: Option<u32>) -> Option<u64> {
        let pid = pid.unwrap_or_else(std::process::id);
        stat_fields(pid)
            .filter(|fields| fields.len() > 12)
            .map(|fields| self.ticks_ns(&fields, 11..13))
    }

    /// The CPU time of `root` and its child processes, the exited ones included (as its
    /// children's time): a PostgreSQL server, whose postmaster forks a backend per connection.
    pub(crate) fn tree_ns(&self, root: u32) -> u64 {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return 0;
        };
        let children: u64 = entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|pid| {
                let fields = stat_fields(pid).filter(|fields| fields.len() > 12)?;
                (fields[1].parse::<u32>().ok()? == root).then_some(fields)
            })
            .map(|fields| self.ticks_ns(&fields, 11..13))
            .sum();
        let own = stat_fields(root)
            .filter(|fields| fields.len() > 14)
            .map_or(0, |fields| self.ticks_ns(&fields, 11..15));
        own + children
    }

    /// The sum of the tick counts in `fields[range]`, in nanoseconds.
    fn ticks_ns(&self, fields: &[String], range: std::ops::Range<usize>) -> u64 {
        let ticks: u64 = fields[range]
            .iter()
            .filter_map(|field| field.parse::<u64>().ok())
            .sum();
        ticks * 1_000_000_000 / self.ticks_per_second
    }
}

/// The fields of `/proc/<pid>/stat` after the command name: state, ppid, ... (utime is the 12th,
/// stime the 13th, then the exited children's cutime and cstime).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// A field of `/proc/<pid>/status` (this process's for `None`): `VmRSS:`, `VmHWM:`, ...
pub(crate) fn status_field(pid: Option<u32>, field: &str) -> Option<String> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field).map(|v| v.trim().to_owned()))
}

/// The resident memory of `pid` (this process for `None`), in KiB.
pub(crate) fn resident_kib(pid: Option<u32>) -> Option<u64> {
    status_field(pid, "VmRSS:")?
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// What this process's exited and reaped child processes used in all: their CPU time and how
/// often they went to sleep (voluntary context switches). Between two readings around one run of
/// wrk, that is wrk's: the store servers keep running.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ChildrenUse {
    pub cpu_ns: u64,
    pub sleeps: u64,
}

impl ChildrenUse {
    pub(crate) fn now() -> Self {
        // SAFETY: an all-zero rusage is valid, and getrusage only writes to it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid rusage to write to.
        if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } != 0 {
            return Self::default();
        }
        let ns = |t: libc::timeval| {
            u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_usec).unwrap_or(0) * 1_000
        };
        Self {
            cpu_ns: ns(usage.ru_utime) + ns(usage.ru_stime),
            sleeps: u64::try_from(usage.ru_nvcsw).unwrap_or(0),
        }
    }

    /// What was used from `earlier` until this reading.
    pub(crate) fn since(self, earlier: Self) -> Self {
        Self {
            cpu_ns: self.cpu_ns.saturating_sub(earlier.cpu_ns),
            sleeps: self.sleeps.saturating_sub(earlier.sleeps),
        }
    }
}
