//! gRPC mode (feature `grpc`): tonic services made safe to retry, trailers and all
//! (`docs/PROTOCOL.md` §16).
//!
//! [`IdempotencyLayer::grpc`] names the unary methods to protect. A call to one of them with an
//! `idempotency-key` metadata entry is claimed, run once, and its answer stored: the initial
//! metadata, the message and the trailers (`grpc-status`, `grpc-message`, trailing metadata). A
//! retry with the same key and the same message gets that answer back, byte for byte, with
//! `idempotent-replayed: true` in its initial metadata. Every other call (streaming methods,
//! methods not named) passes through untouched. A named method's path sent with another HTTP
//! method than `POST` is no gRPC call, yet tonic would run it: it is refused before the handler
//! (HTTP 405, `INTERNAL`).
//!
//! The layer's own answers are gRPC statuses, trailers-only: HTTP 200, `content-type:
//! application/grpc`, `grpc-status`, `grpc-message`, and in `grpc-status-details-bin` a
//! `google.rpc.Status` whose `google.rpc.ErrorInfo` names the answer ([`problem_kind`]) and,
//! for a call in flight (`ABORTED`) and a store away (`UNAVAILABLE`), a `google.rpc.RetryInfo`
//! with the wait ([`retry_delay`]). [`code_for`] has the table; [`is_stored`] says which of a
//! handler's statuses are stored.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full, StreamBody};
//! use http_body::Frame;
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A unary gRPC method as tonic answers it: a framed message, then `grpc-status` in trailers.
//! let calls = Arc::new(AtomicUsize::new(0));
//! let counter = calls.clone();
//! let charge = service_fn(move |_: Request<_>| {
//!     counter.fetch_add(1, Ordering::SeqCst);
//!     let frames = vec![
//!         Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"\0\0\0\0\x02\x08\x01"))),
//!         Ok(Frame::trailers(http::HeaderMap::from_iter([(
//!             http::HeaderName::from_static("grpc-status"),
//!             http::HeaderValue::from_static("0"),
//!         )]))),
//!     ];
//!     let body = StreamBody::new(futures_util::stream::iter(frames));
//!     async move { Ok::<_, std::convert::Infallible>(Response::new(body)) }
//! });
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .single_tenant()
//!     .grpc(["/payments.v1.Payments/CreateCharge"]);
//! let service = ServiceBuilder::new().layer(layer).service(charge);
//!
//! let call = || {
//!     Request::post("/payments.v1.Payments/CreateCharge")
//!         .header("content-type", "application/grpc")
//!         .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
//!         .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02\x08\x64")))
//!         .unwrap()
//! };
//! let first = service.clone().oneshot(call()).await.unwrap();
//! let first = first.into_body().collect().await.unwrap();
//! let retry = service.clone().oneshot(call()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let retry = retry.into_body().collect().await.unwrap();
//! assert_eq!(retry.trailers().unwrap()["grpc-status"], "0");
//! assert_eq!(retry.trailers(), first.trailers());
//! assert_eq!(retry.to_bytes(), first.to_bytes());
//! assert_eq!(calls.load(Ordering::SeqCst), 1, "run once");
//! # }
//! ```
//!
//! With tonic, the layer goes around the generated (or hand-written) server of the service, which
//! it then stands for (`NamedService`): `Server::builder().add_service(layer.layer(server))`.
//! `examples/grpc.rs` serves `payments.v1.Payments` so. The client's half is
//! `tower_idempotency_client::GrpcRetryLayer` (crate `tower-idempotency-client`, its feature
//! `grpc`).

mod details;
mod status;

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::response::Parts as ResponseParts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};

pub use status::{code_for, is_stored};

use crate::IdempotencyLayer;
use crate::layer::ConfigError;
use crate::problem::{Problem, ProblemKind};
use crate::protocol_mode::{Coverage, ProtocolMode};
use crate::service::Idempotency;
use crate::store_policy::StorePolicy;

/// The `domain` of the `google.rpc.ErrorInfo` in each of the layer's answers.
pub const ERROR_DOMAIN: &str = "tower-idempotency";

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

