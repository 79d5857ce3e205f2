//! How a command ends: one [`Status`] per run, mapped to the process exit code in
//! one place, and the `error: ... / caused by: ... / hint: ...` rendering of errors.
//!
//! Every subcommand returns `anyhow::Result<Status>`: `Ok` carries the outcome of
//! a command that ran (including a check that found differences), `Err` an error
//! that stopped it. [`finish`] turns either into the exit code.

use std::io::Write;
use std::process::ExitCode;

use unshard::Error;

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
    pub fn code(self) -> ExitCode {
        ExitCode::from(match self {
            Status::Success => 0,
            Status::Failure => 1,
            Status::Error => 2,
        })
    }
}

/// The exit code of a finished command; prints the error when there is one.
pub fn finish(result: anyhow::Result<Status>) -> ExitCode {
    match result {
        Ok(status) => status.code(),
        // A reader that went away (`unshard inspect ... | head`) is not an error.
        Err(e) if is_broken_pipe(&e) => Status::Success.code(),
        Err(e) => {
            print_error(&e);
            match e.downcast_ref::<Error>() {
                Some(Error::Usage(_)) => Status::Error.code(),
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
    let _ = writeln!(err, "error: {e}");
    for cause in e.chain().skip(1).take(8) {
        let _ = writeln!(err, "  caused by: {cause}");
    }
    if let Some(hint) = e.downcast_ref::<Error>().and_then(Error::hint) {
        let _ = writeln!(err, "hint: {hint}");
    }
}
