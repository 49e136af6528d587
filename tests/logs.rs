//! The layer's `tracing` events (PROTOCOL.md §12: every outcome is visible, with the key and scope
//! hashed), captured by the binary's global subscriber; the tests take turns.

use http::HeaderValue;
use http::Method;
use test_servers::logs::{Captured, LogEvent};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome, Scope};
use tower_idempotency_test::{Faulty, Handler, created, keyed, post, send, service};

/// The layer's outcome events logged since `from`.
fn outcomes_since(captured: &Captured, from: usize) -> Vec<LogEvent> {
    (captured.since(from).into_iter())
        .filter(|e| e.target == "tower_idempotency" && e.field("outcome").is_some())
        .collect()
}

/// Each protected request logs one outcome event (target `tower_idempotency`) carrying its
/// `outcome`, and the key and scope as short hashes; neither the raw key, the raw scope nor the
/// body ever appears in a log.
#[tokio::test(start_paused = true)]
async fn each_protected_request_logs_its_outcome_without_the_raw_key() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let raw_key = "raw-key-4f1c9e";
    let body = "card=4242424242424242";
    let svc = service(
        IdempotencyLayer::new(MemoryStore::new()).scope(|parts: &http::request::Parts| {
            Ok(Scope::from(parts.uri.path().trim_start_matches('/')))
        }),
        Handler::ok(|call| created(format!("call {}", call.n))),
    );
    let request = |scope: &str, key: &str, body: &'static str| {
        keyed(Method::POST, &format!("/{scope}"), key)
            .body(axum::body::Body::from(body))
            .expect("a request")
    };

    let from = captured.len();
    let mut tags = Vec::new();
    let cases = [
        (request("acct_a", raw_key, body), Outcome::Executed),
        (request("acct_a", raw_key, body), Outcome::Replayed),
        (request("acct_a", raw_key, "other body"), Outcome::Mismatch),
        (request("acct_b", raw_key, body), Outcome::Executed),
    ];
    for (request, outcome) in cases {
        let before = captured.len();
        let reply = send(&svc, request).await;
        assert_eq!(reply.outcome, Some(outcome));
        let events = outcomes_since(captured, before);
        assert_eq!(events.len(), 1, "one outcome event per request: {events:?}");
        let event = &events[0];
        assert_eq!(event.field("outcome"), Some(outcome.as_str()));
        // What a client did wrong is news; what went as it should is detail.
        let level = match outcome {
            Outcome::Mismatch => tracing::Level::INFO,
            _ => tracing::Level::DEBUG,
        };
        assert_eq!(event.level, level, "{event:?}");
        let key = event.field("key").expect("a key field").to_owned();
        let scope = event.field("scope").expect("a scope field").to_owned();
        assert!(!key.is_empty() && !scope.is_empty(), "{event:?}");
        tags.push((key, scope));
    }
    assert_eq!(tags[0], tags[1], "the same key and scope, the same tags");
    assert_eq!(tags[0], tags[2]);
    assert_ne!(
        tags[0].0, tags[3].0,
        "the key tag is of the record (scope and key)"
    );
    assert_ne!(tags[0].1, tags[3].1, "two scopes, two scope tags");

    // A key that cannot be parsed has no record: the event has the outcome alone.
    let before = captured.len();
    let invalid = http::Request::post("/acct_a")
        .header(
            "idempotency-key",
            HeaderValue::from_static("raw key 4f1c9e"),
        )
        .body(axum::body::Body::from(body))
        .expect("a request");
    assert_eq!(send(&svc, invalid).await.outcome, Some(Outcome::Rejected));
    let events = outcomes_since(captured, before);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].field("outcome"), Some("rejected"));
    assert_eq!(events[0].level, tracing::Level::INFO);

    // A handler that failed is a warning.
    let failing = service(
        IdempotencyLayer::new(MemoryStore::new()).single_tenant(),
        Handler::new(|_| async { Err("the handler failed".into()) }),
    );
    let before = captured.len();
    let reply = send(&failing, post("k", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::HandlerFailed));
    let events = outcomes_since(captured, before);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].level, tracing::Level::WARN);

    for event in captured.events().iter().skip(from) {
        for (name, value) in &event.fields {
            assert!(
                !value.contains("4f1c9e") && !value.contains("4242") && !value.contains("acct_"),
                "{name} of {event:?} leaks the key, the scope or the body"
            );
        }
    }
}

