//! Hostile input and a noisy tenant: requests without credentials or keys, malformed, out of
//! bounds or as large as allowed (in-process, on memory and Redis), then clients that send a
//! request a byte at a time or half of one and stop, and one account charging as fast as it can
//! past its quota, against the server as users run it.

mod support;

use std::thread;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use serde_json::json;

use support::api::{ALICE, Call, visa};
use support::harness::{Harness, on_both_stores};

#[cfg(unix)]
use support::process::{
    BODY_READ_TIMEOUT, CHARGE, HEADER_READ_TIMEOUT, SHUTDOWN_TIMEOUT, SLACK, Server, create_charge,
    read_until_closed, request, send_part, trickle,
};

async fn no_or_empty_bearer_is_401(h: &mut Harness) {
    let cases: [Option<&str>; 5] = [
        None,
        Some("Bearer"),
        Some("Bearer "),
        Some("Bearer    "),
        Some("Basic c2tfdGVzdDo="),
    ];
    for authorization in cases {
        for method in [Method::POST, Method::GET] {
            let mut call = Call::new(&h.router, method.clone(), "/v1/charges").key("k-401");
            if let Some(value) = authorization {
                call = call.header("authorization", value);
            }
            let reply = call.json(visa(100)).send().await;
            reply.assert_error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing_api_key",
            );
            assert!(!reply.replayed());
        }
    }
    assert_eq!(h.provider_counts(), (0, 0));
}

async fn a_charge_without_idempotency_key_is_400(h: &mut Harness) {
    let reply = h
        .post("/v1/charges")
        .auth(ALICE)
        .json(visa(100))
        .send()
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(reply.content_type(), "application/problem+json");
    assert_eq!(h.provider_counts(), (0, 0));
}

/// A form's values are checked as JSON's are, and a parameter the API does not know is refused, as
/// Stripe refuses it.
async fn form_parameters_are_checked(h: &mut Harness) {
    let create = |key: &str, body: &str| h.post("/v1/charges").auth(ALICE).key(key).form(body);
    let reply = create("bad-1", "amount=ten&currency=eur&source=tok_visa")
        .send()
        .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_invalid",
    );
    assert_eq!(reply.json["error"]["param"], "amount");
    let reply = create(
        "bad-2",
        "amount=100&currency=eur&source=tok_visa&customer=cus_1",
    )
    .send()
    .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_unknown",
    );
    let reply = create(
        "bad-3",
        "amount=100&currency=eur&source=tok_visa&capture=maybe",
    )
    .send()
    .await;
    assert_eq!(reply.json["error"]["param"], "capture", "{}", reply.text());
    let many: String = (0..51).map(|i| format!("&metadata[k{i}]=v")).collect();
    let reply = create(
        "bad-4",
        &format!("amount=100&currency=eur&source=tok_visa{many}"),
    )
    .send()
    .await;
    assert_eq!(reply.json["error"]["param"], "metadata", "{}", reply.text());
    let long = "x".repeat(501);
    let reply = create(
        "bad-5",
        &format!("amount=100&currency=eur&source=tok_visa&metadata[k]={long}"),
    )
    .send()
    .await;
    assert_eq!(reply.json["error"]["param"], "metadata", "{}", reply.text());
    assert_eq!(h.provider_counts(), (0, 0));
}

