//! The hot loops: float32 to bfloat16/float16, back (the widening that computed
//! tensors read their inputs with), and the NaN/inf scan of a copy.
//!
//! Each has one portable body that the compiler vectorises: a block of [`LANES`]
//! elements is converted with plain integer arithmetic while an OR-reduction notes
//! whether it holds a value that needs care (NaN, inf, or a finite value that rounds
//! to inf). Such values are rare in weights, so only a block that holds one is redone
//! by the exact element-by-element loop, which also counts them. The output bits of
//! the fast path equal the exact loop's for every input it keeps (the exact loop only
//! differs on NaN), so every variant is bit-identical to the scalar reference; the
//! tests check each variant the CPU supports on random and edge-case bit patterns.
//!
//! On x86-64 each body is compiled for AVX-512, for AVX2 and for the baseline
//! (SSE2), and the best the CPU has is picked at run time. On aarch64 NEON is part
//! of the baseline, so the portable body is the NEON kernel. The exact loops use the
//! scalar rounding functions above (`half`, with F16C when present, for float16).

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
fn f32_to_16_exact(src: &[u8], dst: &mut [u8], round: fn(f32) -> u16, inf: u16) -> ConvertStats {
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
variants!(bf16_to_f32_variants, bf16_to_f32_body);

/// bf16 -> f32: exact (the bits moved up a half-word, NaN payloads kept), with the
/// input's NaN/inf counts: blocks of [`LANES`] are widened while an OR-reduction
/// notes an all-ones exponent, and only such a block is counted element by element.
#[inline(always)]
fn bf16_to_f32_body(src: &[u8], dst: &mut [u8]) -> ConvertStats {
    let mut stats = ConvertStats::default();
    let mut src_blocks = src.chunks_exact(2 * LANES);
    let mut dst_blocks = dst.chunks_exact_mut(4 * LANES);
    for (s, d) in (&mut src_blocks).zip(&mut dst_blocks) {
        // Fixed-size views: no bounds checks, so the three loops vectorise.
        let (Ok(s), Ok(d)) = (
            <&[u8; 2 * LANES]>::try_from(s),
            <&mut [u8; 4 * LANES]>::try_from(d),
        ) else {
            continue;
        };
        let mut u = [0u16; LANES];
        for i in 0..LANES {
            u[i] = u16::from_le_bytes([s[2 * i], s[2 * i + 1]]);
        }
        let mut care = false;
        for x in u {
            care |= (x & 0x7f80) == 0x7f80;
        }
        for i in 0..LANES {
            d[4 * i..4 * i + 4].copy_from_slice(&((u[i] as u32) << 16).to_le_bytes());
        }
        if care {
            stats.add(scan_16(s, 0x7f80));
        }
    }
    let (s, d) = (src_blocks.remainder(), dst_blocks.into_remainder());
    for (s, d) in s.chunks_exact(2).zip(d.chunks_exact_mut(4)) {
        d.copy_from_slice(&[0, 0, s[0], s[1]]);
    }
    stats.add(scan_16(s, 0x7f80));
    stats
}

pub fn bf16_to_f32(src: &[u8], dst: &mut [u8]) -> ConvertStats {
    static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
    BEST.get_or_init(|| bf16_to_f32_variants()[0].1)(src, dst)
}

/// f16 -> f32 through `half`'s slice conversion (F16C where the CPU has it, the
/// same instructions `half`'s scalar conversion picks, so the bits are the scalar
/// path's), a stack buffer at a time; with the input's NaN/inf counts.
pub fn f16_to_f32(src: &[u8], dst: &mut [u8]) -> ConvertStats {
    use half::slice::HalfFloatSliceExt;
    const N: usize = 256;
    let mut h = [half::f16::ZERO; N];
    let mut f = [0f32; N];
    for (s, d) in src.chunks(2 * N).zip(dst.chunks_mut(4 * N)) {
        let n = s.len() / 2;
        for (x, c) in h[..n].iter_mut().zip(s.chunks_exact(2)) {
            *x = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
        }
        h[..n].convert_to_f32_slice(&mut f[..n]);
        for (v, c) in f[..n].iter().zip(d.chunks_exact_mut(4)) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    }
    scan_16(src, 0x7c00)
}

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
