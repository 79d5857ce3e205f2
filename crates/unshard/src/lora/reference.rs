//! verify's own evaluation of a fused weight: plain float64 loops, no matrix
//! library, no shared code with [`super::math`], so that a mistake in one does not
//! hide in the other.
//!
//! A fused value cannot be compared bit for bit: peft and unshard sum the rank-r
//! products and the DoRA norm in different orders, in float32. The tolerance is
//! one unit in the last place of the output dtype, plus the rounding error bound of
//! a float32 evaluation (`(r + 4)` unit roundoffs, 2^-24 each), both taken at the
//! magnitude the float32 arithmetic works at: `max(|W|, scale * sum_k |B[o,k]
//! A[k,i]|)`, times the DoRA factor. For bfloat16 and float16 outputs the second
//! term is a small fraction of an ulp; for float32 outputs it is what lets any
//! correct float32 merge (peft's, or unshard's) pass when `W` and the update
//! nearly cancel. A wrong scale, a missing transpose or a norm on the wrong axis
//! is off by many units.

use crate::dtype::DType;

use super::math::Layout;

/// The exact (float64) fused weight and, per element, the magnitude its float32
/// computation works at.
pub struct Expected {
    /// The fused values, C order.
    pub values: Vec<f64>,
    /// Per element, the magnitude the float32 arithmetic works at.
    pub magnitude: Vec<f64>,
    /// Unit roundoffs a float32 evaluation may lose, relative to the magnitude.
    pub float32_roundoffs: f64,
}

impl Expected {
    /// How far (absolute) a value of `dtype` may be from element `i`'s exact value.
    pub fn allowed(&self, i: usize, dtype: DType) -> f64 {
        tolerance(
            self.values[i],
            self.magnitude[i],
            self.float32_roundoffs,
            dtype,
        )
    }

    /// Whether `found` (a value of `dtype`) is an acceptable fused value of element `i`.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn allows(&self, i: usize, found: f64, dtype: DType) -> bool {
        within_tolerance(
            found,
            self.values[i],
            self.magnitude[i],
            self.float32_roundoffs,
            dtype,
        )
    }
}

/// Inputs of one fused weight, in float64, row-major.
pub struct Operands<'a> {
    /// How the update lies over the weight.
    pub layout: Layout,
    /// The weight, `[rows, cols]`.
    pub w: &'a [f64],
    /// Rows of the stored weight.
    pub rows: usize,
    /// Columns of the stored weight.
    pub cols: usize,
    /// lora_A (or lora_embedding_A), `[r, ..]`.
    pub a: &'a [f64],
    /// lora_B (or lora_embedding_B), `[.., r]`.
    pub b: &'a [f64],
    /// `r`.
    pub rank: usize,
    /// `alpha / r` or `alpha / sqrt(r)`.
    pub scale: f64,
    /// DoRA's magnitude, one per output channel.
    pub dora_magnitude: Option<&'a [f64]>,
}

/// Evaluates `W + scale * B@A` (transposed where the layout says), then DoRA.
pub fn evaluate(op: &Operands<'_>) -> Expected {
    let (rows, cols, r) = (op.rows, op.cols, op.rank);
    let mut values = vec![0f64; rows * cols];
    let mut magnitude = vec![0f64; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            // (out, in) of the element in peft's terms.
            let (o, x) = if op.layout == Layout::Linear {
                (i, j)
            } else {
                (j, i)
            };
            let in_dim = if op.layout == Layout::Linear {
                cols
            } else {
                rows
            };
            let mut sum = 0f64;
            let mut abs = 0f64;
            for k in 0..r {
                let p = op.b[o * r + k] * op.a[k * in_dim + x];
                sum += p;
                abs += p.abs();
            }
            let w = op.w[i * cols + j];
            values[i * cols + j] = w + op.scale * sum;
            magnitude[i * cols + j] = w.abs().max(op.scale.abs() * abs);
        }
    }
    if let Some(m) = op.dora_magnitude {
        let out_channels = if op.layout == Layout::Linear {
            rows
        } else {
            cols
        };
        let mut norms = vec![0f64; out_channels];
        for i in 0..rows {
            for j in 0..cols {
                let o = if op.layout == Layout::Linear { i } else { j };
                norms[o] += values[i * cols + j] * values[i * cols + j];
            }
        }
        for i in 0..rows {
            for j in 0..cols {
                let o = if op.layout == Layout::Linear { i } else { j };
                let factor = m[o] / norms[o].sqrt();
                values[i * cols + j] *= factor;
                magnitude[i * cols + j] *= factor.abs();
            }
        }
    }
    Expected {
        values,
        magnitude,
        float32_roundoffs: (r + 4) as f64,
    }
}