/// Events logged while the detached handler runs (a store write that fails) are attributable to
/// the request: they carry its key and scope tags.
#[tokio::test(start_paused = true)]
async fn events_of_the_detached_handler_carry_the_request_tags() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let faulty = Faulty::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(faulty.clone());
    let shutdown = layer.shutdown_handle();
    let svc = service(layer, Handler::ok(|_| created("ok")));

    let from = captured.len();
    faulty.fail_writes(true);
    let reply = send(&svc, post("k", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed));
    // A few retries fail too; then the store is back, and the write lands.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    faulty.fail_writes(false);
    shutdown.wait().await;
    let events: Vec<_> = captured
        .events()
        .into_iter()
        .skip(from)
        .filter(|e| e.target == "tower_idempotency")
        .collect();
    let outcome = events
        .iter()
        .find(|e| e.field("outcome").is_some())
        .expect("an outcome event");
    let write_failures: Vec<_> = events
        .iter()
        .filter(|e| e.field("operation") == Some("complete"))
        .collect();
    assert!(write_failures.len() >= 2, "{events:?}");
    for event in write_failures {
        assert_eq!(event.field("key"), outcome.field("key"), "{event:?}");
        assert_eq!(event.field("scope"), outcome.field("scope"), "{event:?}");
    }
}

/// A store that refuses every claim (full, or away) is warned of once per interval, with the
/// number of refusals held back, not once or twice per refused request.
#[tokio::test(start_paused = true)]
async fn repeated_store_refusals_are_warned_of_once_per_interval_with_a_count() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let store = MemoryStore::with_capacity(0);
    let svc = service(IdempotencyLayer::new(store), Handler::ok(|_| created("ok")));
    let refusals = |from: usize| -> Vec<LogEvent> {
        captured
            .events()
            .into_iter()
            .skip(from)
            .filter(|e| {
                e.field("message")
                    .is_some_and(|m| m.starts_with("idempotency store failed at claim time"))
            })
            .collect()
    };

    let from = captured.len();
    for n in 0..50 {
        let reply = send(&svc, post(&format!("k{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable));
    }
    let warned = refusals(from);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].field("held_back"), Some("0"));

    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    let from = captured.len();
    assert_eq!(
        send(&svc, post("k-later", "x")).await.outcome,
        Some(Outcome::StoreUnavailable)
    );
    let warned = refusals(from);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].field("held_back"), Some("49"));
}

