//! Serving the API over HTTP/1.1 so that no client can hold the server open: `axum::serve` sets no
//! read timeout, so a client that sends part of a request, then nothing, would keep its connection
//! and a graceful shutdown waiting forever. Here the request head must arrive within
//! [`HEADER_READ_TIMEOUT`] (hyper's, else the connection is closed), and the whole body within
//! [`BODY_READ_TIMEOUT`] of it (tower-http's `RequestBodyDeadlineLayer`: one deadline, which a body
//! trickling a byte at a time cannot push back; a late body fails its request, 400 from the layer).
//! At shutdown, open connections get a grace period to finish their requests, then are closed.
//! HTTP/1.1 only: the header timeout is an HTTP/1 setting, and `hyper_util`'s detection of HTTP/2
//! reads a connection's first bytes with no timeout at all.

use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::Layer;
use tower_http::timeout::RequestBodyDeadlineLayer;

/// How long a client has to send a request's line and headers.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to send a request's body, once its headers are in.
pub(crate) const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to wait after a failed accept (out of file descriptors, usually) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` until `stop`; then lets the requests in flight finish for up to
/// `grace`, and closes the connections still open.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    stop: CancellationToken,
    grace: Duration,
) {
    let app = RequestBodyDeadlineLayer::new(BODY_READ_TIMEOUT).layer(app);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    let close = CancellationToken::new();
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    tracing::warn!(%err, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let close = close.clone().cancelled_owned();
        tokio::spawn(async move {
            tokio::select! {
                served = connection => {
                    if let Err(err) = served {
                        tracing::debug!(%err, "connection ended");
                    }
                }
                () = close => {}
            }
        });
    }
    drop(listener);
    let drained = tokio::time::timeout(grace, graceful.shutdown()).await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "closing the connections still open after the grace period"
        );
        close.cancel();
    }
}