impl<St> IdempotencyLayer<St> {
    /// gRPC mode (feature `grpc`, `docs/PROTOCOL.md` §16): protects the unary `methods`, each
    /// named by its path, `/package.Service/Method`; every other call passes through untouched,
    /// streaming methods included (never name one: its messages would be buffered, and its
    /// answers stored whole).
    ///
    /// In this mode the key is the `idempotency-key` metadata entry (the header name, which
    /// [`header_name`](Self::header_name) still changes); the fingerprint is the method's path
    /// and the request's message bytes, as framed on the wire, and no metadata unless
    /// [`fingerprint_headers`](Self::fingerprint_headers) lists it; a handler's answer is stored
    /// when its `grpc-status` is one of [`is_stored`]'s, read from the trailers or, in a
    /// trailers-only answer, from the headers; the layer's own answers are gRPC statuses
    /// ([`code_for`]), so [`render_problems`](Self::render_problems) and
    /// [`problem_status`](Self::problem_status) do not apply. The store policy, the limits (the
    /// response limit counts the trailers), the scope, the lease and the other settings apply as
    /// they do to HTTP. Calling it again replaces the methods.
    ///
    /// A named method is covered whatever the HTTP method of the request, as tonic routes it by
    /// its path alone: a `POST` (every gRPC call) is protected, and any other HTTP method is
    /// refused before the handler with HTTP 405, `allow: POST` and `INTERNAL`, as gRPC servers
    /// answer it. [`methods`](Self::methods) does not apply in this mode, before or after it.
    ///
    /// A method path that is not `/package.Service/Method`, or none at all, is a configuration
    /// error: [`check`](Self::check) returns [`ConfigError::GrpcMethods`], and applying the
    /// layer panics with it.
    ///
    /// ```
    /// use tower_idempotency::{ConfigError, IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .single_tenant()
    ///     .grpc(["/payments.v1.Payments/CreateCharge"]);
    /// assert_eq!(layer.check(), Ok(()));
    ///
    /// let typo = IdempotencyLayer::new(MemoryStore::new()).grpc(["payments.v1.Payments.CreateCharge"]);
    /// assert!(matches!(typo.check(), Err(ConfigError::GrpcMethods(_))));
    /// ```
    pub fn grpc<I>(mut self, methods: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.config.protocol_mode = Some(std::sync::Arc::new(GrpcMode::new(methods)));
        self
    }
}

/// The gRPC mode's rules: the [`ProtocolMode`] of `IdempotencyLayer::grpc`.
struct GrpcMode {
    methods: HashSet<Box<str>>,
    /// The first method named that is not a gRPC path, or none named: reported by `check`.
    invalid: Option<String>,
}

impl GrpcMode {
    fn new<I>(methods: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut invalid = None;
        let mut set = HashSet::new();
        for method in methods {
            let method = method.as_ref();
            if invalid.is_none() && !is_method_path(method) {
                invalid = Some(format!(
                    "{method:?} is not a gRPC method path: name each as `/package.Service/Method`"
                ));
            }
            set.insert(Box::from(method));
        }
        if set.is_empty() {
            invalid = Some(String::from(
                "no method is named: name the unary methods to protect, as `/package.Service/Method`",
            ));
        }
        Self {
            methods: set,
            invalid,
        }
    }
}

/// `/service/method`, each part non-empty visible ASCII without `/`.
fn is_method_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let part = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    rest.split_once('/')
        .is_some_and(|(service, method)| part(service) && part(method))
}

impl fmt::Debug for GrpcMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut methods: Vec<_> = self.methods.iter().collect();
        methods.sort();
        f.debug_struct("Grpc").field("methods", &methods).finish()
    }
}

impl ProtocolMode for GrpcMode {
    fn covers(&self, method: &Method, uri: &Uri) -> Coverage {
        // The path exactly, as tonic's generated servers match `uri().path()`: what tonic routes
        // to a named method is what is covered.
        if !self.methods.contains(uri.path()) {
            Coverage::Passthrough
        } else if method == Method::POST {
            Coverage::Covered
        } else {
            Coverage::Refused(not_post(method))
        }
    }

    fn respond(&self, problem: &Problem) -> Response<Bytes> {
        let kind = problem.kind();
        let code = code_for(kind);
        let message = match kind {
            ProblemKind::Mismatch => {
                "this idempotency-key was used for another call (another method or message); use a \
                 new key for a new call"
            }
            _ => problem.detail(),
        };
        let retry_after = problem.retry_after().map(Duration::from_secs);
        let details = details::encode(
            code as i32,
            message,
            status::reason(kind),
            ERROR_DOMAIN,
            retry_after,
        );
        let mut response = tonic::Status::with_details(code, message, details).into_http::<Bytes>();
        // `into_http` keeps the `Status` in the extensions: the kind is what the layer's own
        // answers carry.
        response.extensions_mut().remove::<tonic::Status>();
        response.extensions_mut().insert(kind);
        response
    }

