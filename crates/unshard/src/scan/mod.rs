//! Code a checkpoint would run under `torch.load`, found without running anything.
//!
//! unshard never executes a pickle, but a file that carries a code-execution payload
//! is a compromised file, and whoever is about to publish a model from it must be
//! told. This module owns what is reported and how it is found in any file:
//! [`UnsafeCall`] (one callable outside the allowlist of `unshard_pickle::audit`, with
//! the file, the record or pickle it sits in, the route and the offset), and
//! [`scan_paths`], the walk behind `unshard scan`, which also reads files unshard
//! would not merge (bare pickles, `.distcp` files on their own, any zip archive)
//! so that it can serve as a pre-upload or CI check.
//!
//! Readers that parse a pickle anyway (`source/`) call [`audit_pickle`] on it, so
//! reading commands report the same findings without parsing twice.

mod files;
mod trainer;

use std::path::{Path, PathBuf};

use unshard_pickle::{Pickle, Verdict};

use crate::options::UnsafePolicy;

pub use files::scan_file;

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
pub fn apply_policy(policy: UnsafePolicy, calls: &[UnsafeCall]) -> crate::Result<()> {
    let Some(first) = calls.first() else {
        return Ok(());
    };
    if let Some(report) = policy.report {
        report(calls);
    }
    if policy.refuse {
        return Err(crate::Error::Unsafe {
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

/// What `unshard scan` found in one file.
#[derive(Clone, Debug, Default)]
pub struct FileScan {
    /// The file.
    pub path: PathBuf,
    /// What the file was read as (`torch.save zip archive`, `bare pickle`, ...).
    pub kind: String,
    /// Pickles read in the file.
    pub pickles: usize,
    /// What its pickles would run under `torch.load`.
    pub unsafe_calls: Vec<UnsafeCall>,
    /// Calls that run under `torch.load` but only rebuild a Trainer's arguments
    /// (`training_args.bin`: dataclasses created without their constructors, enum
    /// lookups): listed, not counted as unsafe.
    pub recognised: Vec<UnsafeCall>,
    /// Findings beyond the per-pickle bound, not listed.
    pub omitted: usize,
    /// Why part of the file could not be read, or an ambiguity that makes two readers
    /// see different contents (duplicate zip records). Code before a broken opcode is
    /// still reported: `pickle.load` runs it before failing.
    pub problems: Vec<String>,
}

impl FileScan {
    /// Nothing outside the allowlist and nothing unreadable.
    pub fn is_clean(&self) -> bool {
        self.unsafe_calls.is_empty() && self.omitted == 0 && self.problems.is_empty()
    }
}

/// Deepest directory level [`scan_paths`] descends to.
const MAX_DIR_DEPTH: usize = 32;

/// Scans files, and directories recursively (in name order; symbolic links to
/// directories are not followed, so a loop cannot trap the walk). Files that cannot
/// hold a pickle (safetensors, JSON, text) are listed as such.
pub fn scan_paths(paths: &[PathBuf]) -> Vec<FileScan> {
    let mut out = Vec::new();
    for path in paths {
        walk(path, 0, &mut out);
    }
    out
}

fn walk(path: &Path, depth: usize, out: &mut Vec<FileScan>) {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => {
            out.push(FileScan {
                path: path.to_path_buf(),
                kind: "unreadable".into(),
                problems: vec![format!("cannot read it: {e}")],
                ..FileScan::default()
            });
            return;
        }
    };
    let is_dir = meta.is_dir() || (meta.is_symlink() && depth == 0 && path.is_dir());
    if !is_dir {
        if meta.is_file() || (meta.is_symlink() && path.is_file()) {
            out.push(scan_file(path));
        }
        return;
    }
    if depth >= MAX_DIR_DEPTH {
        return;
    }
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(path) {
        Ok(rd) => rd.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
        Err(e) => {
            out.push(FileScan {
                path: path.to_path_buf(),
                kind: "unreadable directory".into(),
                problems: vec![format!("cannot list it: {e}")],
                ..FileScan::default()
            });
            return;
        }
    };
    entries.sort();
    for entry in entries {
        walk(&entry, depth + 1, out);
    }
}
