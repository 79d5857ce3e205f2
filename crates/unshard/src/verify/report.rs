//! What `verify` found: structural problems and tensors whose values differ,
//! collected in a [`VerifyReport`]. Its JSON (the CLI's `verify --json`, schema
//! in the README) is its `Serialize` form; numbers that are not finite (a max abs
//! diff of inf, a NaN value) become `null`.

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use crate::dtype::DType;
use crate::error::Error;
use crate::text::human_bytes;

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
        // 23 = 1*12 + 2*4 + 3 in [2, 3, 4]; a zero-length dimension counts as one.
        assert_eq!(unravel(23, &[2, 3, 4]), [1, 2, 3]);
        assert_eq!(unravel(3, &[0, 4]), [0, 3]);
    }

    #[test]
    fn numbers_are_plain_between_1e_4_and_1e7_and_in_e_notation_outside() {
        assert_eq!(num(0.0), "0");
        assert_eq!(num(1.5), "1.5");
        assert_eq!(num(-2.0), "-2");
        assert_eq!(num(1e-4), "0.0001");
        assert_eq!(num(9999999.0), "9999999");
        assert_eq!(num(1e7), "1e7");
        assert_eq!(num(-3e-5), "-3e-5");
        assert_eq!(num(f64::INFINITY), "inf");
        assert_eq!(num(f64::NAN), "NaN");
    }

    fn mismatch() -> Mismatch {
        Mismatch {
            file: "model.safetensors".into(),
            name: "w".into(),
            shape: vec![2, 3],
            dtype: DType::BF16,
            differing: 2,
            nan_mismatch: 1,
            max_abs_diff: 0.5,
            first: Some(FirstDiff {
                index: 4,
                expected: 1.0,
                found: f64::NAN,
            }),
        }
    }

    fn report(problems: usize, mismatches: usize) -> VerifyReport {
        VerifyReport {
            dir: PathBuf::from("out"),
            files: vec!["a.safetensors".into(), "b.safetensors".into()],
            problems: (0..problems)
                .map(|i| problem(Some("x"), None, format!("p{i}")))
                .collect(),
            mismatches: vec![mismatch(); mismatches],
            tensors_compared: 3,
            bytes_compared: 3 << 20,
            files_checksummed: 0,
        }
    }

    #[test]
    fn a_mismatch_says_how_many_elements_differ_and_where_the_first_is() {
        assert_eq!(
            mismatch().to_string(),
            "model.safetensors: tensor 'w': 2 of 6 element(s) differ, max abs diff 0.5, 1 NaN against a number; first at [1, 1]: expected 1, found NaN"
        );
        let m = Mismatch {
            nan_mismatch: 0,
            first: None,
            ..mismatch()
        };
        assert_eq!(
            m.to_string(),
            "model.safetensors: tensor 'w': 2 of 6 element(s) differ, max abs diff 0.5"
        );
    }

    #[test]
    fn the_summary_says_what_matched_or_what_did_not() {
        let ok = report(0, 0);
        assert!(ok.is_ok());
        assert_eq!(
            ok.summary(),
            "3 tensor(s) in 2 file(s) match the checkpoint (3.0 MiB compared); headers, index and config are consistent"
        );
        let sums = VerifyReport {
            files_checksummed: 2,
            ..report(0, 0)
        };
        assert!(sums
            .summary()
            .ends_with("consistent; 2 file(s) match their checksums"));
        assert!(!report(1, 0).is_ok() && !report(0, 1).is_ok());
        assert_eq!(report(1, 0).summary(), "1 structural problem(s) in out");
        assert_eq!(
            report(0, 2).summary(),
            "2 tensor(s) hold other values than the checkpoint in out"
        );
        assert_eq!(
            report(2, 1).summary(),
            "1 tensor(s) hold other values than the checkpoint and 2 structural problem(s) in out"
        );
        assert_eq!(
            report(1, 1).findings(),
            ["x: p0".to_string(), mismatch().to_string()]
        );
    }

    #[test]
    fn the_error_lists_the_first_ten_findings() {
        let msg = |r: &VerifyReport| match r.to_error() {
            Error::Check { msg, hint } => {
                assert!(hint
                    .unwrap()
                    .contains("the output was not moved into place"));
                msg
            }
            e => panic!("{e}"),
        };
        let m = msg(&report(10, 0));
        assert_eq!(m.lines().count(), 11);
        assert!(m.starts_with(
            "verification failed: 10 structural problem(s) in out\n  x: p0\n  x: p1\n"
        ));
        assert!(m.ends_with("\n  x: p9"));
        let m = msg(&report(11, 1));
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines.len(), 12);
        assert_eq!(lines[10], "  x: p9");
        assert_eq!(lines[11], "  and 2 more");
    }

    #[test]
    fn the_json_puts_the_verdict_first_and_the_first_difference_at_coordinates() {
        let v = serde_json::to_value(report(1, 1)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "ok",
                "dir",
                "files",
                "tensors_compared",
                "bytes_compared",
                "files_checksummed",
                "problems",
                "mismatches",
                "summary"
            ]
        );
        assert_eq!(v["ok"], false);
        assert_eq!(v["dir"], "out");
        assert_eq!(v["tensors_compared"], 3);
        assert_eq!(v["bytes_compared"], 3 << 20);
        assert_eq!(v["files_checksummed"], 0);
        assert_eq!(
            v["problems"][0],
            serde_json::json!({"file": "x", "tensor": null, "message": "p0"})
        );
        assert_eq!(
            v["mismatches"][0],
            serde_json::json!({
                "file": "model.safetensors", "tensor": "w", "dtype": "BF16", "shape": [2, 3],
                "differing": 2, "nan_mismatch": 1, "max_abs_diff": 0.5,
                "first": {"index": [1, 1], "expected": 1.0, "found": null}
            })
        );
        assert_eq!(
            v["summary"],
            "1 tensor(s) hold other values than the checkpoint and 1 structural problem(s) in out"
        );
        assert_eq!(serde_json::to_value(report(0, 0)).unwrap()["ok"], true);
    }
}
