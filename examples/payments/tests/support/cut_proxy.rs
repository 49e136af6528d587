//! A TCP proxy on loopback that passes requests through and cuts answers off after their head, as
//! a connection that drops or a proxy that times out leaves a client: a status, and no whole body.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// What the proxy does to a connection's first answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Forwards everything, both ways.
    Pass,
    /// Forwards the answer's head, then resets the connection (RST).
    Reset,
    /// Forwards the answer's head and half of the body bytes that came with it, then closes the
    /// connection (FIN): the body ends short of its `Content-Length`.
    Truncate,
}

/// How long either side may stay silent before the proxy drops the connection: far longer than
/// any answer in the tests, so it only ends connections a client left open.
const IDLE: Duration = Duration::from_secs(30);
/// The most connections a proxy accepts: a client that sends without end fails its test rather
/// than running on.
const MAX_CONNECTIONS: usize = 100;

/// A running proxy; dropping it stops accepting (connections in progress end on their own).
pub(crate) struct CutProxy {
    addr: SocketAddr,
    cuts: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl CutProxy {
    /// Listens on a free port of 127.0.0.1 and forwards each connection to `to`; connection
    /// `n` (from 0, in the order accepted) gets `script(n)`.
    pub(crate) fn start(to: SocketAddr, script: impl Fn(usize) -> Cut + Send + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let addr = listener.local_addr().expect("the proxy's address");
        let cuts = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (cuts, stop) = (cuts.clone(), stop.clone());
            thread::spawn(move || {
                for (n, client) in listener.incoming().take(MAX_CONNECTIONS).enumerate() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let (cut, cuts) = (script(n), cuts.clone());
                    thread::spawn(move || forward(client, to, cut, &cuts));
                }
            })
        };
        Self {
            addr,
            cuts,
            stop,
            acceptor: Some(acceptor),
        }
    }

    /// The proxy's URL, for a client.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many answers it has cut off so far.
    pub(crate) fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees `stop`.
        let _ = TcpStream::connect(self.addr);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// Forwards one connection; requests untouched, the first answer as `cut` says.
fn forward(client: TcpStream, upstream: SocketAddr, cut: Cut, cuts: &AtomicUsize) {
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    for stream in [&client, &server] {
        let _ = stream.set_read_timeout(Some(IDLE));
    }
    let (Ok(mut from_client), Ok(mut to_server)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let requests = thread::spawn(move || {
        let _ = io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(Shutdown::Write);
    });
    let (mut from_server, mut to_client) = (server, client);
    if cut == Cut::Pass {
        let _ = io::copy(&mut from_server, &mut to_client);
        let _ = to_client.shutdown(Shutdown::Both);
        let _ = requests.join();
        return;
    }
    let Some((answer, head_len)) = read_head(&mut from_server) else {
        let _ = to_client.shutdown(Shutdown::Both);
        let _ = requests.join();
        return;
    };
    cuts.fetch_add(1, Ordering::SeqCst);
    let _ = from_server.shutdown(Shutdown::Both);
    match cut {
        Cut::Reset => {
            let _ = to_client.write_all(&answer[..head_len]);
            // The request thread holds a second descriptor of the socket, and a reset needs the
            // last one closed: end its read first.
            let _ = to_client.shutdown(Shutdown::Read);
            let _ = requests.join();
            reset(to_client);
        }
        Cut::Truncate => {
            let part = head_len + (answer.len() - head_len) / 2;
            let _ = to_client.write_all(&answer[..part]);
            let _ = to_client.shutdown(Shutdown::Both);
            let _ = requests.join();
        }
        Cut::Pass => unreachable!("forwarded whole above"),
    }
}

/// Reads until an answer's head has arrived; returns what was read and the head's length.
fn read_head(from: &mut TcpStream) -> Option<(Vec<u8>, usize)> {
    let mut answer = Vec::new();
    let mut buffer = [0; 4096];
    while answer.len() < 64 * 1024 {
        if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some((answer, end + 4));
        }
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => return None,
            Ok(n) => answer.extend_from_slice(&buffer[..n]),
        }
    }
    None
}

/// Closes `stream` with an RST rather than a FIN: SO_LINGER on, with a timeout of zero.
fn reset(stream: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the descriptor is open (`stream` owns it), and the option's value is a `linger`
    // of the length passed.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(stream);
}
