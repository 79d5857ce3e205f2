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
//!   tools disagree on NaN payloads (see `dtype`). Tensors are compared in windows,
//!   so memory stays bounded whatever the model size.
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
//! index and config), `gather` (the expected values, by coordinates), `compare`
//! (byte comparison, NaN matching NaN), `convert` (the conversions, by definition),
//! `reference` (computed tensors, element by element) and [`checks`] (the checks a
//! merge runs).

use std::collections::HashSet;
use std::path::Path;

use rayon::prelude::*;

use crate::cancel::Cancel;
use crate::options::VerifyOptions;
use crate::plan::{Content, Origin, Plan};
use crate::prepare::{prepare, Inputs};
use crate::write::{windows, Progress, WINDOW_BYTES};
use crate::{Error, Result};

pub mod checks;
mod compare;
pub(crate) mod convert;
mod gather;
mod reference;
pub mod report;
mod structure;

pub use checks::{check_finite, drop_cached, nonfinite_tensors, unchanged_from_base};
pub use report::{unravel, FirstDiff, Mismatch, Problem, VerifyReport};

use compare::{compare, compare_within, Diffs};
use gather::{gather, GatherBufs};
use report::problem;
use structure::{check_config, read_output, Located, Written};

/// Re-derives the plan from `opts` (checkpoint, base, dtype, renames...) and checks
/// the directory `opts.dir` against it.
pub fn verify(opts: &VerifyOptions, progress: &dyn Progress) -> Result<VerifyReport> {
    if !crate::source::fs::is_dir(&opts.dir) {
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
        progress,
        &opts.cancel,
    )
}

/// Checks the model directory `dir` against `plan`, whose tensors point into `inputs`.
pub fn verify_dir(
    dir: &Path,
    plan: &Plan,
    inputs: Inputs<'_>,
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<VerifyReport> {
    let mut problems = Vec::new();
    let written = Written::read(dir, &mut problems)?;
    check_config(dir, plan, &written, &mut problems);

    // Names, shapes and dtypes against the plan.
    let mut checks: Vec<(usize, &Located)> = Vec::new();
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
            problems.push(problem(
                Some(file),
                Some(&t.name),
                format!(
                    "stored as {}, but the merge writes {} ({} in the {})",
                    loc.dtype,
                    t.dtype,
                    t.source_dtype,
                    origin_name(t.origin)
                ),
            ));
        } else {
            checks.push((i, loc));
        }
    }
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

    // Content, window by window, in parallel, in file order so that reading streams.
    checks.sort_by_key(|(_, loc)| (loc.shard, loc.offset));
    let mut items: Vec<(usize, u64, u64)> = Vec::new();
    for (ci, &(ti, _)) in checks.iter().enumerate() {
        let t = &plan.tensors[ti];
        let per = WINDOW_BYTES / t.dtype.size() as u64;
        // A computed tensor's reference value is evaluated whole: one window.
        let per = if t.copied().is_some() { per } else { u64::MAX };
        items.extend(windows(0, t.numel(), per).map(|(e0, e1)| (ci, e0, e1)));
    }
    let total: u64 = checks
        .iter()
        .map(|&(ti, _)| plan.tensors[ti].nbytes())
        .sum();
    progress.start(total);
    let results: Vec<(usize, Window)> = items
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new(), GatherBufs::default()),
            |(expected, found, bufs), &(ci, e0, e1)| {
                cancel.check()?;
                let (ti, loc) = checks[ci];
                let t = &plan.tensors[ti];
                let size = t.dtype.size() as u64;
                let len = ((e1 - e0) * size) as usize;
                expected.resize(len, 0);
                let mut within = None;
                match &t.content {
                    Content::Copy(source) => gather(
                        source,
                        inputs.files(t.origin),
                        t.dtype,
                        e0,
                        e1,
                        expected,
                        bufs,
                    )?,
                    Content::Computed(e) => {
                        match reference::reference(e, &t.shape, t.dtype, inputs)? {
                            reference::Reference::Exact(bytes) => *expected = bytes,
                            reference::Reference::Within { values, allowed } => {
                                within = Some((values, allowed))
                            }
                        }
                    }
                }
                found.resize(len, 0);
                let window = match &written.shards[loc.shard].file {
                    Some(file) => match read_output(file, loc.offset + e0 * size, found) {
                        Ok(()) => Window::Compared(match &within {
                            Some((values, allowed)) => {
                                compare_within(values, allowed, found, t.dtype, e0)
                            }
                            None => compare(expected, found, t.dtype, e0),
                        }),
                        Err(e) => Window::Unreadable(format!(
                            "cannot read its data (the file changed during the check?): {e}"
                        )),
                    },
                    None => Window::Unreadable("the shard could not be read".into()),
                };
                progress.advance(len as u64);
                Ok((ci, window))
            },
        )
        .collect::<Result<_>>()?;
    progress.finish();

    let mut diffs = vec![Diffs::default(); checks.len()];
    let mut unreadable: Vec<Option<String>> = vec![None; checks.len()];
    for (ci, w) in results {
        match w {
            Window::Compared(d) => diffs[ci].add(d),
            Window::Unreadable(e) => unreadable[ci] = Some(e),
        }
    }
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
    })
}

fn origin_name(o: Origin) -> String {
    match o {
        Origin::Checkpoint => "checkpoint".into(),
        Origin::Base => "base".into(),
        Origin::Input(i) => format!("input {i}"),
    }
}

enum Window {
    Compared(Diffs),
    Unreadable(String),
}