    fn stores(
        &self,
        head: &ResponseParts,
        trailers: Option<&HeaderMap>,
        policy: &dyn StorePolicy,
    ) -> bool {
        // Trailers-only (the status in the headers) as tonic's client reads it: headers first.
        let status = (head.headers.get(GRPC_STATUS))
            .or_else(|| trailers.and_then(|trailers| trailers.get(GRPC_STATUS)));
        status.is_some_and(|status| {
            status::stored_under(
                tonic::Code::from_bytes(status.as_bytes()),
                &head.headers,
                policy,
            )
        })
    }

    fn check(&self) -> Result<(), ConfigError> {
        match &self.invalid {
            Some(why) => Err(ConfigError::GrpcMethods(why.clone())),
            None => Ok(()),
        }
    }
}

/// The answer to a named method's path with another HTTP method than `POST`: not a gRPC call
/// (gRPC sends each as a `POST`), though tonic would run it, key or not. As grpc-go answers it:
/// HTTP 405, so that no HTTP client reads it as a success, with `allow` and `INTERNAL`,
/// trailers-only. Not an idempotency problem, so no `ProblemKind` and no `ErrorInfo`.
fn not_post(method: &Method) -> Response<Bytes> {
    let message =
        format!("`{method}` is not a gRPC call's method: gRPC sends every call as `POST`");
    let mut response = tonic::Status::internal(message).into_http::<Bytes>();
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    (response.headers_mut()).insert(http::header::ALLOW, HeaderValue::from_static("POST"));
    response.extensions_mut().remove::<tonic::Status>();
    response
}

/// A protected tonic server stands for the service it wraps, so that it can be added to a tonic
/// `Server` (`add_service`) under the service's name.
impl<S: tonic::server::NamedService, St> tonic::server::NamedService for Idempotency<S, St> {
    const NAME: &'static str = S::NAME;
}

/// Which of the layer's answers a gRPC status is, from the `google.rpc.ErrorInfo` in its details
/// (domain [`ERROR_DOMAIN`]); `None` for a status the layer did not make (a handler's).
///
/// ```
/// use tonic::{Code, Status};
/// use tower_idempotency::grpc::problem_kind;
///
/// assert_eq!(problem_kind(&Status::new(Code::Aborted, "the handler's own")), None);
/// ```
pub fn problem_kind(status: &tonic::Status) -> Option<ProblemKind> {
    let info = details::error_info(&details::decode(status.details())?)?;
    (info.domain == ERROR_DOMAIN)
        .then(|| status::kind_of(&info.reason))
        .flatten()
}

