//! The options of the library's operations, in one module that every operation
//! imports, so that `merge` and `verify` (which re-derives a merge) share them
//! without importing each other. Every operation takes a [`Cancel`] token.

use std::path::{Path, PathBuf};

use crate::cancel::Cancel;
use crate::lora::AdapterOptions;
use crate::plan::PlanOptions;
pub use crate::source::audit::UnsafePolicy;
use crate::source::OpenOptions;

/// Everything a merge takes.
#[derive(Clone, Debug, Default)]
pub struct MergeOptions {
    /// The checkpoint: a `torch.save` file, a DCP directory, a directory of
    /// per-rank files, a safetensors file or a model directory.
    pub checkpoint: PathBuf,
    /// The model directory training started from: config, tokenizer, dtype, and
    /// the tensors the checkpoint lacks.
    pub base: Option<PathBuf>,
    /// The model directory to write (created; absent or empty unless `force`).
    pub output: PathBuf,
    /// How to find the tensors in the checkpoint.
    pub open: OpenOptions,
    /// Names, dtype, shard size, mappings.
    pub plan: PlanOptions,
    /// Replace a non-empty output directory.
    pub force: bool,
    /// Write inf where a cast overflows instead of failing.
    pub allow_overflow: bool,
    /// Read the written output back and verify it before moving it into place.
    pub verify: bool,
    /// NaN or inf in the output is an error instead of a warning.
    pub fail_on_nonfinite: bool,
    /// Do not write `unshard.json` (what the merge did) into the output.
    pub no_manifest: bool,
    /// Write the weights alone when there is no config.json to write with them (no
    /// `base`, none beside the checkpoint, or a base without one): an output
    /// transformers cannot load. Without it such a merge is refused before
    /// anything is written.
    pub weights_only: bool,
    /// How a LoRA adapter input is fused (ignored for other inputs).
    pub adapter: AdapterOptions,
    /// What to do about pickles that would run code under `torch.load`.
    pub unsafe_pickles: UnsafePolicy,
    /// Stops the operation at its next check; what it wrote is removed.
    pub cancel: Cancel,
}

/// What `verify` takes: the directory to check and the merge it should hold
/// (the same checkpoint, base and plan options the merge was given).
#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// The model directory to check.
    pub dir: PathBuf,
    /// The checkpoint the merge read.
    pub checkpoint: PathBuf,
    /// The base the merge was given.
    pub base: Option<PathBuf>,
    /// How the merge found the tensors in the checkpoint.
    pub open: OpenOptions,
    /// The merge's plan options (the shard size does not matter: tensors are
    /// matched by name).
    pub plan: PlanOptions,
    /// How the merge fused a LoRA adapter input.
    pub adapter: AdapterOptions,
    /// What to do about pickles that would run code under `torch.load`.
    pub unsafe_pickles: UnsafePolicy,
    /// What the files should hash to (from `unshard.json`: see
    /// [`Manifest::fill`](crate::manifest::Manifest::fill)); empty: not checked.
    pub checksums: Vec<crate::digest::Expected>,
    /// Stops the check at its next window.
    pub cancel: Cancel,
}

impl VerifyOptions {
    /// The options that check `dir` against the merge `merge` describes.
    pub fn of_merge(merge: &MergeOptions, dir: &Path) -> VerifyOptions {
        VerifyOptions {
            dir: dir.to_path_buf(),
            checkpoint: merge.checkpoint.clone(),
            base: merge.base.clone(),
            open: merge.open.clone(),
            plan: merge.plan.clone(),
            adapter: merge.adapter.clone(),
            unsafe_pickles: merge.unsafe_pickles,
            checksums: Vec::new(),
            cancel: merge.cancel.clone(),
        }
    }
}

/// What `inspect` takes.
#[derive(Clone, Debug, Default)]
pub struct InspectOptions {
    /// Any input unshard reads.
    pub path: PathBuf,
    /// How to find the tensors in it.
    pub open: OpenOptions,
    /// Also compute each tensor's statistics (reads every value).
    pub stats: bool,
    /// Stops the statistics at their next window.
    pub cancel: Cancel,
}

/// What `diff` takes: two inputs of any format; `b` is the reference for
/// relative differences.
#[derive(Clone, Debug, Default)]
pub struct DiffOptions {
    /// One input.
    pub a: PathBuf,
    /// The other, the reference.
    pub b: PathBuf,
    /// How to find the tensors in each.
    pub open: OpenOptions,
    /// What to do about pickles that would run code under `torch.load`.
    pub unsafe_pickles: UnsafePolicy,
    /// Stops the comparison at its next window.
    pub cancel: Cancel,
}
