//! What the tests share: the API called in-process (`api.rs`), the example's components on each
//! backend behind test instruments (`stack.rs`, `instruments.rs`), the package's binaries run as
//! processes, and a proxy that cuts answers off (`cut_proxy.rs`).
#![allow(
    dead_code,
    reason = "every test binary that says `mod support;` compiles all of it, and each uses a part"
)]

pub(crate) mod api;
pub(crate) mod cut_proxy;
pub(crate) mod harness;
pub(crate) mod instruments;
pub(crate) mod process;
pub(crate) mod stack;

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The path of one of this package's binaries: `server` (the payments server), `client` or `provider`,
/// which Cargo builds before it runs the tests.
pub(crate) fn binary(name: &str) -> PathBuf {
    PathBuf::from(match name {
        "server" => env!("CARGO_BIN_EXE_example-payments"),
        "client" => env!("CARGO_BIN_EXE_client"),
        "provider" => env!("CARGO_BIN_EXE_provider"),
        other => panic!("no binary named {other}"),
    })
}

/// Waits for `child` to exit, killing it after `bound`.
pub(crate) fn wait_within(child: &mut Child, bound: Duration) -> ExitStatus {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().expect("the child can be waited on") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a test waits for what must happen soon: far above any step's normal time on a
/// loaded 2-core machine.
pub(crate) const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `condition` every 5 ms until it holds, for up to [`PATIENCE`].
pub(crate) async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
