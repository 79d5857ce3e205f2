//! Element values as numbers: decoding any dtype to `f64`, and per-tensor summary
//! statistics (`inspect --stats`).
//!
//! Statistics stream over a tensor in windows, so any tensor of any input can be
//! summarised in bounded memory. NaN and ±inf are counted, not averaged: mean, std,
//! min and max are over the finite values only, which is what a user looking for a
//! diverged run wants to see next to the counts.

use std::sync::Arc;

use rayon::prelude::*;

use crate::cancel::Cancel;
use crate::dtype::DType;
use crate::error::Result;
use crate::read::{read_tensor_range, windows};
use crate::source::{Blob, Checkpoint, TensorSource};

/// Elements read from an input per unit of work.
pub(crate) const WINDOW_ELEMS: u64 = 1 << 20;

/// Elements decoded to `f64` at a time (keeps the decoded buffer small).
pub(crate) const CHUNK_ELEMS: usize = 1 << 16;

/// The value of the element stored in `b` (little-endian, `dtype.size()` bytes).
/// Every dtype converts exactly except 64-bit integers beyond 2^53.
pub fn element_f64(b: &[u8], dtype: DType) -> f64 {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        b.get(..N).and_then(|s| s.try_into().ok()).unwrap_or([0; N])
    }
    match dtype {
        DType::F64 => f64::from_le_bytes(arr(b)),
        DType::F32 => f32::from_le_bytes(arr(b)) as f64,
        DType::F16 => half::f16::from_bits(u16::from_le_bytes(arr(b))).to_f64(),
        DType::BF16 => f32::from_bits((u16::from_le_bytes(arr(b)) as u32) << 16) as f64,
        DType::F8E4M3 | DType::F8E5M2 => {
            let mut wide = [0u8; 4];
            crate::dtype::convert(&arr::<1>(b), dtype, &mut wide, DType::F32);
            f32::from_le_bytes(wide) as f64
        }
        DType::Bool => (arr::<1>(b)[0] != 0) as u8 as f64,
        DType::U8 => arr::<1>(b)[0] as f64,
        DType::I8 => arr::<1>(b)[0] as i8 as f64,
        DType::I16 => i16::from_le_bytes(arr(b)) as f64,
        DType::U16 => u16::from_le_bytes(arr(b)) as f64,
        DType::I32 => i32::from_le_bytes(arr(b)) as f64,
        DType::U32 => u32::from_le_bytes(arr(b)) as f64,
        DType::I64 => i64::from_le_bytes(arr(b)) as f64,
        DType::U64 => u64::from_le_bytes(arr(b)) as f64,
    }
}

/// Decodes a little-endian buffer of `dtype` elements into `out` (cleared first).
pub fn decode_f64(src: &[u8], dtype: DType, out: &mut Vec<f64>) {
    out.clear();
    macro_rules! ints {
        ($t:ty) => {
            out.extend(
                src.chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()) as f64),
            )
        };
    }
    match dtype {
        DType::F64 => ints!(f64),
        DType::F32 => ints!(f32),
        DType::F16 => out.extend(
            src.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()),
        ),
        DType::BF16 => out.extend(
            src.chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64),
        ),
        DType::F8E4M3 | DType::F8E5M2 => {
            // Widen through the conversion kernels, which know both float8 formats.
            let mut wide = vec![0u8; src.len() * 4];
            crate::dtype::convert(src, dtype, &mut wide, DType::F32);
            decode_f64(&wide, DType::F32, out);
        }
        DType::Bool => out.extend(src.iter().map(|&b| (b != 0) as u8 as f64)),
        DType::U8 => out.extend(src.iter().map(|&b| b as f64)),
        DType::I8 => out.extend(src.iter().map(|&b| b as i8 as f64)),
        DType::I16 => ints!(i16),
        DType::U16 => ints!(u16),
        DType::I32 => ints!(i32),
        DType::U32 => ints!(u32),
        DType::I64 => ints!(i64),
        DType::U64 => ints!(u64),
    }
}

/// Summary of one tensor's values. In JSON, statistics that are not finite (no
/// finite values) are `null`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct TensorStats {
    /// Elements.
    #[serde(skip)]
    pub numel: u64,
    /// Over the finite values; NaN when there are none.
    pub mean: f64,
    /// Sample standard deviation (`torch.std`'s default, correction 1) of the
    /// finite values; NaN with fewer than two.
    pub std: f64,
    /// Smallest finite value.
    pub min: f64,
    /// Largest finite value.
    pub max: f64,
    /// NaN elements.
    pub nan: u64,
    /// ±inf elements.
    pub inf: u64,
}

/// Running moments of a set of finite values, mergeable (Chan et al.).
#[derive(Clone, Copy, Debug)]
struct Moments {
    n: u64,
    mean: f64,
    m2: f64,
    min: f64,
    max: f64,
    nan: u64,
    inf: u64,
}

impl Default for Moments {
    fn default() -> Self {
        Moments {
            n: 0,
            mean: 0.0,
            m2: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            nan: 0,
            inf: 0,
        }
    }
}

impl Moments {
    /// Moments of one chunk, computed in two passes for accuracy.
    fn of(values: &[f64]) -> Moments {
        let mut m = Moments::default();
        let mut sum = 0.0;
        for &v in values {
            if v.is_nan() {
                m.nan += 1;
            } else if v.is_infinite() {
                m.inf += 1;
            } else {
                m.n += 1;
                sum += v;
                m.min = m.min.min(v);
                m.max = m.max.max(v);
            }
        }
        if m.n == 0 {
            return m;
        }
        m.mean = sum / m.n as f64;
        m.m2 = values
            .iter()
            .filter(|v| v.is_finite())
            .map(|v| (v - m.mean) * (v - m.mean))
            .sum();
        m
    }

