//! `IdempotentRetryLayer`: the builder; its settings live in [`Config`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use tower::retry::budget::Budget;
use tower_layer::Layer;

use super::backoff::Backoff;
use super::service::IdempotentRetry;

/// A [`Layer`] for HTTP clients that names each operation with one `Idempotency-Key` and retries
/// it when the outcome is unknown or the server asks for another try.
///
/// Each request gets a fresh UUID v4 key unless it carries one; every attempt sends that key and
/// the same body bytes, so the server runs the operation once and answers a retry with the stored
/// response. See the [module documentation](super) for what is retried, and each method below for
/// its default.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency_client::IdempotentRetryLayer;
///
/// let layer = IdempotentRetryLayer::new()
///     .max_attempts(3)
///     .attempt_timeout(Duration::from_secs(5))
///     .deadline(Duration::from_secs(20));
/// # let _ = layer;
/// ```
#[derive(Clone, Default)]
pub struct IdempotentRetryLayer {
    pub(crate) config: Config,
}

/// The layer's settings, shared by every request of a service.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) key_methods: Vec<Method>,
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) deadline: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) body_limit: usize,
    pub(crate) budget: Option<Arc<dyn Budget + Send + Sync>>,
    /// The server's retention header, whose moment no retry is sent at or after.
    pub(crate) retention_header: HeaderName,
    /// How long before that moment the retries stop.
    pub(crate) retention_margin: Duration,
    /// How long the server keeps a key, as its documentation says, counted from the call.
    pub(crate) retention: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            key_methods: vec![Method::POST, Method::PATCH],
            max_attempts: 4,
            attempt_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            backoff: Backoff {
                initial: Duration::from_millis(200),
                max: Duration::from_secs(5),
            },
            body_limit: 1024 * 1024,
            budget: None,
            retention_header: tower_idempotency::IDEMPOTENCY_KEY_EXPIRES,
            retention_margin: Duration::from_secs(10),
            retention: None,
        }
    }
}

