//! `Attempts`: what the client layer did for a response, in the response's extensions.

use http::HeaderValue;

/// How a response came about: the attempts it took, the key they carried, and whether the server
/// answered with a stored response (`Idempotent-Replayed: true`): the operation had run before,
/// on an attempt whose answer was lost.
///
/// The client layer puts it in the extensions of every response it returns.
///
/// ```
/// use http::Response;
/// use tower_idempotency_client::Attempts;
///
/// # let response: Response<()> = Response::new(());
/// if let Some(attempts) = response.extensions().get::<Attempts>() {
///     println!("{} attempt(s), replayed: {}", attempts.count(), attempts.replayed());
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempts {
    pub(crate) count: u32,
    pub(crate) replayed: bool,
    pub(crate) key: Option<HeaderValue>,
}

impl Attempts {
    /// How many times the request was sent: 1 when the first attempt answered.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Whether the final answer was a replay of a stored response.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The idempotency key every attempt carried, the caller's own or the one the layer made;
    /// `None` for a request sent without one (an idempotent method, such as `GET`).
    pub fn key(&self) -> Option<&HeaderValue> {
        self.key.as_ref()
    }
}
