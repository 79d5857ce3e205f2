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
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
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
    let mut stats = ConvertStats::default();
    match dtype {
        DType::F32 => {
            for c in src.chunks_exact(4) {
                let e = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7fff_ffff;
                stats.nan += (e > 0x7f80_0000) as u64;
                stats.inf += (e == 0x7f80_0000) as u64;
            }
        }
        DType::BF16 | DType::F16 => {
            let inf = if dtype == DType::F16 { 0x7c00 } else { 0x7f80 };
            for c in src.chunks_exact(2) {
                let e = u16::from_le_bytes([c[0], c[1]]) & 0x7fff;
                stats.nan += (e > inf) as u64;
                stats.inf += (e == inf) as u64;
            }
        }
        DType::F64 => {
            for c in src.chunks_exact(8) {
                let v = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                stats.nan += v.is_nan() as u64;
                stats.inf += v.is_infinite() as u64;
            }
        }
        DType::F8E4M3 => stats.nan += src.iter().filter(|b| (**b & 0x7f) == 0x7f).count() as u64,
        DType::F8E5M2 => {
            for b in src {
                let e = *b & 0x7f;
                stats.nan += (e > 0x7c) as u64;
                stats.inf += (e == 0x7c) as u64;
            }
        }
        _ => {}
    }
    stats
}

/// Reverses the bytes of every element in place (big-endian storage to little-endian).
pub fn byteswap(buf: &mut [u8], elem_size: usize) {
    if elem_size > 1 {
        for c in buf.chunks_exact_mut(elem_size) {
            c.reverse();
        }
    }
}

/// The hot conversion loops, compiled for the best instruction set the CPU has.
mod kernels {
    use super::ConvertStats;

    /// f32 -> bf16 with NaN/inf/overflow counts. Written branch-free so it vectorises.
    #[inline(always)]
    fn f32_to_bf16_body(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        let mut nan = 0u64;
        let mut inf = 0u64;
        let mut overflow = 0u64;
        for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
            let u = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            let abs = u & 0x7fff_ffff;
            let is_nan = abs > 0x7f80_0000;
            let rounded = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
            let out = if is_nan { 0xffff } else { rounded };
            nan += is_nan as u64;
            inf += (abs == 0x7f80_0000) as u64;
            overflow += ((abs < 0x7f80_0000) & ((out & 0x7fff) == 0x7f80)) as u64;
            d.copy_from_slice(&out.to_le_bytes());
        }
        ConvertStats { nan, inf, overflow }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn f32_to_bf16_avx2(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        f32_to_bf16_body(src, dst)
    }

    pub fn f32_to_bf16(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { f32_to_bf16_avx2(src, dst) };
        }
        f32_to_bf16_body(src, dst)
    }

    /// f32 -> f16 through `half`'s slice conversion (F16C when the CPU has it).
    pub fn f32_to_f16(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        use half::slice::HalfFloatSliceExt;
        const BLOCK: usize = 4096;
        let mut stats = ConvertStats::default();
        let mut fin = [0f32; BLOCK];
        let mut hout = [half::f16::ZERO; BLOCK];
        for (s, d) in src.chunks(BLOCK * 4).zip(dst.chunks_mut(BLOCK * 2)) {
            let n = s.len() / 4;
            for (i, c) in s.chunks_exact(4).enumerate() {
                fin[i] = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            hout[..n].convert_from_f32_slice(&fin[..n]);
            for i in 0..n {
                let abs_in = fin[i].to_bits() & 0x7fff_ffff;
                let out = hout[i].to_bits();
                stats.nan += (abs_in > 0x7f80_0000) as u64;
                stats.inf += (abs_in == 0x7f80_0000) as u64;
                stats.overflow += ((abs_in < 0x7f80_0000) & ((out & 0x7fff) == 0x7c00)) as u64;
                d[2 * i..2 * i + 2].copy_from_slice(&out.to_le_bytes());
            }
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(bits: u32, to: DType) -> u16 {
        let mut out = [0u8; 2];
        convert(
            &f32::from_bits(bits).to_le_bytes(),
            DType::F32,
            &mut out,
            to,
        );
        u16::from_le_bytes(out)
    }

    /// The test vectors torch 2.15 produced on x86-64 (formats.md §5.4).
    #[test]
    fn matches_torch_rounding_vectors() {
        let cases: &[(u32, u16, u16)] = &[
            (0x3F80_1000, 0x3C00, 0x3F80),
            (0x3F80_3000, 0x3C02, 0x3F80),
            (0x3F81_8000, 0x3C0C, 0x3F82),
            (0x477F_EFFF, 0x7BFF, 0x4780),
            (0x477F_F000, 0x7C00, 0x4780),
            (0x7F7F_FFFF, 0x7C00, 0x7F80),
            (0x3380_0000, 0x0001, 0x3380),
            (0x3300_0000, 0x0000, 0x3300),
            (0x3300_0001, 0x0001, 0x3300),
            (0x0000_0001, 0x0000, 0x0000),
            (0x8000_0000, 0x8000, 0x8000),
            (0x7FC0_0000, 0x7E00, 0xFFFF),
            (0xFFC0_0000, 0xFE00, 0xFFFF),
            (0x7FA1_2345, 0x7F09, 0xFFFF),
        ];
        for &(bits, f16, bf16) in cases {
            assert_eq!(one(bits, DType::F16), f16, "f16 of {bits:#x}");
            assert_eq!(one(bits, DType::BF16), bf16, "bf16 of {bits:#x}");
        }
    }

    #[test]
    fn counts_overflow_but_not_existing_inf() {
        let vals = [1e6f32, f32::INFINITY, 1.0, f32::NAN];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut dst = vec![0u8; 8];
        let s = convert(&src, DType::F32, &mut dst, DType::F16);
        assert_eq!(
            s,
            ConvertStats {
                nan: 1,
                inf: 1,
                overflow: 1
            }
        );
        let s = convert(&src, DType::F32, &mut dst, DType::BF16);
        assert_eq!(
            s,
            ConvertStats {
                nan: 1,
                inf: 1,
                overflow: 0
            }
        );
    }

    #[test]
    fn f64_rounds_twice_through_f32_like_torch() {
        let v = 1.0f64 + 2f64.powi(-11) + 2f64.powi(-40);
        let mut out = [0u8; 2];
        convert(&v.to_le_bytes(), DType::F64, &mut out, DType::F16);
        assert_eq!(u16::from_le_bytes(out), 0x3C00);
    }

    #[test]
    fn scalar_and_vector_bf16_paths_agree() {
        let mut x = 0x1234_5678u32;
        let src: Vec<u8> = (0..10_000)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x.to_le_bytes()
            })
            .collect();
        let mut dst = vec![0u8; src.len() / 2];
        convert(&src, DType::F32, &mut dst, DType::BF16);
        for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact(2)) {
            let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            assert_eq!(u16::from_le_bytes([d[0], d[1]]), f32_to_bf16_bits(v));
        }
    }

    #[test]
    fn float8_decodes() {
        assert_eq!(f8e4m3_to_f32(0x38), 1.0);
        assert_eq!(f8e4m3_to_f32(0x7e), 448.0);
        assert!(f8e4m3_to_f32(0x7f).is_nan());
        assert_eq!(f8e5m2_to_f32(0x3c), 1.0);
        assert_eq!(f8e5m2_to_f32(0x7b), 57344.0);
    }
}
