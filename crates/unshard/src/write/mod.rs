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
//! model size: inputs are byte sources (`source::bytes`), read by range (a strided
//! view, rare, is gathered by the source: a local file from a map whose touched
//! pages are released after each piece).
//!
//! Output goes to a staging directory beside the destination, which is fsynced and
//! renamed into place only when everything succeeded; on any error or interruption
//! the staging directory is removed.
//!
//! The jobs are split by file: [`sink`] (where the files go: the seam, and the
//! staging directory that is its local implementation), `staging` (the staging
//! directory and its atomic commit), `engine` (blocks: what each output byte is,
//! read and converted), `computed` (the rows of computed tensors a block holds),
//! `direct` (the output file with direct I/O and the buffer pool), `geometry`
//! (a piece's runs of elements inside its tensor), and [`read`] (reading tensor
//! values into memory, for `verify`, `diff` and `stats`).

use std::path::PathBuf;

use crate::cancel::Cancel;
use crate::dtype::ConvertStats;
use crate::error::{Error, Result};
use crate::plan::Plan;

#[cfg(feature = "remote")]
pub mod bucket;
mod computed;
mod direct;
mod engine;
mod fetch;
pub mod sink;
mod staging;

pub use crate::digest::{FileDigest, WINDOW_BYTES};
pub use crate::plan::Inputs;
#[cfg(feature = "internals")]
pub use crate::read::read_tensor;
pub use crate::read::{read_tensor_range, windows};
pub(crate) use direct::OutFile;
pub use sink::{ShardFile, Sink, StagingDir};
pub use staging::check_output;
pub(crate) use staging::{sync_dir, write_file};

use engine::write_blocks;

/// Receives progress in output bytes.
pub trait Progress: Sync {
    /// A step before any bytes are counted (reading metadata, planning).
    fn stage(&self, _what: &str) {}
    /// Bytes are about to be counted, `total_bytes` in all.
    fn start(&self, _total_bytes: u64) {}
    /// `bytes` more are done (called from many threads).
    fn advance(&self, _bytes: u64) {}
    /// All done.
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
    /// Stops the writer at its next block.
    pub cancel: Cancel,
    /// Hash each block as it is written (the checksums of `unshard.json` and of
    /// `--verify`'s read-back); without, [`WriteSummary::digests`] of the shards
    /// hold no block digests.
    pub checksums: bool,
}

/// What writing did.
#[derive(Clone, Debug, Default)]
pub struct WriteSummary {
    /// Per planned tensor: what conversion saw.
    pub stats: Vec<ConvertStats>,
    /// Bytes of tensor data written.
    pub bytes_written: u64,
    /// The files written, by name.
    pub files: Vec<String>,
    /// The checksums of the files written, taken while writing (see [`digest`]),
    /// in the order of `files`.
    pub digests: Vec<FileDigest>,
    /// Stale staging directories of interrupted runs that were removed.
    pub cleaned: Vec<PathBuf>,
}

/// Writes every shard, the index, the config and the extra files into `staging`.
pub fn write_into(
    plan: &Plan,
    inputs: Inputs<'_>,
    sink: &dyn Sink,
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    // Create and preallocate every file first: a full disk fails here, before work.
    let mut files = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        files.push(sink.create_shard(&s.file_name, s.file_size)?);
    }
    let total: u64 = plan
        .shards
        .iter()
        .map(|s| s.file_size - s.header.len() as u64)
        .sum();
    progress.start(total);
    let cancel = &opts.cancel;
    let (stats, blocks) = write_blocks(
        plan,
        inputs,
        &files,
        WINDOW_BYTES,
        opts.checksums,
        progress,
        cancel,
    )?;
    let mut digests: Vec<FileDigest> = plan
        .shards
        .iter()
        .zip(blocks)
        .map(|(s, blocks)| FileDigest {
            size: s.file_size,
            blocks,
        })
        .collect();
    // A cancellation that came while the last blocks were in flight still stops the run.
    cancel.check()?;
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
        f.finish()?;
    }
    let mut names: Vec<String> = plan.shards.iter().map(|s| s.file_name.clone()).collect();
    if let Some(index) = &plan.index {
        sink.write_file("model.safetensors.index.json", index.as_bytes())?;
        names.push("model.safetensors.index.json".into());
        digests.push(FileDigest::of_bytes(index.as_bytes()));
    }
    if let Some(config) = &plan.config {
        let mut text = serde_json::to_string_pretty(config).unwrap_or_default();
        text.push('\n');
        sink.write_file("config.json", text.as_bytes())?;
        names.push("config.json".into());
        digests.push(FileDigest::of_bytes(text.as_bytes()));
    }
    for src in &opts.extra_files {
        let Some(name) = src.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        if sink.copy_file(&name, src)? {
            // What was copied, read back where there is a local copy.
            let digest = match sink.staged_dir() {
                Some(dir) => FileDigest::of_file(&dir.join(&name))?,
                // Extra files are small (`MAX_EXTRA_FILE`).
                None => FileDigest::of_bytes(&crate::bytes::fs::read(src)?),
            };
            names.push(name);
            digests.push(digest);
        }
    }
    progress.finish();
    Ok(WriteSummary {
        stats,
        bytes_written: total,
        files: names,
        digests,
        cleaned: Vec::new(),
    })
}