/// The interval is the layer's, not each service's: a router may build a service per connection
/// (axum's does for each one it serves) or per request, and each must not warn again.
/// PROTOCOL.md §12.3.
#[tokio::test(start_paused = true)]
async fn store_refusals_are_warned_of_once_per_layer_whatever_builds_its_services() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let layer = IdempotencyLayer::new(MemoryStore::with_capacity(0));
    let from = captured.len();
    for n in 0..20 {
        // A service of its own for each request, from the layer or from a clone of it.
        let svc = service(layer.clone(), Handler::ok(|_| created("ok")));
        let reply = send(&svc, post(&format!("k{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::StoreUnavailable));
    }
    let warned: Vec<_> = captured
        .events()
        .into_iter()
        .skip(from)
        .filter(|e| {
            e.field("message")
                .is_some_and(|m| m.starts_with("idempotency store failed at claim time"))
        })
        .collect();
    assert_eq!(
        warned.len(),
        1,
        "one warning for the layer's 20 services: {warned:?}"
    );
}

/// A layer without a scope warns once that every client shares one key space, however many
/// services it builds; a scoped layer, or one declared single-tenant, does not.
#[tokio::test]
async fn a_layer_without_a_scope_warns_once_unless_single_tenant() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let unscoped = |from: usize| {
        captured
            .events()
            .into_iter()
            .skip(from)
            .filter(|e| {
                e.field("message")
                    .is_some_and(|m| m.contains("protects routes without a scope"))
            })
            .count()
    };
    let from = captured.len();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    for n in 0..5 {
        let svc = service(layer.clone(), Handler::ok(|_| created("ok")));
        send(&svc, post(&format!("k{n}"), "x")).await;
    }
    assert_eq!(unscoped(from), 1, "one warning for the layer's services");

    let from = captured.len();
    let scoped = IdempotencyLayer::new(MemoryStore::new())
        .scope(|_: &http::request::Parts| Ok(Scope::from("t")));
    let single = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    send(
        &service(scoped, Handler::ok(|_| created("ok"))),
        post("k", "x"),
    )
    .await;
    send(
        &service(single, Handler::ok(|_| created("ok"))),
        post("k", "x"),
    )
    .await;
    assert_eq!(unscoped(from), 0, "no warning where the tenancy is stated");
}

/// A request running on a layer with a 30 s lease over a `Faulty` memory store, its handler held
/// at `gate` once it started.
struct Running {
    store: Faulty<MemoryStore>,
    svc: tower_idempotency::Idempotency<Handler, Faulty<MemoryStore>>,
    gate: std::sync::Arc<tokio::sync::Notify>,
    first: tokio::task::JoinHandle<tower_idempotency_test::Reply>,
}

async fn running() -> Running {
    let store = Faulty::new(MemoryStore::new());
    let (started, gate) = (
        std::sync::Arc::new(tokio::sync::Notify::new()),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let svc = service(
        IdempotencyLayer::new(store.clone()).lease(std::time::Duration::from_secs(30)),
        tower_idempotency_test::gated_handler(started.clone(), gate.clone(), "slow"),
    );
    let first = tower_idempotency_test::spawn_send(&svc, post("k", "x"));
    started.notified().await;
    Running {
        store,
        svc,
        gate,
        first,
    }
}

/// Renewals that fail and are tried again are warned of once, not per try, and the renewal that
/// lands after them says how many failed. PROTOCOL.md §9.2, §12.3.
#[tokio::test(start_paused = true)]
async fn failed_renewals_are_warned_of_once_and_the_one_that_lands_counts_them() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let from = captured.len();
    let Running {
        store, gate, first, ..
    } = running().await;
    store.fail_renewals(3);
    // The renewal at 10 s and its tries fail, then land; the one at 20 s lands at once.
    tokio::time::sleep(std::time::Duration::from_secs(25)).await;
    let events: Vec<LogEvent> = captured.events().into_iter().skip(from).collect();
    let with = |prefix: &str| -> Vec<&LogEvent> {
        events
            .iter()
            .filter(|e| e.field("message").is_some_and(|m| m.starts_with(prefix)))
            .collect()
    };
    let failed = with("renewing the claim's lease failed");
    assert_eq!(
        failed.len(),
        1,
        "one warning for three failed tries: {failed:?}"
    );
    let landed = with("the claim's lease renewed after the store came back");
    assert_eq!(landed.len(), 1, "{landed:?}");
    assert_eq!(landed[0].field("failures"), Some("3"));
    gate.notify_one();
    assert_eq!(first.await.expect("task").outcome, Some(Outcome::Executed));
}

/// A store write that failed and lands on a later attempt says so once, with the failures; a write
/// that lands at its first attempt (a consumer's completion) says nothing of it.
/// PROTOCOL.md §9.5, §12.3.
#[tokio::test(start_paused = true)]
async fn a_write_that_lands_after_failures_says_so_once() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let landed_since = |from: usize| -> Vec<LogEvent> {
        captured
            .events()
            .into_iter()
            .skip(from)
            .filter(|e| {
                e.field("message")
                    .is_some_and(|m| m.starts_with("store write made after the store came back"))
            })
            .collect()
    };

    let store = Faulty::new(MemoryStore::new());
    let svc = service(
        IdempotencyLayer::new(store.clone()),
        Handler::ok(|_| created("ok")),
    );
    let from = captured.len();
    store.fail_writes(true);
    send(&svc, post("k", "x")).await;
    tokio::time::sleep(std::time::Duration::from_millis(350)).await;
    store.fail_writes(false);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let landed = landed_since(from);
    assert_eq!(landed.len(), 1, "{landed:?}");
    // The attempts in the request and at 100 and 300 ms failed; the one at 700 ms landed.
    assert_eq!(landed[0].field("failures"), Some("3"));
    // The request warned of the first failure; the retries after it are not warned of again.
    let rewarned: Vec<LogEvent> = captured
        .events()
        .into_iter()
        .skip(from)
        .filter(|e| {
            e.field("message")
                .is_some_and(|m| m.starts_with("store write failed; retrying it"))
        })
        .collect();
    assert_eq!(rewarned.len(), 0, "{rewarned:?}");

    let from = captured.len();
    let dedup = tower_idempotency::consumer::Deduplicator::new(MemoryStore::new(), "ledger");
    dedup
        .process("evt_1", || async { Ok::<_, std::convert::Infallible>(()) })
        .await
        .expect("processed");
    assert_eq!(
        landed_since(from).len(),
        0,
        "a first attempt that lands is no news"
    );
}

