//! `diff`: compare two checkpoints or model directories tensor by tensor.
//!
//! Either side can be any input unshard reads (a `torch.save` file, a safetensors
//! file, a model directory...), so a merged model can be compared with a reference
//! made by another tool, or a checkpoint with the model it was trained from. Names
//! are compared after stripping the wrappers FSDP, DDP and torch.compile add. Values
//! are compared as numbers (so tensors of different dtypes compare by value), NaN
//! matching NaN, window by window in bounded memory.

use std::path::PathBuf;

use rayon::prelude::*;
use serde::Serialize;

use crate::cancel::Cancel;
use crate::dtype::DType;
use crate::error::Result;
use crate::options::DiffOptions;
use crate::plan::{natural_cmp, strip_wrappers};
use crate::source::format_id;
use crate::source::{Checkpoint, Format, TensorSource};
use crate::stats::{decode_f64, CHUNK_ELEMS, WINDOW_ELEMS};
use crate::text::display_path;
use crate::write::{read_tensor_range, windows, Progress};

/// How the values of two same-shaped tensors differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ValueDiff {
    /// Elements whose values differ (NaN against NaN does not count; -0 equals 0).
    pub differing: u64,
    /// Of those, how many are NaN on one side only.
    pub nan_mismatch: u64,
    /// Largest |a − b| over elements that are numbers on both sides (inf when an
    /// infinity meets a finite value).
    #[serde(rename = "max_abs_diff")]
    pub max_abs: f64,
    /// ‖a − b‖₂ / ‖b‖₂ over the elements finite on both sides (b is the reference).
    pub rel_l2: f64,
}

/// One tensor present on both sides.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(into = "TensorDiffJson")]
pub struct TensorDiff {
    /// The name (without wrapper prefixes).
    pub name: String,
    /// Its dtype in A.
    pub dtype_a: DType,
    /// Its dtype in B.
    pub dtype_b: DType,
    /// Its shape in A.
    pub shape_a: Vec<u64>,
    /// Its shape in B.
    pub shape_b: Vec<u64>,
    /// `None` when the shapes differ (values are not comparable).
    pub values: Option<ValueDiff>,
}

/// A [`TensorDiff`] as JSON, with its verdict after its name.
#[derive(Serialize)]
struct TensorDiffJson {
    name: String,
    identical: bool,
    dtype_a: DType,
    dtype_b: DType,
    shape_a: Vec<u64>,
    shape_b: Vec<u64>,
    values: Option<ValueDiff>,
}

impl From<TensorDiff> for TensorDiffJson {
    fn from(t: TensorDiff) -> Self {
        TensorDiffJson {
            identical: t.identical(),
            name: t.name,
            dtype_a: t.dtype_a,
            dtype_b: t.dtype_b,
            shape_a: t.shape_a,
            shape_b: t.shape_b,
            values: t.values,
        }
    }
}

impl TensorDiff {
    /// Same dtype, same shape, same values.
    pub fn identical(&self) -> bool {
        self.dtype_a == self.dtype_b && self.values.is_some_and(|v| v.differing == 0)
    }
}

/// One side of a comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiffSide {
    /// The input.
    #[serde(serialize_with = "display_path")]
    pub path: PathBuf,
    /// Its format (its id in JSON: `torch-zip`, `dcp`...).
    #[serde(serialize_with = "format_id")]
    pub format: Format,
    /// How many tensors it holds.
    pub tensors: usize,
}

impl DiffSide {
    fn of(c: &Checkpoint) -> DiffSide {
        DiffSide {
            path: c.path.clone(),
            format: c.format,
            tensors: c.tensors.len(),
        }
    }
}

/// Everything `diff` found. Its JSON is the CLI's `diff --json` (README).
#[derive(Clone, Debug, Serialize)]
#[serde(into = "DiffJson")]
pub struct DiffReport {
    /// The first input.
    pub a: DiffSide,
    /// The second input, the reference.
    pub b: DiffSide,
    /// Names only A holds.
    pub only_a: Vec<String>,
    /// Names only B holds.
    pub only_b: Vec<String>,
    /// Tensors on both sides, in natural name order.
    pub tensors: Vec<TensorDiff>,
    /// Names that lost wrapper prefixes (`module.`, `_fsdp_wrapped_module.`), per side.
    pub renamed: (usize, usize),
}