    fn merge(self, o: Moments) -> Moments {
        let n = self.n + o.n;
        let (mean, m2) = if n == 0 {
            (0.0, 0.0)
        } else {
            let d = o.mean - self.mean;
            let (na, nb) = (self.n as f64, o.n as f64);
            (
                self.mean + d * nb / n as f64,
                self.m2 + o.m2 + d * d * na * nb / n as f64,
            )
        };
        Moments {
            n,
            mean,
            m2,
            min: self.min.min(o.min),
            max: self.max.max(o.max),
            nan: self.nan + o.nan,
            inf: self.inf + o.inf,
        }
    }

    fn finish(self, numel: u64) -> TensorStats {
        let none = self.n == 0;
        TensorStats {
            numel,
            nan: self.nan,
            inf: self.inf,
            mean: if none { f64::NAN } else { self.mean },
            std: if self.n < 2 {
                f64::NAN
            } else {
                (self.m2 / (self.n - 1) as f64).sqrt()
            },
            min: if none { f64::NAN } else { self.min },
            max: if none { f64::NAN } else { self.max },
        }
    }
}

/// Statistics of every tensor of a checkpoint, in its order. Windows of all tensors
/// run in parallel; memory stays at a window per thread.
pub fn checkpoint_stats(ckpt: &Checkpoint, cancel: &Cancel) -> Result<Vec<TensorStats>> {
    let mut items: Vec<(usize, u64, u64)> = Vec::new();
    for (i, t) in ckpt.tensors.iter().enumerate() {
        items.extend(windows(0, t.numel(), WINDOW_ELEMS).map(|(e0, e1)| (i, e0, e1)));
    }
    let parts: Vec<(usize, Moments)> = items
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(buf, vals), &(i, e0, e1)| {
                cancel.check()?;
                let m = window_moments(&ckpt.files, &ckpt.tensors[i], e0, e1, buf, vals)?;
                Ok((i, m))
            },
        )
        .collect::<Result<_>>()?;
    let mut acc = vec![Moments::default(); ckpt.tensors.len()];
    for (i, m) in parts {
        acc[i] = acc[i].merge(m);
    }
    Ok(acc
        .into_iter()
        .zip(&ckpt.tensors)
        .map(|(m, t)| m.finish(t.numel()))
        .collect())
}

/// Statistics of one tensor, read window by window.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn tensor_stats(files: &[Arc<Blob>], t: &TensorSource) -> Result<TensorStats> {
    let (mut buf, mut vals) = (Vec::new(), Vec::new());
    let mut acc = Moments::default();
    let n = t.numel();
    for (e0, e1) in windows(0, n, WINDOW_ELEMS) {
        acc = acc.merge(window_moments(files, t, e0, e1, &mut buf, &mut vals)?);
    }
    Ok(acc.finish(n))
}

fn window_moments(
    files: &[Arc<Blob>],
    t: &TensorSource,
    e0: u64,
    e1: u64,
    buf: &mut Vec<u8>,
    vals: &mut Vec<f64>,
) -> Result<Moments> {
    let size = t.dtype.size();
    buf.resize(((e1 - e0) as usize) * size, 0);
    read_tensor_range(files, t, t.dtype, e0, e1, buf)?;
    let mut acc = Moments::default();
    for chunk in buf.chunks(CHUNK_ELEMS * size) {
        decode_f64(chunk, t.dtype, vals);
        acc = acc.merge(Moments::of(vals));
    }
    Ok(acc)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn moments(v: &[f64]) -> TensorStats {
        Moments::of(v).finish(v.len() as u64)
    }

    #[test]
    fn stats_skip_nan_and_inf_and_use_the_sample_std() {
        let s = moments(&[
            1.0,
            2.0,
            3.0,
            4.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ]);
        assert_eq!((s.nan, s.inf), (1, 2));
        assert_eq!((s.mean, s.min, s.max), (2.5, 1.0, 4.0));
        assert!((s.std - 1.2909944487358056).abs() < 1e-12);
    }

    #[test]
    fn merged_chunks_give_the_same_moments_as_one_pass() {
        let v: Vec<f64> = (0..1000).map(|i| ((i * 37) % 101) as f64 * 0.1).collect();
        let whole = moments(&v);
        let merged = v
            .chunks(77)
            .map(Moments::of)
            .fold(Moments::default(), Moments::merge)
            .finish(v.len() as u64);
        assert!((whole.mean - merged.mean).abs() < 1e-12);
        assert!((whole.std - merged.std).abs() < 1e-12);
        assert_eq!((whole.min, whole.max), (merged.min, merged.max));
    }

    #[test]
    fn every_dtype_decodes_to_its_value() {
        let mut out = Vec::new();
        decode_f64(&0x3fc0u16.to_le_bytes(), DType::BF16, &mut out);
        assert_eq!(out, [1.5]);
        decode_f64(&0x3e00u16.to_le_bytes(), DType::F16, &mut out);
        assert_eq!(out, [1.5]);
        decode_f64(&(-7i64).to_le_bytes(), DType::I64, &mut out);
        assert_eq!(out, [-7.0]);
        decode_f64(&[0x38], DType::F8E4M3, &mut out);
        assert_eq!(out, [1.0]);
        decode_f64(&[0x7f], DType::F8E4M3, &mut out);
        assert!(out[0].is_nan());
        decode_f64(&[2, 0], DType::Bool, &mut out);
        assert_eq!(out, [1.0, 0.0]);
        assert_eq!(element_f64(&0xffu8.to_le_bytes(), DType::I8), -1.0);
    }
}