/// A handler that outlived its lost claim finds the key taken by a retry that ran: its completion
/// writes nothing and says so, once, naming the write. PROTOCOL.md §9.2, §12.3.
#[tokio::test(start_paused = true)]
async fn a_completion_after_a_lost_claim_says_nothing_was_written() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let from = captured.len();
    let Running {
        store,
        svc,
        gate,
        first,
    } = running().await;
    // Every renewal fails: the claim runs out, and the retry claims the key and completes it.
    store.fail_renewals(usize::MAX);
    tokio::time::sleep(std::time::Duration::from_secs(31)).await;
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    gate.notify_one();
    first.await.expect("task");
    let not_written: Vec<LogEvent> = captured
        .events()
        .into_iter()
        .skip(from)
        .filter(|e| {
            e.field("message")
                .is_some_and(|m| m.starts_with("the record no longer carries this claim"))
        })
        .collect();
    assert_eq!(not_written.len(), 1, "{not_written:?}");
    assert_eq!(not_written[0].field("operation"), Some("complete"));
}

/// The circuit breaker's changes of state are logged: a warning when it opens (with the failures
/// and the last error), and again when a failed probe opens it; information when it turns
/// half-open and when it closes. The requests it answers meanwhile log no warning of their own.
/// PROTOCOL.md §9.11, §12.3.
#[tokio::test(start_paused = true)]
async fn the_breakers_changes_of_state_are_logged() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let store = Faulty::new(MemoryStore::new());
    let breaker = tower_idempotency::store::CircuitBreaker::new(store.clone())
        .with_failure_threshold(3)
        .with_cool_down(std::time::Duration::from_secs(5));
    let svc = service(
        IdempotencyLayer::new(breaker).single_tenant(),
        Handler::ok(|_| created("ok")),
    );
    let from = captured.len();
    let changes = |from: usize| -> Vec<LogEvent> {
        (captured.since(from).into_iter())
            .filter(|e| e.says("idempotency store circuit breaker"))
            .collect()
    };

    store.time_out(true);
    for n in 0..3 {
        send(&svc, post(&format!("k{n}"), "x")).await;
    }
    let opened = changes(from);
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert_eq!(opened[0].level, tracing::Level::WARN);
    assert!(opened[0].says("idempotency store circuit breaker opened: "));
    assert_eq!(opened[0].field("state"), Some("open"));
    assert_eq!(opened[0].field("failures"), Some("3"));
    assert_eq!(opened[0].field("cool_down_ms"), Some("5000"));
    assert!(
        opened[0]
            .field("error")
            .is_some_and(|e| e.contains("did not answer")),
        "{opened:?}"
    );

    // Answers while open log no warning per request.
    let before = captured.len();
    for n in 0..5 {
        let reply = send(&svc, post(&format!("o{n}"), "x")).await;
        assert_eq!(reply.outcome, Some(Outcome::CircuitOpen));
    }
    let warned: Vec<LogEvent> = (captured.since(before).into_iter())
        .filter(|e| e.level <= tracing::Level::WARN)
        .collect();
    assert!(warned.is_empty(), "{warned:?}");

    // The probe fails: half-open, then opened again.
    tokio::time::advance(std::time::Duration::from_secs(5)).await;
    let before = captured.len();
    send(&svc, post("p1", "x")).await;
    let probed = changes(before);
    let summary: Vec<_> = (probed.iter())
        .map(|e| (e.level, e.field("state").unwrap_or_default().to_owned()))
        .collect();
    assert_eq!(
        summary,
        [
            (tracing::Level::INFO, "half_open".to_owned()),
            (tracing::Level::WARN, "open".to_owned())
        ]
    );
    assert!(probed[1].says("idempotency store circuit breaker opened again: the probe failed"));

    // The store is back: the next probe closes it.
    store.time_out(false);
    tokio::time::advance(std::time::Duration::from_secs(5)).await;
    let before = captured.len();
    assert_eq!(
        send(&svc, post("p2", "x")).await.outcome,
        Some(Outcome::Executed)
    );
    let summary: Vec<_> = (changes(before).iter())
        .map(|e| (e.level, e.field("state").unwrap_or_default().to_owned()))
        .collect();
    assert_eq!(
        summary,
        [
            (tracing::Level::INFO, "half_open".to_owned()),
            (tracing::Level::INFO, "closed".to_owned())
        ]
    );
}

