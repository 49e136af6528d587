//! The client layer's `tracing` events (PROTOCOL.md §14.5): one per retry, with the attempt, the
//! reason and the wait, and a warning when it gives up; never the key. One capturing subscriber
//! is the global default of this test binary.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::HeaderMap;
use support::{Fault, Link, always, charge, layer, server};
use tower::{ServiceBuilder, ServiceExt};

/// One event's fields (its level first), as text.
type Event = Vec<(String, String)>;

/// Every event of target `tower_idempotency`.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<Event>>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Captured {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "tower_idempotency_client" {
            let mut fields = vec![("level".to_owned(), event.metadata().level().to_string())];
            event.record(&mut Fields(&mut fields));
            self.0.lock().unwrap().push(fields);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn each_retry_is_an_event_and_giving_up_a_warning() {
    use tracing_subscriber::layer::SubscriberExt;
    let captured = Captured::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(captured.clone()))
        .unwrap();
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

    let events = captured.0.lock().unwrap().clone();
    let field = |event: &Event, name: &str| {
        event
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let client_events: Vec<_> = events
        .iter()
        .filter(|event| field(event, "reason").is_some())
        .collect();
    let summary: Vec<(String, String, String, String)> = client_events
        .iter()
        .map(|event| {
            (
                field(event, "level").unwrap(),
                field(event, "message").unwrap(),
                field(event, "attempt").unwrap(),
                field(event, "reason").unwrap(),
            )
        })
        .collect();
    let row = |level: &str, message: &str, attempt: &str, reason: &str| {
        (level.into(), message.into(), attempt.into(), reason.into())
    };
    assert_eq!(
        summary,
        [
            row("INFO", "retry", "1", "\"transport\""),
            row("INFO", "retry", "2", "\"unavailable\""),
            row("WARN", "retry: out of attempts", "3", "\"unavailable\""),
        ]
    );
    assert_eq!(field(client_events[0], "delay_ms").as_deref(), Some("0"));
    let everything = format!("{events:?}");
    assert!(
        !everything.contains("secret-key-1"),
        "the key is never logged"
    );
}
