//! A protocol spoken over HTTP with rules of its own, such as gRPC (`IdempotencyLayer::grpc`,
//! feature `grpc`): which requests it covers, in place of the layer's `methods`, how the layer's
//! own answers are written, and which whole responses are stored. The layer without one speaks
//! plain HTTP.

use std::fmt;

use bytes::Bytes;
use http::response::Parts as ResponseParts;
use http::{HeaderMap, Method, Response, Uri};

use crate::layer::ConfigError;
use crate::problem::Problem;
use crate::store_policy::StorePolicy;

/// What a protocol mode makes of a request.
#[cfg_attr(
    not(feature = "grpc"),
    allow(dead_code, reason = "made by the gRPC mode only")
)]
pub(crate) enum Coverage {
    /// Not the protocol mode's: it passes through (§1.2).
    Passthrough,
    /// Covered: keyed, claimed and run once.
    Covered,
    /// Refused with this answer before the handler: a request the protocol never sends, to a
    /// path the protocol mode covers, which the handler would still run (gRPC's non-`POST`, §16.1).
    Refused(Response<Bytes>),
}

/// The rules of a protocol over HTTP, consulted by the layer where plain HTTP has its own.
#[cfg_attr(
    not(feature = "grpc"),
    allow(dead_code, reason = "implemented by the gRPC mode only")
)]
pub(crate) trait ProtocolMode: Send + Sync + fmt::Debug + 'static {
    /// Whether a request is covered. The protocol mode decides alone, whatever its HTTP method: the
    /// layer's `methods` does not apply, so that no setting of it can open a covered path.
    fn covers(&self, method: &Method, uri: &Uri) -> Coverage;

    /// The layer's own answer for `problem`, with its `ProblemKind` in the extensions: in place
    /// of a rendered problem, its status, `Cache-Control` and `Retry-After`.
    fn respond(&self, problem: &Problem) -> Response<Bytes>;

    /// Whether a whole response, read within the response limit, is stored: its head and its
    /// trailers, if it ended with some. Asked after the store policy, which sees the head only;
    /// `policy` is that policy, for a protocol mode whose status is in the trailers.
    fn stores(
        &self,
        head: &ResponseParts,
        trailers: Option<&HeaderMap>,
        policy: &dyn StorePolicy,
    ) -> bool;

    /// Whether the protocol mode's settings can serve (`IdempotencyLayer::check`).
    fn check(&self) -> Result<(), ConfigError>;
}
