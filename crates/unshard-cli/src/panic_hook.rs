//! A panic is a bug in unshard, never the user's fault: instead of Rust's raw
//! message and backtrace note, say so in a few lines with what a bug report needs
//! (the version and where it happened), and where to send it.

use std::io::Write;

/// Where bug reports go.
const ISSUES: &str = "https://github.com/unshard/unshard/issues";

/// Replaces the default panic message for the rest of the process.
///
/// The exit code stays Rust's 101 for a panic, distinct from every code unshard
/// returns on purpose. `RUST_BACKTRACE=1` still adds a backtrace.
pub fn install() {
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown cause".to_string());
        let at = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown location".to_string());
        let mut err = std::io::stderr().lock();
        let _ = writeln!(
            err,
            "error: internal error in unshard {} (this is a bug, not a problem with your files)",
            env!("CARGO_PKG_VERSION")
        );
        let _ = writeln!(err, "  panicked at {at}: {what}");
        let _ = writeln!(
            err,
            "hint: please report it at {ISSUES} with this message and the command you ran"
        );
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            let _ = writeln!(err, "{}", std::backtrace::Backtrace::force_capture());
        }
    }));
}