/// A [`DiffReport`] as JSON: the verdict first.
#[derive(Serialize)]
struct DiffJson {
    identical: bool,
    a: DiffSide,
    b: DiffSide,
    only_a: Vec<String>,
    only_b: Vec<String>,
    tensors: Vec<TensorDiff>,
}

impl From<DiffReport> for DiffJson {
    fn from(r: DiffReport) -> Self {
        DiffJson {
            identical: r.identical(),
            a: r.a,
            b: r.b,
            only_a: r.only_a,
            only_b: r.only_b,
            tensors: r.tensors,
        }
    }
}

impl DiffReport {
    /// Same names, dtypes, shapes and values.
    pub fn identical(&self) -> bool {
        self.only_a.is_empty()
            && self.only_b.is_empty()
            && self.tensors.iter().all(|t| t.identical())
    }
}

/// Names of a checkpoint's tensors with wrapper prefixes stripped, unless stripping
/// would make two of them collide.
fn comparable_names(ckpt: &Checkpoint) -> (Vec<String>, usize) {
    let stripped: Vec<String> = ckpt
        .tensors
        .iter()
        .map(|t| strip_wrappers(&t.name))
        .collect();
    let mut seen = std::collections::HashSet::new();
    if stripped.iter().all(|n| seen.insert(n.as_str())) {
        let renamed = stripped
            .iter()
            .zip(&ckpt.tensors)
            .filter(|(n, t)| **n != t.name)
            .count();
        (stripped, renamed)
    } else {
        (ckpt.tensors.iter().map(|t| t.name.clone()).collect(), 0)
    }
}

/// Opens both inputs and compares them (`b` is the reference for relative norms).
pub fn diff(opts: &DiffOptions, progress: &dyn Progress) -> Result<DiffReport> {
    let a = crate::source::open(&opts.a, &opts.open)?;
    let b = crate::source::open(&opts.b, &opts.open)?;
    let calls: Vec<_> = a
        .unsafe_calls
        .iter()
        .chain(&b.unsafe_calls)
        .cloned()
        .collect();
    crate::source::audit::apply_policy(opts.unsafe_pickles, &calls)?;
    compare(&a, &b, progress, &opts.cancel)
}

