//! The conversion kernels and the scalar path against `verify::convert`, which
//! converts by definition with no code in common with them, and that reference
//! against the `half` crate (a third implementation) for every non-NaN value.
//!
//! The default run takes a strided sample of the 2^32 float32 inputs plus every
//! input where rounding decides something: every tie of both formats with its two
//! neighbours, the overflow thresholds, the subnormal boundaries, zeros, infinities
//! and NaNs. The full 2^32 run is `--ignored` (minutes in release).

use super::{f32_to_bf16_bits, f32_to_f16_bits, kernels, ConvertStats};
use crate::verify::convert as reference;

/// Every float32 whose rounding to bfloat16 or float16 is a tie, with the values
/// just below and above it, both signs.
fn ties() -> Vec<u32> {
    let mut out = Vec::new();
    let mut push = |u: u32| {
        for v in [u.wrapping_sub(1), u, u.wrapping_add(1)] {
            out.push(v & 0x7fff_ffff);
            out.push(v | 0x8000_0000);
        }
    };
    // bfloat16 keeps the top 16 bits at every exponent (its subnormals are
    // float32's): the ties are the patterns with low half 0x8000.
    for hi in 0..1u32 << 15 {
        push(hi << 16 | 0x8000);
    }
    // float16: for a float32 exponent field `e`, the kept bits end at mantissa bit
    // `k` (13 for float16 normals, more below 2^-14); a tie has bit k-1 set and
    // the bits under it clear. Exponents from 2^-25 (ties with zero) to 2^15.
    for e in 102u32..=142 {
        let k = 13 + (113u32.saturating_sub(e));
        for upper in 0..1u32 << (23u32.saturating_sub(k)) {
            let man = if k >= 23 {
                0
            } else {
                upper << k | 1 << (k - 1)
            };
            push(e << 23 | man);
        }
    }
    out
}

/// Boundaries: zeros, the smallest subnormals, the smallest normals of float16,
/// the largest finite values and what overflows, infinities, NaNs; each with a few
/// neighbours.
fn boundaries() -> Vec<u32> {
    let centres = [
        0x0000_0000u32, // 0
        0x0000_0001,    // smallest float32 subnormal
        0x0080_0000,    // smallest float32 normal
        0x3300_0000,    // 2^-25: float16 tie with 0
        0x3380_0000,    // 2^-24: smallest float16 subnormal
        0x387f_c000,    // largest float16 subnormal
        0x3880_0000,    // 2^-14: smallest float16 normal
        0x3f80_0000,    // 1
        0x477f_e000,    // 65504: largest float16
        0x477f_f000,    // 65520: float16 overflow threshold
        0x4780_0000,    // 65536
        0x7f7f_0000,    // largest bfloat16
        0x7f7f_8000,    // bfloat16 overflow threshold
        0x7f7f_ffff,    // largest float32
        0x7f80_0000,    // inf
        0x7f80_0001,    // smallest signalling NaN
        0x7fc0_0000,    // quiet NaN
        0x7fff_ffff,    // largest NaN
    ];
    let mut out = Vec::new();
    for c in centres {
        for d in 0..=4u32 {
            for v in [c.wrapping_sub(d), c.wrapping_add(d)] {
                out.push(v & 0x7fff_ffff);
                out.push(v | 0x8000_0000);
            }
        }
    }
    out
}

/// What the kernels must count for `u`: NaN and inf in, finite values that became
/// inf out (`inf` is the format's infinity without its sign).
fn expected_counts(bits: &[u32], out: &[u16], inf: u16) -> ConvertStats {
    let mut s = ConvertStats::default();
    for (&u, &o) in bits.iter().zip(out) {
        let abs = u & 0x7fff_ffff;
        s.nan += (abs > 0x7f80_0000) as u64;
        s.inf += (abs == 0x7f80_0000) as u64;
        s.overflow += (abs < 0x7f80_0000 && o & 0x7fff == inf) as u64;
    }
    s
}

