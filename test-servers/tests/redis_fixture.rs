//! Self-tests of the `redis-server` test fixture (`RedisServer`).

use std::io::ErrorKind;
use std::time::Duration;

use test_servers::redis_server::{RedisServer, RespValue};

fn pong() -> RespValue {
    RespValue::Simple("PONG".to_string())
}

#[test]
fn start_answers_ping() {
    let server = RedisServer::start();
    assert_ne!(server.port(), 0);
    assert_ne!(server.port(), 6379, "must never use the shared Redis");
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    assert_eq!(server.command(&["PING"]), pong());
}

#[test]
fn set_then_get() {
    let server = RedisServer::start();
    assert!(server.command(&["SET", "greeting", "hello"]).is_ok());
    assert_eq!(
        server.command(&["GET", "greeting"]),
        RespValue::Bulk(Some(b"hello".to_vec()))
    );
    assert_eq!(server.command(&["GET", "missing"]), RespValue::Bulk(None));
    assert!(matches!(
        server.command(&["NOSUCHCOMMAND"]),
        RespValue::Error(_)
    ));
}

#[test]
fn pause_times_out_and_resume_recovers() {
    let server = RedisServer::start();
    server.pause();
    let err = server
        .try_command(&["PING"], Duration::from_millis(300))
        .expect_err("a paused server must not answer");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "expected a timeout, got {err:?}"
    );
    server.resume();
    assert_eq!(server.command(&["PING"]), pong());
}

#[test]
fn kill_refuses_connections_and_restart_reuses_port() {
    let mut server = RedisServer::start();
    let port = server.port();
    assert!(server.command(&["SET", "k", "v"]).is_ok());

    server.kill();
    assert_eq!(server.pid(), None);
    let err = server
        .try_command(&["PING"], Duration::from_secs(1))
        .expect_err("a killed server must not answer");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err:?}");

    server.restart();
    assert_eq!(server.port(), port);
    assert_eq!(server.command(&["PING"]), pong());
    // Persistence is off: a restarted server starts empty.
    assert_eq!(server.command(&["GET", "k"]), RespValue::Bulk(None));
}

#[test]
fn stop_then_restart_and_restart_while_paused() {
    let mut server = RedisServer::start();
    let port = server.port();
    server.stop();
    let err = server
        .try_command(&["PING"], Duration::from_secs(1))
        .expect_err("a stopped server must not answer");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err:?}");
    server.restart();
    assert_eq!(server.command(&["PING"]), pong());

    // `restart` stops a paused server gracefully before starting anew.
    server.pause();
    server.restart();
    assert_eq!(server.port(), port);
    assert_eq!(server.command(&["PING"]), pong());
}

#[test]
fn info_commandstats_counts_set() {
    let server = RedisServer::start();
    server.config_resetstat();
    assert_eq!(server.info_commandstats().get("set"), None);
    assert!(server.command(&["SET", "a", "1"]).is_ok());
    assert!(server.command(&["SET", "b", "2"]).is_ok());
    let stats = server.info_commandstats();
    assert_eq!(stats.get("set"), Some(&2), "{stats:?}");
    assert_eq!(stats.get("get"), None, "{stats:?}");
}

#[test]
fn keys_without_ttl_and_flushall() {
    let server = RedisServer::start();
    assert!(server.command(&["SET", "forever", "1"]).is_ok());
    assert!(server.command(&["SET", "expiring", "1"]).is_ok());
    assert_eq!(
        server.command(&["EXPIRE", "expiring", "100"]),
        RespValue::Integer(1)
    );
    assert!(server.command(&["SET", "px", "1", "PX", "100000"]).is_ok());
    assert_eq!(server.keys_without_ttl(), vec!["forever".to_string()]);

    server.flushall();
    assert!(server.keys_without_ttl().is_empty());
    assert_eq!(server.command(&["DBSIZE"]), RespValue::Integer(0));
}

#[test]
fn keys_without_ttl_scans_many_keys() {
    let server = RedisServer::start();
    for i in 0..2500 {
        let key = format!("key:{i:04}");
        assert!(server.command(&["SET", &key, "v"]).is_ok());
        if i % 2 == 0 {
            assert_eq!(
                server.command(&["EXPIRE", &key, "100"]),
                RespValue::Integer(1)
            );
        }
    }
    let expected: Vec<String> = (0..2500)
        .filter(|i| i % 2 == 1)
        .map(|i| format!("key:{i:04}"))
        .collect();
    assert_eq!(server.keys_without_ttl(), expected);
}

#[test]
fn drop_kills_the_process_and_removes_the_dir() {
    let server = RedisServer::start();
    let port = server.port();
    let dir = server.dir().to_path_buf();
    assert!(dir.is_dir());
    // Dropping must also work on a paused server.
    server.pause();
    drop(server);
    assert!(!dir.exists(), "{} still exists", dir.display());
    let err = std::net::TcpStream::connect(("127.0.0.1", port)).expect_err("server must be gone");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err:?}");
}

#[test]
fn servers_are_independent() {
    let a = RedisServer::start();
    let b = RedisServer::start();
    assert_ne!(a.port(), b.port());
    assert!(a.command(&["SET", "only-in-a", "1"]).is_ok());
    assert_eq!(b.command(&["EXISTS", "only-in-a"]), RespValue::Integer(0));
}
