//! The servers that live in statics (a test binary's shared cluster or PostgreSQL), which are
//! never dropped: killed and their directories removed when the process exits.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, Once};

static LEFT: Mutex<(Vec<u32>, Vec<PathBuf>)> = Mutex::new((Vec::new(), Vec::new()));

/// Kills `pids` and removes `dirs` when the process exits.
pub(crate) fn kill(pids: Vec<u32>, dirs: Vec<PathBuf>) {
    static REGISTERED: Once = Once::new();
    {
        let mut left = LEFT.lock().unwrap_or_else(|e| e.into_inner());
        left.0.extend(pids);
        left.1.extend(dirs);
    }
    REGISTERED.call_once(|| {
        // SAFETY: `kill_all` is an `extern "C" fn()` that does not unwind.
        unsafe {
            libc::atexit(kill_all);
        }
    });
}

extern "C" fn kill_all() {
    let left = LEFT.lock().unwrap_or_else(|e| e.into_inner());
    for pid in &left.0 {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    for dir in &left.1 {
        let _ = std::fs::remove_dir_all(dir);
    }
}
