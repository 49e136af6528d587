//! The package's binaries run as users run them (`cargo run -p example-payments`): a real process
//! on a real port, stopped with SIGTERM, and HTTP/1.1 spoken by hand.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use test_servers::redis_server::{RedisServer, RespValue};

/// How long the example may take to print its address.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the example may take to exit after SIGTERM, or after a failed start.
pub(crate) const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the payments example's shutdown may take in these tests (`SHUTDOWN_TIMEOUT_MS`).
pub(crate) const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);

/// The payments example's read timeouts (`src/http_server.rs`).
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What a timing bound allows on top: a signal's delivery, a loaded machine.
pub(crate) const SLACK: Duration = Duration::from_millis(1500);

pub(crate) const CHARGE: &str = r#"{"amount": 1000, "currency": "eur", "source": "tok_visa"}"#;

/// The credential the charges are made with.
pub(crate) const API_KEY: &str = "sk_test_alice";

/// A running example process.
pub(crate) struct Server {
    child: Child,
    /// The line it printed when it started listening.
    pub banner: String,
    pub addr: SocketAddr,
    /// Everything it wrote to stderr so far.
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts the payments example on a free port with `env`, and waits until it listens.
    pub(crate) fn start(env: &[(&str, &str)]) -> Server {
        Server::start_example("server", env)
    }

    /// Starts the example `name` on a free port with `env`, and waits until it listens.
    pub(crate) fn start_example(name: &'static str, env: &[(&str, &str)]) -> Server {
        let mut child = spawn(name, env);
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = Arc::new(Mutex::new(String::new()));
        let stderr_reader = {
            let pipe = child.stderr.take().expect("piped stderr");
            let stderr = stderr.clone();
            thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut text = stderr.lock().unwrap_or_else(PoisonError::into_inner);
                    text.push_str(&line);
                    text.push('\n');
                }
            })
        };
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // `listening on http://...` (the server), `provider listening on http://...`.
        let banner = loop {
            match rx.recv_timeout(START_TIMEOUT) {
                Ok(line) if line.contains("listening on http://") => break line,
                Ok(_) => continue,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let _ = stderr_reader.join();
                    let stderr = stderr.lock().unwrap_or_else(PoisonError::into_inner);
                    panic!("the example did not print its address; stderr:\n{stderr}");
                }
            }
        };
        let addr = (banner.split_once("listening on http://"))
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no address in {banner:?}"));
        Server {
            child,
            banner,
            addr,
            stderr,
            stderr_reader: Some(stderr_reader),
        }
    }

    /// Its URL, as `PROVIDER_URL` or `SERVER` names it.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn stderr_text(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Stops the server as an orchestrator does (SIGTERM) and asserts that it exits 0, without a
    /// panic; returns its stderr.
    pub(crate) fn stop(self) -> String {
        self.terminate();
        let (status, stderr) = self.wait();
        assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    }

    /// Waits for the process to exit; returns its status and its stderr.
    pub(crate) fn wait(self) -> (ExitStatus, String) {
        self.wait_within(EXIT_TIMEOUT)
    }

    /// Waits up to `bound` for the process to exit; returns its status and its stderr.
    pub(crate) fn wait_within(mut self, bound: Duration) -> (ExitStatus, String) {
        let status = super::wait_within(&mut self.child, bound);
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
        (status, self.stderr_text())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(crate) fn spawn(example: &'static str, env: &[(&str, &str)]) -> Child {
    let mut command = Command::new(super::binary(example));
    command
        .env("ADDR", "127.0.0.1:0")
        .env_remove("REDIS_URL")
        .env_remove("REDIS_CLUSTER_URLS")
        .env_remove("PSP_LATENCY_MS")
        .env_remove("IDEMPOTENCY_WAIT_MS")
        .env_remove("SHUTDOWN_TIMEOUT_MS")
        .env_remove("DATABASE_URL")
        .env_remove("RECONCILE_AFTER_MS")
        .env_remove("PROVIDER_URL")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    command.spawn().expect("the example starts")
}

/// Reads a pipe to the end on a thread.
pub(crate) fn collect(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// Runs the payments example to its exit (it is expected to fail at start-up).
pub(crate) fn run_to_exit(env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    run_example_to_exit("server", env)
}

/// Runs the example `name` to its exit: a client, or a server expected to fail at start-up,
/// which fails the test at once if it starts listening instead.
pub(crate) fn run_example_to_exit(
    name: &'static str,
    env: &[(&str, &str)],
) -> (ExitStatus, String, String) {
    let mut child = spawn(name, env);
    let stderr = collect(child.stderr.take().expect("piped stderr"));
    let (tx, lines) = mpsc::channel();
    let pipe = child.stdout.take().expect("piped stdout");
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + EXIT_TIMEOUT;
    let mut stdout = String::new();
    // Until stdout closes (the process exited) or the deadline, which `wait_within` enforces.
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("listening on http://") {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = stderr.join().unwrap_or_default();
            panic!("{name} started instead of failing: {line}\nstderr:\n{stderr}");
        }
        stdout.push_str(&line);
        stdout.push('\n');
    }
    let status = super::wait_within(
        &mut child,
        deadline.saturating_duration_since(Instant::now()),
    );
    (status, stdout, stderr.join().unwrap_or_default())
}

/// An HTTP/1.1 answer.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    /// The body as JSON; panics unless it is.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|err| panic!("{err}: {self:?}"))
    }

    pub(crate) fn replayed(&self) -> bool {
        self.head.contains("idempotent-replayed: true")
    }
}