/// The wait a gRPC status asks for in a `google.rpc.RetryInfo` in its details, such as the
/// layer's `ABORTED` (a call with the key in flight) and `UNAVAILABLE` (the store away) carry.
///
/// ```
/// use tonic::{Code, Status};
/// use tower_idempotency::grpc::retry_delay;
///
/// assert_eq!(retry_delay(&Status::new(Code::Unavailable, "no details")), None);
/// ```
pub fn retry_delay(status: &tonic::Status) -> Option<Duration> {
    details::retry_delay(&details::decode(status.details())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_paths() {
        for good in ["/payments.v1.Payments/CreateCharge", "/S/M"] {
            assert!(is_method_path(good), "{good}");
        }
        for bad in [
            "",
            "/",
            "//M",
            "/S/",
            "S/M",
            "/S/M/x",
            "/S M/x",
            "payments.v1.Payments.CreateCharge",
        ] {
            assert!(!is_method_path(bad), "{bad:?}");
        }
        assert!(GrpcMode::new(Vec::<&str>::new()).check().is_err());
        assert!(GrpcMode::new(["/a.B/C", "nope"]).check().is_err());
        assert!(GrpcMode::new(["/a.B/C"]).check().is_ok());
    }

    #[test]
    fn a_named_path_is_covered_as_a_post_and_refused_as_anything_else() {
        let mode = GrpcMode::new(["/a.B/C"]);
        let uri = |uri: &'static str| Uri::from_static(uri);
        let covers = |method: Method, path| mode.covers(&method, &uri(path));
        assert!(matches!(covers(Method::POST, "/a.B/C"), Coverage::Covered));
        assert!(matches!(
            covers(Method::POST, "/a.B/C?x=1"),
            Coverage::Covered
        ));
        for path in ["/a.B/D", "/a.B/C/", "/a.b/c", "/a.B/%43", "/a.B"] {
            assert!(
                matches!(covers(Method::POST, path), Coverage::Passthrough),
                "{path}"
            );
            assert!(
                matches!(covers(Method::PUT, path), Coverage::Passthrough),
                "{path}"
            );
        }
        let extension = Method::from_bytes(b"CHARGE").unwrap();
        for method in [
            Method::GET,
            Method::PUT,
            Method::DELETE,
            Method::OPTIONS,
            extension,
        ] {
            let Coverage::Refused(response) = covers(method.clone(), "/a.B/C") else {
                panic!("{method} to a named path must be refused");
            };
            assert_eq!(response.status(), http::StatusCode::METHOD_NOT_ALLOWED);
            let headers = response.headers();
            assert_eq!(headers["allow"], "POST");
            assert_eq!(headers["content-type"], "application/grpc");
            assert_eq!(headers["grpc-status"], "13");
            assert!(response.body().is_empty());
            assert!(response.extensions().get::<ProblemKind>().is_none());
            assert!(response.extensions().get::<tonic::Status>().is_none());
        }
    }

    #[test]
    fn the_layers_answers_are_trailers_only_statuses() {
        let mode = GrpcMode::new(["/a.B/C"]);
        let problem = Problem::new(
            ProblemKind::InFlight,
            http::StatusCode::CONFLICT,
            "still running",
        )
        .with_retry_after(Some(2));
        let response = mode.respond(&problem);
        assert_eq!(response.status(), http::StatusCode::OK);
        assert!(response.body().is_empty());
        let headers = response.headers();
        let names: Vec<_> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "grpc-status",
                "grpc-message",
                "grpc-status-details-bin"
            ]
        );
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "10");
        assert_eq!(headers["grpc-message"], "still%20running");
        let details = headers["grpc-status-details-bin"].as_bytes();
        assert!(!details.ends_with(b"="), "unpadded base64");
        let tonic_status = tonic::Status::from_header_map(headers).unwrap();
        let status = details::decode(tonic_status.details()).unwrap();
        assert_eq!(status.code, tonic::Code::Aborted as i32);
        assert_eq!(status.message, "still running");
        assert_eq!(details::retry_delay(&status), Some(Duration::from_secs(2)));
        assert_eq!(
            response.extensions().get::<ProblemKind>(),
            Some(&ProblemKind::InFlight)
        );
        assert_eq!(problem_kind(&tonic_status), Some(ProblemKind::InFlight));
        assert_eq!(retry_delay(&tonic_status), Some(Duration::from_secs(2)));
    }

    #[test]
    fn a_status_is_read_from_the_headers_first_then_the_trailers() {
        let mode = GrpcMode::new(["/a.B/C"]);
        let head = |status: Option<&'static str>| {
            let mut response = Response::new(());
            if let Some(status) = status {
                response
                    .headers_mut()
                    .insert(GRPC_STATUS, http::HeaderValue::from_static(status));
            }
            response.into_parts().0
        };
        let trailers = |status: &'static str| {
            HeaderMap::from_iter([(GRPC_STATUS, http::HeaderValue::from_static(status))])
        };
        let stores = |head: ResponseParts, trailers: Option<&HeaderMap>| {
            mode.stores(&head, trailers, &crate::DefaultStorePolicy)
        };
        assert!(stores(head(None), Some(&trailers("0"))));
        assert!(!stores(head(None), Some(&trailers("14"))));
        assert!(
            stores(head(Some("9")), None),
            "trailers-only FAILED_PRECONDITION"
        );
        assert!(!stores(head(Some("13")), None), "trailers-only INTERNAL");
        assert!(!stores(head(None), None), "no status at all");
        assert!(!stores(head(None), Some(&trailers("x"))), "not a code");
        assert!(
            !stores(head(None), Some(&trailers("99"))),
            "an unknown code"
        );
        // A refusal, as the policy stores its HTTP status.
        assert!(!stores(head(Some("5")), None), "trailers-only NOT_FOUND");
        let every = &crate::Every4xxStorePolicy;
        assert!(mode.stores(&head(Some("5")), None, every));
        // The policy sees the answer's headers, with the refusal's HTTP status.
        let marked = |head: &ResponseParts| head.headers.contains_key("x-store");
        let mut head_marked = head(Some("5"));
        head_marked
            .headers
            .insert("x-store", http::HeaderValue::from_static("1"));
        assert!(mode.stores(&head_marked, None, &marked));
        assert!(!mode.stores(&head(Some("5")), None, &marked));
    }
}
