//! Callgrind's client requests (`valgrind/callgrind.h`), the two a bench needs to count only the
//! work it measures: run under `valgrind --tool=callgrind --instr-atstart=no`, the program is not
//! instrumented until [`start_instrumentation`] (a prefill of millions of records runs at
//! valgrind's uninstrumented speed, and counts nothing), and not after [`stop_instrumentation`].
//!
//! A client request is a no-op sequence of instructions that valgrind recognises: outside valgrind
//! it does nothing, so the same binary runs natively. Written out here (x86-64 only, as the
//! header's `VALGRIND_DO_CLIENT_REQUEST_EXPR`) rather than through a crate that compiles the C
//! header: two requests do not earn a build script and a C compiler.

/// `VG_USERREQ_TOOL_BASE('C','T')`: the first of callgrind's requests.
const BASE: u64 = (b'C' as u64) << 24 | (b'T' as u64) << 16;
/// `VG_USERREQ__START_INSTRUMENTATION`, `VG_USERREQ__STOP_INSTRUMENTATION`.
const START_INSTRUMENTATION: u64 = BASE + 4;
const STOP_INSTRUMENTATION: u64 = BASE + 5;

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
