//! OpenTelemetry (feature `opentelemetry`): a claimed request without a `traceparent` header
//! keeps its span's OpenTelemetry context as its record's origin, and a request answered from a
//! record gets a span link to the span that wrote it (PROTOCOL.md §5.6, §12.1). Both go through
//! `tracing-opentelemetry`'s `OpenTelemetrySpanExt`: with no OpenTelemetry layer installed,
//! there is no context to keep and the link goes nowhere.
//!
//! # Versions
//!
//! The layer is built against **`opentelemetry` 0.33** and **`tracing-opentelemetry` 0.34**, and
//! reads a span's context only through an `OpenTelemetryLayer` of that `tracing-opentelemetry`.
//! A layer of another release (tracing-opentelemetry 0.32 for opentelemetry 0.31, say) compiles
//! and exports spans, but is a different type the layer cannot see: no origin is kept from a
//! span and no replay is linked. Build the application's layer with the crates re-exported here
//! ([`opentelemetry`], [`tracing_opentelemetry`]), or depend on the same versions (and an
//! `opentelemetry_sdk` and exporter made for `opentelemetry` 0.33). When trace origins are on and
//! a request's span has no OpenTelemetry context the layer can read, it logs one warning per
//! process naming these versions (PROTOCOL.md §12.3).
//!
//! # Exporting
//!
//! The SDK's tracer provider, its tracer under `tracing-opentelemetry`'s layer, and the layer
//! with trace origins on. The in-memory exporter stands in for the application's own (an OTLP
//! exporter of `opentelemetry-otlp`'s release for `opentelemetry` 0.33, for example):
//!
//! ```
//! use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
//! use tower_idempotency::otel::opentelemetry::trace::TracerProvider as _;
//! use tower_idempotency::otel::tracing_opentelemetry;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//! use tracing_subscriber::layer::SubscriberExt as _;
//! use tracing_subscriber::util::SubscriberInitExt as _;
//!
//! let exporter = InMemorySpanExporter::default(); // the application's exporter
//! let provider = SdkTracerProvider::builder()
//!     .with_batch_exporter(exporter)
//!     .build();
//! tracing_subscriber::registry()
//!     .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("payments")))
//!     .with(tracing_subscriber::fmt::layer())
//!     .init();
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .single_tenant()
//!     .trace_origin(true);
//! # let _ = layer;
//! // ... serve; at exit, send what is left:
//! provider.shutdown().expect("the spans exported");
//! ```
//!
//! # A request with a `traceparent`
//!
//! A valid `traceparent` header comes first (PROTOCOL.md §5.6): the record keeps the header's
//! context, the span of the caller that sent it, not the context of the server span that ran the
//! handler. A replay's link then points at the caller's span (the client's attempt, or the
//! upstream service's call), one hop above the run; the run's own span is that span's child in
//! the same trace when the application continues the caller's trace from the header.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::record::TraceOrigin;

/// The `opentelemetry` crate the layer reads span contexts with (0.33): build the application's
/// tracer provider with this release, or the layer cannot see its spans.
pub use opentelemetry;
/// The `tracing-opentelemetry` crate the layer reads a span's context through (0.34, for
/// `opentelemetry` 0.33): the application's `OpenTelemetryLayer` must be this release's.
pub use tracing_opentelemetry;

/// The releases named by the warning below: those of `Cargo.toml`, checked by a test.
const VERSIONS: &str = "tracing-opentelemetry 0.34 (opentelemetry 0.33)";

/// Whether the warning that a request's span has no OpenTelemetry context was logged: once per
/// process, as a start-up mistake, not a request's.
static NO_CONTEXT_WARNED: AtomicBool = AtomicBool::new(false);

/// The origin of a request when trace origins are on: its `header`'s (a valid `traceparent`), or
/// else the OpenTelemetry context of `span`. Warns once per process when `span` has none, header
/// or not: spans are then neither kept as origins nor linked.
pub(crate) fn origin(header: Option<TraceOrigin>, span: &tracing::Span) -> Option<TraceOrigin> {
    let Some(header) = header else {
        let origin = current_origin(span);
        if origin.is_none() {
            warn_no_context();
        }
        return origin;
    };
    if !NO_CONTEXT_WARNED.load(Ordering::Relaxed)
        && !span.context().span().span_context().is_valid()
    {
        warn_no_context();
    }
    Some(header)
}

fn warn_no_context() {
    if NO_CONTEXT_WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    tracing::warn!(
        target: "tower_idempotency",
        expected = VERSIONS,
        "trace origins are on, but the request's span has no OpenTelemetry context the layer can \
         read: no OpenTelemetry layer of {VERSIONS} is installed (a layer of another release is \
         not seen), or the `idempotency` span is disabled; records keep only a `traceparent` \
         header's origin and replays get no span link. Build the layer with \
         `tower_idempotency::otel::{{opentelemetry, tracing_opentelemetry}}`"
    );
}

/// The OpenTelemetry context of `span` as an origin: `None` when it has none that is valid (no
/// OpenTelemetry layer, or a span it does not trace).
fn current_origin(span: &tracing::Span) -> Option<TraceOrigin> {
    let cx = span.context();
    let otel_span = cx.span();
    let context = otel_span.span_context();
    if !context.is_valid() {
        return None;
    }
    let origin = TraceOrigin::new(
        context.trace_id().to_bytes(),
        context.span_id().to_bytes(),
        context.trace_flags().to_u8(),
    )?;
    let state = context.trace_state().header();
    Some(match state.is_empty() {
        true => origin,
        false => origin.with_tracestate(&state),
    })
}

/// Links `span` to the span `origin` names (a remote one: it ran in another request, perhaps on
/// another instance).
pub(crate) fn link(span: &tracing::Span, origin: &TraceOrigin) {
    let state = (origin.tracestate())
        .and_then(|state| state.parse::<TraceState>().ok())
        .unwrap_or_default();
    let context = SpanContext::new(
        TraceId::from_bytes(origin.trace_id()),
        SpanId::from_bytes(origin.span_id()),
        TraceFlags::new(origin.flags()),
        true,
        state,
    );
    span.add_link(context);
}

#[cfg(test)]
mod tests {
    /// The versions the warning and the docs name are those `Cargo.toml` builds with.
    #[test]
    fn the_versions_named_are_the_dependencies() {
        let manifest = include_str!("../Cargo.toml");
        for (name, version) in [("opentelemetry", "0.33"), ("tracing-opentelemetry", "0.34")] {
            let line = format!("\n{name} = {{ version = \"{version}\"");
            assert!(manifest.contains(&line), "Cargo.toml: {line:?}");
            assert!(super::VERSIONS.contains(&format!("{name} {version}")));
        }
    }
}
