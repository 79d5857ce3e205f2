//! `verify`: prove that an output directory holds what merging the checkpoint
//! should have written.
//!
//! Two kinds of check, both against the plan re-derived from the inputs:
//! - **Structure.** Every shard header is valid safetensors (the strict reader of
//!   `source::safetensors`, plus no duplicate names). The index and the shards agree:
//!   every tensor is listed once, in the shard that holds it; `total_size` is right;
//!   no shard is missing, none is left over. The tensor names, shapes and dtypes are
//!   the plan's (a silently widened dtype is caught here), and config.json declares
//!   the dtype the tensors have.
//! - **Content.** Each tensor's bytes equal the checkpoint's (or, for base-filled
//!   tensors, the base's) values after the plan's conversion. Bytes must be
//!   identical, except that NaNs match by class: any NaN equals any NaN, because
//!   tools disagree on NaN payloads (see `dtype`). Each shard is read once, in
//!   blocks (`blocks`), so memory stays bounded whatever the model size.
//! - **Checksums.** Each block read is hashed and compared with what the writer
//!   hashed while writing it (a merge's `--verify`), or each file with the
//!   checksum `unshard.json` records (`checksums`).
//!
//! The expected values are gathered here with a deliberately plain algorithm (output
//! row by output row, asking each piece for the columns it holds) rather than with
//! the writer's run merging, so that a placement bug in the engine shows up as a
//! mismatch instead of being reproduced. For the same reason the conversions are
//! not the writer's: `convert` converts by definition (exact values, rounding by
//! `f64::round_ties_even`), so a rounding bug in `dtype`'s kernels or its scalar
//! path shows up as a mismatch; the kernel tests hold `dtype` to it as well.
//!
//! Problems with the output are findings, collected in a [`VerifyReport`]; only
//! problems with the inputs (which make the check itself impossible) are errors.
//!
//! The module also holds the cheaper content checks a merge runs: whether the
//! checkpoint equals the base (nothing was trained) and `--fail-on-nonfinite`.

//!
//! Files by job: [`report`] (what was found), `structure` (the files, headers,
//! index and config), `blocks` (the one read of the shards, compared block by
//! block), [`checksums`] (the files against their checksums), `gather` (the expected values, by coordinates), `compare`
//! (byte comparison, NaN matching NaN), `convert` (the conversions, by definition),
//! `reference` (computed tensors, element by element) and [`checks`] (the checks a
//! merge runs).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::cancel::Cancel;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::VerifyOptions;
use crate::plan::{Origin, Plan};
use crate::prepare::{prepare, Inputs};
use crate::write::{FileDigest, Progress};

mod blocks;
pub mod checks;
pub mod checksums;
mod compare;
pub(crate) mod convert;
mod gather;
mod reference;
pub mod report;
mod structure;

pub use crate::digest::Expected;
#[cfg(feature = "internals")]
pub use crate::digest::ExpectedDigest;
pub use checks::{check_finite, drop_cached, nonfinite_tensors, unchanged_from_base};
#[cfg(feature = "internals")]
pub use report::unravel;
pub use report::{FirstDiff, Mismatch, Problem, VerifyReport};

use report::problem;
use structure::{check_config, Located, Written};

/// Re-derives the plan from `opts` (checkpoint, base, dtype, renames...) and checks
/// the directory `opts.dir` against it.
pub fn verify(opts: &VerifyOptions, progress: &dyn Progress) -> Result<VerifyReport> {
    if !crate::bytes::fs::is_dir(&opts.dir) {
        return Err(Error::Usage(format!(
            "{} is not a directory; pass the model directory a merge wrote",
            opts.dir.display()
        )));
    }
    let prepared = prepare(opts)?;
    verify_dir(
        &opts.dir,
        &prepared.plan,
        prepared.inputs(),
        &opts.checksums,
        progress,
        &opts.cancel,
    )
}

