//! Hostile input and a noisy tenant, against the server as users run it: clients that send a
//! request a byte at a time or half of one and stop, and one account charging as fast as it can
//! past its quota. (Bodies that are too large, malformed or quoted back at length are refused
//! in-process: `charges.rs`.)

#![cfg(unix)]

mod support;

use std::thread;
use std::time::Duration;

use support::process::{
    BODY_READ_TIMEOUT, CHARGE, HEADER_READ_TIMEOUT, SHUTDOWN_TIMEOUT, SLACK, Server, create_charge,
    read_until_closed, request, send_part, trickle,
};

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
