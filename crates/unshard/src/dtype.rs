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

/// The hot loops: float32 to bfloat16/float16 and the NaN/inf scan of a copy.
///
/// Each has one portable body that the compiler vectorises: a block of [`LANES`]
/// elements is converted with plain integer arithmetic while an OR-reduction notes
/// whether it holds a value that needs care (NaN, inf, or a finite value that rounds
/// to inf). Such values are rare in weights, so only a block that holds one is redone
/// by the exact element-by-element loop, which also counts them. The output bits of
/// the fast path equal the exact loop's for every input it keeps (the exact loop only
/// differs on NaN), so every variant is bit-identical to the scalar reference; the
/// tests check each variant the CPU supports on random and edge-case bit patterns.
///
/// On x86-64 each body is compiled for AVX-512, for AVX2 and for the baseline
/// (SSE2), and the best the CPU has is picked at run time. On aarch64 NEON is part
/// of the baseline, so the portable body is the NEON kernel. The exact loops use the
/// scalar rounding functions above (`half`, with F16C when present, for float16).
mod kernels {
    use super::ConvertStats;

    /// Elements per block of the fast path: one AVX-512 vector of f32.
    const LANES: usize = 16;

    /// |f32 bits| at or above this become bf16 inf or NaN (0x7f7f8000 rounds up to
    /// 0x7f80), or are inf/NaN already.
    const BF16_CARE: u32 = 0x7f7f_8000;

    /// |f32 bits| at or above this become f16 inf or NaN: 65520 is halfway between
    /// 65504 (the largest float16) and 65536, and ties round to the even inf.
    const F16_CARE: u32 = 0x477f_f000;

