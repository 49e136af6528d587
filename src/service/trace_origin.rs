//! Trace origins (PROTOCOL.md §5.6, §12.1): the trace context a claimed request's record keeps,
//! taken as it is claimed, and what a request answered from a record shows of it.

use http::HeaderMap;

use super::Shared;
use crate::record::TraceOrigin;

impl<St> Shared<St> {
    /// The trace context a claimed request's record keeps, when the layer records origins: its
    /// `traceparent` header (with its `tracestate`), or, with the feature `opentelemetry` and no
    /// valid header, the OpenTelemetry context of the request's span (the current one), warning
    /// once per process when that span has none.
    pub(super) fn origin_of(&self, headers: &HeaderMap) -> Option<TraceOrigin> {
        if !self.config.trace_origin {
            return None;
        }
        let origin = TraceOrigin::from_headers(headers);
        #[cfg(feature = "opentelemetry")]
        let origin = crate::otel::origin(origin, &tracing::Span::current());
        origin
    }
}

/// Records where the record a request is answered from came from on the request's span (the
/// current one): `origin.traceparent`, `origin.trace_id` and `origin.span_id` (never its
/// `tracestate`), and with the feature `opentelemetry`, a link to that span.
pub(super) fn show_origin(origin: &TraceOrigin) {
    let span = tracing::Span::current();
    span.record("origin.traceparent", tracing::field::display(origin));
    span.record("origin.trace_id", origin.trace_id_hex());
    span.record("origin.span_id", origin.span_id_hex());
    #[cfg(feature = "opentelemetry")]
    crate::otel::link(&span, origin);
}