/// One unit in the last place of `dtype` at magnitude `x` (the spacing of the
/// dtype's numbers around it, never below its smallest subnormal).
pub fn ulp(dtype: DType, x: f64) -> f64 {
    let (mantissa_bits, min_exp) = match dtype {
        DType::F64 => (52, -1022),
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
        DType::F8E4M3 => (3, -6),
        DType::F8E5M2 => (2, -14),
        _ => return 0.0,
    };
    let x = x.abs();
    let exp = if x > 0.0 && x.is_finite() {
        (x.log2().floor() as i32).max(min_exp)
    } else {
        min_exp
    };
    2f64.powi(exp - mantissa_bits)
}

/// Whether `found` (a value of `dtype`) is within one ulp of `expected`, plus
/// `roundoffs` float32 unit roundoffs, at `magnitude`.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn within_tolerance(
    found: f64,
    expected: f64,
    magnitude: f64,
    roundoffs: f64,
    dtype: DType,
) -> bool {
    if found.is_nan() || expected.is_nan() {
        return found.is_nan() && expected.is_nan();
    }
    found == expected
        || (found - expected).abs() <= tolerance(expected, magnitude, roundoffs, dtype)
}

/// One ulp of `dtype` plus `roundoffs` float32 unit roundoffs, at the larger of
/// `magnitude` and `|expected|`.
pub fn tolerance(expected: f64, magnitude: f64, roundoffs: f64, dtype: DType) -> f64 {
    let at = magnitude.max(expected.abs());
    ulp(dtype, at) + roundoffs * 2f64.powi(-24) * at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ulps_of_the_output_dtypes() {
        assert_eq!(ulp(DType::BF16, 1.0), 2f64.powi(-7));
        assert_eq!(ulp(DType::BF16, 1.99), 2f64.powi(-7));
        assert_eq!(ulp(DType::F16, 0.5), 2f64.powi(-11));
        assert_eq!(ulp(DType::F16, 1e-9), 2f64.powi(-24));
        assert_eq!(ulp(DType::F32, 3.0), 2f64.powi(-22));
        assert!(within_tolerance(
            1.0 + 2f64.powi(-7),
            1.0,
            1.0,
            8.0,
            DType::BF16
        ));
        assert!(!within_tolerance(
            1.0 + 2f64.powi(-6),
            1.0,
            1.0,
            8.0,
            DType::BF16
        ));
        assert!(!within_tolerance(
            1.0 + 2f64.powi(-19),
            1.0,
            1.0,
            8.0,
            DType::F32
        ));
    }

    #[test]
    fn ulps_of_the_other_float_dtypes() {
        assert_eq!(ulp(DType::F64, 1.0), 2f64.powi(-52));
        assert_eq!(ulp(DType::F8E4M3, 1.0), 2f64.powi(-3));
        assert_eq!(ulp(DType::F8E4M3, 1e-9), 2f64.powi(-9));
        assert_eq!(ulp(DType::F8E5M2, 1.0), 2f64.powi(-2));
        assert_eq!(ulp(DType::F8E5M2, 1e-9), 2f64.powi(-16));
        assert_eq!(ulp(DType::I32, 1.0), 0.0);
    }

    #[test]
    fn the_tolerance_grows_with_the_magnitude() {
        // One float32 ulp at 4 (2^-21), plus 8 unit roundoffs of 4 (8 * 2^-24 * 4).
        assert_eq!(
            tolerance(1.0, 4.0, 8.0, DType::F32),
            2f64.powi(-21) + 2f64.powi(-19)
        );
        // At the larger of the magnitude and the value.
        assert_eq!(
            tolerance(-4.0, 1.0, 8.0, DType::F32),
            2f64.powi(-21) + 2f64.powi(-19)
        );
    }

    #[test]
    fn nan_is_only_within_tolerance_of_nan() {
        assert!(within_tolerance(f64::NAN, f64::NAN, 1.0, 8.0, DType::F32));
        assert!(!within_tolerance(f64::NAN, 1.0, 1.0, 8.0, DType::F32));
        assert!(!within_tolerance(1.0, f64::NAN, 1.0, 8.0, DType::F32));
        assert!(within_tolerance(
            f64::INFINITY,
            f64::INFINITY,
            1.0,
            8.0,
            DType::F32
        ));
    }

    #[test]
    fn the_magnitude_is_the_larger_of_the_weight_and_the_summed_products() {
        // One element, rank 2: B@A = 3 * 2 + (-1) * 5 = 1, its products' sizes 6 + 5.
        let e = evaluate(&Operands {
            layout: Layout::Linear,
            w: &[-4.0],
            rows: 1,
            cols: 1,
            a: &[2.0, 5.0],
            b: &[3.0, -1.0],
            rank: 2,
            scale: 0.5,
            dora_magnitude: None,
        });
        assert_eq!(e.values, [-3.5]);
        assert_eq!(e.magnitude, [0.5 * 11.0]);
        assert_eq!(e.float32_roundoffs, 6.0);
        assert!(e.allows(0, -3.5, DType::F32));
        assert!(!e.allows(0, -3.5 + 2f64.powi(-10), DType::F32));
    }

    #[test]
    fn every_element_has_its_own_magnitude() {
        // W [2, 2] = 0, rank 1, A = (1, -2), B = (3, 4): W' = B A.
        let e = evaluate(&Operands {
            layout: Layout::Linear,
            w: &[0.0; 4],
            rows: 2,
            cols: 2,
            a: &[1.0, -2.0],
            b: &[3.0, 4.0],
            rank: 1,
            scale: 1.0,
            dora_magnitude: None,
        });
        assert_eq!(e.values, [3.0, -6.0, 4.0, -8.0]);
        assert_eq!(e.magnitude, [3.0, 6.0, 4.0, 8.0]);
    }

    #[test]
    fn dora_scales_each_output_channel_to_its_magnitude() {
        // Two output channels of one input each: W + B A = (2, 5) + (1, -1) = (3, 4),
        // the norm of each channel is its one value, scaled to the magnitudes (6, 2).
        // nn.Linear stores it [out, in] = [2, 1], Conv1D [in, out] = [1, 2].
        for (layout, rows, cols) in [(Layout::Linear, 2, 1), (Layout::FanInFanOut, 1, 2)] {
            let e = evaluate(&Operands {
                layout,
                w: &[2.0, 5.0],
                rows,
                cols,
                a: &[1.0],
                b: &[1.0, -1.0],
                rank: 1,
                scale: 1.0,
                dora_magnitude: Some(&[6.0, 2.0]),
            });
            assert_eq!(e.values, [6.0, 2.0], "{layout:?}");
            // Before the factors (2, 1/2): max(|W|, |B A|) = (2, 5).
            assert_eq!(e.magnitude, [4.0, 2.5], "{layout:?}");
        }
        // Channels of two values, no update: norms 5 and 10, scaled to 10 and 5.
        // nn.Linear's channels are the rows, Conv1D's the columns.
        let cases = [
            (Layout::Linear, [3.0, 4.0, 6.0, 8.0], [6.0, 8.0, 3.0, 4.0]),
            (
                Layout::FanInFanOut,
                [3.0, 6.0, 4.0, 8.0],
                [6.0, 3.0, 8.0, 4.0],
            ),
        ];
        for (layout, w, fused) in cases {
            let e = evaluate(&Operands {
                layout,
                w: &w,
                rows: 2,
                cols: 2,
                a: &[0.0, 0.0],
                b: &[0.0, 0.0],
                rank: 1,
                scale: 1.0,
                dora_magnitude: Some(&[10.0, 5.0]),
            });
            assert_eq!(e.values, fused, "{layout:?}");
            assert_eq!(e.magnitude, fused, "{layout:?}");
        }
    }

    #[test]
    fn conv1d_update_is_the_transpose() {
        // W = 0 [in=2, out=1]; A [1, 2] = (1, 2); B [1, 1] = 3: W' = 3 * (1, 2)^T.
        let e = evaluate(&Operands {
            layout: Layout::FanInFanOut,
            w: &[0.0, 0.0],
            rows: 2,
            cols: 1,
            a: &[1.0, 2.0],
            b: &[3.0],
            rank: 1,
            scale: 1.0,
            dora_magnitude: None,
        });
        assert_eq!(e.values, [3.0, 6.0]);
    }
}
