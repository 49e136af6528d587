//! Test fixture: a private, throw-away PostgreSQL server per test.
//!
//! Every [`PostgresServer`] runs its own `postgres` on a free port of `127.0.0.1`, with its Unix
//! socket in its own temporary directory, `fsync=off`, and trust authentication for the
//! `postgres` user. The fixture never touches the shared server on port 5432.
//!
//! Start-up takes about a tenth of a second: the cluster is not made with `initdb` per server but
//! copied from a template cluster that `initdb` made once, kept in the temporary directory
//! (`tower-idempotency-postgres-template-*`, keyed by the server's version) and shared by every
//! test process that uses the same binaries.
//!
//! The server can be stopped (fast shutdown), killed (`SIGKILL` to the postmaster and every
//! backend) and started again on the same port with the same data. Dropping it kills it and
//! removes its directory.
//!
//! As root, the server and `initdb` run as the `postgres` user (`initdb` refuses root), and the
//! directories are given to that user. The binaries are looked up on `PATH`, then under
//! `/usr/lib/postgresql/*/bin` (where Debian puts them). Missing binaries are a panic that says
//! what to install: PostgreSQL tests never skip.

use std::fs::{self, OpenOptions};
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{MetadataExt, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long to wait for a spawned server to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long [`PostgresServer::stop`] waits after `SIGINT` before using `SIGKILL`.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How many fresh ports [`PostgresServer::start`] tries before giving up.
const START_ATTEMPTS: usize = 5;
/// At most this many bytes of the server log go into a panic message.
const MAX_LOG_IN_PANIC: usize = 16 * 1024;

const INSTALL_HINT: &str = "install the PostgreSQL server (apt-get install postgresql); \
                            PostgreSQL tests never skip";

/// Distinguishes the directories made by one test process.
static COUNTER: AtomicU64 = AtomicU64::new(0);
/// One template made at a time in this process.
static TEMPLATE: Mutex<Option<PathBuf>> = Mutex::new(None);

/// How a spawned server's start went.
enum Started {
    Ready,
    /// The port was taken: try another.
    PortTaken,
    /// Backends of a killed server still hold its shared memory: try again in a moment.
    MemoryInUse,
    Failed(String),
}

/// A PostgreSQL server owned by one test.
#[derive(Debug)]
pub struct PostgresServer {
    bin: PathBuf,
    /// The `postgres` user's uid and gid, when running as root.
    run_as: Option<(u32, u32)>,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Extra arguments of `postgres` (`-c name=value` settings).
    args: Vec<String>,
}

impl PostgresServer {
    /// Starts a server on a free port of `127.0.0.1` and waits until it accepts connections.
    ///
    /// # Panics
    /// When the binaries are missing, or the server does not start (the panic includes its log).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`PostgresServer::start`], with extra arguments for `postgres` (`["-c", "name=value"]`).
    pub fn start_with(args: &[&str]) -> Self {
        let bin = find_bin_dir();
        let run_as = run_as();
        let template = template(&bin, run_as);
        let dir = create_dir(&format!(
            "tower-idempotency-postgres-{}",
            std::process::id()
        ));
        give(&dir, run_as);
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template.join("data"))
            .arg(dir.join("data"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run cp: {e}"));
        assert!(copied.success(), "copying the template cluster failed");
        let socket_dir = dir.join("sock");
        fs::create_dir(&socket_dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", socket_dir.display()));
        give(&socket_dir, run_as);
        let mut server = Self {
            bin,
            run_as,
            port: 0,
            dir,
            child: None,
            args: args.iter().map(|arg| (*arg).to_owned()).collect(),
        };
        for _ in 0..START_ATTEMPTS {
            server.port = free_port();
            match server.spawn_and_wait() {
                Started::Ready => return server,
                Started::PortTaken => eprintln!(
                    "postgres could not bind port {}; trying another port",
                    server.port
                ),
                Started::MemoryInUse => unreachable!("a new cluster shares no memory"),
                Started::Failed(why) => server.fail(&why),
            }
        }
        server.fail(&format!(
            "postgres could not start on a free port after {START_ATTEMPTS} attempts"
        ))
    }

    /// One server for the whole test binary, started on first use and killed when the process
    /// exits: for tests that each take a table or a database of their own on it, and never stop
    /// or pause it (those start their own with [`PostgresServer::start`]).
    pub fn shared() -> &'static PostgresServer {
        static SHARED: OnceLock<PostgresServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            let server = PostgresServer::start();
            let pids = server.pid().into_iter().collect();
            crate::at_exit::kill(pids, vec![server.dir.clone()]);
            server
        })
    }

    /// The URL of the `postgres` database, as the `postgres` user: `postgres://...`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of `database`.
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The TCP port (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's temporary directory: `data/`, `sock/` and `postgres.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The postmaster's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything the server has logged so far.
    pub fn log_contents(&self) -> String {
        let path = self.log_path();
        match fs::read(&path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("<could not read {}: {e}>", path.display()),
        }
    }

    /// Shuts the server down (fast shutdown: open transactions roll back, connections end) and
    /// waits for it, escalating to `SIGKILL` after 10 seconds. Does nothing when it is not
    /// running.
    pub fn stop(&mut self) {
        let Some(pid) = self.pid() else { return };
        send_signal(&pid.to_string(), "INT");
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if self.try_wait().is_some() {
                self.child = None;
                return;
            }
            if Instant::now() >= deadline {
                eprintln!("postgres did not stop within {STOP_TIMEOUT:?}; killing it");
                self.kill();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the postmaster and every backend at once (`SIGKILL` to its process group), as a
    /// crash of the machine would, and waits for the postmaster. Does nothing when it is not
    /// running.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // The postmaster leads its own process group; its backends are in it.
        send_signal(&format!("-{}", child.id()), "KILL");
        let _ = child.wait();
    }

    /// Starts the server again (after [`stop`](Self::stop) or [`kill`](Self::kill)) on the same
    /// port, with the same data, and waits until it accepts connections; stops it first if it
    /// runs.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.spawn_and_wait() {
                Started::Ready => return,
                Started::MemoryInUse | Started::PortTaken if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Started::MemoryInUse | Started::PortTaken => {
                    self.fail("postgres could not start again on its port")
                }
                Started::Failed(why) => self.fail(&why),
            }
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn try_wait(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        child
            .try_wait()
            .unwrap_or_else(|e| panic!("waiting for postgres failed: {e}"))
    }

    /// Spawns the postmaster on `self.port` and waits until it is ready, or has exited.
    fn spawn_and_wait(&mut self) -> Started {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", log_path.display()));
        let offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let log_err = log
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot clone a file handle: {e}"));
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.join("sock"))
            .args(["-c", "listen_addresses=127.0.0.1"])
            // Nothing reaches the disk's platter, but every commit reaches the kernel: a killed
            // server loses nothing (`synchronous_commit=off` would lose the last commits).
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .args(["-c", "max_connections=100"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0);
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start postgres: {e}; {INSTALL_HINT}"));
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.try_wait() {
                self.child = None;
                let log = self.log_contents();
                let since = log.get(offset as usize..).unwrap_or(&log);
                if since.contains("could not bind") || since.contains("Address already in use") {
                    return Started::PortTaken;
                }
                if since.contains("pre-existing shared memory block") {
                    return Started::MemoryInUse;
                }
                return Started::Failed(format!("postgres exited ({status})"));
            }
            if is_ready(&self.dir.join("data").join("postmaster.pid"), pid) {
                return Started::Ready;
            }
            if Instant::now() >= deadline {
                return Started::Failed(format!("postgres was not ready within {READY_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A command for the binary `name`, run as the `postgres` user when running as root.
    fn command(&self, name: &str) -> Command {
        command(&self.bin, name, self.run_as, &self.dir)
    }

    /// Kills the server and panics with `message` and the log's tail.
    fn fail(&mut self, message: &str) -> ! {
        self.kill();
        let log = self.log_contents();
        let mut start = log.len().saturating_sub(MAX_LOG_IN_PANIC);
        while !log.is_char_boundary(start) {
            start += 1;
        }
        panic!(
            "{message}\n--- {} ---\n{}--- end of log ---",
            self.log_path().display(),
            &log[start..]
        )
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Whether `postmaster.pid` names `pid` and says it accepts connections (its eighth line,
/// PostgreSQL 10 and newer).
fn is_ready(pid_file: &Path, pid: u32) -> bool {
    let Ok(text) = fs::read_to_string(pid_file) else {
        return false;
    };
    let lines: Vec<&str> = text.lines().collect();
    lines.first().and_then(|l| l.trim().parse::<u32>().ok()) == Some(pid)
        && lines.get(7).map(|l| l.trim()) == Some("ready")
}

/// The template cluster for the binaries in `bin`, made with `initdb` if no process made it yet.
fn template(bin: &Path, run_as: Option<(u32, u32)>) -> PathBuf {
    let mut made = TEMPLATE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = made.as_ref() {
        return path.clone();
    }
    let version = Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run postgres --version: {e}; {INSTALL_HINT}"));
    let key = {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut hasher = DefaultHasher::new();
        bin.hash(&mut hasher);
        version.stdout.hash(&mut hasher);
        run_as.hash(&mut hasher);
        hasher.finish()
    };
    let path = std::env::temp_dir().join(format!("tower-idempotency-postgres-template-{key:016x}"));
    // Written last, before the template is moved into place: its presence says it is whole.
    let marker = path.join("complete");
    if !marker.is_file() {
        let _ = fs::remove_dir_all(&path);
        let staging = create_dir(&format!(
            "tower-idempotency-postgres-template-{key:016x}.{}",
            std::process::id()
        ));
        give(&staging, run_as);
        let output = command(bin, "initdb", run_as, &staging)
            .arg("-D")
            .arg(staging.join("data"))
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"])
            .arg("--no-sync")
            .output()
            .unwrap_or_else(|e| panic!("cannot run initdb: {e}; {INSTALL_HINT}"));
        assert!(
            output.status.success(),
            "initdb failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        fs::write(staging.join("complete"), b"")
            .unwrap_or_else(|e| panic!("cannot write to {}: {e}", staging.display()));
        // Another process may have moved its own into place meanwhile: then use that one.
        if fs::rename(&staging, &path).is_err() {
            let _ = fs::remove_dir_all(&staging);
            assert!(marker.is_file(), "no template at {}", path.display());
        }
    }
    *made = Some(path.clone());
    path
}

fn command(bin: &Path, name: &str, run_as: Option<(u32, u32)>, cwd: &Path) -> Command {
    let mut command = Command::new(bin.join(name));
    command.current_dir(cwd);
    for var in [
        "PGDATA",
        "PGPORT",
        "PGHOST",
        "PGUSER",
        "PGDATABASE",
        "PGOPTIONS",
    ] {
        command.env_remove(var);
    }
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid);
    }
    command
}

/// The directory holding `initdb` and `postgres`: the one `initdb` on `PATH` resolves to, else
/// the newest `/usr/lib/postgresql/*/bin`.
fn find_bin_dir() -> PathBuf {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("initdb"))
            .filter(|initdb| initdb.is_file())
            .filter_map(|initdb| fs::canonicalize(initdb).ok())
            .filter_map(|initdb| initdb.parent().map(Path::to_path_buf))
            .find(|dir| has_both(dir))
    });
    if let Some(dir) = on_path {
        return dir;
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_both(dir))
        .collect();
    versions.sort();
    versions.pop().map(|(_, dir)| dir).unwrap_or_else(|| {
        panic!(
            "PostgreSQL server binaries (initdb, postgres) not found on PATH or under \
             /usr/lib/postgresql/*/bin: {INSTALL_HINT}"
        )
    })
}

/// The `postgres` user's uid and gid when this process runs as root (PostgreSQL refuses to run
/// as root), else `None`.
fn run_as() -> Option<(u32, u32)> {
    let euid = fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or_else(|e| panic!("cannot read /proc/self: {e}"));
    if euid != 0 {
        return None;
    }
    let passwd = fs::read_to_string("/etc/passwd")
        .unwrap_or_else(|e| panic!("cannot read /etc/passwd: {e}"));
    let ids = passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        match fields.as_slice() {
            ["postgres", _, uid, gid, ..] => Some((uid.parse().ok()?, gid.parse().ok()?)),
            _ => None,
        }
    });
    Some(ids.unwrap_or_else(|| {
        panic!(
            "running as root, and there is no postgres user to run the server as: {INSTALL_HINT}"
        )
    }))
}

/// Gives `path` to the `postgres` user, when running as root.
fn give(path: &Path, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        chown(path, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("cannot chown {}: {e}", path.display()));
    }
}

/// Creates a new, unique directory under the system temp dir, named after `prefix`.
fn create_dir(prefix: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{prefix}-{nanos}-{n}"));
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("cannot create {}: {e}", dir.display()),
        }
    }
}

/// Asks the OS for a free port on `127.0.0.1` (by binding port 0).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("cannot bind a free port on 127.0.0.1: {e}"))
}

/// Sends `signal` (a name such as `INT`) to `target` (a pid, or `-pgid` for a process group).
fn send_signal(target: &str, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, "--", target])
        .status();
    let status = match status {
        // Without procps' `kill`, the shell's builtin.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Command::new("sh")
            .args(["-c", "kill -s \"$0\" -- \"$1\"", signal, target])
            .status(),
        other => other,
    };
    match status {
        Ok(status) if status.success() => {}
        // The process may have exited by itself meanwhile.
        Ok(status) => eprintln!("kill -s {signal} {target}: {status}"),
        Err(e) => panic!("cannot run kill -s {signal} {target}: {e}"),
    }
}
