//! OpenTelemetry (feature `opentelemetry`): a claimed request without a `traceparent` header
//! keeps its span's OpenTelemetry context as its record's origin, and a request answered from a
//! record gets a span link to the span that wrote it (PROTOCOL.md §5.6, §12.1). Both go through
//! `tracing-opentelemetry`'s [`OpenTelemetrySpanExt`]: with no OpenTelemetry layer installed,
//! there is no context to keep and the link goes nowhere.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::record::TraceOrigin;

/// The OpenTelemetry context of `span` as an origin: `None` when it has none that is valid (no
/// OpenTelemetry layer, or a span it does not trace).
pub(crate) fn current_origin(span: &tracing::Span) -> Option<TraceOrigin> {
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