/// `first` created something (201), `retry` is its replay, byte for byte, and Redis holds the one
/// idempotency record.
#[track_caller]
pub(crate) fn assert_replay_in_redis(first: &Answer, retry: &Answer, redis: &RedisServer) {
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(
        retry.head.contains("idempotent-replayed: true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, first.body);
    let records = redis.command(&["KEYS", "idempotency:*"]);
    assert!(
        matches!(&records, RespValue::Array(keys) if keys.len() == 1),
        "one idempotency record in Redis: {records:?}"
    );
}

/// Waits until the payments example's balance (its ledger consumer's work) lists `entry`.
pub(crate) fn wait_for_balance(addr: SocketAddr, entry: &str) {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let auth = format!("Bearer {API_KEY}");
        let balance = request(addr, "GET", "/v1/balance", &[("Authorization", &auth)], "");
        if balance.body.contains(entry) {
            return;
        }
        assert!(Instant::now() < deadline, "no {entry} in {balance:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`), read to the end.
pub(crate) fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut stream = TcpStream::connect(addr).expect("the example accepts connections");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("a socket timeout");
    let mut message = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        message.push_str(&format!("{name}: {value}\r\n"));
    }
    message.push_str("\r\n");
    message.push_str(body);
    stream
        .write_all(message.as_bytes())
        .expect("the request is sent");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("the response is read");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    Answer {
        status,
        head: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

pub(crate) fn create_charge(addr: SocketAddr, key: &str) -> Answer {
    request(
        addr,
        "POST",
        "/v1/charges",
        &[
            ("Authorization", &format!("Bearer {API_KEY}")),
            ("Idempotency-Key", key),
            ("Content-Type", "application/json"),
        ],
        CHARGE,
    )
}

/// `POST path` as [`API_KEY`] under the idempotency key `key`, with a form `body`, as Stripe's
/// SDKs send it.
pub(crate) fn post_form(addr: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    let auth = format!("Bearer {API_KEY}");
    let form = "application/x-www-form-urlencoded";
    let headers = [
        ("Authorization", auth.as_str()),
        ("Idempotency-Key", key),
        ("Content-Type", form),
    ];
    request(addr, "POST", path, &headers, body)
}

/// `GET path` as [`API_KEY`].
pub(crate) fn get(addr: SocketAddr, path: &str) -> Answer {
    let auth = format!("Bearer {API_KEY}");
    request(addr, "GET", path, &[("Authorization", &auth)], "")
}

/// Asserts that a run ended before it listened, with a non-zero exit, no panic and exactly one
/// line on stderr; returns that line.
pub(crate) fn the_one_error_line(status: ExitStatus, stdout: &str, stderr: &str) -> String {
    assert!(!status.success(), "exit {status:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {stderr}");
    lines[0].to_owned()
}

/// The first line of `stdout` that starts with `prefix`.
pub(crate) fn line_starting(stdout: &str, prefix: &str) -> String {
    stdout
        .lines()
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{stdout}"))
        .to_owned()
}

/// The key a line of the client example names (`..., key <key>: ...` or `..., key <key>`).
pub(crate) fn key_of(line: &str) -> String {
    line.split("key ")
        .nth(1)
        .and_then(|rest| rest.split([':', ' ']).next())
        .filter(|key| !key.is_empty())
        .unwrap_or_else(|| panic!("no key in {line:?}"))
        .to_owned()
}

/// The charge id of the client example's last line (`charge <id>, after ...`).
pub(crate) fn charge_id(done: &str) -> &str {
    done.strip_prefix("charge ")
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("no charge id in {done:?}"))
}

/// The account's charges are exactly `ids`: each charge was made once.
#[track_caller]
pub(crate) fn assert_charges(addr: SocketAddr, ids: &[&str]) {
    let auth = format!("Bearer {API_KEY}");
    let list = request(addr, "GET", "/v1/charges", &[("Authorization", &auth)], "");
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(
        list.body.matches("\"object\":\"charge\"").count(),
        ids.len(),
        "{list:?}"
    );
    for id in ids {
        assert!(
            list.body.contains(&format!("\"id\":\"{id}\"")),
            "{id}: {list:?}"
        );
    }
}

/// Opens a connection to `addr` and sends `part` of a request, no more.
pub(crate) fn send_part(addr: SocketAddr, part: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("the example accepts connections");
    stream.write_all(part).expect("the part is sent");
    stream
}

/// Sends `rest` one byte a second on a thread, as a slow client does, until the server closes.
pub(crate) fn trickle(stream: &TcpStream, rest: &[u8]) -> JoinHandle<()> {
    let mut stream = stream.try_clone().expect("a second handle on the socket");
    let rest = rest.to_vec();
    thread::spawn(move || {
        for byte in rest {
            thread::sleep(Duration::from_secs(1));
            if stream.write_all(&[byte]).is_err() {
                return;
            }
        }
    })
}

/// Reads what the server sends until it closes the connection; panics when that takes longer
/// than `bound`. Returns what was read and when the connection closed.
pub(crate) fn read_until_closed(stream: &mut TcpStream, bound: Duration) -> (String, Duration) {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(bound))
        .expect("a socket timeout");
    let mut received = Vec::new();
    let mut buffer = [0; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&buffer[..n]),
            Err(err) if err.kind() == ErrorKind::ConnectionReset => break,
            Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!(
                    "the server kept the connection open for {bound:?}; it sent {:?}",
                    String::from_utf8_lossy(&received)
                )
            }
            Err(err) => panic!("reading failed: {err}"),
        }
    }
    (
        String::from_utf8_lossy(&received).into_owned(),
        started.elapsed(),
    )
}
