//! Trace origins through OpenTelemetry (feature `opentelemetry`, PROTOCOL.md §5.6, §12.1).