/// Checks the model directory `dir` against `plan`, whose tensors point into
/// `inputs`, and its files against the checksums `expected` (none, those the
/// writer took, or those `unshard.json` records).
pub fn verify_dir(
    dir: &Path,
    plan: &Plan,
    inputs: Inputs<'_>,
    expected: &[Expected],
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<VerifyReport> {
    let mut problems = Vec::new();
    let written = Written::read(dir, &mut problems)?;
    check_config(dir, plan, &written, &mut problems);

    // Names, shapes and dtypes against the plan.
    let mut checks: Vec<(usize, &Located)> = Vec::new();
    let mut casts: Vec<(usize, &str, DType)> = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        let Some(loc) = written.tensors.get(&t.name) else {
            if !written.in_unreadable.contains(&t.name) {
                problems.push(problem(
                    None,
                    Some(&t.name),
                    "missing: the merge writes it, the output does not hold it",
                ));
            }
            continue;
        };
        let file = written.shards[loc.shard].name.as_str();
        if loc.shape != t.shape {
            problems.push(problem(
                Some(file),
                Some(&t.name),
                format!(
                    "shape {:?}, but the checkpoint's is {:?}",
                    loc.shape, t.shape
                ),
            ));
        } else if loc.dtype != t.dtype {
            casts.push((i, file, loc.dtype));
        } else {
            checks.push((i, loc));
        }
    }
    dtype_problems(plan, &casts, expected.is_empty(), &mut problems);
    let planned: HashSet<&str> = plan.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut extra: Vec<(&String, &Located)> = written
        .tensors
        .iter()
        .filter(|(n, _)| !planned.contains(n.as_str()))
        .collect();
    extra.sort_by(|a, b| crate::plan::natural_cmp(a.0, b.0));
    for (n, loc) in extra {
        problems.push(problem(
            Some(&written.shards[loc.shard].name),
            Some(n),
            "extra: the merge does not write this tensor",
        ));
    }

    // Content and checksums, from one read of each shard.
    let found = blocks::check_blocks(plan, inputs, &written, &checks, progress, cancel)?;
    let read: HashMap<&str, Option<&FileDigest>> = written
        .shards
        .iter()
        .zip(&found.digests)
        .map(|(s, d)| (s.name.as_str(), d.as_ref()))
        .collect();
    let files_checksummed = checksums::check_files(dir, expected, &read, &mut problems)?;
    let (diffs, unreadable) = (found.diffs, found.unreadable);
    let mut mismatches = Vec::new();
    let mut bytes_compared = 0;
    // Report in the plan's (natural name) order.
    let mut order: Vec<usize> = (0..checks.len()).collect();
    order.sort_by_key(|&ci| checks[ci].0);
    for ci in order {
        let (ti, loc) = checks[ci];
        let t = &plan.tensors[ti];
        let file = &written.shards[loc.shard].name;
        if let Some(e) = &unreadable[ci] {
            problems.push(problem(Some(file), Some(&t.name), e.clone()));
            continue;
        }
        bytes_compared += t.nbytes();
        let d = &diffs[ci];
        if d.differing > 0 {
            mismatches.push(Mismatch {
                file: file.clone(),
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                differing: d.differing,
                nan_mismatch: d.nan_mismatch,
                max_abs_diff: d.max_abs,
                first: d.first,
            });
        }
    }
    Ok(VerifyReport {
        dir: dir.to_path_buf(),
        files: written.shards.iter().map(|s| s.name.clone()).collect(),
        problems,
        mismatches,
        tensors_compared: checks.len(),
        bytes_compared,
        files_checksummed,
    })
}

/// Tensors stored in another dtype than the plan's. When every floating tensor is
/// off the same way and the options were given by hand (no checksums: no
/// `unshard.json`), the options are what is wrong, not the tensors: one line
/// says which `--dtype` (or `--base`) to pass instead of one line per tensor.
fn dtype_problems(
    plan: &Plan,
    casts: &[(usize, &str, DType)],
    by_hand: bool,
    problems: &mut Vec<Problem>,
) {
    let floats = plan.tensors.iter().filter(|t| t.dtype.is_float()).count();
    if let [(i0, file0, found), ..] = casts {
        let planned = plan.tensors[*i0].dtype;
        let uniform = casts
            .iter()
            .all(|&(i, _, f)| f == *found && plan.tensors[i].dtype == planned);
        if by_hand && casts.len() > 1 && uniform && casts.len() == floats && found.is_float() {
            problems.push(problem(
                None,
                None,
                format!(
                    "all {} floating tensors are stored as {found}, but with the options given the merge writes {planned} (first: '{}' in {file0}): the merge ran with other options; pass --dtype {found}, or the --base it was given (whose config sets the dtype)",
                    casts.len(),
                    plan.tensors[*i0].name,
                ),
            ));
            return;
        }
    }
    for &(i, file, found) in casts {
        let t = &plan.tensors[i];
        problems.push(problem(
            Some(file),
            Some(&t.name),
            format!(
                "stored as {}, but the merge writes {} ({} in the {})",
                found,
                t.dtype,
                t.source_dtype,
                origin_name(t.origin)
            ),
        ));
    }
}

fn origin_name(o: Origin) -> String {
    match o {
        Origin::Checkpoint => "checkpoint".into(),
        Origin::Base => "base".into(),
        Origin::Input(i) => format!("input {i}"),
    }
}

#[cfg(test)]
mod tests;
