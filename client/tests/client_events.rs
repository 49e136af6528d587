//! The client layer's `tracing` events (PROTOCOL.md §14.5): one per retry, with the attempt, the
//! reason and the wait, and a warning when it gives up; never the key.

mod support;

use std::time::Duration;

use http::HeaderMap;
use support::{Fault, Link, always, charge, layer, server};
use test_servers::logs::{Captured, LogEvent};
use tower::{ServiceBuilder, ServiceExt};

#[tokio::test(start_paused = true)]
async fn each_retry_is_an_event_and_giving_up_a_warning() {
    let captured = Captured::global();
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

    let events = captured.events();
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
