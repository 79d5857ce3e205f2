//! Element types and the conversion kernels between them.
//!
//! [`DType`] covers every dtype a torch checkpoint can hold that safetensors can
//! store. Conversions reproduce `torch.Tensor.to(dtype)` on x86 CPUs bit for bit for
//! every non-NaN value: round-to-nearest-even, gradual underflow, overflow to ±inf,
//! and `float64 -> float16/bfloat16` rounding twice through float32 as torch does.
//!
//! NaN policy: float32 -> bfloat16 writes `0xFFFF` for every NaN, which is what
//! torch's vectorised CPU kernels (AVX2/AVX-512, used for any tensor on x86) write;
//! float32 -> float16 keeps the sign and top payload bits with the quiet bit set, as
//! F16C does. Tests compare NaNs by class only.

use std::fmt;

/// An element type, named as safetensors names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// `torch.bool`, `BOOL`.
    Bool,
    /// `torch.uint8`, `U8`.
    U8,
    /// `torch.int8`, `I8`.
    I8,
    /// `torch.float8_e5m2`, `F8_E5M2`.
    F8E5M2,
    /// `torch.float8_e4m3fn`, `F8_E4M3`.
    F8E4M3,
    /// `torch.int16`, `I16`.
    I16,
    /// `torch.uint16`, `U16`.
    U16,
    /// `torch.float16`, `F16`.
    F16,
    /// `torch.bfloat16`, `BF16`.
    BF16,
    /// `torch.int32`, `I32`.
    I32,
    /// `torch.uint32`, `U32`.
    U32,
    /// `torch.float32`, `F32`.
    F32,
    /// `torch.float64`, `F64`.
    F64,
    /// `torch.int64`, `I64`.
    I64,
    /// `torch.uint64`, `U64`.
    U64,
}

/// Every dtype, in safetensors' enum order (used to order tensors in a header).
pub const ALL_DTYPES: [DType; 15] = [
    DType::Bool,
    DType::U8,
    DType::I8,
    DType::F8E5M2,
    DType::F8E4M3,
    DType::I16,
    DType::U16,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::U32,
    DType::F32,
    DType::F64,
    DType::I64,
    DType::U64,
];

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E5M2 | DType::F8E4M3 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether this is a floating-point type (the ones a dtype policy casts).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F8E5M2 | DType::F8E4M3 | DType::F16 | DType::BF16 | DType::F32 | DType::F64
        )
    }

    /// The safetensors header spelling (`F32`, `BF16`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E5M2 => "F8_E5M2",
            DType::F8E4M3 => "F8_E4M3",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
        }
    }

    /// Parses a safetensors dtype string.
    pub fn from_safetensors_name(s: &str) -> Option<DType> {
        ALL_DTYPES.into_iter().find(|d| d.safetensors_name() == s)
    }

    /// torch's name without the `torch.` prefix (`float32`, `bfloat16`, ...), which is
    /// also what `config.json` writes under `dtype`/`torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::F8E5M2 => "float8_e5m2",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::I16 => "int16",
            DType::U16 => "uint16",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::U64 => "uint64",
        }
    }

    /// Parses a torch dtype name (`float32`, `float`, `half`, `torch.bfloat16`, ...).
    pub fn from_torch_name(s: &str) -> Option<DType> {
        let s = s.strip_prefix("torch.").unwrap_or(s);
        Some(match s {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "int8" => DType::I8,
            "float8_e5m2" => DType::F8E5M2,
            "float8_e4m3fn" => DType::F8E4M3,
            "int16" | "short" => DType::I16,
            "uint16" => DType::U16,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "int32" | "int" => DType::I32,
            "uint32" => DType::U32,
            "float32" | "float" => DType::F32,
            "float64" | "double" => DType::F64,
            "int64" | "long" => DType::I64,
            "uint64" => DType::U64,
            _ => return None,
        })
    }

    /// The dtype of a legacy typed storage class (`FloatStorage`, `HalfStorage`, ...).
    pub fn from_storage_class(name: &str) -> Option<DType> {
        Some(match name {
            "DoubleStorage" => DType::F64,
            "FloatStorage" => DType::F32,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}

/// What a conversion saw, for the report and the overflow policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConvertStats {
    /// NaN values in the input.
    pub nan: u64,
    /// ±inf values in the input.
    pub inf: u64,
    /// Finite input values that became ±inf in the output.
    pub overflow: u64,
}

impl ConvertStats {
    /// Adds another range's counts to these.
    pub fn add(&mut self, other: ConvertStats) {
        self.nan += other.nan;
        self.inf += other.inf;
        self.overflow += other.overflow;
    }
}

/// Rounds an f32 to bfloat16 bits exactly as torch's vectorised CPU kernel does.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        0xffff
    } else {
        let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
        (rounded >> 16) as u16
    }
}

/// Rounds an f32 to float16 bits (IEEE round-to-nearest-even, as F16C does).
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

fn f8e4m3_to_f32(b: u8) -> f32 {
    // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no inf, 0x7f/0xff = NaN.
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

fn f8e5m2_to_f32(b: u8) -> f32 {
    // float8_e5m2 is the top byte of an IEEE float16.
    half::f16::from_bits((b as u16) << 8).to_f32()
}

/// Reads element `i` of a little-endian buffer as f32 (exact for every float dtype
/// but f64, which rounds to nearest even like torch's first step of a double cast).
#[inline(always)]
fn load_f32(src: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(le4(src, i)),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes(le2(src, i))).to_f32(),
        DType::BF16 => f32::from_bits((u16::from_le_bytes(le2(src, i)) as u32) << 16),
        DType::F64 => f64::from_le_bytes(le8(src, i)) as f32,
        DType::F8E4M3 => f8e4m3_to_f32(src[i]),
        DType::F8E5M2 => f8e5m2_to_f32(src[i]),
        _ => 0.0,
    }
}

