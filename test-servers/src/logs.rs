//! A `tracing` subscriber that keeps every event, for tests that assert what is logged.
//!
//! It is installed as the global default of the test binary ([`Captured::global`]): a
//! thread-local subscriber loses events when tests run in parallel, through `tracing`'s shared
//! callsite interest cache. Tests of one binary that compare what was logged take turns
//! ([`Captured::turn`]) and read the events logged since they began ([`Captured::since`]).

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::Level;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// One captured event: its level, its target, and every field (its spans', outermost first, then
/// its own, the message included) as text.
#[derive(Debug, Clone)]
pub struct LogEvent {
    /// The event's level.
    pub level: Level,
    /// The event's target.
    pub target: String,
    /// The fields, as text: a `&str` as it is, anything else as its `Debug`.
    pub fields: Vec<(String, String)>,
}

impl LogEvent {
    /// The field `name`'s value (the event's own over its spans': the last one recorded).
    pub fn field(&self, name: &str) -> Option<&str> {
        (self.fields.iter().rev())
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the event's message starts with `prefix`.
    pub fn says(&self, prefix: &str) -> bool {
        self.field("message").is_some_and(|m| m.starts_with(prefix))
    }
}

/// The events of the test binary, in the order they were logged.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<LogEvent>>>);

impl fmt::Debug for Captured {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Captured")
            .field("events", &self.len())
            .finish()
    }
}

impl Captured {
    /// The binary's capture, installed as the global default subscriber by the first call.
    ///
    /// # Panics
    /// If another global subscriber was installed first.
    pub fn global() -> &'static Captured {
        static CAPTURED: OnceLock<Captured> = OnceLock::new();
        CAPTURED.get_or_init(|| {
            let captured = Captured::default();
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(captured.clone()),
            )
            .expect("no other global subscriber in this binary");
            captured
        })
    }

    /// One test at a time: hold the guard while logging and reading, so that the events since a
    /// snapshot are the running test's.
    pub async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
        static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        TURN.lock().await
    }

    /// How many events were captured so far: a snapshot for [`since`](Self::since).
    pub fn len(&self) -> usize {
        self.events().len()
    }

    /// Whether nothing was captured yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every event captured.
    pub fn events(&self) -> Vec<LogEvent> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The events captured after the first `from`.
    pub fn since(&self, from: usize) -> Vec<LogEvent> {
        self.events().into_iter().skip(from).collect()
    }
}

/// Writes each field as text.
struct FieldsAsText<'a>(&'a mut Vec<(String, String)>);

impl tracing::field::Visit for FieldsAsText<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

/// The fields of a span, kept in its extensions.
struct SpanFields(Vec<(String, String)>);

impl<S> tracing_subscriber::Layer<S> for Captured
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut fields = Vec::new();
        attrs.record(&mut FieldsAsText(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields));
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: Context<'_, S>,
    ) {
        // Fields recorded after the span was made: kept after its first ones, so that the last
        // value of a field is the one events read.
        let mut fields = Vec::new();
        values.record(&mut FieldsAsText(&mut fields));
        if let Some(span) = ctx.span(id)
            && let Some(span_fields) = span.extensions_mut().get_mut::<SpanFields>()
        {
            span_fields.0.extend(fields);
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Vec::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(span_fields) = span.extensions().get::<SpanFields>() {
                    fields.extend(span_fields.0.iter().cloned());
                }
            }
        }
        event.record(&mut FieldsAsText(&mut fields));
        let event = LogEvent {
            level: *event.metadata().level(),
            target: event.metadata().target().to_owned(),
            fields,
        };
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(event);
    }
}