impl IdempotentRetryLayer {
    /// A layer with the default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// The request header that carries the key. Default: `Idempotency-Key`.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// The methods that get a key when the caller set none, and so are retried. Requests of
    /// methods idempotent by definition (`GET`, `HEAD`, `PUT`, `DELETE`, `OPTIONS`) are retried
    /// with or without a key; a request of any other method is retried only when the caller gave
    /// it a key, and is otherwise sent once. Default: `POST` and `PATCH`.
    pub fn key_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.key_methods = methods.into_iter().collect();
        self
    }

    /// The most times one request is sent, the first included; at least 1. Default: 4 (three
    /// retries).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts.max(1);
        self
    }

    /// How long one attempt may take until the response's head arrives; an attempt that runs out
    /// is retried (the server may still be running it: the key lets it answer the retry with a
    /// 409, then the replay). Default: 10 seconds.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.config.attempt_timeout = timeout;
        self
    }

    /// How long the whole operation may take, attempts and waits together, from the call until
    /// the response's head. No wait is started that would end past it (a longer `Retry-After`
    /// ends the retries: the last answer is returned), and an attempt still running at the
    /// deadline ends as [`Error::TimedOut`](super::Error::TimedOut). Default: 30 seconds.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.config.deadline = deadline;
        self
    }

    /// The backoff between attempts when the server gave no `Retry-After`: exponential with full
    /// jitter, a wait drawn uniformly from zero to `initial` before the first retry, doubling the
    /// bound for each further retry, never above `max`. Default: 200 ms, up to 5 s.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.config.backoff = Backoff {
            initial,
            max: max.max(initial),
        };
        self
    }

    /// The largest request body the layer buffers, so that every attempt sends the same bytes. A
    /// larger body is refused with [`Error::BodyTooLarge`](super::Error::BodyTooLarge) and
    /// nothing is sent. Every request's body is buffered, retried or not. Default: 1 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// A retry budget shared by every request of the service, such as tower's
    /// [`TpsBudget`](tower::retry::budget::TpsBudget): each request deposits, each retry
    /// withdraws, and a retry the budget refuses is not made (the answer in hand is returned).
    /// It bounds the extra load retries put on a server that is failing for everyone. Default:
    /// none (each request is bounded by its attempts and deadline only).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tower::retry::budget::TpsBudget;
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// // Retries up to 20% of requests, over a 10 s window, and 10 per second in any case.
    /// let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2));
    /// let layer = IdempotentRetryLayer::new().budget(budget);
    /// # let _ = layer;
    /// ```
    pub fn budget(mut self, budget: Arc<dyn Budget + Send + Sync>) -> Self {
        self.config.budget = Some(budget);
        self
    }

    /// The response header in which the server states until when it keeps a key (the server
    /// layer's `retention_header`: an HTTP-date, or `@` and seconds since the Unix epoch). Once
    /// an attempt's response stated that moment, no retry of the operation is sent at or after
    /// it, less the [`retention_margin`](Self::retention_margin): the server would have forgotten
    /// the key and would run the operation again. The call ends with
    /// [`Error::RetentionPassed`](super::Error::RetentionPassed) instead. Default:
    /// `Idempotency-Key-Expires` (`tower_idempotency::IDEMPOTENCY_KEY_EXPIRES`).
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new()
    ///     .retention_header(HeaderName::from_static("x-key-kept-until"));
    /// # let _ = layer;
    /// ```
    pub fn retention_header(mut self, name: HeaderName) -> Self {
        self.config.retention_header = name;
        self
    }

    /// How long before the server's stated retention moment the retries stop: room for the
    /// difference between the client's clock and the server's, and for the retry's way to the
    /// server. The client compares the moment with its own wall clock, and the time a retry
    /// would be sent (now plus its wait) must come before the moment less this margin.
    /// Default: 10 seconds (clocks kept by NTP differ by far less; the server keeps keys for
    /// hours).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().retention_margin(Duration::from_secs(60));
    /// # let _ = layer;
    /// ```
    pub fn retention_margin(mut self, margin: Duration) -> Self {
        self.config.retention_margin = margin;
        self
    }

    /// How long the server keeps a key, as its documentation states it (the server layer's
    /// `dedup_window`, 24 hours by default), for a server that states no moment in its responses
    /// (or before any response stated one). Counted from the call, which comes before the
    /// operation completes and the server's window starts, on this process's clock: no retry of a
    /// keyed request is sent at or after the call plus `kept`, less the
    /// [`retention_margin`](Self::retention_margin), and the call ends with
    /// [`Error::RetentionPassed`](super::Error::RetentionPassed) instead. A moment stated by the
    /// server bounds the retries too; the earlier bound ends them. Only a
    /// [`deadline`](Self::deadline) longer than `kept` less the margin can reach it. Default: none.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency_client::IdempotentRetryLayer;
    ///
    /// // A queue worker that retries for hours, against an API that keeps keys for a day.
    /// let layer = IdempotentRetryLayer::new()
    ///     .deadline(Duration::from_secs(36 * 3600))
    ///     .retention(Duration::from_secs(24 * 3600));
    /// # let _ = layer;
    /// ```
    pub fn retention(mut self, kept: Duration) -> Self {
        self.config.retention = Some(kept);
        self
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry::new(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for IdempotentRetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentRetryLayer")
            .field("header", &self.header)
            .field("key_methods", &self.key_methods)
            .field("max_attempts", &self.max_attempts)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("deadline", &self.deadline)
            .field("backoff", &self.backoff)
            .field("body_limit", &self.body_limit)
            .field("budget", &self.budget.is_some())
            .field("retention_header", &self.retention_header)
            .field("retention_margin", &self.retention_margin)
            .field("retention", &self.retention)
            .finish()
    }
}
