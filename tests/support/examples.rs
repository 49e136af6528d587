#![allow(dead_code)]
//! The examples' binaries, for tests that run an example as a process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The binary of the example `name`, built on first use with every feature (as
/// `cargo test --all-features` builds it already, so that this is usually a no-op), shared by every
/// test file that runs an example as a process.
pub fn example_binary(name: &'static str) -> PathBuf {
    static BINARIES: Mutex<BTreeMap<&str, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut binaries = BINARIES.lock().unwrap_or_else(PoisonError::into_inner);
    let binary = binaries.entry(name).or_insert_with(|| {
        // The test runs as <target dir>/<profile>/deps/<test>-<hash>.
        let exe = std::env::current_exe().expect("the test's own path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("the test runs from <target>/<profile>/deps");
        let target_dir = profile_dir.parent().expect("a target directory");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = Command::new(cargo);
        build
            .args([
                "build",
                "--quiet",
                "--all-features",
                "--example",
                name,
                "--manifest-path",
            ])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .arg("--target-dir")
            .arg(target_dir);
        match profile_dir.file_name().and_then(|name| name.to_str()) {
            Some("debug") | None => {}
            Some(profile) => {
                build.args(["--profile", profile]);
            }
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "cargo build --example {name} failed");
        let binary = profile_dir
            .join("examples")
            .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
        assert!(binary.exists(), "no example binary at {}", binary.display());
        binary
    });
    binary.clone()
}

/// Waits for `child` to exit, killing it after `bound`.
pub fn wait_within(child: &mut Child, bound: Duration) -> ExitStatus {
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
