//! Test fixture: a private, throw-away `redis-server` process per test.
//!
//! Every [`RedisServer`] runs its own `redis-server` on a free port of
//! `127.0.0.1`, with persistence switched off and a unique temporary working
//! directory. The fixture never touches the shared Redis on port 6379.
//!
//! The process can be stopped, killed, restarted on the same port, paused and
//! resumed, so tests can exercise failure modes of the store. Signals are sent
//! with the `kill` command, so no `libc`/`nix` dependency is needed.
//!
//! A blocking raw-RESP client ([`RedisServer::command`]) lets tests inspect
//! the server independently of the crate under test.
//!
//! If `redis-server` is not on `PATH`, [`RedisServer::start`] panics: Redis
//! tests never skip silently.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long to wait for a freshly spawned server to answer `PING`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`RedisServer::stop`] waits after `SIGTERM` before using `SIGKILL`.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Socket timeout used by [`RedisServer::command`].
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// How many fresh ports [`RedisServer::start`] tries before giving up.
const START_ATTEMPTS: usize = 5;

/// At most this many bytes of the server log go into a panic message.
const MAX_LOG_IN_PANIC: usize = 16 * 1024;

/// Distinguishes the temp dirs of servers started by one test process.
static DIR_COUNTER: AtomicU64 = AtomicU64::new(0);

/// One reply of the Redis serialization protocol (RESP2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// A simple string, such as `OK` or `PONG`.
    Simple(String),
    /// An error reply, such as `ERR unknown command`.
    Error(String),
    /// An integer reply.
    Integer(i64),
    /// A bulk string; `None` is the nil bulk string.
    Bulk(Option<Vec<u8>>),
    /// An array reply (a nil array is returned as an empty array).
    Array(Vec<RespValue>),
}

impl RespValue {
    /// Returns `true` for the simple string `OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, RespValue::Simple(s) if s == "OK")
    }

    /// Returns the integer of an integer reply.
    pub fn as_integer(&self) -> Option<i64> {
        match self {
            RespValue::Integer(n) => Some(*n),
            _ => None,
        }
    }

    /// Returns the bytes of a non-nil bulk string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            RespValue::Bulk(Some(bytes)) => Some(bytes),
            _ => None,
        }
    }

    /// Returns a simple string or a non-nil bulk string as text (lossy UTF-8).
    pub fn as_string(&self) -> Option<String> {
        match self {
            RespValue::Simple(s) => Some(s.clone()),
            RespValue::Bulk(Some(bytes)) => Some(String::from_utf8_lossy(bytes).into_owned()),
            _ => None,
        }
    }
}

/// Outcome of waiting for a spawned server to become ready.
enum Readiness {
    /// Our process answers `PING` with `PONG`.
    Ready,
    /// The process exited before it became ready.
    Exited(ExitStatus),
    /// Another process answers on the port.
    Foreign,
    /// No `PONG` before the deadline.
    TimedOut,
}

/// A `redis-server` child process owned by one test.
///
/// Dropping it kills the process and removes its temporary directory.
#[derive(Debug)]
pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    log_path: PathBuf,
    child: Option<Child>,
    /// Arguments beyond the fixture's own (cluster mode, say).
    extra_args: Vec<String>,
}

impl RedisServer {
    /// Starts `redis-server` on a free port of `127.0.0.1` and waits until it
    /// answers `PING` with `PONG`.
    ///
    /// # Panics
    ///
    /// If `redis-server` is not on `PATH`, or it does not become ready within
    /// about 10 seconds (the panic message includes the server log).
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Like [`start`](Self::start), with more `redis-server` arguments. With
    /// `--cluster-enabled yes`, the port is below 55536 and the cluster bus
    /// port (the port + 10000) is free too.
    pub fn start_with(extra_args: &[&str]) -> RedisServer {
        let cluster = extra_args.contains(&"--cluster-enabled");
        let binary = find_redis_server();
        let dir = create_temp_dir();
        let log_path = dir.join("redis-server.log");
        let mut server = RedisServer {
            binary,
            port: 0,
            dir,
            log_path,
            child: None,
            extra_args: extra_args.iter().map(|arg| arg.to_string()).collect(),
        };
        for _ in 0..START_ATTEMPTS {
            server.port = if cluster {
                free_port_with_bus()
            } else {
                free_port()
            };
            let log_offset = server.log_len();
            server.spawn();
            match server.wait_ready() {
                Readiness::Ready => return server,
                Readiness::Exited(status) if server.bind_failed_since(log_offset) => {
                    eprintln!(
                        "redis-server could not bind port {} ({status}); trying another port",
                        server.port
                    );
                }
                Readiness::Foreign => {
                    server.kill();
                    eprintln!(
                        "port {} was taken by another process; trying another port",
                        server.port
                    );
                }
                other => server.fail("start", &other),
            }
        }
        server.fail_with(&format!(
            "redis-server could not start on a free port after {START_ATTEMPTS} attempts"
        ))
    }

