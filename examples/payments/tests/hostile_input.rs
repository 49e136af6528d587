//! Hostile input and a noisy tenant, as the payments example meets them. In process, on the
//! memory ledger (the example checks its input before any ledger is read): no API key,
//! parameters unknown, misspelt, malformed or out of bounds, as a form and as JSON, the largest
//! valid charge, and a route the API does not have. Then, against the server as users run it:
//! clients that send a request slowly or half of one, and one account charging past its quota.

mod support;

use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

use example_payments::REQUEST_LIMIT;
use support::api::{ALICE, Call, visa};
use support::harness::Harness;

/// The example's bound on `description`, in characters (`charges.rs`).
const DESCRIPTION_CHARS: usize = 1000;

/// No API key, an empty one, or a scheme other than Bearer: 401, and nothing runs or is kept.
#[tokio::test]
async fn no_or_empty_bearer_is_401() {
    let h = Harness::memory();
    let cases = [
        None,
        Some("Bearer"),
        Some("Bearer "),
        Some("Bearer    "),
        Some("Basic c2tfdGVzdDo="),
    ];
    for authorization in cases {
        for method in [Method::POST, Method::GET] {
            let mut call = Call::new(&h.router, method, "/v1/charges").key("k-401");
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

/// Sends `call` and asserts the example's validation error: 400 `invalid_request_error` with
/// `code`, naming `param` (or none), quoting little of the input, and `Cache-Control: no-store`.
async fn assert_refused(call: Call, code: &str, param: Option<&str>) {
    let reply = call.send().await;
    let text = reply.text();
    reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request_error", code);
    assert_eq!(reply.error()["param"], json!(param), "{text}");
    assert_eq!(reply.header("cache-control"), Some("no-store"), "{text}");
    assert!(reply.bytes.len() < 1024, "{} bytes: {text}", text.len());
}

/// `visa(100)` as JSON with `field` set to `value`, or left out when `value` is `Null`.
fn visa_with(field: &str, value: Value) -> String {
    let mut body = visa(100);
    body[field] = value;
    if let Some(fields) = body.as_object_mut() {
        fields.retain(|_, value| !value.is_null());
    }
    body.to_string()
}

/// Every parameter is checked, in a form as in JSON: an unknown or misspelt one is refused, one
/// out of its bounds named. Each refusal is `no-store`, so all go under one key and the corrected
/// request then runs under it; a misspelt refund amount refunds nothing.
#[tokio::test]
async fn parameters_are_checked_in_forms_and_json() {
    let h = Harness::memory();
    let create = || h.post("/v1/charges").auth(ALICE).key("fix-and-retry");
    let form = |body: String| create().form(&body);
    let json = |body: String| {
        create()
            .header("content-type", "application/json")
            .raw(body)
    };
    let with = |field: &str, value: Value| json(visa_with(field, value));
    let base = "amount=100&currency=eur&source=tok_visa";
    let x = |n: usize| "x".repeat(n);
    let too_long = x(DESCRIPTION_CHARS + 1);
    let many: String = (0..51).map(|i| format!("&metadata[k{i}]=v")).collect();
    let (invalid, unknown) = ("parameter_invalid", "parameter_unknown");
    #[rustfmt::skip]
    let cases = [
        (json("not json".into()), "invalid_json", None),
        (json(String::new()), "invalid_json", None),
        (json("[1, 2]".into()), invalid, None),
        (form(base.replace("100", "ten")), invalid, Some("amount")),
        (form(base.replace("100", "100000000")), invalid, Some("amount")),
        (with("amount", json!(0)), invalid, Some("amount")),
        (with("amount", json!(-5)), invalid, Some("amount")),
        (with("amount", json!(100_000_000)), invalid, Some("amount")),
        (with("amount", json!(i64::MAX)), invalid, Some("amount")),
        (with("amount", json!(10.5)), invalid, None),
        (with("amount", json!("ten")), invalid, None),
        (with("currency", json!("eu")), invalid, Some("currency")),
        (with("currency", json!("e1r")), invalid, Some("currency")),
        (with("source", json!("tok_nope")), invalid, Some("source")),
        (form(format!("{base}&capture=maybe")), invalid, Some("capture")),
        (with("capture", json!("yes")), invalid, None),
        (with("captur", json!(false)), unknown, None),
        (form(format!("{base}&customer=cus_1")), unknown, None),
        (form(format!("{base}&metadata[k]=v&metadat[k]=v")), unknown, None),
        (form(format!("{base}&description={too_long}")), invalid, Some("description")),
        (with("description", json!(too_long)), invalid, Some("description")),
        (form(format!("{base}{many}")), invalid, Some("metadata")),
        (form(format!("{base}&metadata[]=v")), invalid, Some("metadata")),
        (form(format!("{base}&metadata[{}]=v", x(41))), invalid, Some("metadata")),
        (form(format!("{base}&metadata[k]={}", x(501))), invalid, Some("metadata")),
        (with("metadata", json!({ "k": x(501) })), invalid, Some("metadata")),
        // 60 KB of a parameter's name, and of a bad value (which serde's message quotes): 200
        // bytes of either come back.
        (form(format!("{base}&{}=1", x(60_000))), unknown, None),
        (with("amount", json!(x(REQUEST_LIMIT - 80))), invalid, None),
    ];
    for (call, code, param) in cases {
        assert_refused(call, code, param).await;
    }
    for field in ["amount", "currency", "source"] {
        assert_refused(with(field, Value::Null), "parameter_missing", Some(field)).await;
    }
    assert_eq!(h.provider_counts(), (0, 0));

    let fixed = create().form(base).send().await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{}", fixed.text());
    assert!(!fixed.replayed());
    let id = fixed.json["id"].as_str().expect("a charge id");
    let path = format!("/v1/charges/{id}/refunds");
    let refund = || h.post(&path).auth(ALICE).key("refund");
    let unknown = "parameter_unknown";
    assert_refused(refund().form("amont=100"), unknown, None).await;
    assert_refused(refund().json(json!({ "amont": 100 })), unknown, None).await;
    h.assert_refunded(id, "captured", 0).await;
    assert_eq!(h.provider_counts(), (1, 1), "the charge's call alone");
}

/// The largest valid charge as stripe-python sends it: every bound at its maximum, every character
/// `%01` (the longest an ASCII character takes, as a form and as JSON). At exactly `REQUEST_LIMIT`
/// it is charged and replayed byte for byte; one byte more is `413` and runs nothing.
#[tokio::test]
async fn the_largest_valid_charge_fits_the_limits_and_replays_byte_for_byte() {
    let h = Harness::memory();
    let c = |n: usize| "\u{1}".repeat(n);
    let mut form = form_urlencoded::Serializer::new(String::new());
    form.extend_pairs([
        ("amount", "99999999"),
        ("currency", "eur"),
        ("source", "tok_visa"),
    ]);
    form.append_pair("description", &c(DESCRIPTION_CHARS));
    for i in 0..50 {
        form.append_pair(&format!("metadata[{}{i:02}]", c(38)), &c(500));
    }
    let charge = form.finish();
    let padded = |len: usize| format!("{charge}{}", "&".repeat(len - charge.len()));
    let create = |body: String| h.post("/v1/charges").auth(ALICE).key("largest").form(&body);

    let too_large = create(padded(REQUEST_LIMIT + 1)).send().await;
    assert_eq!(
        too_large.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        too_large.text()
    );
    assert_eq!(too_large.error_code(), "request_too_large");
    assert_eq!(h.provider_counts(), (0, 0));

    let first = create(padded(REQUEST_LIMIT)).send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json["description"], c(DESCRIPTION_CHARS));
    let metadata = first.json["metadata"].as_object();
    assert!(metadata.is_some_and(|m| m.len() == 50 && m.values().all(|v| *v == c(500))));
    let retry = create(padded(REQUEST_LIMIT)).send().await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes, "the same body, byte for byte");
    assert_eq!(h.provider_counts(), (1, 1));
}

/// A route the API does not have answers as Stripe's does, `404` with `{"error": {"type":
/// "invalid_request_error", "message": "Unrecognized request URL (POST: ...)"}}`, so that an SDK
/// call to an endpoint the example lacks raises a clear error (not "Invalid JSON received from
/// the Stripe API"); no key or API key is needed to learn that, and a long path is not echoed.
#[tokio::test]
async fn an_unknown_route_is_404_in_stripes_form() {
    let h = Harness::memory();
    let refund = h
        .post("/v1/refunds")
        .auth(ALICE)
        .key("refund-1")
        .form("charge=ch_1&amount=100");
    let long = format!("/v2/{}", "x".repeat(10_000));
    let calls = [
        (refund, "POST: /v1/refunds"),
        (h.get("/v2/nothing"), "GET: /v2/nothing"),
        (h.get(&long), "GET: /v2/xxxx"),
    ];
    for (call, named) in calls {
        let reply = call.send().await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
        assert_eq!(reply.content_type(), "application/json");
        assert_eq!(reply.error()["type"], "invalid_request_error");
        let message = reply.error()["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with(&format!("Unrecognized request URL ({named}")),
            "{message}"
        );
        assert!(reply.bytes.len() < 1024, "{} bytes", reply.bytes.len());
    }
    assert_eq!(h.provider_counts(), (0, 0), "nothing ran");
}

/// The server as users run it, a process on a port, spoken to by hand.
#[cfg(unix)]
mod server {
    use std::thread;
    use std::time::Duration;

    use serde_json::Value;

    use super::support::process::{
        BODY_READ_TIMEOUT, CHARGE, HEADER_READ_TIMEOUT, SHUTDOWN_TIMEOUT, SLACK, Server,
        create_charge, read_until_closed, request, send_part, trickle,
    };

    /// The head of a JSON charge as Alice under `key`, its body `CHARGE` still to come.
    fn head(key: &str) -> String {
        format!(
            "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Authorization: Bearer sk_test_alice\r\nIdempotency-Key: {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            CHARGE.len()
        )
    }

    /// SIGTERM while clients hold requests half sent (a request line, headers, a body): the
    /// server exits 0 within its shutdown timeout.
    #[test]
    fn sigterm_with_half_sent_requests_exits_within_the_shutdown_timeout() {
        let server = Server::start(&[("SHUTDOWN_TIMEOUT_MS", "2000")]);
        let headers = "POST /v1/charges HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk_te";
        let body = format!("{}{}", head("half-body"), &CHARGE[..10]);
        let parts = [
            b"POST /v1/cha".as_slice(),
            headers.as_bytes(),
            body.as_bytes(),
        ];
        let _clients: Vec<_> = parts
            .iter()
            .map(|part| send_part(server.addr, part))
            .collect();
        // Let the server read the parts: the connections are busy, no longer idle.
        thread::sleep(Duration::from_millis(200));
        server.terminate();
        let (status, stderr) = server.wait_within(SHUTDOWN_TIMEOUT + SLACK);
        assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    /// Headers sent a byte a second: the connection is closed at the header read timeout,
    /// counted from the start of the request, not from the last byte, and nothing is answered.
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
        let early = HEADER_READ_TIMEOUT - Duration::from_millis(500);
        assert!(closed_after >= early, "closed after {closed_after:?}");
        let _ = writer.join();
    }

    /// A body sent a byte a second: the request fails at the body read timeout, counted from the
    /// end of the headers, and nothing is charged or kept: the retry with the whole body runs.
    #[test]
    fn a_slow_body_is_cut_by_the_body_read_timeout() {
        let server = Server::start(&[]);
        let (first, rest) = CHARGE.split_at(10);
        let mut client = send_part(
            server.addr,
            format!("{}{first}", head("slow-body")).as_bytes(),
        );
        let writer = trickle(&client, rest.as_bytes());
        let (received, answered_after) = read_until_closed(&mut client, BODY_READ_TIMEOUT + SLACK);
        assert!(
            received.starts_with("HTTP/1.1 400 "),
            "the request failed: {received:?}"
        );
        assert!(
            received.contains(r#""code":"request_unreadable""#),
            "{received:?}"
        );
        let early = BODY_READ_TIMEOUT - Duration::from_millis(500);
        assert!(answered_after >= early, "answered after {answered_after:?}");
        let _ = writer.join();

        let retry = create_charge(server.addr, "slow-body");
        assert_eq!(retry.status, 201, "{retry:?}");
        assert!(!retry.head.contains("idempotent-replayed"), "{retry:?}");
        server.stop();
    }

    /// One account creating charges as fast as it can is answered `429` once it has written its
    /// quota of idempotency records (`IDEMPOTENCY_QUOTA_BYTES`): `rate_limit`, which Stripe's SDKs
    /// raise as their `RateLimitError` and retry after `Retry-After`. Another account's charges
    /// go on untouched.
    #[test]
    fn one_account_past_its_quota_leaves_the_others_untouched() {
        let server = Server::start(&[("IDEMPOTENCY_QUOTA_BYTES", "16384")]);
        let charge = |account: &str, key: &str| {
            let auth = format!("Bearer {account}");
            let json = ("Content-Type", "application/json");
            let headers = [
                ("Authorization", auth.as_str()),
                ("Idempotency-Key", key),
                json,
            ];
            request(server.addr, "POST", "/v1/charges", &headers, CHARGE)
        };
        let refused = (0..200)
            .map(|n| (n, charge("sk_test_flood", &format!("flood-{n}"))))
            .find(|(_, answer)| answer.status != 201);
        let (n, refused) = refused.expect("the quota refuses the flood");
        assert!(
            n >= 4,
            "half of 16 KiB holds several charges: refused after {n}"
        );
        assert_eq!(refused.status, 429, "{refused:?}");
        assert!(refused.head.contains("retry-after: "), "{refused:?}");
        assert!(
            refused.head.contains("stripe-should-retry: true"),
            "{refused:?}"
        );
        let body: Value = serde_json::from_str(&refused.body).unwrap_or_default();
        assert_eq!(
            body["error"]["type"], "invalid_request_error",
            "{refused:?}"
        );
        assert_eq!(body["error"]["code"], "rate_limit", "{refused:?}");
        for n in 0..3 {
            let other = charge("sk_test_other", &format!("other-{n}"));
            assert_eq!(other.status, 201, "the other account charges: {other:?}");
        }
        server.stop();
    }
}
