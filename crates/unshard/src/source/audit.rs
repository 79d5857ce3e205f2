//! What a pickle would run under `torch.load`, found as readers parse it: the
//! [`UnsafeCall`]s every reader records in `Checkpoint::unsafe_calls`, and the
//! [`UnsafePolicy`] that operations apply to them once the inputs are open. The walk
//! over any file behind `unshard scan` is the `scan` operation, above the readers.

use std::path::{Path, PathBuf};

use unshard_pickle::{Pickle, Verdict};

use crate::error::{Error, Result};

/// One callable a pickle would run under `torch.load(weights_only=False)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsafeCall {
    /// The file holding the pickle.
    pub path: PathBuf,
    /// Where in the file: the zip record (`archive/data.pkl`) or which of a legacy
    /// file's pickles (`legacy pickle 4 of 5 (object)`).
    pub entry: String,
    /// The callable's full name, or the chain of calls that produces it.
    pub callable: String,
    /// The opcode that calls or names it (`REDUCE`, `EXT1 (code 7) + REDUCE`, ...).
    pub route: String,
    /// Byte offset of that opcode inside the entry.
    pub offset: usize,
    /// Known dangerous, or merely outside the allowlist.
    pub verdict: Verdict,
}

impl UnsafeCall {
    /// `posix.system (dangerous; REDUCE at byte 53 of archive/data.pkl)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}; {} at byte {} of {})",
            self.callable,
            self.verdict.as_str(),
            self.route,
            self.offset,
            self.entry
        )
    }
}

impl serde::Serialize for UnsafeCall {
    /// `{callable, route, offset, entry, verdict, path}`: the `unsafe` arrays of
    /// `inspect --json` and `scan --json`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut o = s.serialize_struct("UnsafeCall", 6)?;
        o.serialize_field("callable", &self.callable)?;
        o.serialize_field("route", &self.route)?;
        o.serialize_field("offset", &self.offset)?;
        o.serialize_field("entry", &self.entry)?;
        o.serialize_field("verdict", self.verdict.as_str())?;
        o.serialize_field("path", &self.path.display().to_string())?;
        o.end()
    }
}

/// Applies an [`UnsafePolicy`] to what inputs' pickles would run: tells its
/// `report` (if any), then refuses if asked to.
pub fn apply_policy(policy: UnsafePolicy, calls: &[UnsafeCall]) -> Result<()> {
    let Some(first) = calls.first() else {
        return Ok(());
    };
    if let Some(report) = policy.report {
        report(calls);
    }
    if policy.refuse {
        return Err(Error::Unsafe {
            path: first.path.clone(),
            calls: calls.iter().map(|c| c.callable.clone()).collect(),
        });
    }
    Ok(())
}

/// Findings of one pickle, as [`UnsafeCall`]s of `path` / `entry`; the second value
/// counts findings beyond the audit's bound, which are not listed.
pub fn audit_pickle(path: &Path, entry: &str, pickle: &Pickle) -> (Vec<UnsafeCall>, usize) {
    let audit = unshard_pickle::audit(pickle);
    let calls = audit
        .findings
        .into_iter()
        .map(|f| UnsafeCall {
            path: path.to_path_buf(),
            entry: entry.to_string(),
            callable: f.callable,
            route: f.route,
            offset: f.offset,
            verdict: f.verdict,
        })
        .collect();
    (calls, audit.omitted)
}

/// What an operation that reads a checkpoint does about pickles that would run code
/// under `torch.load` (unshard runs none of it, but such a file is compromised).
/// By default their tensors are read and nothing is said: a front end sets
/// `report` to tell the user.
#[derive(Clone, Copy, Debug, Default)]
pub struct UnsafePolicy {
    /// Refuse, writing nothing ([`Error::Unsafe`]).
    pub refuse: bool,
    /// Told what the pickles read would run, as soon as the inputs are opened
    /// (before any refusal), so that the user hears of it even if the operation
    /// then fails.
    pub report: Option<fn(&[UnsafeCall])>,
}
