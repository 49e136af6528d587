//! The client layer's `tracing` events (PROTOCOL.md §14.5): one per retry, with the attempt, the
//! reason and the wait, and a warning when it gives up; never the key.

mod support;

use std::time::Duration;

use http::HeaderMap;
use support::{Fault, Link, always, charge, charges, layer, server, server_with};
use test_servers::logs::{Captured, LogEvent};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[tokio::test(start_paused = true)]
async fn each_retry_is_an_event_and_giving_up_a_warning() {
    let captured = Captured::global();
    let _turn = Captured::turn().await;
    let from = captured.len();
    let (server, _runs) = server(Duration::ZERO, always(503, HeaderMap::new()));
    let link = Link::new(server, [Fault::Refuse]);
    let client = ServiceBuilder::new()
        .layer(layer().max_attempts(3))
        .service(link);

    let mut request = charge("x");
    request.headers_mut().insert(
        "idempotency-key",
        http::HeaderValue::from_static("secret-key-1"),
    );
    client.oneshot(request).await.unwrap();

    let events = captured.since(from);
    let client_events: Vec<&LogEvent> = (events.iter())
        .filter(|event| event.target == "tower_idempotency_client")
        .collect();
    let summary: Vec<(String, String, String, String)> = (client_events.iter())
        .map(|event| {
            let field = |name| event.field(name).unwrap().to_owned();
            (
                event.level.to_string(),
                field("message"),
                field("attempt"),
                field("reason"),
            )
        })
        .collect();
    let row = |level: &str, message: &str, attempt: &str, reason: &str| {
        (level.into(), message.into(), attempt.into(), reason.into())
    };
    assert_eq!(
        summary,
        [
            row("INFO", "retry", "1", "transport"),
            row("INFO", "retry", "2", "unavailable"),
            row("WARN", "retry: out of attempts", "3", "unavailable"),
        ]
    );
    assert_eq!(client_events[0].field("delay_ms"), Some("0"));
    let everything = format!("{events:?}");
    assert!(
        !everything.contains("secret-key-1"),
        "the key is never logged"
    );
}

/// A `not-replayable` answer is told as such, once, and not as a `409` in flight.
#[tokio::test(start_paused = true)]
async fn a_not_replayable_answer_is_logged_as_such() {
    let captured = Captured::global();
    let _turn = Captured::turn().await;
    let limited = IdempotencyLayer::new(MemoryStore::new()).response_body_limit(1);
    let (server, _runs) = server_with(limited, Duration::ZERO, charges());
    let link = Link::new(server, [Fault::LoseResponse]);
    let client = ServiceBuilder::new().layer(layer()).service(link);
    let from = captured.len();

    let result = client.oneshot(charge("x")).await;

    let client_events: Vec<(String, String, String)> = (captured.since(from).iter())
        .filter(|event| event.target == "tower_idempotency_client")
        .map(|event| {
            let field = |name| event.field(name).unwrap().to_owned();
            (event.level.to_string(), field("attempt"), field("reason"))
        })
        .collect();
    let row = |level: &str, attempt: &str, reason: &str| {
        (level.to_owned(), attempt.to_owned(), reason.to_owned())
    };
    assert_eq!(
        client_events,
        [
            row("INFO", "1", "transport"),
            row("WARN", "2", "not_replayable")
        ]
    );
    assert!(result.is_err(), "the call ended with an error");
}
