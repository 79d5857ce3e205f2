//! Comparing expected and written bytes: identical, except that NaNs match by
//! class (any NaN equals any NaN), because tools disagree on NaN payloads.

use super::report::FirstDiff;
use crate::stats::element_f64;
use crate::DType;

/// Differences found in one window or one tensor.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Diffs {
    pub(crate) differing: u64,
    pub(crate) nan_mismatch: u64,
    pub(crate) max_abs: f64,
    pub(crate) first: Option<FirstDiff>,
}

impl Diffs {
    pub(crate) fn add(&mut self, o: Diffs) {
        self.differing += o.differing;
        self.nan_mismatch += o.nan_mismatch;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.first = match (self.first, o.first) {
            (Some(a), Some(b)) => Some(if b.index < a.index { b } else { a }),
            (a, b) => a.or(b),
        };
    }
}

/// Compares two windows of `dtype` elements byte for byte, NaN matching NaN.
pub(crate) fn compare(expected: &[u8], found: &[u8], dtype: DType, e0: u64) -> Diffs {
    let mut d = Diffs::default();
    if expected == found {
        return d;
    }
    let size = dtype.size();
    for (i, (e, f)) in expected
        .chunks_exact(size)
        .zip(found.chunks_exact(size))
        .enumerate()
    {
        if e == f {
            continue;
        }
        let (ve, vf) = (element_f64(e, dtype), element_f64(f, dtype));
        if ve.is_nan() && vf.is_nan() {
            continue;
        }
        d.differing += 1;
        if ve.is_nan() || vf.is_nan() {
            d.nan_mismatch += 1;
        } else {
            let diff = (ve - vf).abs();
            // inf against inf of the other sign, or against a number.
            d.max_abs = d
                .max_abs
                .max(if diff.is_nan() { f64::INFINITY } else { diff });
        }
        if d.first.is_none() {
            d.first = Some(FirstDiff {
                index: e0 + i as u64,
                expected: ve,
                found: vf,
            });
        }
    }
    d
}

/// Whether two windows hold the same values (bytes equal, NaN matching NaN).
pub(crate) fn same_values(a: &[u8], b: &[u8], dtype: DType) -> bool {
    a == b || compare(a, b, dtype, 0).differing == 0
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn nan_matches_nan_but_signed_zeros_do_not_match() {
        let bf = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // 0x7fc0 and 0xffff are both NaN; 0x0000 and 0x8000 are +0 and -0.
        let d = compare(
            &bf(&[0x7fc0, 0x0000]),
            &bf(&[0xffff, 0x0000]),
            DType::BF16,
            0,
        );
        assert_eq!(d.differing, 0);
        let d = compare(
            &bf(&[0x3f80, 0x0000]),
            &bf(&[0x3f80, 0x8000]),
            DType::BF16,
            10,
        );
        assert_eq!((d.differing, d.max_abs), (1, 0.0));
        assert_eq!(d.first.map(|f| f.index), Some(11));
        let d = compare(
            &bf(&[0x3f80, 0x7fc0]),
            &bf(&[0x4000, 0x3f80]),
            DType::BF16,
            0,
        );
        assert_eq!((d.differing, d.nan_mismatch, d.max_abs), (2, 1, 1.0));
    }
}