    #[inline(always)]
    fn le_u32(s: &[u8], i: usize) -> u32 {
        u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]])
    }

    /// The scalar reference for f32 -> a 16-bit float: `round` per element, with the
    /// NaN/inf/overflow counts (`inf` is the output's infinity with the sign cleared).
    #[inline(always)]
    fn f32_to_16_exact(
        src: &[u8],
        dst: &mut [u8],
        round: fn(f32) -> u16,
        inf: u16,
    ) -> ConvertStats {
        let mut stats = ConvertStats::default();
        for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
            let u = le_u32(s, 0);
            let abs = u & 0x7fff_ffff;
            let out = round(f32::from_bits(u));
            stats.nan += (abs > 0x7f80_0000) as u64;
            stats.inf += (abs == 0x7f80_0000) as u64;
            stats.overflow += ((abs < 0x7f80_0000) & ((out & 0x7fff) == inf)) as u64;
            d.copy_from_slice(&out.to_le_bytes());
        }
        stats
    }

    /// The scalar reference for f32 -> bf16: exact bits and counts, element by element.
    #[inline(always)]
    pub(crate) fn f32_to_bf16_exact(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        f32_to_16_exact(src, dst, super::f32_to_bf16_bits, 0x7f80)
    }

    /// f32 -> bf16, blocks of [`LANES`]; see the module documentation.
    #[inline(always)]
    fn f32_to_bf16_body(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        let mut stats = ConvertStats::default();
        let mut src_blocks = src.chunks_exact(4 * LANES);
        let mut dst_blocks = dst.chunks_exact_mut(2 * LANES);
        for (s, d) in (&mut src_blocks).zip(&mut dst_blocks) {
            let mut care = false;
            for i in 0..LANES {
                let u = le_u32(s, i);
                care |= (u & 0x7fff_ffff) >= BF16_CARE;
                // Round to nearest even: add 0x7fff plus the lowest kept bit.
                let out = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
                let b = out.to_le_bytes();
                d[2 * i] = b[0];
                d[2 * i + 1] = b[1];
            }
            if care {
                stats.add(f32_to_bf16_exact(s, d));
            }
        }
        stats.add(f32_to_bf16_exact(
            src_blocks.remainder(),
            dst_blocks.into_remainder(),
        ));
        stats
    }

    /// A kernel compiled for one instruction set.
    pub(crate) type Kernel = fn(&[u8], &mut [u8]) -> ConvertStats;

    /// Compiles a portable body once per instruction set and lists the variants
    /// this CPU can run, best first.
    macro_rules! variants {
        ($variants:ident, $body:ident) => {
            pub(crate) fn $variants() -> Vec<(&'static str, Kernel)> {
                #[cfg(target_arch = "x86_64")]
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn avx512(src: &[u8], dst: &mut [u8]) -> ConvertStats {
                    $body(src, dst)
                }
                #[cfg(target_arch = "x86_64")]
                #[target_feature(enable = "avx2")]
                unsafe fn avx2(src: &[u8], dst: &mut [u8]) -> ConvertStats {
                    $body(src, dst)
                }
                fn portable(src: &[u8], dst: &mut [u8]) -> ConvertStats {
                    $body(src, dst)
                }
                let mut v: Vec<(&'static str, Kernel)> = Vec::new();
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("avx512bw")
                        && std::arch::is_x86_feature_detected!("avx512vl")
                    {
                        // SAFETY: the CPU supports AVX-512 F/BW/VL, checked just above.
                        v.push(("avx512", |s, d| unsafe { avx512(s, d) }));
                    }
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU supports AVX2, checked just above.
                        v.push(("avx2", |s, d| unsafe { avx2(s, d) }));
                    }
                }
                v.push(("portable", portable));
                v
            }
        };
    }

    variants!(f32_to_bf16_variants, f32_to_bf16_body);
    variants!(f32_to_f16_variants, f32_to_f16_body);

    pub fn f32_to_bf16(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        BEST.get_or_init(|| f32_to_bf16_variants()[0].1)(src, dst)
    }

    pub fn f32_to_f16(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        BEST.get_or_init(|| f32_to_f16_variants()[0].1)(src, dst)
    }

    /// The scalar reference for f32 -> f16: `half` per element (F16C when present).
    #[inline(always)]
    pub(crate) fn f32_to_f16_exact(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        f32_to_16_exact(src, dst, super::f32_to_f16_bits, 0x7c00)
    }

    /// Rounds a finite f32 of magnitude below 65520 to float16 bits, to nearest even,
    /// subnormals included, with arithmetic that vectorises. The float addition does
    /// the rounding: `magic` is 2^(e+15) for the f16 exponent e of `x` (at least -14,
    /// the subnormal range), so the sum's last mantissa bit is worth one f16 ulp of
    /// `4|x|` and its low 12 bits hold the rounded f16 significand, implicit bit
    /// included; its exponent bits, taken modulo 32, are then e + 14, and adding the
    /// significand carries the implicit bit into the exponent field.
    #[inline(always)]
    fn f32_to_f16_finite(u: u32) -> u16 {
        let abs = u & 0x7fff_ffff;
        let exponent = (abs >> 23).max(113);
        let magic = f32::from_bits((exponent + 15) << 23);
        let sum = (f32::from_bits(abs) * 4.0 + magic).to_bits();
        let sign = (u >> 16) & 0x8000;
        (sign | (((sum >> 13) & 0x7c00) + (sum & 0x0fff))) as u16
    }

    /// f32 -> f16, blocks of [`LANES`]; see the module documentation.
    #[inline(always)]
    fn f32_to_f16_body(src: &[u8], dst: &mut [u8]) -> ConvertStats {
        let mut stats = ConvertStats::default();
        let mut src_blocks = src.chunks_exact(4 * LANES);
        let mut dst_blocks = dst.chunks_exact_mut(2 * LANES);
        for (s, d) in (&mut src_blocks).zip(&mut dst_blocks) {
            let mut care = false;
            for i in 0..LANES {
                let u = le_u32(s, i);
                care |= (u & 0x7fff_ffff) >= F16_CARE;
                let b = f32_to_f16_finite(u).to_le_bytes();
                d[2 * i] = b[0];
                d[2 * i + 1] = b[1];
            }
            if care {
                stats.add(f32_to_f16_exact(s, d));
            }
        }
        stats.add(f32_to_f16_exact(
            src_blocks.remainder(),
            dst_blocks.into_remainder(),
        ));
        stats
    }

    /// NaN and inf in little-endian f32s.
    pub fn scan_f32(src: &[u8]) -> ConvertStats {
        let exact = |s: &[u8]| {
            let mut stats = ConvertStats::default();
            for i in 0..s.len() / 4 {
                let e = le_u32(s, i) & 0x7fff_ffff;
                stats.nan += (e > 0x7f80_0000) as u64;
                stats.inf += (e == 0x7f80_0000) as u64;
            }
            stats
        };
        let mut stats = ConvertStats::default();
        let mut blocks = src.chunks_exact(4 * LANES);
        for s in &mut blocks {
            let mut care = false;
            for i in 0..LANES {
                care |= (le_u32(s, i) & 0x7fff_ffff) >= 0x7f80_0000;
            }
            if care {
                stats.add(exact(s));
            }
        }
        stats.add(exact(blocks.remainder()));
        stats
    }

    /// NaN and inf in little-endian 16-bit floats whose inf is `inf` (bf16 or f16).
    pub fn scan_16(src: &[u8], inf: u16) -> ConvertStats {
        let exact = |s: &[u8]| {
            let mut stats = ConvertStats::default();
            for c in s.chunks_exact(2) {
                let e = u16::from_le_bytes([c[0], c[1]]) & 0x7fff;
                stats.nan += (e > inf) as u64;
                stats.inf += (e == inf) as u64;
            }
            stats
        };
        let mut stats = ConvertStats::default();
        let mut blocks = src.chunks_exact(4 * LANES);
        for s in &mut blocks {
            let mut care = false;
            for c in s.chunks_exact(2) {
                care |= (u16::from_le_bytes([c[0], c[1]]) & 0x7fff) >= inf;
            }
            if care {
                stats.add(exact(s));
            }
        }
        stats.add(exact(blocks.remainder()));
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

    /// Random f32 bit patterns with the values that need care mixed in: NaNs, infs,
    /// the bf16 and f16 overflow thresholds and their neighbours, subnormals, -0.
    fn tricky_f32s(n: usize, seed: u32) -> Vec<u8> {
        const EDGES: [u32; 16] = [
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_8000,
            0x7f7f_7fff,
            0xff7f_ffff,
            0x477f_f000,
            0x477f_efff,
            0xc77f_f000,
            0x0000_0001,
            0x807f_ffff,
            0x8000_0000,
            0x3f80_8000,
            0x3f81_8000,
        ];
        let mut x = seed | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        (0..n)
            .flat_map(|_| {
                let r = next();
                let bits = match r % 50 {
                    0 => EDGES[(next() % 16) as usize],
                    // Ordinary weights: small normal numbers.
                    1..=30 => (next() & 0x8000_0000) | (0x3a00_0000 + (next() & 0x07ff_ffff)),
                    _ => next(),
                };
                bits.to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn every_bf16_kernel_is_bit_identical_to_the_scalar_path() {
        let variants = kernels::f32_to_bf16_variants();
        assert!(variants.iter().any(|(name, _)| *name == "portable"));
        for (round, n) in [0usize, 1, 15, 16, 17, 31, 33, 100, 1000, 65_537]
            .into_iter()
            .enumerate()
        {
            let src = tricky_f32s(n, 0x9e37_79b9 ^ round as u32);
            let mut want = vec![0u8; 2 * n];
            let want_stats = kernels::f32_to_bf16_exact(&src, &mut want);
            for (s, d) in src.chunks_exact(4).zip(want.chunks_exact(2)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                assert_eq!(u16::from_le_bytes([d[0], d[1]]), f32_to_bf16_bits(v));
            }
            for (name, kernel) in &variants {
                let mut got = vec![0u8; 2 * n];
                let stats = kernel(&src, &mut got);
                assert_eq!(got, want, "{name} kernel, {n} elements");
                assert_eq!(stats, want_stats, "{name} kernel counts, {n} elements");
            }
        }
    }

    #[test]
    fn every_f16_kernel_is_bit_identical_to_the_scalar_path() {
        let variants = kernels::f32_to_f16_variants();
        for (round, n) in [0usize, 1, 16, 17, 100, 65_537].into_iter().enumerate() {
            let src = tricky_f32s(n, 0x85eb_ca6b ^ round as u32);
            let mut want = vec![0u8; 2 * n];
            let want_stats = kernels::f32_to_f16_exact(&src, &mut want);
            for (name, kernel) in &variants {
                let mut got = vec![0u8; 2 * n];
                let stats = kernel(&src, &mut got);
                assert_eq!(got, want, "{name} kernel, {n} elements");
                assert_eq!(stats, want_stats, "{name} kernel counts, {n} elements");
            }
        }
    }

    /// Every one of the 2^32 f32 bit patterns through every kernel variant. Too slow
    /// for the default run; `cargo test --release -p unshard -- --ignored exhaustive`.
    #[test]
    #[ignore]
    fn exhaustive_kernels_match_the_scalar_path() {
        const CHUNK: u64 = 1 << 20;
        let kernels = [
            (
                "bf16",
                kernels::f32_to_bf16_variants(),
                kernels::f32_to_bf16_exact as kernels::Kernel,
            ),
            (
                "f16",
                kernels::f32_to_f16_variants(),
                kernels::f32_to_f16_exact,
            ),
        ];
        let mut src = vec![0u8; 4 * CHUNK as usize];
        let mut want = vec![0u8; 2 * CHUNK as usize];
        let mut got = vec![0u8; 2 * CHUNK as usize];
        for start in (0..1u64 << 32).step_by(CHUNK as usize) {
            for (i, c) in src.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&((start + i as u64) as u32).to_le_bytes());
            }
            for (what, variants, exact) in &kernels {
                let want_stats = exact(&src, &mut want);
                for (name, kernel) in variants {
                    let stats = kernel(&src, &mut got);
                    assert!(
                        got == want && stats == want_stats,
                        "{what} {name} near {start:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn f16_blocks_match_elementwise_rounding_and_counts() {
        for n in [0usize, 7, 1024, 1025, 5000] {
            let src = tricky_f32s(n, 0x51ed_270b ^ n as u32);
            let mut got = vec![0u8; 2 * n];
            let stats = convert(&src, DType::F32, &mut got, DType::F16);
            let mut want_stats = ConvertStats::default();
            for (s, d) in src.chunks_exact(4).zip(got.chunks_exact(2)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                let out = f32_to_f16_bits(v);
                assert_eq!(u16::from_le_bytes([d[0], d[1]]), out, "f16 of {v:e}");
                let abs = v.to_bits() & 0x7fff_ffff;
                count(
                    &mut want_stats,
                    abs > 0x7f80_0000,
                    abs == 0x7f80_0000,
                    abs < 0x7f80_0000 && (out & 0x7fff) == 0x7c00,
                );
            }
            assert_eq!(stats, want_stats, "{n} elements");
        }
    }

    #[test]
    fn scan_counts_like_elementwise_checks() {
        let src = tricky_f32s(3001, 77);
        let mut want = ConvertStats::default();
        for c in src.chunks_exact(4) {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            count(&mut want, v.is_nan(), v.is_infinite(), false);
        }
        assert_eq!(scan(&src, DType::F32), want);
        // 16-bit floats: random bits with both formats' inf and NaN patterns mixed in,
        // 6001 of them (not a whole number of blocks).
        const EDGES: [u16; 8] = [
            0x7f80, 0xff80, 0x7c00, 0xfc00, 0x7fc0, 0x7e00, 0xffff, 0x7c01,
        ];
        let src16: Vec<u8> = src
            .chunks_exact(2)
            .take(6001)
            .enumerate()
            .flat_map(|(i, c)| {
                let r = u16::from_le_bytes([c[0], c[1]]);
                let v = if i % 37 == 0 {
                    EDGES[(r % 8) as usize]
                } else {
                    r
                };
                v.to_le_bytes()
            })
            .collect();
        for (dtype, inf) in [(DType::BF16, 0x7f80u16), (DType::F16, 0x7c00)] {
            let mut want = ConvertStats::default();
            for c in src16.chunks_exact(2) {
                let e = u16::from_le_bytes([c[0], c[1]]) & 0x7fff;
                count(&mut want, e > inf, e == inf, false);
            }
            assert!(
                want.nan > 0 && want.inf > 0,
                "the input exercises both counts"
            );
            assert_eq!(scan(&src16, dtype), want, "{dtype}");
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
