//! Comparing expected and written bytes: identical, except that NaNs match by
//! class (any NaN equals any NaN), because tools disagree on NaN payloads.

use super::report::FirstDiff;
use crate::dtype::DType;
use crate::stats::element_f64;

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

/// Compares a window of `dtype` elements with values that may each be off by up to
/// `allowed[i]` (a computed value whose float32 evaluation order is not fixed, such
/// as a fused adapter); NaN matches NaN.
pub(crate) fn compare_within(
    values: &[f64],
    allowed: &[f64],
    found: &[u8],
    dtype: DType,
    e0: u64,
) -> Diffs {
    let mut d = Diffs::default();
    for (i, ((&ve, &tol), f)) in values
        .iter()
        .zip(allowed)
        .zip(found.chunks_exact(dtype.size()))
        .enumerate()
    {
        let vf = element_f64(f, dtype);
        if (ve.is_nan() && vf.is_nan()) || (ve - vf).abs() <= tol || ve == vf {
            continue;
        }
        d.differing += 1;
        if ve.is_nan() || vf.is_nan() {
            d.nan_mismatch += 1;
        } else {
            let diff = (ve - vf).abs();
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

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn infinities_of_other_signs_differ_by_infinity_and_the_first_difference_is_kept() {
        let d = compare(
            &f32s(&[1.0, f32::INFINITY, 3.0, 5.0]),
            &f32s(&[1.0, f32::NEG_INFINITY, 1.0, 4.0]),
            DType::F32,
            100,
        );
        assert_eq!(
            (d.differing, d.nan_mismatch, d.max_abs),
            (3, 0, f64::INFINITY)
        );
        let first = d.first.unwrap();
        assert_eq!(
            (first.index, first.expected, first.found),
            (101, f64::INFINITY, f64::NEG_INFINITY)
        );
        // Equal windows: nothing, whatever the offset.
        let d = compare(&f32s(&[1.0, 2.0]), &f32s(&[1.0, 2.0]), DType::F32, 7);
        assert_eq!((d.differing, d.first.map(|f| f.index)), (0, None));
        // The largest difference wins, wherever it is.
        let d = compare(
            &f32s(&[0.0, 0.0, 0.0]),
            &f32s(&[2.0, 5.0, 3.0]),
            DType::F32,
            0,
        );
        assert_eq!((d.differing, d.max_abs), (3, 5.0));
        assert_eq!(d.first.map(|f| (f.index, f.found)), Some((0, 2.0)));
    }

    #[test]
    fn values_within_their_allowance_match() {
        let found = f32s(&[1.0, 2.5, f32::NAN, 7.0, 4.0, f32::INFINITY]);
        let values = [1.25, 2.0, f64::NAN, f64::NAN, 4.0, f64::INFINITY];
        let allowed = [0.25, 0.25, 0.0, 1.0, 0.0, 0.0];
        let d = compare_within(&values, &allowed, &found, DType::F32, 10);
        // 1 is within 0.25 of 1.25 (the bound counts); 2.5 is not within 0.25 of 2;
        // NaN matches NaN; 7 is not NaN; 4 equals 4; inf equals inf.
        assert_eq!((d.differing, d.nan_mismatch, d.max_abs), (2, 1, 0.5));
        let first = d.first.unwrap();
        assert_eq!((first.index, first.expected, first.found), (11, 2.0, 2.5));
        // An infinity against a number: an infinite difference.
        let d = compare_within(
            &[f64::INFINITY, 3.0],
            &[1.0, 1.0],
            &f32s(&[1.0, 1.0]),
            DType::F32,
            0,
        );
        assert_eq!((d.differing, d.max_abs), (2, f64::INFINITY));
        let d = compare_within(
            &[f64::INFINITY],
            &[1.0],
            &f32s(&[f32::NEG_INFINITY]),
            DType::F32,
            0,
        );
        assert_eq!((d.differing, d.max_abs), (1, f64::INFINITY));
    }

    #[test]
    fn differences_add_up_and_the_earliest_first_difference_is_kept() {
        let at = |index: u64| FirstDiff {
            index,
            expected: index as f64,
            found: 0.0,
        };
        let mut d = Diffs {
            differing: 2,
            nan_mismatch: 1,
            max_abs: 3.0,
            first: Some(at(20)),
        };
        d.add(Diffs {
            differing: 5,
            nan_mismatch: 2,
            max_abs: 1.0,
            first: Some(at(10)),
        });
        assert_eq!((d.differing, d.nan_mismatch, d.max_abs), (7, 3, 3.0));
        assert_eq!(d.first, Some(at(10)));
        d.add(Diffs {
            max_abs: 4.0,
            first: Some(at(30)),
            ..Diffs::default()
        });
        assert_eq!((d.max_abs, d.first), (4.0, Some(at(10))));
        let mut e = Diffs::default();
        e.add(Diffs {
            first: Some(at(5)),
            ..Diffs::default()
        });
        assert_eq!(e.first, Some(at(5)));
        e.add(Diffs::default());
        assert_eq!(e.first, Some(at(5)));
    }

    #[test]
    fn same_values_ignores_nan_payloads_only() {
        let a = f32s(&[f32::from_bits(0x7fc0_0001), 1.0]);
        let b = f32s(&[f32::from_bits(0xffc0_0002), 1.0]);
        assert!(same_values(&a, &a, DType::F32));
        assert!(same_values(&a, &b, DType::F32));
        assert!(!same_values(&a, &f32s(&[f32::NAN, 2.0]), DType::F32));
        assert!(!same_values(&f32s(&[0.0]), &f32s(&[-0.0]), DType::F32));
    }
}
