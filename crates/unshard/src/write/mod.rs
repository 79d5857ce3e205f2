//! The engine: streams tensors from input files into output shards.
//!
//! Every shard file is laid out by the plan before a byte is written, so each
//! tensor's place in its file is known. The work is cut into blocks: aligned ranges
//! of [`WINDOW_BYTES`] of an output file. A block is filled from whatever it overlaps
//! (the header, the tensors, and for each tensor the pieces that hold its elements),
//! reading the inputs with positioned reads a chunk at a time, byte-swapping and
//! converting on the way, and is written with one positioned write, straight to the
//! disk where the filesystem allows direct I/O. Each input byte is read once and
//! each output byte written once. Blocks run in parallel across all shards and
//! within large tensors, so memory is a block and a chunk per thread, whatever the
//! model size: inputs are byte sources (`source::bytes`), read by range, never
//! mapped (a strided view, rare, is gathered from spans of at most 1 MiB).
//!
//! Output goes to a staging directory beside the destination, which is fsynced and
//! renamed into place only when everything succeeded; on any error or interruption
//! the staging directory is removed.
//!
//! The jobs are split by file: [`staging`] (the staging directory and its atomic
//! commit), `engine` (blocks: what each output byte is, read and converted),
//! `direct` (the output file with direct I/O and the buffer pool), `geometry`
//! (a piece's runs of elements inside its tensor), and [`read`] (reading tensor
//! values into memory, for `verify`, `diff` and `stats`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::dtype::ConvertStats;
use crate::plan::Plan;
use crate::{Error, Result};

mod direct;
mod engine;
mod geometry;
pub mod read;
pub mod staging;

pub use crate::prepare::Inputs;
pub use read::{read_tensor, read_tensor_range, windows};
pub use staging::{check_output, commit, create_staging, Staging};

use direct::OutFile;
use engine::write_blocks;
use staging::write_file;

/// Output bytes assembled per unit of work (a multiple of the direct I/O alignment).
pub const WINDOW_BYTES: u64 = 8 << 20;

/// Set by a signal handler to stop the writer at the next block.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Receives progress in output bytes.
pub trait Progress: Sync {
    /// A step before any bytes are counted (reading metadata, planning).
    fn stage(&self, _what: &str) {}
    fn start(&self, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A progress sink that ignores everything.
pub struct NoProgress;

impl Progress for NoProgress {}

/// Options for writing.
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// Replace a non-empty output directory.
    pub force: bool,
    /// Write inf where a cast overflows instead of failing.
    pub allow_overflow: bool,
    /// Non-weight files to copy into the output (tokenizer, generation config...).
    pub extra_files: Vec<PathBuf>,
    /// Paths the output must not overlap (inputs, base).
    pub protected: Vec<PathBuf>,
}

/// What writing did.
#[derive(Clone, Debug, Default)]
pub struct WriteSummary {
    /// Per planned tensor: what conversion saw.
    pub stats: Vec<ConvertStats>,
    pub bytes_written: u64,
    pub files: Vec<String>,
    /// Stale staging directories of interrupted runs that were removed.
    pub cleaned: Vec<PathBuf>,
}

/// Writes every shard, the index, the config and the extra files into `staging`.
pub fn write_into(
    plan: &Plan,
    inputs: Inputs<'_>,
    staging: &Path,
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    // Create and preallocate every file first: a full disk fails here, before work.
    let mut files = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        files.push(OutFile::create(&staging.join(&s.file_name), s.file_size)?);
    }
    let total: u64 = plan
        .shards
        .iter()
        .map(|s| s.file_size - s.header.len() as u64)
        .sum();
    progress.start(total);
    let stats = write_blocks(plan, inputs, &files, WINDOW_BYTES, progress)?;
    // A signal that arrived while the last blocks were in flight still stops the run.
    if INTERRUPTED.load(Ordering::Relaxed) {
        return Err(Error::Interrupted);
    }
    if !opts.allow_overflow {
        if let Some((i, s)) = stats.iter().enumerate().find(|(_, s)| s.overflow > 0) {
            return Err(Error::Overflow {
                tensor: plan.tensors[i].name.clone(),
                dtype: plan.tensors[i].dtype,
                count: s.overflow,
            });
        }
    }
    for f in &files {
        f.file
            .sync_all()
            .map_err(|e| Error::io("flush", &f.path, e))?;
    }
    let mut names: Vec<String> = plan.shards.iter().map(|s| s.file_name.clone()).collect();
    if let Some(index) = &plan.index {
        write_file(
            &staging.join("model.safetensors.index.json"),
            index.as_bytes(),
        )?;
        names.push("model.safetensors.index.json".into());
    }
    if let Some(config) = &plan.config {
        let mut text = serde_json::to_string_pretty(config).unwrap_or_default();
        text.push('\n');
        write_file(&staging.join("config.json"), text.as_bytes())?;
        names.push("config.json".into());
    }
    for src in &opts.extra_files {
        let Some(name) = src.file_name() else {
            continue;
        };
        let dst = staging.join(name);
        if dst.exists() {
            continue;
        }
        std::fs::copy(src, &dst).map_err(|e| Error::io("copy", src, e))?;
        File::open(&dst)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("flush", &dst, e))?;
        names.push(name.to_string_lossy().into_owned());
    }
    progress.finish();
    Ok(WriteSummary {
        stats,
        bytes_written: total,
        files: names,
        cleaned: Vec::new(),
    })
}
