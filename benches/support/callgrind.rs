//! Callgrind's client requests (`valgrind/callgrind.h`), the two a bench needs to count only the
//! work it measures: run under `valgrind --tool=callgrind --instr-atstart=no`, the program is not
//! instrumented until [`start_instrumentation`] (a prefill of millions of records runs at
//! valgrind's uninstrumented speed, and counts nothing), and not after [`stop_instrumentation`].
//!
//! A client request is a no-op sequence of instructions that valgrind recognises: outside valgrind
//! it does nothing, so the same binary runs natively. Written out here (x86-64 only, as the
//! header's `VALGRIND_DO_CLIENT_REQUEST_EXPR`) rather than through a crate that compiles the C
//! header: two requests do not earn a build script and a C compiler.
//!
//! [`instructions`] runs a bench's own binary under callgrind and reads back what it counted.

use std::path::Path;
use std::process::Command;

/// `VG_USERREQ_TOOL_BASE('C','T')`: the first of callgrind's requests.
const BASE: u64 = (b'C' as u64) << 24 | (b'T' as u64) << 16;
/// `VG_USERREQ__START_INSTRUMENTATION`, `VG_USERREQ__STOP_INSTRUMENTATION`.
const START_INSTRUMENTATION: u64 = BASE + 4;
const STOP_INSTRUMENTATION: u64 = BASE + 5;

/// The instructions callgrind counts over a run of this program with the environment variable
/// `probe` (its name and value) set, which the bench reads to run one case. With `at_start`, the
/// whole run counts; without, only what [`start_instrumentation`] and [`stop_instrumentation`]
/// enclose.
///
/// # Panics
/// When valgrind is missing, the run fails, or callgrind reports no count.
pub fn instructions(probe: (&str, &str), at_start: bool) -> u64 {
    let exe = std::env::current_exe().expect("this program's path");
    let out = std::env::temp_dir().join(format!(
        "{}-{}.callgrind",
        exe.file_stem()
            .and_then(|stem| stem.to_str())
            .unwrap_or("bench"),
        std::process::id()
    ));
    let run = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!(
            "--instr-atstart={}",
            if at_start { "yes" } else { "no" }
        ))
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(Path::new(&exe))
        .env(probe.0, probe.1)
        .output()
        .expect("valgrind runs (apt-get install valgrind)");
    let _ = std::fs::remove_file(&out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "{}={} under callgrind failed:\n{stderr}",
        probe.0,
        probe.1
    );
    // callgrind's last words: "==<pid>== Collected : <Ir>".
    stderr
        .lines()
        .find_map(|line| line.split("Collected : ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no instruction count from callgrind:\n{stderr}"))
}

/// Turns callgrind's instrumentation (and counting) on.
pub fn start_instrumentation() {
    request(START_INSTRUMENTATION);
}

/// Turns it off: what follows (the teardown of millions of records) counts nothing.
pub fn stop_instrumentation() {
    request(STOP_INSTRUMENTATION);
}

#[cfg(target_arch = "x86_64")]
fn request(code: u64) {
    let args: [u64; 6] = [code, 0, 0, 0, 0, 0];
    let mut result: u64 = 0;
    // SAFETY: the four rotations of rdi add up to 128 bits (rdi is unchanged) and `xchg rbx, rbx`
    // swaps rbx with itself: natively, nothing changes. Under valgrind, the sequence reads the six
    // words at rax and writes its answer to rdx.
    unsafe {
        std::arch::asm!(
            "rol rdi, 3",
            "rol rdi, 13",
            "rol rdi, 61",
            "rol rdi, 51",
            "xchg rbx, rbx",
            inout("rdx") result,
            in("rax") args.as_ptr(),
            inout("rdi") 0u64 => _,
            options(nostack),
        );
    }
    std::hint::black_box(result);
}

#[cfg(not(target_arch = "x86_64"))]
fn request(_code: u64) {
    panic!("callgrind client requests are written for x86-64 only");
}
