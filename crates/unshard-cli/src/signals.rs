//! Ctrl-C and SIGTERM: the library's writer checks a flag at every window and, when
//! it is set, removes its staging directory and returns an `interrupted` error.

use std::sync::atomic::Ordering;

use unshard::write::INTERRUPTED;

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM stop the writer at the next window; the staging directory is
/// then removed and the process exits 1.
pub fn install() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}
