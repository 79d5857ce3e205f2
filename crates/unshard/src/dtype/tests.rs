//! Conversions bit for bit against values torch gives.

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

/// Test vectors: what `torch.tensor([x]).to(dtype)` gave with torch 2.15 on x86-64
/// for float32 inputs at the rounding, subnormal and overflow edges.
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

/// Widening bf16/f16 to f32 (how computed tensors read their inputs): every
/// variant gives the scalar path's bits, NaN payloads included, and its counts.
#[test]
fn widening_kernels_are_bit_identical_to_the_scalar_path() {
    for (round, n) in [0usize, 1, 15, 16, 17, 255, 256, 257, 1000, 65_537]
        .into_iter()
        .enumerate()
    {
        // Every 16-bit pattern class: random halves of tricky f32s, plus all NaN/inf edges.
        let mut src: Vec<u8> = tricky_f32s(n, 0x85eb_ca6b ^ round as u32)
            .chunks_exact(4)
            .flat_map(|c| [c[2], c[3]])
            .collect();
        for (i, e) in [
            0x7f80u16, 0xff80, 0x7fc1, 0x7c00, 0xfc00, 0x7c01, 0x0001, 0x8000,
        ]
        .iter()
        .enumerate()
        {
            if 2 * i + 1 < src.len() {
                src[2 * i..2 * i + 2].copy_from_slice(&e.to_le_bytes());
            }
        }
        for from in [DType::BF16, DType::F16] {
            let mut want = vec![0u8; 2 * src.len()];
            let mut want_stats = ConvertStats::default();
            for i in 0..n {
                let v = load_f32(&src, from, i);
                count(&mut want_stats, v.is_nan(), v.is_infinite(), false);
                want[4 * i..4 * i + 4].copy_from_slice(&v.to_bits().to_le_bytes());
            }
            let mut got = vec![0u8; 2 * src.len()];
            let stats = convert(&src, from, &mut got, DType::F32);
            assert_eq!(got, want, "{from} -> F32, {n} elements");
            assert_eq!(stats, want_stats, "{from} -> F32 counts, {n} elements");
            if from == DType::BF16 {
                for (name, kernel) in kernels::bf16_to_f32_variants() {
                    let mut got = vec![0u8; 2 * src.len()];
                    assert_eq!(kernel(&src, &mut got), want_stats, "{name}");
                    assert_eq!(got, want, "{name} kernel, {n} elements");
                }
            }
        }
    }
}
