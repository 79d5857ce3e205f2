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
//! Readers that parse a pickle anyway call `source::audit::audit_pickle` on it, so
//! reading commands report the same findings without parsing twice.

mod files;
mod trainer;

use std::path::{Path, PathBuf};

pub use crate::source::audit::{audit_pickle, UnsafeCall};
pub use files::scan_file;

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
