//! The payments server as users run it (`cargo run -p example-payments`): a real process on a real
//! port, stopped with SIGTERM. Cargo builds the package's binaries before it runs this test.

#![cfg(unix)]

mod support;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use support::cut_proxy::{Cut, CutProxy};
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::{RedisServer, RespValue};

/// How long the example may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the example may take to exit after SIGTERM, or after a failed start.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the payments example's shutdown may take in these tests (`SHUTDOWN_TIMEOUT_MS`).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
/// The payments example's read timeouts (`src/http_server.rs`).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// What a timing bound allows on top: a signal's delivery, a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

const CHARGE: &str = r#"{"amount": 1000, "currency": "eur", "source": "tok_visa"}"#;
/// The credential the charges are made with.
const API_KEY: &str = "sk_test_alice";

/// A running example process.
struct Server {
    child: Child,
    /// The line it printed when it started listening.
    banner: String,
    addr: SocketAddr,
    /// Everything it wrote to stderr so far.
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts the payments example on a free port with `env`, and waits until it listens.
    fn start(env: &[(&str, &str)]) -> Server {
        Server::start_example("server", env)
    }

    /// Starts the example `name` on a free port with `env`, and waits until it listens.
    fn start_example(name: &'static str, env: &[(&str, &str)]) -> Server {
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
        let banner = loop {
            match rx.recv_timeout(START_TIMEOUT) {
                Ok(line) if line.starts_with("listening on ") => break line,
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
        let addr = banner
            .strip_prefix("listening on http://")
            .and_then(|rest| rest.split_whitespace().next())
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

    /// Waits until the example logs `needle` on stderr.
    fn wait_for_log(&self, needle: &str) {
        let deadline = Instant::now() + START_TIMEOUT;
        while !self.stderr_text().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log:\n{}",
                self.stderr_text()
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn stderr_text(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits for the process to exit; returns its status and its stderr.
    fn wait(self) -> (ExitStatus, String) {
        self.wait_within(EXIT_TIMEOUT)
    }

    /// Waits up to `bound` for the process to exit; returns its status and its stderr.
    fn wait_within(mut self, bound: Duration) -> (ExitStatus, String) {
        let status = support::wait_within(&mut self.child, bound);
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

fn spawn(example: &'static str, env: &[(&str, &str)]) -> Child {
    let mut command = Command::new(support::binary(example));
    command
        .env("ADDR", "127.0.0.1:0")
        .env_remove("REDIS_URL")
        .env_remove("LEDGER_REDIS_URL")
        .env_remove("REDIS_CLUSTER_URLS")
        .env_remove("PSP_LATENCY_MS")
        .env_remove("IDEMPOTENCY_WAIT_MS")
        .env_remove("SHUTDOWN_TIMEOUT_MS")
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
fn collect(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// Runs the payments example to its exit (it is expected to fail at start-up).
fn run_to_exit(env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    run_example_to_exit("server", env)
}

/// Runs the example `name` to its exit (it is expected to fail at start-up).
fn run_example_to_exit(name: &'static str, env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    let mut child = spawn(name, env);
    let stdout = collect(child.stdout.take().expect("piped stdout"));
    let stderr = collect(child.stderr.take().expect("piped stderr"));
    let status = support::wait_within(&mut child, EXIT_TIMEOUT);
    (
        status,
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    )
}

/// An HTTP/1.1 answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// `first` created something (201), `retry` is its replay, byte for byte, and Redis holds the one
/// idempotency record.
#[track_caller]
fn assert_replay_in_redis(first: &Answer, retry: &Answer, redis: &RedisServer) {
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
fn wait_for_balance(addr: SocketAddr, entry: &str) {
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

/// Every key in `redis`, with what it holds as text (lossy UTF-8; values, fields, members,
/// stream entries).
fn redis_contents(redis: &RedisServer) -> Vec<(String, String)> {
    fn text(value: &RespValue, out: &mut String) {
        match value {
            RespValue::Array(items) => items.iter().for_each(|item| text(item, out)),
            other => {
                let part = other
                    .as_string()
                    .or_else(|| other.as_integer().map(|n| n.to_string()))
                    .unwrap_or_else(|| panic!("unexpected reply {other:?}"));
                out.push_str(&part);
                out.push(' ');
            }
        }
    }
    let mut contents = Vec::new();
    for key in redis.keys() {
        let kind = redis.command(&["TYPE", &key]).as_string();
        let (read, range): (&str, &[&str]) = match kind.as_deref() {
            Some("string") => ("GET", &[]),
            Some("hash") => ("HGETALL", &[]),
            Some("set") => ("SMEMBERS", &[]),
            Some("zset") => ("ZRANGE", &["0", "-1", "WITHSCORES"]),
            Some("list") => ("LRANGE", &["0", "-1"]),
            Some("stream") => ("XRANGE", &["-", "+"]),
            other => panic!("{key} is a {other:?}"),
        };
        let mut args = vec![read, key.as_str()];
        args.extend(range);
        let mut stored = String::new();
        text(&redis.command(&args), &mut stored);
        contents.push((key, stored));
    }
    contents
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`), read to the end.
fn request(
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

fn create_charge(addr: SocketAddr, key: &str) -> Answer {
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

#[test]
fn start_up_prints_the_address_and_sigterm_exits_0() {
    let server = Server::start(&[]);
    assert_eq!(
        server.banner,
        format!("listening on http://{} (store: memory)", server.addr)
    );
    assert_ne!(server.addr.port(), 0);

    let list = request(
        server.addr,
        "GET",
        "/v1/charges",
        &[("Authorization", "Bearer sk_test_alice")],
        "",
    );
    assert_eq!(list.status, 200, "{list:?}");
    let anonymous = request(server.addr, "GET", "/v1/charges", &[], "");
    assert_eq!(anonymous.status, 401, "{anonymous:?}");

    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn sigterm_lets_an_in_flight_charge_finish() {
    let server = Server::start(&[
        ("PSP_LATENCY_MS", "500"),
        ("RUST_LOG", "info,example_payments=debug"),
    ]);
    let addr = server.addr;
    let started = Instant::now();
    let in_flight = thread::spawn(move || create_charge(addr, "slow-1"));
    // Once the request is at the (slow) provider, ask the server to stop.
    server.wait_for_log("provider: create payment");
    server.terminate();

    let answer = in_flight.join().expect("the request thread");
    assert_eq!(answer.status, 201, "{answer:?}");
    assert!(
        answer.body.contains("\"status\":\"captured\""),
        "{answer:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the provider's latency was not simulated"
    );
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(TcpStream::connect(addr).is_err(), "the port is closed");
}

/// With `IDEMPOTENCY_WAIT_MS`, a duplicate of a charge still at the (slow) provider waits for it
/// and gets its replay, not a `409`.
#[test]
fn idempotency_wait_ms_turns_a_409_into_the_replay() {
    let server = Server::start(&[
        ("PSP_LATENCY_MS", "800"),
        ("IDEMPOTENCY_WAIT_MS", "5000"),
        ("RUST_LOG", "info,example_payments=debug"),
    ]);
    let addr = server.addr;
    let first = thread::spawn(move || create_charge(addr, "waited-1"));
    server.wait_for_log("provider: create payment");
    let duplicate = create_charge(addr, "waited-1");
    let first = first.join().expect("the first request's thread");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((duplicate.status, &duplicate.body), (201, &first.body));
    assert!(
        duplicate.head.contains("idempotent-replayed: true"),
        "{duplicate:?}"
    );
    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// Asserts that a run ended before it listened, with a non-zero exit, no panic and exactly one
/// line on stderr; returns that line.
fn the_one_error_line(status: ExitStatus, stdout: &str, stderr: &str) -> String {
    assert!(!status.success(), "exit {status:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {stderr}");
    lines[0].to_owned()
}

#[test]
fn a_bad_redis_url_fails_clearly() {
    let (status, stdout, stderr) = run_to_exit(&[("REDIS_URL", "notaurl")]);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(line.contains("bad REDIS_URL"), "{line}");
    assert!(!line.contains("LEDGER_REDIS_URL"), "{line}");
}

#[test]
fn an_unreachable_redis_fails_clearly() {
    let started = Instant::now();
    let (status, stdout, stderr) = run_to_exit(&[("REDIS_URL", "redis://127.0.0.1:1")]);
    let line = the_one_error_line(status, &stdout, &stderr);
    // It names the variable that was set: the ledger's Redis defaults to REDIS_URL's.
    assert!(line.contains("cannot use Redis at REDIS_URL"), "{line}");
    assert!(!line.contains("LEDGER_REDIS_URL"), "{line}");
    assert!(started.elapsed() < Duration::from_secs(10), "it fails fast");
}

#[test]
fn an_unreachable_ledger_redis_names_ledger_redis_url() {
    let redis = RedisServer::start();
    let (status, stdout, stderr) = run_to_exit(&[
        ("REDIS_URL", &redis.url()),
        ("LEDGER_REDIS_URL", "redis://127.0.0.1:1"),
    ]);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(
        line.contains("cannot use Redis at LEDGER_REDIS_URL"),
        "{line}"
    );
}

#[test]
fn redis_end_to_end() {
    let redis = RedisServer::start();
    let url = redis.url();
    let server = Server::start(&[("REDIS_URL", &url)]);
    assert!(
        server.banner.ends_with("(store: redis)"),
        "{}",
        server.banner
    );

    let first = create_charge(server.addr, "redis-1");
    assert!(!first.head.contains("idempotent-replayed"), "{first:?}");
    let retry = create_charge(server.addr, "redis-1");
    assert_replay_in_redis(&first, &retry, &redis);
    wait_for_balance(server.addr, r#"{"amount":1000,"currency":"eur"}"#);

    // Every key and record is there now: the layer's, the provider's, the event stream, the
    // consumer's and the balances. None holds the credential, in its name or in its contents.
    let contents = redis_contents(&redis);
    assert!(contents.len() >= 5, "the records of a charge: {contents:?}");
    for (key, stored) in &contents {
        assert!(!key.contains(API_KEY), "{key}");
        assert!(!stored.contains(API_KEY), "{key} holds {stored}");
    }
    assert!(
        contents
            .iter()
            .any(|(key, _)| key.starts_with("payments:balance:{acct_")),
        "balances under the account's id: {contents:?}"
    );
    // Only the durable ledger data lives without a TTL: the event stream, the balances, the
    // charges (with their lists and indexes) and the provider's payments.
    for key in redis.keys_without_ttl() {
        let charges = key.starts_with("payments:{ledger}:") && !key.contains(":op:");
        assert!(
            key == "payments:{events}"
                || key.starts_with("payments:balance:") && key.ends_with(":available")
                || charges
                || key.starts_with("payments:{provider}:payment"),
            "{key} has no TTL"
        );
    }

    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// The payments example on a Redis Cluster (`REDIS_CLUSTER_URLS`): a charge runs once and
/// replays, its event goes through the stream and its consumer to the balance, and the records,
/// the stream and the balances spread over the masters.
#[test]
fn redis_cluster_end_to_end() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls().join(",");
    let server = Server::start(&[("REDIS_CLUSTER_URLS", &urls)]);
    assert!(
        server.banner.ends_with("(store: redis cluster)"),
        "{}",
        server.banner
    );

    let first = create_charge(server.addr, "cluster-1");
    let retry = create_charge(server.addr, "cluster-1");
    assert_eq!(
        (first.status, retry.status),
        (201, 201),
        "{first:?} {retry:?}"
    );
    assert!(
        retry.head.contains("idempotent-replayed: true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, first.body);
    wait_for_balance(server.addr, r#"{"amount":1000,"currency":"eur"}"#);
    let second = create_charge(server.addr, "cluster-2");
    assert_ne!(second.body, first.body, "another key, another charge");
    wait_for_balance(server.addr, r#"{"amount":2000,"currency":"eur"}"#);

    let keys = cluster.keys();
    let records: Vec<&String> = keys
        .iter()
        .filter(|k| k.starts_with("idempotency:"))
        .collect();
    assert_eq!(records.len(), 2, "one record per key: {keys:?}");
    assert!(keys.iter().any(|k| k == "payments:{events}"), "{keys:?}");

    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// Both `REDIS_URL` and `REDIS_CLUSTER_URLS`: which one is meant is unclear, so the example
/// refuses to start and says why.
#[test]
fn redis_url_and_cluster_urls_together_are_refused() {
    let (status, stdout, stderr) = run_to_exit(&[
        ("REDIS_URL", "redis://127.0.0.1:1"),
        ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:2"),
    ]);
    assert!(!status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("set REDIS_URL or REDIS_CLUSTER_URLS, not both"),
        "{stderr}"
    );
}

/// Opens a connection to `addr` and sends `part` of a request, no more.
fn send_part(addr: SocketAddr, part: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("the example accepts connections");
    stream.write_all(part).expect("the part is sent");
    stream
}

/// Sends `rest` one byte a second on a thread, as a slow client does, until the server closes.
fn trickle(stream: &TcpStream, rest: &[u8]) -> JoinHandle<()> {
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
fn read_until_closed(stream: &mut TcpStream, bound: Duration) -> (String, Duration) {
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

/// SIGTERM while a client holds a request it sent a part of: the example exits within its
/// shutdown timeout, and exits 0.
fn sigterm_with_a_half_sent_request_exits_in_time(part: &[u8]) {
    let server = Server::start(&[("SHUTDOWN_TIMEOUT_MS", "2000")]);
    let _client = send_part(server.addr, part);
    // Let the server read the part: the connection is then busy, no longer idle.
    thread::sleep(Duration::from_millis(200));
    server.terminate();
    let (status, stderr) = server.wait_within(SHUTDOWN_TIMEOUT + SLACK);
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn sigterm_with_12_bytes_of_a_request_line_exits_within_the_shutdown_timeout() {
    sigterm_with_a_half_sent_request_exits_in_time(b"POST /v1/cha");
}

#[test]
fn sigterm_with_half_sent_headers_exits_within_the_shutdown_timeout() {
    sigterm_with_a_half_sent_request_exits_in_time(
        b"POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk_te",
    );
}

/// Headers sent a byte a second: the connection is closed at the header read timeout, counted
/// from the start of the request, not from the last byte.
#[test]
fn slow_headers_are_cut_by_the_header_read_timeout() {
    let server = Server::start(&[]);
    let mut client = send_part(server.addr, b"POST /v1/charges HTTP/1.1\r\nHost: ");
    let writer = trickle(
        &client,
        b"localhost\r\nAuthorization: Bearer sk_test_alice\r\n\r\n",
    );
    let (received, closed_after) = read_until_closed(&mut client, HEADER_READ_TIMEOUT + SLACK);
    assert!(
        received.is_empty(),
        "no answer to a request never read: {received:?}"
    );
    assert!(
        closed_after >= HEADER_READ_TIMEOUT - Duration::from_millis(500),
        "closed after {closed_after:?}"
    );
    let _ = writer.join();
}

/// A body sent a byte a second: the request fails at the body read timeout, counted from the
/// end of the headers, not from the last byte.
#[test]
fn a_slow_body_is_cut_by_the_body_read_timeout() {
    let server = Server::start(&[]);
    let head = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Authorization: Bearer sk_test_alice\r\nIdempotency-Key: slow-body\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        CHARGE.len()
    );
    let (first, rest) = CHARGE.split_at(10);
    let mut client = send_part(server.addr, format!("{head}{first}").as_bytes());
    let writer = trickle(&client, rest.as_bytes());
    let (received, answered_after) = read_until_closed(&mut client, BODY_READ_TIMEOUT + SLACK);
    assert!(
        received.starts_with("HTTP/1.1 400 "),
        "the request failed: {received:?}"
    );
    assert!(received.contains("body-unreadable"), "{received:?}");
    assert!(
        answered_after >= BODY_READ_TIMEOUT - Duration::from_millis(500),
        "answered after {answered_after:?}"
    );
    let _ = writer.join();

    // Nothing was charged: a retry with the whole body runs.
    let retry = create_charge(server.addr, "slow-body");
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.head.contains("idempotent-replayed"), "{retry:?}");
}

/// `the client (`src/bin/client.rs`)` against the payments example: the flaky link loses the first answer, the
/// client layer retries with the same key, the server replays its stored answer, and the charge
/// is applied once (one charge in the list, its amount once in the balance).
#[test]
fn the_client_example_pays_once_through_a_flaky_link() {
    let server = Server::start(&[]);
    let url = format!("http://{}", server.addr);
    let (status, stdout, stderr) = run_example_to_exit("client", &[("SERVER", &url)]);
    assert!(
        status.success(),
        "exit {status:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let line = |prefix: &str| line_starting(&stdout, prefix);
    let lost = line("attempt 1: POST /v1/charges");
    assert!(
        lost.ends_with("the server answered 201 Created, the link lost it"),
        "{lost}"
    );
    let replayed = line("attempt 2: POST /v1/charges");
    assert!(
        replayed.ends_with("201 Created (idempotent-replayed: true)"),
        "{replayed}"
    );
    assert_eq!(key_of(&lost), key_of(&replayed), "one key on both attempts");
    assert!(
        !stdout.contains("attempt 3"),
        "two attempts only:\n{stdout}"
    );
    let done = line("charge ");
    assert!(
        done.ends_with(", after 2 attempts, replayed: true"),
        "{done}"
    );
    let id = charge_id(&done);

    // The server applied the charge once.
    assert_charges(server.addr, &[id]);
    wait_for_balance(server.addr, r#"{"amount":2500,"currency":"eur"}"#);

    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// The first line of `stdout` that starts with `prefix`.
fn line_starting(stdout: &str, prefix: &str) -> String {
    stdout
        .lines()
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{stdout}"))
        .to_owned()
}

/// The key a line of the client example names (`..., key <key>: ...` or `..., key <key>`).
fn key_of(line: &str) -> String {
    line.split("key ")
        .nth(1)
        .and_then(|rest| rest.split([':', ' ']).next())
        .filter(|key| !key.is_empty())
        .unwrap_or_else(|| panic!("no key in {line:?}"))
        .to_owned()
}

/// The charge id of the client example's last line (`charge <id>, after ...`).
fn charge_id(done: &str) -> &str {
    done.strip_prefix("charge ")
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("no charge id in {done:?}"))
}

/// The account's charges are exactly `ids`: each charge was made once.
#[track_caller]
fn assert_charges(addr: SocketAddr, ids: &[&str]) {
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

/// `the client (`src/bin/client.rs`)` through a proxy that cuts answers off after their head (a reset, or a
/// body that ends short): the layer's retries end at the head, so the example sends the charge
/// again with the same key until an answer arrives whole, and the server makes each charge once.
#[test]
fn the_client_example_sends_the_charge_again_when_its_answer_is_cut_off() {
    use Cut::{Pass, Reset, Truncate};
    let server = Server::start(&[]);
    // A connection per attempt until one passes: a cut connection is closed. The first carries
    // the attempt the example's own link loses, which the layer retries; each later cut is one
    // more send of the charge.
    let scripts: [&'static [Cut]; 3] = [
        &[Reset, Reset],
        &[Truncate, Truncate],
        &[Truncate, Reset, Truncate, Reset],
    ];
    let mut ids = Vec::new();
    for script in scripts {
        let proxy = CutProxy::start(server.addr, |n| script.get(n).copied().unwrap_or(Pass));
        let (status, stdout, stderr) = run_example_to_exit("client", &[("SERVER", &proxy.url())]);
        assert!(
            status.success(),
            "{script:?}: exit {status:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert_eq!(proxy.cuts(), script.len(), "{script:?}:\n{stdout}");

        let attempts: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("attempt "))
            .collect();
        assert_eq!(attempts.len(), script.len() + 1, "{script:?}:\n{stdout}");
        let key = key_of(attempts[0]);
        let sent_again: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("the answer was cut off"))
            .collect();
        assert_eq!(sent_again.len(), script.len() - 1, "{script:?}:\n{stdout}");
        for line in attempts.iter().chain(&sent_again) {
            assert_eq!(key_of(line), key, "one key on every send: {line}");
        }
        let last = attempts.last().expect("attempts");
        assert!(
            last.ends_with("201 Created (idempotent-replayed: true)"),
            "{script:?}: {last}"
        );
        let done = line_starting(&stdout, "charge ");
        let count = script.len() + 1;
        assert!(
            done.ends_with(&format!(", after {count} attempts, replayed: true")),
            "{script:?}: {done}"
        );
        ids.push(charge_id(&done).to_owned());
    }

    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert_charges(server.addr, &ids);
    wait_for_balance(server.addr, r#"{"amount":7500,"currency":"eur"}"#);
    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// Every answer cut off after its head: the example gives up at its deadline with an error that
/// names the charge's key. The charge was made once, and the same request sent again by hand
/// with that key gets its replay.
#[test]
fn the_client_example_names_the_key_when_every_answer_is_cut_off() {
    let server = Server::start(&[]);
    let proxy = CutProxy::start(server.addr, |n| {
        if n % 2 == 0 {
            Cut::Reset
        } else {
            Cut::Truncate
        }
    });
    let url = proxy.url();
    let env = [("SERVER", url.as_str()), ("DEADLINE_MS", "3000")];
    let (status, stdout, stderr) = run_example_to_exit("client", &env);

    assert!(!status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let key = key_of(&line_starting(&stdout, "attempt 1: "));
    assert!(proxy.cuts() >= 3, "the charge was sent again:\n{stdout}");
    assert!(!stdout.contains("\ncharge "), "{stdout}");
    let error = stderr.lines().last().unwrap_or_default();
    assert!(
        error.contains(&format!("charge with key {key} failed")),
        "the error names the key {key}: {stderr}"
    );

    // By hand, as an operator would: the same request with the key is the charge's replay.
    let auth = format!("Bearer {API_KEY}");
    let again = request(
        server.addr,
        "POST",
        "/v1/charges",
        &[
            ("Authorization", &auth),
            ("Idempotency-Key", &key),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        "amount=2500&currency=eur&source=tok_visa",
    );
    assert_eq!(again.status, 201, "{again:?}");
    assert!(
        again.head.contains("idempotent-replayed: true"),
        "{again:?}"
    );
    let json: serde_json::Value = serde_json::from_str(&again.body).expect("a charge");
    assert_charges(server.addr, &[json["id"].as_str().expect("an id")]);
    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}

/// One account creating charges as fast as it can is answered `429` (`rate_limit`, with
/// `Retry-After`) once it has written its quota of idempotency records
/// (`IDEMPOTENCY_QUOTA_BYTES`), and another account's charges are untouched.
#[test]
fn one_account_past_its_quota_leaves_the_others_untouched() {
    let server = Server::start(&[("IDEMPOTENCY_QUOTA_BYTES", "16384")]);
    let charge = |account: &str, key: &str| {
        request(
            server.addr,
            "POST",
            "/v1/charges",
            &[
                ("Authorization", &format!("Bearer {account}")),
                ("Idempotency-Key", key),
                ("Content-Type", "application/json"),
            ],
            CHARGE,
        )
    };
    let mut refused = None;
    for n in 0..200 {
        let answer = charge("sk_test_flood", &format!("flood-{n}"));
        if answer.status != 201 {
            refused = Some((n, answer));
            break;
        }
    }
    let (n, refused) = refused.expect("the quota refuses the flood");
    assert!(
        n >= 4,
        "half of 16 KiB holds several charges: refused after {n}"
    );
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(refused.head.contains("retry-after: "), "{refused:?}");
    assert!(refused.body.contains("\"rate_limit\""), "{refused:?}");
    for n in 0..3 {
        let other = charge("sk_test_other", &format!("other-{n}"));
        assert_eq!(other.status, 201, "the other account charges: {other:?}");
    }
    server.terminate();
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
}