/// One target format: its kernels, exact loop, reference and scalar rounding.
struct Format {
    what: &'static str,
    variants: Vec<(&'static str, kernels::Kernel)>,
    exact: kernels::Kernel,
    reference: fn(f32) -> u16,
    scalar: fn(f32) -> u16,
    inf: u16,
}

/// Runs every kernel variant, the exact loop and the scalar functions on `bits`
/// and compares each with the reference, bits and counts.
fn check(bits: &[u32]) {
    let src: Vec<u8> = bits.iter().flat_map(|u| u.to_le_bytes()).collect();
    let formats = [
        Format {
            what: "bf16",
            variants: kernels::f32_to_bf16_variants(),
            exact: kernels::f32_to_bf16_exact,
            reference: reference::f32_to_bf16,
            scalar: f32_to_bf16_bits,
            inf: 0x7f80,
        },
        Format {
            what: "f16",
            variants: kernels::f32_to_f16_variants(),
            exact: kernels::f32_to_f16_exact,
            reference: reference::f32_to_f16,
            scalar: f32_to_f16_bits,
            inf: 0x7c00,
        },
    ];
    for f in formats {
        let Format {
            what,
            mut variants,
            exact,
            reference,
            scalar,
            inf,
        } = f;
        let want: Vec<u16> = bits.iter().map(|&u| reference(f32::from_bits(u))).collect();
        let want_counts = expected_counts(bits, &want, inf);
        for (i, &u) in bits.iter().enumerate() {
            let got = scalar(f32::from_bits(u));
            assert_eq!(
                got, want[i],
                "{what} scalar path on {u:#010x}: {got:#06x}, reference {:#06x}",
                want[i]
            );
        }
        variants.push(("exact", exact));
        let mut out = vec![0u8; 2 * bits.len()];
        for (name, kernel) in variants {
            let counts = kernel(&src, &mut out);
            for (i, d) in out.chunks_exact(2).enumerate() {
                let got = u16::from_le_bytes([d[0], d[1]]);
                assert_eq!(
                    got, want[i],
                    "{what} {name} kernel on {:#010x}: {got:#06x}, reference {:#06x}",
                    bits[i], want[i]
                );
            }
            assert_eq!(counts, want_counts, "{what} {name} kernel counts");
        }
    }
}

/// A stride that is odd and not a power of two, so the sample visits every
/// low-bit pattern over the run.
const STRIDE: u64 = 4099;

#[test]
fn kernels_match_the_reference_on_a_sample_and_every_tie() {
    let ties = ties();
    // 2^15 bfloat16 tie patterns and the float16 ties of 41 exponents, 6 each.
    assert!(ties.len() > 6 * (1 << 15) + 6 * 30 * 1024, "{}", ties.len());
    check(&ties);
    check(&boundaries());
    let sample: Vec<u32> = (0..1u64 << 32)
        .step_by(STRIDE as usize)
        .map(|u| u as u32)
        .collect();
    assert_eq!(sample.len(), (1usize << 32).div_ceil(STRIDE as usize));
    for chunk in sample.chunks(1 << 16) {
        check(chunk);
    }
}

#[test]
fn the_reference_agrees_with_the_half_crate_off_nan() {
    let inputs = ties()
        .into_iter()
        .chain(boundaries())
        .chain((0..1u64 << 32).step_by(STRIDE as usize).map(|u| u as u32));
    let mut n = 0;
    for u in inputs {
        let x = f32::from_bits(u);
        if x.is_nan() {
            continue;
        }
        assert_eq!(
            reference::f32_to_bf16(x),
            half::bf16::from_f32(x).to_bits(),
            "{u:#010x}"
        );
        assert_eq!(
            reference::f32_to_f16(x),
            half::f16::from_f32(x).to_bits(),
            "{u:#010x}"
        );
        n += 1;
    }
    assert!(n > 1_000_000, "{n}");
}

/// Every one of the 2^32 float32 inputs. Minutes in release:
/// `cargo test --release -p unshard --lib -- --ignored exhaustive`.
#[test]
#[ignore = "2^32 inputs: run with --release --ignored (the default run samples them)"]
fn exhaustive_kernels_match_the_reference() {
    const CHUNK: u64 = 1 << 20;
    for start in (0..1u64 << 32).step_by(CHUNK as usize) {
        let bits: Vec<u32> = (start..start + CHUNK).map(|u| u as u32).collect();
        check(&bits);
    }
}
