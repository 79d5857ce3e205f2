//! What `verify` found: structural problems and tensors whose values differ,
//! collected in a [`VerifyReport`]. Its JSON (the CLI's `verify --json`, schema
//! in the README) is its `Serialize` form; numbers that are not finite (a max abs
//! diff of inf, a NaN value) become `null`.

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use crate::report::human_bytes;
use crate::{DType, Error};

/// A structural finding: something about the files, not the values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The file at fault, relative to the output directory.
    pub file: Option<String>,
    /// The tensor at fault.
    pub tensor: Option<String>,
    /// What is wrong.
    #[serde(rename = "message")]
    pub msg: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}: ")?;
        }
        if let Some(t) = &self.tensor {
            write!(f, "tensor '{t}': ")?;
        }
        f.write_str(&self.msg)
    }
}

pub(crate) fn problem(file: Option<&str>, tensor: Option<&str>, msg: impl Into<String>) -> Problem {
    Problem {
        file: file.map(str::to_string),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

/// The first element that differs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstDiff {
    /// Flat (C-order) index.
    pub index: u64,
    /// The value the merge writes.
    pub expected: f64,
    /// The value in the file.
    pub found: f64,
}

/// A tensor whose values are not what the merge should have written.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(into = "MismatchJson")]
pub struct Mismatch {
    /// The shard file that holds it.
    pub file: String,
    /// The tensor.
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its dtype in the file.
    pub dtype: DType,
    /// Elements whose bytes differ (NaN against NaN does not count).
    pub differing: u64,
    /// Of those, how many are NaN on one side and a number on the other.
    pub nan_mismatch: u64,
    /// Largest |expected − found| over the differing elements that are numbers on
    /// both sides (0 when only signed zeros or NaNs differ).
    pub max_abs_diff: f64,
    /// The first element that differs.
    pub first: Option<FirstDiff>,
}

/// A [`Mismatch`] as JSON: the tensor under `tensor`, the first difference at
/// coordinates.
#[derive(Serialize)]
struct MismatchJson {
    file: String,
    tensor: String,
    dtype: DType,
    shape: Vec<u64>,
    differing: u64,
    nan_mismatch: u64,
    max_abs_diff: f64,
    first: Option<FirstDiffJson>,
}

#[derive(Serialize)]
struct FirstDiffJson {
    index: Vec<u64>,
    expected: f64,
    found: f64,
}

impl From<Mismatch> for MismatchJson {
    fn from(m: Mismatch) -> Self {
        MismatchJson {
            first: m.first.map(|d| FirstDiffJson {
                index: unravel(d.index, &m.shape),
                expected: d.expected,
                found: d.found,
            }),
            file: m.file,
            tensor: m.name,
            dtype: m.dtype,
            shape: m.shape,
            differing: m.differing,
            nan_mismatch: m.nan_mismatch,
            max_abs_diff: m.max_abs_diff,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let numel: u64 = self.shape.iter().product();
        write!(
            f,
            "{}: tensor '{}': {} of {numel} element(s) differ, max abs diff {}",
            self.file,
            self.name,
            self.differing,
            num(self.max_abs_diff)
        )?;
        if self.nan_mismatch > 0 {
            write!(f, ", {} NaN against a number", self.nan_mismatch)?;
        }
        if let Some(d) = &self.first {
            write!(
                f,
                "; first at {:?}: expected {}, found {}",
                unravel(d.index, &self.shape),
                num(d.expected),
                num(d.found)
            )?;
        }
        Ok(())
    }
}

/// What `verify` found.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(into = "VerifyJson")]
pub struct VerifyReport {
    /// The directory checked.
    pub dir: PathBuf,
    /// Shard files read.
    pub files: Vec<String>,
    /// What is wrong with the files.
    pub problems: Vec<Problem>,
    /// Tensors whose values differ.
    pub mismatches: Vec<Mismatch>,
    /// Tensors whose values were compared.
    pub tensors_compared: usize,
    /// Bytes of tensor data compared.
    pub bytes_compared: u64,
    /// Files whose checksums matched what was written or recorded.
    pub files_checksummed: usize,
}

/// A [`VerifyReport`] as JSON: the verdict first, the summary line last.
#[derive(Serialize)]
struct VerifyJson {
    ok: bool,
    dir: String,
    files: Vec<String>,
    tensors_compared: usize,
    bytes_compared: u64,
    files_checksummed: usize,
    problems: Vec<Problem>,
    mismatches: Vec<Mismatch>,
    summary: String,
}

impl From<VerifyReport> for VerifyJson {
    fn from(r: VerifyReport) -> Self {
        VerifyJson {
            ok: r.is_ok(),
            summary: r.summary(),
            dir: r.dir.display().to_string(),
            files: r.files,
            tensors_compared: r.tensors_compared,
            bytes_compared: r.bytes_compared,
            files_checksummed: r.files_checksummed,
            problems: r.problems,
            mismatches: r.mismatches,
        }
    }
}

impl VerifyReport {
    /// Whether the output is exactly what the merge should write.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty() && self.mismatches.is_empty()
    }

    /// One line: what matched, or how much did not.
    pub fn summary(&self) -> String {
        if self.is_ok() {
            let sums = match self.files_checksummed {
                0 => String::new(),
                n => format!("; {n} file(s) match their checksums"),
            };
            format!(
                "{} tensor(s) in {} file(s) match the checkpoint ({} compared); headers, index and config are consistent{sums}",
                self.tensors_compared,
                self.files.len(),
                human_bytes(self.bytes_compared)
            )
        } else {
            let mut parts = Vec::new();
            if !self.mismatches.is_empty() {
                parts.push(format!(
                    "{} tensor(s) hold other values than the checkpoint",
                    self.mismatches.len()
                ));
            }
            if !self.problems.is_empty() {
                parts.push(format!("{} structural problem(s)", self.problems.len()));
            }
            format!("{} in {}", parts.join(" and "), self.dir.display())
        }
    }

    /// Every finding, one per line: structural problems first, then mismatches.
    pub fn findings(&self) -> Vec<String> {
        self.problems
            .iter()
            .map(ToString::to_string)
            .chain(self.mismatches.iter().map(ToString::to_string))
            .collect()
    }

    /// The failure as an error (for `merge --verify`), listing the first findings.
    pub fn to_error(&self) -> Error {
        let findings = self.findings();
        let mut msg = format!("verification failed: {}", self.summary());
        for f in findings.iter().take(10) {
            msg.push_str("\n  ");
            msg.push_str(f);
        }
        if findings.len() > 10 {
            msg.push_str(&format!("\n  and {} more", findings.len() - 10));
        }
        Error::Check {
            msg,
            hint: Some(
                "the output was not moved into place; check the disk, then run the merge again"
                    .into(),
            ),
        }
    }
}

/// A C-order flat index as coordinates.
pub fn unravel(mut i: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for (x, &n) in idx.iter_mut().zip(shape).rev() {
        let n = n.max(1);
        *x = i % n;
        i /= n;
    }
    idx
}

/// A number in a short readable form.
pub(crate) fn num(v: f64) -> String {
    let a = v.abs();
    if v.is_nan() || v.is_infinite() || a == 0.0 || (1e-4..1e7).contains(&a) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn unravels_flat_indices() {
        assert_eq!(unravel(5, &[2, 3]), [1, 2]);
        assert_eq!(unravel(0, &[]), Vec::<u64>::new());
    }
}
