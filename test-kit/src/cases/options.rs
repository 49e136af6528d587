//! Cases for the opt-in options over the store: the retention header (PROTOCOL.md §8.7).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use http::header::RETRY_AFTER;
use http::{HeaderName, Method, Request, Response, StatusCode};
use tower_test::mock;

use super::layer::assert_replay_of;
use crate::*;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::ScopeQuota;
use tower_idempotency::{IDEMPOTENCY_KEY_EXPIRES, Outcome, RequestBody, RetentionFormat};

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

/// With the retention header on, a `409` while the key's first request runs states a dedup window
/// from now: that run completes no earlier, so its record is kept at least until then, and the
/// moment its completion states is no earlier. PROTOCOL.md §8.7.
pub async fn retention_header_on_a_409_in_flight_is_a_window_from_now<H: Harness>(h: H) {
    let (mock, mut handle) = mock::pair::<Request<RequestBody<Body>>, Response<Body>>();
    let stating =
        layer(&h, h.store()).retention_header(IDEMPOTENCY_KEY_EXPIRES, RetentionFormat::HttpDate);
    let svc = service(stating, mock);
    let stated = |reply: &Reply| {
        let value = reply.header(IDEMPOTENCY_KEY_EXPIRES).unwrap_or_else(|| {
            panic!("§8.7: a 409 in flight carries the retention header when it is on: {reply:?}")
        });
        unix_seconds(httpdate::parse_http_date(value).expect("§8.7: an HTTP-date"))
    };

    let first = spawn_send(&svc, post("k", "x"));
    let (_request, respond) = handle
        .next_request()
        .await
        .expect("the first request reaches the inner service");
    let before = unix_seconds(SystemTime::now() + h.window());
    let conflict = send(&svc, post("k", "x")).await;
    let after = unix_seconds(SystemTime::now() + h.window());
    conflict.assert_in_flight();
    let in_flight = stated(&conflict);
    assert!(
        (before..=after).contains(&in_flight),
        "§8.7: a 409 in flight states now plus the dedup window: {in_flight}, not in \
         {before}..={after}"
    );

    respond.send_response(Response::new(Body::from("charged")));
    let first = first.await.expect("the first request's task");
    assert!(
        stated(&first) >= in_flight,
        "§8.7: the record is kept at least until the moment the 409 stated"
    );
    let mismatch = send(&svc, post("k", "other")).await;
    assert_eq!(
        mismatch.header(IDEMPOTENCY_KEY_EXPIRES),
        None,
        "§8.7: the layer's other problems state nothing"
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

/// With a quota per scope, one scope writing records as fast as it can is refused once its budget
/// is spent: `429` `quota-exceeded` with a `Retry-After` of when it has room again, before its key
/// is claimed. What it already holds is still answered (a replay, a `422`). Another scope's
/// requests run and replay as before, and the refused scope runs again once the wait has passed.
/// PROTOCOL.md §3.4.
pub async fn a_scope_past_its_quota_leaves_the_others_untouched<H: Harness>(h: H) {
    /// About what a response of `RESPONSE` bytes costs a budget: its body, headers and claim.
    const RESPONSE: usize = 60 * 1024;
    const COST: u64 = RESPONSE as u64 + 512;
    const QUOTA: u64 = 1 << 20;
    let store = Counting::new(h.store());
    let handler = Handler::ok(|_| created(pattern(RESPONSE)));
    let layer = layer(&h, ScopeQuota::new(store.clone(), QUOTA)).scope(account_scope);
    let svc = service(layer, handler.clone());

    // The flood: distinct keys, one after another, until the quota answers.
    let started = tokio::time::Instant::now();
    let (executed, refused) = flood(&svc, "acct_flood", 100).await;
    let executed = executed as u64;
    let refused = refused.expect("§3.4: a scope past its quota is refused");
    refused.assert_problem(ProblemKind::QuotaExceeded, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.outcome,
        Some(Outcome::QuotaExceeded),
        "§3.4, §6.5: the refusal's outcome is QuotaExceeded"
    );
    // Half the quota at once, plus what refilled meanwhile (half the quota per window), plus the
    // one request admitted with less than a response left.
    let rate = (QUOTA / 2) as f64 / h.window().as_secs_f64();
    let refilled = (rate * started.elapsed().as_secs_f64()) as u64;
    let most = (QUOTA / 2 + refilled) / COST + 1;
    assert!(
        (QUOTA / 2 / COST..=most).contains(&executed),
        "§3.4: a scope writes half its quota at once, and no more: {executed} responses of \
         {RESPONSE} bytes, expected at most {most}"
    );
    let retry_after: u64 = refused
        .header(RETRY_AFTER)
        .and_then(|v| v.parse().ok())
        .expect("§3.4: a refusal has a Retry-After in whole seconds");
    // What is owed is at most one response and a claim: the wait is that much refill, not the
    // dedup window.
    let longest = whole_seconds(Duration::from_secs_f64((COST + 256) as f64 / rate));
    assert!(
        (1..=longest).contains(&retry_after),
        "§3.4: Retry-After is the time the budget takes to refill, at most {longest} s: \
         {retry_after}"
    );
    let claims = store.calls().claim;
    let again = send(&svc, account_post("acct_flood", "flood-again")).await;
    again.assert_problem(ProblemKind::QuotaExceeded, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        store.calls().claim,
        claims,
        "§3.4: a request past its scope's quota claims nothing"
    );
    // What the scope already holds is still answered, from a read: the replay of a key it ran,
    // and 422 for that key with another body.
    let replay = send(&svc, account_post("acct_flood", "acct_flood-0")).await;
    assert_eq!(
        (replay.outcome, replay.status, replay.body.len()),
        (Some(Outcome::Replayed), StatusCode::CREATED, RESPONSE),
        "§3.4: past its quota, a scope's replay is answered: {replay:?}"
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let other_body = keyed(Method::POST, "/", "acct_flood-0")
        .header("x-account", "acct_flood")
        .body(Body::from("another charge"))
        .expect("a request");
    let mismatch = send(&svc, other_body).await;
    mismatch.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        store.calls().claim,
        claims,
        "§3.4: answered from a read of the key, with no claim"
    );

    // Another scope is untouched: it runs, and its retry replays.
    let other = send(&svc, account_post("acct_other", "k")).await;
    assert_eq!(
        other.outcome,
        Some(Outcome::Executed),
        "§3.4: another scope's request runs while one scope is past its quota: {other:?}"
    );
    assert_replay_of(&send(&svc, account_post("acct_other", "k")).await, &other);
    assert_eq!(
        handler.calls() as u64,
        executed + 1,
        "§3.4: the refused never ran"
    );

    // Once the wait has passed, the flooding scope runs again.
    h.advance(Duration::from_secs(retry_after)).await;
    let later = send(&svc, account_post("acct_flood", "flood-later")).await;
    assert_eq!(
        later.outcome,
        Some(Outcome::Executed),
        "§3.4: after Retry-After, the scope's budget has room again: {later:?}"
    );
}
