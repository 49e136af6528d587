//! Trace origins through OpenTelemetry (feature `opentelemetry`, PROTOCOL.md §5.6, §12.1): the
//! SDK's tracer with its in-memory exporter, under a `tracing_subscriber` registry with the
//! OpenTelemetry layer, as an application that exports its `tracing` spans has it.

use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore, Outcome, Record, RecordId};
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
