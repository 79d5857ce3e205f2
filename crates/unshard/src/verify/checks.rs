//! The cheaper content checks a merge runs: whether the checkpoint equals the base
//! (nothing was trained), `fail_on_nonfinite`, and dropping the cached output
//! before a read-back verification.

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::compare::same_values;
use crate::cancel::Cancel;
use crate::dtype::{self, ConvertStats};
use crate::error::NonFiniteTensor;
use crate::plan::{Origin, Plan, PlannedTensor};
use crate::prepare::Inputs;
use crate::source::TensorSource;
use crate::write::{read_tensor_range, windows, WINDOW_BYTES};
use crate::{Error, Result};

/// Whether every checkpoint tensor equals the base's after conversion to the output
/// dtype, i.e. the merge would write the base again (an adapter-only export, a
/// checkpoint saved before the first step). Returns how many tensors were compared
/// when they all match.
///
/// Cheap when training changed something: the first window of each tensor is
/// compared first, and the rest is read only if all of those match.
pub fn unchanged_from_base(
    plan: &Plan,
    inputs: Inputs<'_>,
    cancel: &Cancel,
) -> Result<Option<usize>> {
    const FIRST_BYTES: u64 = 64 << 10;
    let Some(base) = inputs.base else {
        return Ok(None);
    };
    let by_name: HashMap<&str, &TensorSource> =
        base.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut pairs: Vec<(&PlannedTensor, &TensorSource, &TensorSource)> = Vec::new();
    for t in plan
        .tensors
        .iter()
        .filter(|t| t.origin == Origin::Checkpoint)
    {
        // A computed tensor is not the checkpoint's as it is: the output differs.
        let Some(source) = t.copied() else {
            return Ok(None);
        };
        match by_name.get(t.name.as_str()) {
            Some(b) if b.shape == t.shape && dtype::can_convert(b.dtype, t.dtype) => {
                pairs.push((t, source, b))
            }
            _ => return Ok(None),
        }
    }
    if pairs.is_empty() {
        return Ok(None);
    }
    let window_equal = |(t, source, b): (&PlannedTensor, &TensorSource, &TensorSource),
                        e0: u64,
                        e1: u64,
                        bufs: &mut (Vec<u8>, Vec<u8>)|
     -> Result<bool> {
        cancel.check()?;
        let len = ((e1 - e0) * t.dtype.size() as u64) as usize;
        bufs.0.resize(len, 0);
        bufs.1.resize(len, 0);
        read_tensor_range(
            &inputs.checkpoint.files,
            source,
            t.dtype,
            e0,
            e1,
            &mut bufs.0,
        )?;
        read_tensor_range(&base.files, b, t.dtype, e0, e1, &mut bufs.1)?;
        Ok(same_values(&bufs.0, &bufs.1, t.dtype))
    };
    let mut bufs = (Vec::new(), Vec::new());
    let mut rest: Vec<(usize, u64, u64)> = Vec::new();
    for (i, &(t, source, b)) in pairs.iter().enumerate() {
        let n = t.numel();
        let head = (FIRST_BYTES / t.dtype.size() as u64)
            .clamp(1, n.max(1))
            .min(n);
        if !window_equal((t, source, b), 0, head, &mut bufs)? {
            return Ok(None);
        }
        let per = WINDOW_BYTES / t.dtype.size() as u64;
        rest.extend(windows(head, n, per).map(|(e0, e1)| (i, e0, e1)));
    }
    let differs = rest
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |bufs, &(i, e0, e1)| window_equal(pairs[i], e0, e1, bufs),
        )
        .find_any(|r| !matches!(r, Ok(true)));
    match differs {
        Some(Err(e)) => Err(e),
        Some(_) => Ok(None),
        None => Ok(Some(pairs.len())),
    }
}

/// The tensors that hold NaN or inf in the checkpoint or that overflowed to inf in
/// the cast, from the writer's own counts (this is a report of what writing saw, not
/// a check of the output: no second reading is needed). Both `fail_on_nonfinite` and
/// the merge's JSON report list them from here.
pub fn nonfinite_tensors(plan: &Plan, stats: &[ConvertStats]) -> Vec<NonFiniteTensor> {
    plan.tensors
        .iter()
        .zip(stats)
        .filter(|(_, s)| s.nan + s.inf + s.overflow > 0)
        .map(|(t, s)| NonFiniteTensor {
            name: t.name.clone(),
            nan: s.nan,
            inf: s.inf,
            overflow: s.overflow,
            dtype: t.dtype,
        })
        .collect()
}

/// `fail_on_nonfinite`: an error naming every tensor that holds NaN or inf in
/// the checkpoint or that overflowed to inf in the cast.
pub fn check_finite(plan: &Plan, stats: &[ConvertStats]) -> Result<()> {
    let tensors = nonfinite_tensors(plan, stats);
    if tensors.is_empty() {
        return Ok(());
    }
    Err(Error::NonFinite { tensors })
}

/// Asks the kernel to drop the cached pages of the planned shard files (fsynced, so
/// clean), so that a verification right after writing reads them back from the disk
/// rather than from memory. A hint: failures are ignored.
/// Linux only (`posix_fadvise`); elsewhere the read-back may come from the cache.
pub fn drop_cached(dir: &Path, plan: &Plan) {
    #[cfg(target_os = "linux")]
    for s in &plan.shards {
        use std::os::fd::AsRawFd;
        if let Ok(f) = std::fs::File::open(dir.join(&s.file_name)) {
            // SAFETY: fadvise only reads the descriptor, which is open for the call.
            let _ = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (dir, plan);
}