#[inline(always)]
fn le2(src: &[u8], i: usize) -> [u8; 2] {
    [src[2 * i], src[2 * i + 1]]
}
#[inline(always)]
fn le4(src: &[u8], i: usize) -> [u8; 4] {
    let s = &src[4 * i..4 * i + 4];
    [s[0], s[1], s[2], s[3]]
}
#[inline(always)]
fn le8(src: &[u8], i: usize) -> [u8; 8] {
    let s = &src[8 * i..8 * i + 8];
    [s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]
}

/// Whether [`convert`] supports this pair. Floats convert to floats; anything else
/// must keep its dtype (a dtype policy never casts integer or bool buffers).
pub fn can_convert(from: DType, to: DType) -> bool {
    from == to || (from.is_float() && to.is_float() && !matches!(to, DType::F8E4M3 | DType::F8E5M2))
}

/// Converts `n` elements from `src` (dtype `from`, little-endian) into `dst` (dtype
/// `to`, little-endian). `src` must hold `n * from.size()` bytes and `dst`
/// `n * to.size()`. Returns what was seen (NaN/inf in the input, overflows).
pub fn convert(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> ConvertStats {
    let n = dst.len() / to.size();
    debug_assert_eq!(src.len(), n * from.size());
    if from == to {
        dst.copy_from_slice(&src[..dst.len()]);
        return if from.is_float() {
            scan(src, from)
        } else {
            ConvertStats::default()
        };
    }
    match (from, to) {
        (DType::F32, DType::BF16) => kernels::f32_to_bf16(src, dst),
        (DType::F32, DType::F16) => kernels::f32_to_f16(src, dst),
        (DType::BF16, DType::F32) => kernels::bf16_to_f32(src, dst),
        (DType::F16, DType::F32) => kernels::f16_to_f32(src, dst),
        (_, DType::F64) => {
            let mut stats = ConvertStats::default();
            for i in 0..n {
                let v = load_f32(src, from, i) as f64;
                count(&mut stats, v.is_nan(), v.is_infinite(), false);
                dst[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
            }
            stats
        }
        _ => {
            let mut stats = ConvertStats::default();
            let src_inf = |i: usize| -> (bool, bool) {
                if from == DType::F64 {
                    let v = f64::from_le_bytes(le8(src, i));
                    (v.is_nan(), v.is_infinite())
                } else {
                    let v = load_f32(src, from, i);
                    (v.is_nan(), v.is_infinite())
                }
            };
            for i in 0..n {
                let v = load_f32(src, from, i);
                let (was_nan, was_inf) = src_inf(i);
                let bits: u32 = match to {
                    DType::F32 => v.to_bits(),
                    DType::F16 => f32_to_f16_bits(v) as u32,
                    DType::BF16 => f32_to_bf16_bits(v) as u32,
                    _ => 0,
                };
                let out_inf = match to {
                    DType::F32 => v.is_infinite(),
                    _ => (bits & 0x7fff) == if to == DType::F16 { 0x7c00 } else { 0x7f80 },
                };
                count(
                    &mut stats,
                    was_nan,
                    was_inf,
                    out_inf && !was_inf && !was_nan,
                );
                match to {
                    DType::F32 => dst[4 * i..4 * i + 4].copy_from_slice(&bits.to_le_bytes()),
                    _ => dst[2 * i..2 * i + 2].copy_from_slice(&(bits as u16).to_le_bytes()),
                }
            }
            stats
        }
    }
}

#[inline(always)]
fn count(stats: &mut ConvertStats, nan: bool, inf: bool, overflow: bool) {
    stats.nan += nan as u64;
    stats.inf += inf as u64;
    stats.overflow += overflow as u64;
}

/// Counts NaN and inf in a float buffer.
pub fn scan(src: &[u8], dtype: DType) -> ConvertStats {
    match dtype {
        DType::F32 => kernels::scan_f32(src),
        DType::BF16 => kernels::scan_16(src, 0x7f80),
        DType::F16 => kernels::scan_16(src, 0x7c00),
        DType::F64 => {
            let mut stats = ConvertStats::default();
            for c in src.chunks_exact(8) {
                let v = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                stats.nan += v.is_nan() as u64;
                stats.inf += v.is_infinite() as u64;
            }
            stats
        }
        DType::F8E4M3 => ConvertStats {
            nan: src.iter().filter(|b| (**b & 0x7f) == 0x7f).count() as u64,
            ..ConvertStats::default()
        },
        DType::F8E5M2 => {
            let mut stats = ConvertStats::default();
            for b in src {
                let e = *b & 0x7f;
                stats.nan += (e > 0x7c) as u64;
                stats.inf += (e == 0x7c) as u64;
            }
            stats
        }
        _ => ConvertStats::default(),
    }
}

/// Reverses the bytes of every element in place (big-endian storage to little-endian).
pub fn byteswap(buf: &mut [u8], elem_size: usize) {
    if elem_size > 1 {
        for c in buf.chunks_exact_mut(elem_size) {
            c.reverse();
        }
    }
}

pub mod fuse;
mod kernels;

#[cfg(test)]
mod tests;

/// A dtype serializes as its safetensors name (`BF16`), as reports show it.
impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.safetensors_name())
    }
}

#[cfg(test)]
mod reference_tests;
