//! Telling the user what an input's pickles would run under `torch.load`.
//!
//! Every reading command reports it on stderr, whatever `--quiet` says: a file that
//! carries a payload is compromised even though unshard ran none of it, and the
//! person about to publish a model from it must hear of it. `--refuse-unsafe` (and
//! `--strict`) turn the warning into a refusal.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use unshard::{UnsafeCall, UnsafePolicy};

use crate::text::escape;

/// `--refuse-unsafe`: refuse inputs whose pickles would run code.
#[derive(clap::Args, Debug)]
pub struct RefuseArg {
    /// Refuse (exit 1, write nothing) if a pickle read would run code under
    /// torch.load (a call or import outside what torch and the checkpoint formats
    /// use). Without it such calls are listed as warnings and the tensors are read;
    /// --strict refuses too.
    #[arg(long)]
    pub refuse_unsafe: bool,
}

impl RefuseArg {
    /// The library's policy: warn on stderr, and refuse if asked to (`--strict`
    /// refuses too).
    pub fn policy(&self, strict: bool) -> UnsafePolicy {
        UnsafePolicy {
            refuse: self.refuse_unsafe || strict,
            report: Some(warn),
        }
    }
}

/// Whether [`warn`] has reported anything in this run.
static WARNED: AtomicBool = AtomicBool::new(false);

/// Prints one warning per file, listing each callable (never silenced).
pub fn warn(calls: &[UnsafeCall]) {
    if !calls.is_empty() {
        WARNED.store(true, Ordering::Relaxed);
    }
    let mut err = std::io::stderr().lock();
    let mut i = 0;
    while let Some(first) = calls.get(i) {
        let same = calls[i..]
            .iter()
            .take_while(|c| c.path == first.path)
            .count();
        let _ = writeln!(
            err,
            "warning: {}: its pickle would run code under torch.load (unshard ran none of it):",
            escape(&first.path.display().to_string())
        );
        for c in &calls[i..i + same] {
            let _ = writeln!(err, "  {}", escape(&c.describe()));
        }
        i += same;
    }
    if !calls.is_empty() {
        let _ = writeln!(
            err,
            "hint: do not load this file with torch.load(weights_only=False); `unshard scan` lists every call; --refuse-unsafe refuses such files"
        );
    }
}

/// After a command failed before its inputs' calls were reported (the pickle
/// broke, or holds no tensors), scans the input files given (not directories,
/// which may be large) and warns about what they would run: `torch.load` runs a
/// pickle's calls up to where it breaks.
pub fn after_error(paths: &[&Path]) {
    if WARNED.load(Ordering::Relaxed) {
        return;
    }
    for path in paths.iter().filter(|p| p.is_file()) {
        warn(&unshard::scan_file(path).unsafe_calls);
    }
}