/// Compares `a` with `b` (the reference, for relative norms).
pub fn compare(
    a: &Checkpoint,
    b: &Checkpoint,
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<DiffReport> {
    let (names_a, renamed_a) = comparable_names(a);
    let (names_b, renamed_b) = comparable_names(b);
    let index_b: std::collections::HashMap<&str, usize> = names_b
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let index_a: std::collections::HashSet<&str> = names_a.iter().map(String::as_str).collect();
    let mut report = DiffReport {
        a: DiffSide::of(a),
        b: DiffSide::of(b),
        only_a: Vec::new(),
        only_b: Vec::new(),
        tensors: Vec::new(),
        renamed: (renamed_a, renamed_b),
    };
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for (i, n) in names_a.iter().enumerate() {
        match index_b.get(n.as_str()) {
            Some(&j) => pairs.push((i, j)),
            None => report.only_a.push(n.clone()),
        }
    }
    report.only_b = names_b
        .iter()
        .filter(|n| !index_a.contains(n.as_str()))
        .cloned()
        .collect();
    pairs.sort_by(|x, y| natural_cmp(&names_a[x.0], &names_a[y.0]));
    report.only_a.sort_by(|x, y| natural_cmp(x, y));
    report.only_b.sort_by(|x, y| natural_cmp(x, y));

    // Windows of every comparable pair, in parallel.
    let mut items: Vec<(usize, u64, u64)> = Vec::new();
    for (k, &(i, j)) in pairs.iter().enumerate() {
        let (ta, tb) = (&a.tensors[i], &b.tensors[j]);
        if ta.shape != tb.shape {
            continue;
        }
        items.extend(windows(0, ta.numel(), WINDOW_ELEMS).map(|(e0, e1)| (k, e0, e1)));
    }
    let total: u64 = items
        .iter()
        .map(|&(k, e0, e1)| (e1 - e0) * a.tensors[pairs[k].0].dtype.size() as u64)
        .sum();
    progress.start(total);
    let parts: Vec<(usize, Acc)> = items
        .par_iter()
        .map_init(Bufs::default, |bufs, &(k, e0, e1)| {
            cancel.check()?;
            let (i, j) = pairs[k];
            let acc = compare_window((a, &a.tensors[i]), (b, &b.tensors[j]), e0, e1, bufs)?;
            progress.advance((e1 - e0) * a.tensors[i].dtype.size() as u64);
            Ok((k, acc))
        })
        .collect::<Result<_>>()?;
    progress.finish();
    let mut accs = vec![Acc::default(); pairs.len()];
    for (k, acc) in parts {
        accs[k].add(&acc);
    }
    for (k, &(i, j)) in pairs.iter().enumerate() {
        let (ta, tb) = (&a.tensors[i], &b.tensors[j]);
        report.tensors.push(TensorDiff {
            name: names_a[i].clone(),
            dtype_a: ta.dtype,
            dtype_b: tb.dtype,
            shape_a: ta.shape.clone(),
            shape_b: tb.shape.clone(),
            values: (ta.shape == tb.shape).then(|| accs[k].finish()),
        });
    }
    Ok(report)
}

#[derive(Default)]
struct Bufs {
    raw_a: Vec<u8>,
    raw_b: Vec<u8>,
    va: Vec<f64>,
    vb: Vec<f64>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Acc {
    differing: u64,
    nan_mismatch: u64,
    max_abs: f64,
    sq_diff: f64,
    sq_ref: f64,
}

impl Acc {
    fn add(&mut self, o: &Acc) {
        self.differing += o.differing;
        self.nan_mismatch += o.nan_mismatch;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.sq_diff += o.sq_diff;
        self.sq_ref += o.sq_ref;
    }

    fn push(&mut self, x: f64, y: f64) {
        if y.is_finite() {
            self.sq_ref += y * y;
        }
        if x == y || (x.is_nan() && y.is_nan()) {
            return;
        }
        self.differing += 1;
        if x.is_nan() || y.is_nan() {
            self.nan_mismatch += 1;
            return;
        }
        let d = (x - y).abs();
        self.max_abs = self.max_abs.max(d);
        if d.is_finite() {
            self.sq_diff += d * d;
        }
    }

    fn finish(&self) -> ValueDiff {
        let rel_l2 = if self.sq_diff == 0.0 {
            0.0
        } else if self.sq_ref == 0.0 {
            f64::INFINITY
        } else {
            (self.sq_diff / self.sq_ref).sqrt()
        };
        ValueDiff {
            differing: self.differing,
            nan_mismatch: self.nan_mismatch,
            max_abs: self.max_abs,
            rel_l2,
        }
    }
}

fn compare_window(
    (ca, ta): (&Checkpoint, &TensorSource),
    (cb, tb): (&Checkpoint, &TensorSource),
    e0: u64,
    e1: u64,
    bufs: &mut Bufs,
) -> Result<Acc> {
    let n = (e1 - e0) as usize;
    bufs.raw_a.resize(n * ta.dtype.size(), 0);
    bufs.raw_b.resize(n * tb.dtype.size(), 0);
    read_tensor_range(&ca.files, ta, ta.dtype, e0, e1, &mut bufs.raw_a)?;
    read_tensor_range(&cb.files, tb, tb.dtype, e0, e1, &mut bufs.raw_b)?;
    let mut acc = Acc::default();
    for (xa, xb) in bufs
        .raw_a
        .chunks(CHUNK_ELEMS * ta.dtype.size())
        .zip(bufs.raw_b.chunks(CHUNK_ELEMS * tb.dtype.size()))
    {
        decode_f64(xa, ta.dtype, &mut bufs.va);
        decode_f64(xb, tb.dtype, &mut bufs.vb);
        for (&x, &y) in bufs.va.iter().zip(&bufs.vb) {
            acc.push(x, y);
        }
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_l2_is_against_the_reference_and_nan_matches_nan() {
        let mut acc = Acc::default();
        for (x, y) in [(1.0, 1.0), (3.0, 4.0), (f64::NAN, f64::NAN), (-0.0, 0.0)] {
            acc.push(x, y);
        }
        let v = acc.finish();
        assert_eq!((v.differing, v.nan_mismatch, v.max_abs), (1, 0, 1.0));
        assert!((v.rel_l2 - (1.0f64 / 17.0).sqrt()).abs() < 1e-12);
        let mut acc = Acc::default();
        acc.push(f64::NAN, 2.0);
        acc.push(f64::INFINITY, 2.0);
        let v = acc.finish();
        assert_eq!(
            (v.differing, v.nan_mismatch, v.max_abs),
            (2, 1, f64::INFINITY)
        );
    }
}