/// A request answered from a record points at the run that wrote it: its span carries the first
/// run's `origin.traceparent`, `origin.trace_id` and `origin.span_id` (never its `tracestate`),
/// so that the outcome event of a replay, a 422 or a not-replayable answer leads a log search to
/// that run; the first run's own events carry none. PROTOCOL.md §5.6, §12.1.
#[tokio::test(start_paused = true)]
async fn a_replay_logs_the_trace_of_the_run_that_wrote_its_record() {
    let _turn = Captured::turn().await;
    let captured = Captured::global();
    let first_run = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let svc = service(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .trace_origin(true)
            .response_body_limit(16),
        Handler::ok(|call| match call.header("x-large") {
            Some(_) => created("a response over the sixteen-byte limit"),
            None => created(format!("call {}", call.n)),
        }),
    );
    let request = |key: &str, traceparent: &str, body: &'static str| {
        keyed(Method::POST, "/", key)
            .header("traceparent", traceparent)
            .header("tracestate", "congo=t61rcWkgMzE")
            .body(axum::body::Body::from(body))
            .expect("a request")
    };
    let retry = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut large = request("large", first_run, "x");
    large
        .headers_mut()
        .insert("x-large", HeaderValue::from_static("1"));
    let cases = [
        (request("k", first_run, "x"), Outcome::Executed),
        (request("k", retry, "x"), Outcome::Replayed),
        (request("k", retry, "another body"), Outcome::Mismatch),
        (large, Outcome::Executed),
        (request("large", retry, "x"), Outcome::NotReplayable),
    ];
    for (request, outcome) in cases {
        let before = captured.len();
        assert_eq!(send(&svc, request).await.outcome, Some(outcome));
        let events = outcomes_since(captured, before);
        assert_eq!(events.len(), 1, "{events:?}");
        let event = &events[0];
        if outcome == Outcome::Executed {
            assert_eq!(event.field("origin.traceparent"), None, "{event:?}");
            continue;
        }
        assert_eq!(
            event.field("origin.traceparent"),
            Some(first_run),
            "{event:?}"
        );
        assert_eq!(
            event.field("origin.trace_id"),
            Some("4bf92f3577b34da6a3ce929d0e0e4736"),
            "{event:?}"
        );
        assert_eq!(event.field("origin.span_id"), Some("00f067aa0ba902b7"));
        assert!(
            !event.fields.iter().any(|(_, v)| v.contains("t61rcWkgMzE")),
            "the tracestate is never logged: {event:?}"
        );
    }
}
