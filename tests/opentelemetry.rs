//! Trace origins through OpenTelemetry (feature `opentelemetry`, PROTOCOL.md §5.6, §12.1): the
//! SDK's tracer with its in-memory exporter, under a `tracing_subscriber` registry with the
//! OpenTelemetry layer, as an application that exports its `tracing` spans has it.

use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tower_idempotency::record::{Fingerprint, Record, RecordId};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{Handler, created, post, send, service};
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;

/// An exporter that keeps every finished span, and the subscriber that sends spans to it: this
/// thread's default while the guard lives.
fn traced() -> (
    InMemorySpanExporter,
    SdkTracerProvider,
    tracing::subscriber::DefaultGuard,
) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("tests"));
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
    (exporter, provider, guard)
}

/// The finished `idempotency` spans, in the order they ended.
fn idempotency_spans(
    exporter: &InMemorySpanExporter,
    provider: &SdkTracerProvider,
) -> Vec<SpanData> {
    provider.force_flush().expect("flushed");
    let spans = exporter.get_finished_spans().expect("the finished spans");
    spans
        .into_iter()
        .filter(|span| span.name == "idempotency")
        .collect()
}

fn layer(store: MemoryStore) -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(store)
        .single_tenant()
        .trace_origin(true)
}

/// The origin of the record under `key`.
async fn stored_origin(store: &MemoryStore, key: &str) -> (TraceId, SpanId) {
    let fingerprint = Fingerprint::from_bytes([0; 32]);
    let id = RecordId::new(b"", key);
    let claim = store
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await;
    let Ok(Claim::Existing(Record::Completed(done))) = claim else {
        panic!("a completed record: {claim:?}");
    };
    let origin = done.origin.expect("§5.6: the record keeps an origin");
    (
        TraceId::from_bytes(origin.trace_id()),
        SpanId::from_bytes(origin.span_id()),
    )
}

/// The retry's span carries a link to the first request's span: the trace id and span id of the
/// span that was exported for the run that wrote the record.
#[tokio::test]
async fn a_replays_span_links_to_the_span_of_the_first_run() {
    let (exporter, provider, _guard) = traced();
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let svc = service(layer(MemoryStore::new()), handler.clone());

    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let retry = send(&svc, post("k", "x")).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(handler.calls(), 1);

    let spans = idempotency_spans(&exporter, &provider);
    assert_eq!(spans.len(), 2, "{spans:?}");
    let (original, replay) = (&spans[0], &spans[1]);
    assert!(original.links.is_empty(), "the first run links to nothing");
    assert_ne!(
        original.span_context.trace_id(),
        replay.span_context.trace_id(),
        "two requests, two traces: only the link joins them"
    );
    let links: Vec<_> = replay.links.iter().map(|link| &link.span_context).collect();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0].trace_id(), original.span_context.trace_id());
    assert_eq!(links[0].span_id(), original.span_context.span_id());
}

/// Without a `traceparent` header, the record keeps the OpenTelemetry context of the request's
/// span (the current one when it is claimed: the layer's `idempotency` span, inside the
/// application's own); with one, the header's.
#[tokio::test]
async fn without_a_traceparent_the_current_spans_context_is_stored() {
    let (exporter, provider, _guard) = traced();
    let store = MemoryStore::new();
    let svc = service(layer(store.clone()), Handler::ok(|_| created("done")));

    let server = tracing::info_span!("server");
    let reply = send(&svc, post("no-header", "x")).instrument(server).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed));
    let spans = idempotency_spans(&exporter, &provider);
    assert_eq!(spans.len(), 1, "{spans:?}");
    let span = &spans[0].span_context;
    assert_eq!(
        stored_origin(&store, "no-header").await,
        (span.trace_id(), span.span_id()),
        "§5.6: the request span's context is the origin"
    );

    // A request with a valid header keeps the header's, whatever its span.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut request = post("header", "x");
    (request.headers_mut()).insert("traceparent", traceparent.parse().expect("a value"));
    assert_eq!(send(&svc, request).await.outcome, Some(Outcome::Executed));
    assert_eq!(
        stored_origin(&store, "header").await,
        (
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex"),
            SpanId::from_hex("00f067aa0ba902b7").expect("hex"),
        ),
        "§5.6: the header first"
    );
}

/// Counts the `tower_idempotency` warnings that a request's span has no OpenTelemetry context.
#[derive(Clone, Default)]
struct NoContextWarnings(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl NoContextWarnings {
    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for NoContextWarnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let meta = event.metadata();
        if meta.target() != "tower_idempotency" || *meta.level() != tracing::Level::WARN {
            return;
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        if message.0.contains("no OpenTelemetry context") {
            assert!(
                message
                    .0
                    .contains("tracing-opentelemetry 0.34 (opentelemetry 0.33)"),
                "the warning names the versions expected: {}",
                message.0
            );
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// With trace origins on and no OpenTelemetry layer the layer can read (none, or one of another
/// release: the same to it), the layer warns once per process, naming the versions it expects;
/// with the layer, never. One test: the warning is the process's, and every other test here
/// installs the layer.
#[tokio::test]
async fn trace_origins_without_a_readable_opentelemetry_layer_are_warned_of_once() {
    let two_requests = async |prefix: &str| {
        let svc = service(layer(MemoryStore::new()), Handler::ok(|_| created("done")));
        for n in 0..2 {
            let reply = send(&svc, post(&format!("{prefix}{n}"), "x")).await;
            assert_eq!(reply.outcome, Some(Outcome::Executed));
        }
    };

    let warnings = NoContextWarnings::default();
    let provider = SdkTracerProvider::builder().build();
    let otel = tracing_opentelemetry::layer().with_tracer(provider.tracer("tests"));
    let subscriber = (tracing_subscriber::registry())
        .with(otel)
        .with(warnings.clone());
    {
        let _guard = tracing::subscriber::set_default(subscriber);
        two_requests("with-layer").await;
    }
    assert_eq!(warnings.count(), 0, "an OpenTelemetry layer: no warning");

    let subscriber = tracing_subscriber::registry().with(warnings.clone());
    let _guard = tracing::subscriber::set_default(subscriber);
    two_requests("no-layer").await;
    assert_eq!(warnings.count(), 1, "no OpenTelemetry layer: one warning");
}