async fn invalid_input_is_400(h: &mut Harness) {
    let cases: [(&str, &str, Option<&str>); 15] = [
        ("not json", "invalid_json", None),
        ("", "invalid_json", None),
        ("[1, 2]", "parameter_invalid", None),
        (
            r#"{"currency": "eur", "source": "tok_visa"}"#,
            "parameter_missing",
            Some("amount"),
        ),
        (
            r#"{"amount": 0, "currency": "eur", "source": "tok_visa"}"#,
            "parameter_invalid",
            Some("amount"),
        ),
        (
            r#"{"amount": -5, "currency": "eur", "source": "tok_visa"}"#,
            "parameter_invalid",
            Some("amount"),
        ),
        (
            r#"{"amount": 10.5, "currency": "eur", "source": "tok_visa"}"#,
            "parameter_invalid",
            None,
        ),
        (
            r#"{"amount": "ten", "currency": "eur", "source": "tok_visa"}"#,
            "parameter_invalid",
            None,
        ),
        (
            r#"{"amount": 100, "source": "tok_visa"}"#,
            "parameter_missing",
            Some("currency"),
        ),
        (
            r#"{"amount": 100, "currency": "eu", "source": "tok_visa"}"#,
            "parameter_invalid",
            Some("currency"),
        ),
        (
            r#"{"amount": 100, "currency": "e1r", "source": "tok_visa"}"#,
            "parameter_invalid",
            Some("currency"),
        ),
        (
            r#"{"amount": 100, "currency": "eur"}"#,
            "parameter_missing",
            Some("source"),
        ),
        (
            r#"{"amount": 100, "currency": "eur", "source": "tok_nope"}"#,
            "parameter_invalid",
            Some("source"),
        ),
        (
            r#"{"amount": 100, "currency": "eur", "source": "tok_visa", "capture": "yes"}"#,
            "parameter_invalid",
            None,
        ),
        // Misspelt, not left out: the charge is not captured by default.
        (
            r#"{"amount": 100, "currency": "eur", "source": "tok_visa", "captur": false}"#,
            "parameter_unknown",
            None,
        ),
    ];
    for (i, (body, code, param)) in cases.into_iter().enumerate() {
        let reply = h
            .post("/v1/charges")
            .auth(ALICE)
            .key(&format!("invalid-{i}"))
            .raw(body)
            .send()
            .await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            reply.text()
        );
        reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request_error", code);
        if let Some(param) = param {
            assert_eq!(reply.json["error"]["param"], param, "{body}");
        }
    }
    assert_eq!(h.provider_counts(), (0, 0));
}

/// A JSON refund with a parameter the API does not know is refused, not taken as a refund of the
/// rest with the parameter left out.
async fn a_misspelt_refund_amount_refunds_nothing(h: &mut Harness) {
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().expect("an id");
    let reply = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("misspelt-refund")
        .raw(r#"{"amont": 100}"#)
        .send()
        .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_unknown",
    );
    let charge = h.charge_status(ALICE, id).await;
    assert_eq!(
        (&charge["status"], &charge["amount_refunded"]),
        (&json!("captured"), &json!(0))
    );
    assert_eq!(h.provider_counts(), (1, 1), "the charge's call alone");
}

async fn amounts_out_of_bounds_are_400(h: &mut Harness) {
    for (i, amount) in [100_000_000, i64::MAX].into_iter().enumerate() {
        let reply = h
            .post("/v1/charges")
            .auth(ALICE)
            .key(&format!("too-much-{i}"))
            .json(visa(amount))
            .send()
            .await;
        reply.assert_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "parameter_invalid",
        );
        assert_eq!(reply.json["error"]["param"], "amount", "{}", reply.text());
    }
    assert_eq!(h.provider_counts(), (0, 0));
    let largest = h.charge(ALICE, visa(99_999_999)).await;
    assert_eq!(largest["amount"], 99_999_999);
}

async fn a_description_over_the_bound_is_400(h: &mut Harness) {
    let reply = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("long-description")
        .json(json!({
            "amount": 100,
            "currency": "eur",
            "source": "tok_visa",
            "description": "x".repeat(DESCRIPTION_LIMIT + 1),
        }))
        .send()
        .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_invalid",
    );
    assert_eq!(
        reply.json["error"]["param"],
        "description",
        "{}",
        reply.text()
    );
    assert_eq!(h.provider_counts(), (0, 0));
}

/// The largest valid charge, with the description whose JSON grows the most (every character a
/// control character, escaped as `\u00XX`), padded to the largest body: its 201 replays.
async fn the_largest_valid_charge_replays_byte_for_byte(h: &mut Harness) {
    let description = "\u{1}".repeat(DESCRIPTION_LIMIT);
    let body = json!({
        "amount": 99_999_999,
        "currency": "eur",
        "source": "tok_visa",
        "capture": false,
        "description": description,
    })
    .to_string();
    let padding = REQUEST_LIMIT - body.len();
    let body = format!("{}{body}", " ".repeat(padding));
    assert_eq!(body.len(), REQUEST_LIMIT);
    let create = || {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("largest")
            .raw(body.clone())
    };
    let first = create().send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json["description"], description.as_str());
    let retry = create().send().await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes, "the same body, byte for byte");
    assert_eq!(h.provider_counts(), (1, 1));
}

