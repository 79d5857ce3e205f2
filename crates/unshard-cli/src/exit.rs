//! How a command ends: one [`Status`] per run, mapped to the process exit code in
//! one place, and the `error: ... / caused by: ... / hint: ...` rendering of errors.
//!
//! Every subcommand returns `anyhow::Result<Status>`: `Ok` carries the outcome of
//! a command that ran (including a check that found differences), `Err` an error
//! that stopped it. [`finish`] turns either into the exit code.
//!
//! Two exits bypass [`Status`]: a signal (128 + its number, see `signals.rs`)
//! and a panic (Rust's 101, see `panic_hook.rs`).

use std::io::Write;
use unshard::Error;

use crate::signals;
use crate::text::escape_lines;

/// The outcome of a command, as the shell sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Did what was asked; for `verify` and `diff`, found no difference (exit 0).
    Success,
    /// Ran into a problem with the inputs, the output or the system, or a check
    /// found a difference (exit 1).
    Failure,
    /// The command line itself is wrong: a bad flag value, a missing argument (exit 2,
    /// as clap's own usage errors).
    Error,
}

impl Status {
    /// The process exit code of this outcome.
    pub fn code(self) -> u8 {
        match self {
            Status::Success => 0,
            Status::Failure => 1,
            Status::Error => 2,
        }
    }
}

/// A command line that cannot be right, found after clap parsed it (two outputs
/// that differ, ...): exit 2 like clap's own usage errors, with a hint.
#[derive(Debug)]
pub struct UsageError {
    /// What is wrong.
    pub msg: String,
    /// What to type instead.
    pub hint: String,
}

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for UsageError {}

/// The exit code of a finished command; prints the error when there is one.
pub fn finish(result: anyhow::Result<Status>) -> u8 {
    match result {
        Ok(status) => status.code(),
        // A reader that went away (`unshard inspect ... | head`) is not an error.
        Err(e) if is_broken_pipe(&e) => Status::Success.code(),
        // Stopped by Ctrl-C or SIGTERM: the writer has cleaned up; exit as the
        // shell expects of a signal.
        Err(e) if matches!(e.downcast_ref::<Error>(), Some(Error::Interrupted)) => {
            signals::exit_interrupted(signals::received().unwrap_or(libc::SIGINT))
        }
        Err(e) => {
            print_error(&e);
            match e.downcast_ref::<Error>() {
                Some(Error::Usage(_)) => Status::Error.code(),
                _ if e.is::<UsageError>() => Status::Error.code(),
                _ => Status::Failure.code(),
            }
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Prints `error: ...`, each cause, and a hint when there is one.
pub fn print_error(e: &anyhow::Error) {
    let mut err = std::io::stderr().lock();
    let msg = e
        .downcast_ref::<Error>()
        .and_then(crate::hints::message_for_flags)
        .unwrap_or_else(|| e.to_string());
    let _ = writeln!(err, "error: {}", escape_lines(&msg));
    for cause in e.chain().skip(1).take(8) {
        let _ = writeln!(err, "  caused by: {}", escape_lines(&cause.to_string()));
    }
    let hint = match e.downcast_ref::<UsageError>() {
        Some(u) => Some(u.hint.clone()),
        None => e
            .downcast_ref::<Error>()
            .and_then(|e| crate::hints::for_flags(e).or_else(|| e.hint())),
    };
    if let Some(hint) = hint {
        let _ = writeln!(err, "hint: {}", escape_lines(&hint));
    }
}
