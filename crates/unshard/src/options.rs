//! The options of the library's operations, in one module that every operation
//! imports, so that `merge` and `verify` (which re-derives a merge) share them
//! without importing each other.

use std::path::PathBuf;

use crate::cancel::Cancel;
use crate::plan::PlanOptions;
use crate::source::OpenOptions;

/// Everything a merge takes. `verify` takes the same (the merge to re-derive), with
/// `output` the directory to check.
#[derive(Clone, Debug, Default)]
pub struct MergeOptions {
    pub checkpoint: PathBuf,
    pub base: Option<PathBuf>,
    pub output: PathBuf,
    pub open: OpenOptions,
    pub plan: PlanOptions,
    pub force: bool,
    pub allow_overflow: bool,
    /// Read the written output back and verify it before moving it into place.
    pub verify: bool,
    /// NaN or inf in the output is an error instead of a warning.
    pub fail_on_nonfinite: bool,
    /// Stops the operation at its next check; what it wrote is removed.
    pub cancel: Cancel,
}
