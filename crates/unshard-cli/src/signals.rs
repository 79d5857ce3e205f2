//! Ctrl-C and SIGTERM. Once a merge has a staging directory, the library's writer
//! must stop at its next window, remove the directory and return `interrupted`:
//! the handler sets the flag it checks. Before that (opening and planning, which
//! take minutes on a large checkpoint) and in the commands that write nothing,
//! nothing needs cleaning up, so the process exits at once.
//!
//! Either way the exit code is the shell's convention for a signal: 128 + its
//! number (130 for SIGINT, 143 for SIGTERM).
//!
//! SIGINT and SIGTERM are blocked in every thread and taken by one thread with
//! sigwait(2), which can do what a signal handler may not (list a directory,
//! print, exit). It uses no file descriptor: a merge may need every one the limit
//! allows. Should that thread fail to start, a plain handler sets the flag as
//! before.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::OnceLock;

use unshard::Cancel;

/// Set on SIGINT/SIGTERM; the library sees it through [`token`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The cancellation token the commands pass to the library: cancelled by a signal.
pub fn token() -> Cancel {
    Cancel::from_static(&INTERRUPTED)
}

/// The last signal received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// The output of the running merge, whose staging directory must be cleaned up.
static OUTPUT: OnceLock<PathBuf> = OnceLock::new();
/// Set once the `interrupted` message is printed, so it is printed once.
static REPORTED: AtomicBool = AtomicBool::new(false);

/// The fallback: flags only, which is all that is async-signal-safe here.
extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Takes SIGINT and SIGTERM for the rest of the process. Call before any other
/// thread starts: threads inherit the blocked mask.
pub fn install() {
    // SAFETY: sigset_t is plain data that sigemptyset initialises; the calls
    // only read and write the set passed to them.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    };
    // SAFETY: as above; the old mask is not needed.
    let blocked =
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) } == 0;
    let waiting = blocked
        && std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || watch(set))
            .is_ok();
    if waiting {
        return;
    }
    // SAFETY: unblocking restores the default mask; the handler only stores to
    // atomics, which is async-signal-safe.
    unsafe {
        if blocked {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Declares that a merge into `output` is running: from now on a signal exits at
/// once only while no staging directory of this process exists beside `output`.
pub fn protect_output(output: &Path) {
    let _ = OUTPUT.set(output.to_path_buf());
}

/// The signal received, if any.
pub fn received() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Prints `error: interrupted` (once per process) and exits with 128 + `sig`.
pub fn exit_interrupted(sig: i32) -> ! {
    if !REPORTED.swap(true, Ordering::SeqCst) {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "error: interrupted");
        if OUTPUT.get().is_some() {
            let _ = writeln!(err, "hint: nothing was written; run the same command again");
        }
    }
    std::process::exit(128 + sig)
}

fn watch(set: libc::sigset_t) {
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: sigwait reads the set and writes the signal number to `sig`.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            continue;
        }
        SIGNAL.store(sig, Ordering::SeqCst);
        INTERRUPTED.store(true, Ordering::SeqCst);
        if !staging_exists() {
            exit_interrupted(sig);
        }
    }
}

/// Whether a staging directory of this process sits beside the output: the
/// library names it `.<output name>.unshard-tmp-<pid>` while writing, and
/// `.<output name>.unshard-tmp-old-<pid>` for a replaced output during the final
/// rename (the library's staging directory and its commit). When the directory
/// cannot be listed, assume there is one: the writer's own check is always safe,
/// only slower.
fn staging_exists() -> bool {
    let Some(out) = OUTPUT.get() else {
        return false;
    };
    // An output in object storage has no staging directory: the writer undoes its
    // uploads itself once it sees the cancellation, so never exit under it.
    if unshard::is_url(out) {
        return true;
    }
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let prefix = format!(".{name}.unshard-tmp-");
    let suffix = format!("-{}", std::process::id());
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::read_dir(parent) {
        Ok(entries) => entries.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(&prefix) && n.ends_with(&suffix)
        }),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}
