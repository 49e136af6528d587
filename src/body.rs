//! The body types the layer hands to the inner service and returns to the client.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

pin_project! {
    /// The request body the inner service receives: the buffered bytes of a protected request, or
    /// the untouched body of a request the layer passes through.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    /// The response body the layer returns: the inner service's body untouched, a buffered,
    /// replayed or problem body, or a buffered prefix followed by the rest of the inner body (a
    /// response larger than the response limit).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Full { #[pin] body: Full<Bytes> },
        Inner { #[pin] body: B },
        // The trailers are boxed: they are rare, and unboxed they would triple the size of every
        // response body (and of every future that holds one).
        Chained { prefix: Option<Bytes>, trailers: Option<Box<HeaderMap>>, rest: Pin<Box<B>> },
        // A whole body that ends with trailers (a gRPC response's, first or replayed).
        Trailed { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                body: Full::new(bytes),
            },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                body: Full::new(bytes),
            },
        }
    }

    /// A whole body: `bytes`, then `trailers` if there are any.
    pub(crate) fn with_trailers(bytes: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        let Some(trailers) = trailers else {
            return Self::full(bytes);
        };
        Self {
            kind: Kind::Trailed {
                data: Some(bytes).filter(|b| !b.is_empty()),
                trailers: Some(trailers),
            },
        }
    }

    /// `body`, passed through as it comes.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// `prefix` (bytes already read of a body), then `trailers` if any, then the `rest` of the
    /// body as it comes.
    pub(crate) fn chained(
        prefix: Bytes,
        trailers: Option<Box<HeaderMap>>,
        rest: Pin<Box<B>>,
    ) -> Self {
        let prefix = Some(prefix).filter(|p| !p.is_empty());
        Self {
            kind: Kind::Chained {
                prefix,
                trailers,
                rest,
            },
        }
    }
}

/// Both public body types are thin wrappers that delegate to `Kind`.
macro_rules! delegate_body {
    ($name:ident) => {
        impl<B> Body for $name<B>
        where
            B: Body<Data = Bytes>,
        {
            type Data = Bytes;
            type Error = B::Error;

            fn poll_frame(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
                self.project().kind.poll_frame(cx)
            }

            fn is_end_stream(&self) -> bool {
                self.kind.is_end_stream()
            }

            fn size_hint(&self) -> SizeHint {
                self.kind.size_hint()
            }
        }
    };
}

delegate_body!(RequestBody);
delegate_body!(ResponseBody);

impl<B> Kind<B>
where
    B: Body<Data = Bytes>,
{
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            KindProj::Full { body } => match body.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Chained {
                prefix,
                trailers,
                rest,
            } => {
                if let Some(bytes) = prefix.take() {
                    Poll::Ready(Some(Ok(Frame::data(bytes))))
                } else if let Some(trailers) = trailers.take() {
                    Poll::Ready(Some(Ok(Frame::trailers(*trailers))))
                } else {
                    rest.as_mut().poll_frame(cx)
                }
            }
            KindProj::Trailed { data, trailers } => {
                if let Some(bytes) = data.take() {
                    Poll::Ready(Some(Ok(Frame::data(bytes))))
                } else {
                    Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(*t))))
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Kind::Full { body } => body.is_end_stream(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Chained {
                prefix,
                trailers,
                rest,
            } => prefix.is_none() && trailers.is_none() && rest.is_end_stream(),
            Kind::Trailed { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Kind::Full { body } => body.size_hint(),
            Kind::Inner { body } => body.size_hint(),
            Kind::Chained { prefix, rest, .. } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + extra);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            // No exact size: a length would keep hyper from sending the trailers over HTTP/1.1
            // (chunked), and add a `content-length` the handler did not send.
            Kind::Trailed { data, .. } => {
                let mut hint = SizeHint::new();
                hint.set_lower(data.as_ref().map_or(0, |d| d.len() as u64));
                hint
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn chained_body_yields_prefix_then_rest() {
        let body = ResponseBody::chained(
            Bytes::from_static(b"abc"),
            None,
            Box::pin(Full::new(Bytes::from_static(b"def"))),
        );
        assert_eq!(body.size_hint().exact(), Some(6));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcdef");
    }

    #[tokio::test]
    async fn a_trailed_body_yields_its_data_then_its_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body = ResponseBody::<Full<Bytes>>::with_trailers(
            Bytes::from_static(b"abc"),
            Some(Box::new(trailers.clone())),
        );
        assert_eq!(body.size_hint().lower(), 3);
        assert_eq!(
            body.size_hint().upper(),
            None,
            "no length: trailers go chunked"
        );
        assert!(!body.is_end_stream());
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "abc");

        let without = ResponseBody::<Full<Bytes>>::with_trailers(Bytes::new(), None);
        assert!(without.is_end_stream(), "no trailers: a plain, empty body");
    }
}