    /// The connection URL, `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The TCP port the server listens on (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// The server's temporary working directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The process id of the running server, if one is running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything the server processes have logged so far.
    pub fn log_contents(&self) -> String {
        match fs::read(&self.log_path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("<could not read {}: {e}>", self.log_path.display()),
        }
    }

    /// Shuts the server down gracefully: `SIGTERM` (plus `SIGCONT`, in case it
    /// is paused) and waits for it to exit, escalating to `SIGKILL` after
    /// 10 seconds. Does nothing if no server is running.
    pub fn stop(&mut self) {
        let Some(pid) = self.pid() else { return };
        send_signal(pid, "TERM");
        // A stopped process only acts on SIGTERM once it is continued.
        send_signal(pid, "CONT");
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("child is present");
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => thread_sleep_ms(20),
                Ok(None) => {
                    eprintln!("redis-server {pid} ignored SIGTERM for {STOP_TIMEOUT:?}; killing");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Err(e) => panic!("waiting for redis-server {pid} failed: {e}"),
            }
        }
        self.child = None;
    }

    /// Kills the server abruptly with `SIGKILL` and waits for it to exit.
    /// All data is lost (persistence is off). Does nothing if no server is
    /// running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // `Child::kill` sends SIGKILL on Unix; it also kills a paused process.
            let _ = child.kill();
            if let Err(e) = child.wait() {
                panic!("waiting for killed redis-server {} failed: {e}", child.id());
            }
        }
    }

    /// Starts the server again on the same port and waits for `PONG`. A
    /// server that is still running is stopped first. The new server starts
    /// empty. Binding is retried for about 10 seconds, in case the port is
    /// briefly unavailable (for example in `TIME_WAIT`).
    ///
    /// # Panics
    ///
    /// If the server does not become ready on the same port in time.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let log_offset = self.log_len();
            self.spawn();
            let outcome = self.wait_ready();
            let retry = match &outcome {
                Readiness::Ready => return,
                Readiness::Exited(_) => self.bind_failed_since(log_offset),
                Readiness::Foreign => {
                    self.kill();
                    true
                }
                Readiness::TimedOut => false,
            };
            if !retry || Instant::now() >= deadline {
                self.fail("restart", &outcome);
            }
            self.child = None;
            thread_sleep_ms(100);
        }
    }

    /// Freezes the server with `SIGSTOP`: its port still accepts connections
    /// (the kernel queues them) but no command gets a reply until
    /// [`resume`](Self::resume).
    ///
    /// # Panics
    ///
    /// If no server is running.
    pub fn pause(&self) {
        send_signal(self.running_pid("pause"), "STOP");
    }

    /// Resumes a server paused with [`pause`](Self::pause) (`SIGCONT`).
    ///
    /// # Panics
    ///
    /// If no server is running.
    pub fn resume(&self) {
        send_signal(self.running_pid("resume"), "CONT");
    }

    /// Freezes the server with `SIGSTOP` until the returned guard is thawed or dropped
    /// (`SIGCONT`): a hung machine, whose connections stay open and never answer. The guard
    /// thaws on drop, a panicking test included, so no test leaves a frozen process behind.
    ///
    /// # Panics
    ///
    /// If no server is running.
    #[must_use = "the server is thawed when the guard drops"]
    pub fn freeze(&self) -> Frozen {
        let pid = self.running_pid("freeze");
        send_signal(pid, "STOP");
        Frozen { pid: Some(pid) }
    }

    /// Sends one command over a fresh TCP connection and returns its reply.
    /// An error reply is returned as [`RespValue::Error`], not a panic.
    ///
    /// # Panics
    ///
    /// On any I/O error, including a 10-second socket timeout.
    pub fn command(&self, args: &[&str]) -> RespValue {
        self.try_command(args, COMMAND_TIMEOUT)
            .unwrap_or_else(|e| panic!("redis command {args:?} on port {} failed: {e}", self.port))
    }

    /// Like [`command`](Self::command) but returns I/O errors, using
    /// `timeout` for connecting, writing and reading. A timed-out read is an
    /// error of kind `WouldBlock` or `TimedOut`; a stopped server gives
    /// `ConnectionRefused`.
    pub fn try_command(&self, args: &[&str], timeout: Duration) -> io::Result<RespValue> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        send_command(self.addr(), &args, timeout)
    }

    /// Runs `INFO commandstats` and returns, per command, how often it was
    /// called (for example `"set" -> 3`; subcommands look like
    /// `"config|resetstat"`).
    ///
    /// # Panics
    ///
    /// If the reply is not a bulk string.
    pub fn info_commandstats(&self) -> HashMap<String, u64> {
        let reply = self.command(&["INFO", "commandstats"]);
        let text = reply
            .as_string()
            .unwrap_or_else(|| panic!("unexpected INFO commandstats reply: {reply:?}"));
        parse_commandstats(&text)
    }

    /// Resets the server statistics (`CONFIG RESETSTAT`), including the
    /// counters of [`info_commandstats`](Self::info_commandstats).
    ///
    /// # Panics
    ///
    /// If the reply is not `OK`.
    pub fn config_resetstat(&self) {
        let reply = self.command(&["CONFIG", "RESETSTAT"]);
        assert!(reply.is_ok(), "CONFIG RESETSTAT failed: {reply:?}");
    }

    /// Returns all keys (found with `SCAN`), sorted.
    ///
    /// # Panics
    ///
    /// On an unexpected reply.
    pub fn keys(&self) -> Vec<String> {
        self.scan()
            .into_iter()
            .map(|key| String::from_utf8_lossy(&key).into_owned())
            .collect()
    }

    /// Returns all keys (found with `SCAN`) that have no expiry (`PTTL` is
    /// -1), sorted.
    ///
    /// # Panics
    ///
    /// On an unexpected reply.
    pub fn keys_without_ttl(&self) -> Vec<String> {
        let mut without_ttl = Vec::new();
        for key in self.scan() {
            let reply = send_command(self.addr(), &[b"PTTL", &key], COMMAND_TIMEOUT)
                .unwrap_or_else(|e| panic!("PTTL on port {} failed: {e}", self.port));
            // -2 means the key expired or was deleted since SCAN saw it.
            if reply == RespValue::Integer(-1) {
                without_ttl.push(String::from_utf8_lossy(&key).into_owned());
            }
        }
        without_ttl
    }

    /// Every key, as bytes, sorted: one full `SCAN`.
    fn scan(&self) -> BTreeSet<Vec<u8>> {
        let mut keys = BTreeSet::new();
        let mut cursor = String::from("0");
        loop {
            let reply = self.command(&["SCAN", &cursor, "COUNT", "1000"]);
            let RespValue::Array(parts) = &reply else {
                panic!("unexpected SCAN reply: {reply:?}");
            };
            let (Some(next), Some(RespValue::Array(batch))) = (parts.first(), parts.get(1)) else {
                panic!("unexpected SCAN reply: {reply:?}");
            };
            for key in batch {
                let key = key
                    .as_bytes()
                    .unwrap_or_else(|| panic!("unexpected key in SCAN reply: {key:?}"));
                keys.insert(key.to_vec());
            }
            cursor = next
                .as_string()
                .unwrap_or_else(|| panic!("unexpected SCAN cursor: {next:?}"));
            if cursor == "0" {
                break;
            }
        }
        keys
    }

    /// Deletes all keys of all databases (`FLUSHALL`).
    ///
    /// # Panics
    ///
    /// If the reply is not `OK`.
    pub fn flushall(&self) {
        let reply = self.command(&["FLUSHALL"]);
        assert!(reply.is_ok(), "FLUSHALL failed: {reply:?}");
    }

    /// Spawns `redis-server` on `self.port`, logging to `self.log_path`.
    fn spawn(&mut self) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.log_path.display()));
        let log_err = log
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot clone log file handle: {e}"));
        let port = self.port.to_string();
        let child = Command::new(&self.binary)
            .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .args(["--port", &port, "--daemonize", "no"])
            .args(&self.extra_args)
            .arg("--dir")
            .arg(&self.dir)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        match child {
            Ok(child) => self.child = Some(child),
            Err(e) if e.kind() == io::ErrorKind::NotFound => panic!(
                "redis-server not found on PATH: install it (apt-get install redis-server); \
                 Redis tests never skip ({}: {e})",
                self.binary.display()
            ),
            Err(e) => panic!("cannot spawn {}: {e}", self.binary.display()),
        }
    }

    /// Waits until our process answers `PING` with `PONG` on `self.port`.
    fn wait_ready(&mut self) -> Readiness {
        let deadline = Instant::now() + READY_TIMEOUT;
        let addr = self.addr();
        loop {
            let child = self.child.as_mut().expect("a server was spawned");
            match child.try_wait() {
                Ok(Some(status)) => return Readiness::Exited(status),
                Ok(None) => {}
                Err(e) => panic!("waiting for redis-server failed: {e}"),
            }
            let pid = child.id();
            let ping = send_command(addr, &[b"PING"], Duration::from_millis(500));
            if matches!(&ping, Ok(RespValue::Simple(s)) if s == "PONG") {
                // Make sure the PONG came from our process, not from another
                // server that grabbed the port first.
                match server_pid(addr) {
                    Some(p) if p == pid => return Readiness::Ready,
                    Some(_) => return Readiness::Foreign,
                    None => {}
                }
            }
            if Instant::now() >= deadline {
                return Readiness::TimedOut;
            }
            thread_sleep_ms(25);
        }
    }

    /// The pid of the running server, or a panic naming `what`.
    fn running_pid(&self, what: &str) -> u32 {
        self.pid().unwrap_or_else(|| {
            panic!(
                "cannot {what}: redis-server on port {} is not running",
                self.port
            )
        })
    }

    /// Current length of the log file (0 if it does not exist yet).
    fn log_len(&self) -> u64 {
        fs::metadata(&self.log_path).map(|m| m.len()).unwrap_or(0)
    }

    /// Whether the log written since `offset` reports a failed bind.
    fn bind_failed_since(&self, offset: u64) -> bool {
        let mut text = String::new();
        let read = File::open(&self.log_path).and_then(|mut f| {
            f.seek(SeekFrom::Start(offset))?;
            let mut bytes = Vec::new();
            f.read_to_end(&mut bytes)?;
            text = String::from_utf8_lossy(&bytes).into_owned();
            Ok(())
        });
        read.is_ok() && text.contains("Address already in use")
    }

    /// Kills the server and panics with the log, after `outcome` of `what`.
    fn fail(&mut self, what: &str, outcome: &Readiness) -> ! {
        let reason = match outcome {
            Readiness::Ready => "it became ready".to_string(),
            Readiness::Exited(status) => format!("it exited ({status})"),
            Readiness::Foreign => "another process answers on its port".to_string(),
            Readiness::TimedOut => format!("it did not answer PING within {READY_TIMEOUT:?}"),
        };
        self.fail_with(&format!(
            "redis-server {what} on port {} failed: {reason}",
            self.port
        ))
    }

    /// Kills the server and panics with `message` and the log.
    fn fail_with(&mut self, message: &str) -> ! {
        self.kill();
        let log = self.log_contents();
        let mut tail_start = log.len().saturating_sub(MAX_LOG_IN_PANIC);
        while !log.is_char_boundary(tail_start) {
            tail_start += 1;
        }
        let omitted = if tail_start > 0 {
            format!("[... {tail_start} earlier bytes omitted ...]\n")
        } else {
            String::new()
        };
        panic!(
            "{message}\n--- {} ---\n{omitted}{}--- end of log ---",
            self.log_path.display(),
            &log[tail_start..]
        )
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A server frozen by [`RedisServer::freeze`]; thawed (`SIGCONT`) by [`Frozen::thaw`] or on drop.
#[derive(Debug)]
pub struct Frozen {
    pid: Option<u32>,
}

impl Frozen {
    /// Thaws the server now (`SIGCONT`).
    ///
    /// # Panics
    ///
    /// If the signal cannot be sent.
    pub fn thaw(mut self) {
        if let Some(pid) = self.pid.take() {
            send_signal(pid, "CONT");
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // No panic here: this may run while a test unwinds. A process already gone needs nothing.
        if let Some(pid) = self.pid.take() {
            let _ = Command::new("kill")
                .args(["-s", "CONT", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Looks `redis-server` up on `PATH`, panicking loudly if it is missing.
fn find_redis_server() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("redis-server"))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "redis-server not found on PATH: install it (apt-get install redis-server); \
             Redis tests never skip"
        )
    })
}

/// Creates a new, unique directory under the system temp dir.
fn create_temp_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    loop {
        let n = DIR_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("tower-idempotency-redis-{}-{nanos}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("cannot create {}: {e}", dir.display()),
        }
    }
}

/// Asks the OS for a free port on `127.0.0.1` (by binding port 0).
fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap_or_else(|e| panic!("cannot bind a free port on 127.0.0.1: {e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("cannot read local address: {e}"))
        .port()
}

/// A free port below 55536 whose cluster bus port (the port + 10000) is free
/// too. Candidates come from a per-process sequence in 20000..45000, away from
/// the kernel's ephemeral range, where `free_port` finds its ports.
fn free_port_with_bus() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let start = u64::from(std::process::id()) * 7919;
    for _ in 0..2000 {
        let step = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20000 + ((start + step * 13) % 25000) as u16;
        let free = |p: u16| TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok();
        if free(port) && free(port + 10000) {
            return port;
        }
    }
    panic!("no free port with a free cluster bus port in 20000..45000")
}

/// Sends `SIGNAL` (a name such as `STOP`) to `pid` with the `kill` command.
fn send_signal(pid: u32, signal: &str) {
    let pid_arg = pid.to_string();
    let status = match Command::new("kill").args(["-s", signal, &pid_arg]).status() {
        // Without procps' `kill`, fall back to the shell's builtin.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Command::new("sh")
            .args(["-c", "kill -s \"$0\" \"$1\"", signal, &pid_arg])
            .status(),
        other => other,
    };
    match status {
        Ok(status) if status.success() => {}
        Ok(status) => panic!("kill -s {signal} {pid} failed: {status}"),
        Err(e) => panic!("cannot run kill -s {signal} {pid}: {e}"),
    }
}

/// The `process_id` reported by `INFO server` at `addr`, if readable.
fn server_pid(addr: SocketAddr) -> Option<u32> {
    let reply = send_command(addr, &[b"INFO", b"server"], Duration::from_millis(500)).ok()?;
    let text = reply.as_string()?;
    text.lines()
        .find_map(|line| line.trim().strip_prefix("process_id:"))
        .and_then(|pid| pid.parse().ok())
}

/// Parses `INFO commandstats` text into command name -> calls.
fn parse_commandstats(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (name, stats) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Opens a connection to `addr`, sends one command and reads one reply.
fn send_command(addr: SocketAddr, args: &[&[u8]], timeout: Duration) -> io::Result<RespValue> {
    let stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut request = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        request.extend_from_slice(arg);
        request.extend_from_slice(b"\r\n");
    }
    (&stream).write_all(&request)?;
    read_reply(&mut BufReader::new(stream))
}

/// Reads one RESP2 reply.
fn read_reply<R: BufRead>(reader: &mut R) -> io::Result<RespValue> {
    let line = read_line(reader)?;
    let (kind, rest) = line
        .split_first()
        .ok_or_else(|| protocol_error("empty reply line"))?;
    let text = String::from_utf8_lossy(rest).into_owned();
    match kind {
        b'+' => Ok(RespValue::Simple(text)),
        b'-' => Ok(RespValue::Error(text)),
        b':' => Ok(RespValue::Integer(parse_int(&text)?)),
        b'$' => {
            let Ok(len) = usize::try_from(parse_int(&text)?) else {
                return Ok(RespValue::Bulk(None));
            };
            let mut data = vec![0; len + 2];
            reader.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                return Err(protocol_error("bulk string not terminated by CRLF"));
            }
            data.truncate(len);
            Ok(RespValue::Bulk(Some(data)))
        }
        b'*' => {
            let Ok(len) = usize::try_from(parse_int(&text)?) else {
                return Ok(RespValue::Array(Vec::new()));
            };
            let mut items = Vec::with_capacity(len);
            for _ in 0..len {
                items.push(read_reply(reader)?);
            }
            Ok(RespValue::Array(items))
        }
        other => Err(protocol_error(&format!(
            "unexpected reply type byte {:?}",
            char::from(*other)
        ))),
    }
}

/// Reads one CRLF-terminated line, without the CRLF.
fn read_line<R: BufRead>(reader: &mut R) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\r\n") {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed in the middle of a reply",
        ));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

/// Parses the integer of a RESP header line.
fn parse_int(text: &str) -> io::Result<i64> {
    text.parse()
        .map_err(|_| protocol_error(&format!("invalid integer {text:?}")))
}

/// An `InvalidData` error for malformed replies.
fn protocol_error(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_string())
}

/// Sleeps for `ms` milliseconds.
fn thread_sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}
