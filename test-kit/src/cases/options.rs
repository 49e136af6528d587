//! Cases for the opt-in options over the store: the retention header (PROTOCOL.md §8.7).

use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderName;

use crate::*;
use tower_idempotency::{IDEMPOTENCY_KEY_EXPIRES, Outcome, RetentionFormat};

/// The seconds since the epoch of `at`, rounded down.
fn unix_seconds(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs()
}

/// With the retention header on, the first response and every replay state the same moment: the
/// completion's time plus the dedup window, to the second. The record lives until then (a replay
/// just before it) and no longer (the request runs again just after it), and the new record
/// states its own moment. A response that leaves no record carries no header.
/// PROTOCOL.md §8.6, §8.7.
pub async fn retention_header_states_the_records_expiry<H: Harness>(h: H) {
    let handler = Handler::ok(|call| {
        if call.body == "free" {
            respond(503, "try again")
        } else {
            created(format!("call {}", call.n))
        }
    });
    let stating =
        layer(&h, h.store()).retention_header(IDEMPOTENCY_KEY_EXPIRES, RetentionFormat::HttpDate);
    let svc = service(stating, handler.clone());
    let m = margin(&h);
    let stated = |reply: &Reply| {
        let value = reply.header(IDEMPOTENCY_KEY_EXPIRES).unwrap_or_else(|| {
            panic!("§8.7: a response that leaves a record carries the retention header: {reply:?}")
        });
        let at = httpdate::parse_http_date(value)
            .expect("§8.7: the retention header is an HTTP-date by default");
        unix_seconds(at)
    };

    let before = unix_seconds(SystemTime::now() + h.window());
    let first = send(&svc, post("k", "x")).await;
    let after = unix_seconds(SystemTime::now() + h.window());
    assert_eq!(
        first.outcome,
        Some(Outcome::Executed),
        "§6.2: a new key runs the handler"
    );
    let expires = stated(&first);
    assert!(
        (before..=after).contains(&expires),
        "§8.7: the retention header states the completion's time plus the dedup window: \
         {expires}, not in {before}..={after}"
    );

    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(
        replay.outcome,
        Some(Outcome::Replayed),
        "§6.4: a retry gets the replay"
    );
    assert_eq!(
        replay.header(IDEMPOTENCY_KEY_EXPIRES),
        first.header(IDEMPOTENCY_KEY_EXPIRES),
        "§8.7: a replay states the same moment as the first response"
    );
    h.advance(h.window() - m).await;
    let late = send(&svc, post("k", "x")).await;
    assert_eq!(
        late.outcome,
        Some(Outcome::Replayed),
        "§8.6, §8.7: the record is kept until the stated moment"
    );
    assert_eq!(
        stated(&late),
        expires,
        "§8.7: a late replay still states the record's moment"
    );
    h.advance(m + m).await;
    let again = send(&svc, post("k", "x")).await;
    assert_eq!(
        (again.outcome, again.text()),
        (Some(Outcome::Executed), "call 2".into()),
        "§8.6, §8.7: the record is not kept past the stated moment: the request runs again"
    );
    assert!(
        stated(&again) >= expires,
        "§8.7: a new record states its own moment"
    );

    let released = send(&svc, post("other", "free")).await;
    assert_eq!(
        released.outcome,
        Some(Outcome::NotStored),
        "§8.1: a 503 is not stored"
    );
    assert_eq!(
        released.header(IDEMPOTENCY_KEY_EXPIRES),
        None,
        "§8.7: a response that leaves no record carries no retention header"
    );
    let default = send(&service(layer(&h, h.store()), handler), post("k2", "x")).await;
    assert_eq!(
        default.outcome,
        Some(Outcome::Executed),
        "§6.2: a new key runs the handler"
    );
    assert_eq!(
        default.header(IDEMPOTENCY_KEY_EXPIRES),
        None,
        "§8.7: the retention header is off by default"
    );
}

/// The retention header under another name, as a structured-field Date.
/// PROTOCOL.md §8.7.
pub async fn retention_header_takes_a_name_and_format<H: Harness>(h: H) {
    let name = HeaderName::from_static("x-key-kept-until");
    let named =
        layer(&h, h.store()).retention_header(name.clone(), RetentionFormat::StructuredDate);
    let svc = service(named, Handler::ok(|_| created("done")));

    let before = unix_seconds(SystemTime::now() + h.window());
    let first = send(&svc, post("k", "x")).await;
    let after = unix_seconds(SystemTime::now() + h.window());
    let value = first
        .header(&name)
        .expect("§8.7: the retention header goes under the name given");
    let seconds: u64 = value
        .strip_prefix('@')
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("§8.7: a structured-field Date is @<seconds>: {value:?}"));
    assert!(
        (before..=after).contains(&seconds),
        "§8.7: the retention header states the completion's time plus the dedup window: \
         {seconds}, not in {before}..={after}"
    );
    assert_eq!(
        first.header(IDEMPOTENCY_KEY_EXPIRES),
        None,
        "§8.7: under another name, the default name is not sent"
    );
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(
        replay.header(&name),
        Some(value),
        "§8.7: a replay states the same moment under the same name"
    );
}