/// A request refused by validation (before any effect) is not stored (`Cache-Control: no-store`),
/// as Stripe saves nothing for it: the same key with a corrected body then charges, where a stored
/// 400 would have made it a mismatch. And a client's input is never quoted back at length: a
/// 60 KB unknown parameter, or a 60 KB bad value, comes back as a few hundred bytes, marked cut.
async fn a_validation_error_is_not_stored_nor_quoted_at_length(h: &mut Harness) {
    let huge = "p".repeat(60_000);
    let unknown = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("fix-and-retry")
        .form(&format!("amount=100&currency=eur&source=tok_visa&{huge}=1"))
        .send()
        .await;
    unknown.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_unknown",
    );
    assert_eq!(unknown.header("cache-control"), Some("no-store"));
    assert!(unknown.bytes.len() < 1024, "{} bytes", unknown.bytes.len());
    let message = unknown.error()["message"].as_str().unwrap_or_default();
    assert!(message.contains("[truncated]"), "{message}");

    let fixed = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("fix-and-retry")
        .form("amount=100&currency=eur&source=tok_visa")
        .send()
        .await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{}", fixed.text());
    assert!(!fixed.replayed());

    let prefix = r#"{"currency": "eur", "source": "tok_visa", "amount": ""#;
    let suffix = r#""}"#;
    let value = "\u{7f}".repeat(REQUEST_LIMIT - prefix.len() - suffix.len());
    let body = format!("{prefix}{value}{suffix}");
    let bad_value = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("bad-value")
        .raw(body)
        .send()
        .await;
    bad_value.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "parameter_invalid",
    );
    assert!(
        bad_value.bytes.len() < 1024,
        "{} bytes",
        bad_value.bytes.len()
    );
    assert_eq!(h.provider_counts(), (1, 1), "only the corrected charge");
}

/// The example's documented limits: characters of `description`, bytes of a request body.
const DESCRIPTION_LIMIT: usize = 1000;

const REQUEST_LIMIT: usize = 64 * 1024;

/// A route the API does not have answers as Stripe's does: `404` with
/// `{"error": {"type": "invalid_request_error", "message": "Unrecognized request URL (POST: ...)"}}`,
/// so that an SDK call to an endpoint the example lacks raises a clear error (not "Invalid JSON
/// received from the Stripe API"). No key or API key is needed to learn that.
#[tokio::test]
async fn an_unknown_route_is_404_in_stripes_form() {
    let h = Harness::memory();
    let refund = h
        .post("/v1/refunds")
        .auth(ALICE)
        .key("refund-1")
        .form("charge=ch_1&amount=100")
        .send()
        .await;
    assert_eq!(refund.status, StatusCode::NOT_FOUND, "{}", refund.text());
    assert!(refund.content_type().starts_with("application/json"));
    assert_eq!(refund.json["error"]["type"], "invalid_request_error");
    let message = refund.json["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("Unrecognized request URL (POST: /v1/refunds)."),
        "{message}"
    );
    let unknown = h.get("/v2/nothing").send().await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    let message = unknown.json["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.starts_with("Unrecognized request URL (GET: /v2/nothing)."),
        "{message}"
    );
    assert_eq!(h.provider_counts(), (0, 0), "nothing ran");
    h.finish();
}

on_both_stores!(
    no_or_empty_bearer_is_401,
    a_charge_without_idempotency_key_is_400,
    form_parameters_are_checked,
    invalid_input_is_400,
    a_misspelt_refund_amount_refunds_nothing,
    amounts_out_of_bounds_are_400,
    a_description_over_the_bound_is_400,
    the_largest_valid_charge_replays_byte_for_byte,
    a_validation_error_is_not_stored_nor_quoted_at_length,
);

/// SIGTERM while a client holds a request it sent a part of: the example exits within its
/// shutdown timeout, and exits 0.
#[cfg(unix)]
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

#[cfg(unix)]
#[test]
fn sigterm_with_12_bytes_of_a_request_line_exits_within_the_shutdown_timeout() {
    sigterm_with_a_half_sent_request_exits_in_time(b"POST /v1/cha");
}

#[cfg(unix)]
#[test]
fn sigterm_with_half_sent_headers_exits_within_the_shutdown_timeout() {
    sigterm_with_a_half_sent_request_exits_in_time(
        b"POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk_te",
    );
}

/// Headers sent a byte a second: the connection is closed at the header read timeout, counted
/// from the start of the request, not from the last byte.
#[cfg(unix)]
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
#[cfg(unix)]
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
#[cfg(unix)]
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
    server.stop();
}
