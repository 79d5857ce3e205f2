//! The conversions `verify` expects, computed by definition rather than with the
//! writer's code.
//!
//! A verify that converted with `dtype` (its SIMD kernels or its scalar path) would
//! reproduce any rounding bug there and pass. So this module converts the slow,
//! obvious way: decode each element to its exact value (every float dtype here is
//! exact in f64), scale it by the power of two of the target's spacing at that
//! magnitude, round with `f64::round_ties_even`, and re-encode; past the largest
//! finite value, infinity. Nothing is shared with `dtype` but the [`DType`] names.
//!
//! It follows the policy README.md documents: round to nearest even with gradual
//! underflow; float64 to float16/bfloat16 rounds through float32 (torch's two
//! steps); a NaN becomes bfloat16 `0xFFFF`, or float16 `sign|0x7E00|payload` (the top
//! ten payload bits of a float32 NaN, as F16C writes). Verify compares NaN by class
//! anyway; the kernel tests hold this module to the exact NaN bits too.

use crate::dtype::DType;

/// A binary floating-point format: stored mantissa bits, exponent field bits,
/// bias, and whether the all-ones exponent means inf/NaN (IEEE) or only its
/// all-ones mantissa is NaN (float8_e4m3fn, which has no inf).
#[derive(Clone, Copy)]
struct Format {
    mantissa: u32,
    exponent: u32,
    bias: i32,
    ieee: bool,
}

const F16: Format = Format {
    mantissa: 10,
    exponent: 5,
    bias: 15,
    ieee: true,
};
const BF16: Format = Format {
    mantissa: 7,
    exponent: 8,
    bias: 127,
    ieee: true,
};
const E4M3: Format = Format {
    mantissa: 3,
    exponent: 4,
    bias: 7,
    ieee: false,
};
const E5M2: Format = Format {
    mantissa: 2,
    exponent: 5,
    bias: 15,
    ieee: true,
};

/// 2^e exactly, for the exponents these formats reach (well inside f64's range).
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The exact value of `bits` in format `f` (NaN for its NaNs).
fn decode(bits: u32, f: Format) -> f64 {
    let sign = if bits >> (f.mantissa + f.exponent) & 1 == 1 {
        -1.0
    } else {
        1.0
    };
    let field = (bits >> f.mantissa) & ((1 << f.exponent) - 1);
    let man = bits & ((1 << f.mantissa) - 1);
    let all_ones = (1 << f.exponent) - 1;
    if f.ieee && field == all_ones {
        return if man == 0 {
            sign * f64::INFINITY
        } else {
            f64::NAN
        };
    }
    if !f.ieee && field == all_ones && man == (1 << f.mantissa) - 1 {
        return f64::NAN;
    }
    let m = f.mantissa as i32;
    if field == 0 {
        sign * man as f64 * pow2(1 - f.bias - m)
    } else {
        sign * ((1u32 << f.mantissa) + man) as f64 * pow2(field as i32 - f.bias - m)
    }
}

/// The 16-bit pattern nearest to `x` (not NaN) in IEEE format `f`: ties to even,
/// gradual underflow, infinity beyond the largest finite value.
fn round_to(x: f64, f: Format) -> u16 {
    let m = f.mantissa;
    let sign = if x.is_sign_negative() {
        1u32 << (m + f.exponent)
    } else {
        0
    };
    let inf = sign | (((1 << f.exponent) - 1) << m);
    let a = x.abs();
    if a.is_infinite() {
        return inf as u16;
    }
    if a == 0.0 {
        return sign as u16;
    }
    let emin = 1 - f.bias;
    let emax = f.bias;
    // The binade of `a` (its f64 exponent), no lower than the smallest normal's:
    // below it the spacing stays that of the subnormals.
    let mut e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
    // Multiples of the spacing 2^(e-m): `a / spacing` is exact, so is its rounding.
    let mut r = (a / pow2(e - m as i32)).round_ties_even() as u32;
    if r == 1 << (m + 1) {
        // Rounded up into the next binade.
        r >>= 1;
        e += 1;
    }
    if e > emax {
        return inf as u16;
    }
    let bits = if r < 1 << m {
        r // subnormal (then e == emin)
    } else {
        (((e - emin + 1) as u32) << m) | (r - (1 << m))
    };
    (sign | bits) as u16
}

/// float32 -> bfloat16 by definition, NaN as [`crate::dtype`]'s policy says.
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        0xffff
    } else {
        round_to(x as f64, BF16)
    }
}

/// float32 -> float16 by definition; a NaN keeps its sign and top payload bits,
/// quiet.
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        ((u >> 16) & 0x8000) as u16 | 0x7e00 | ((u >> 13) & 0x3ff) as u16
    } else {
        round_to(x as f64, F16)
    }
}

/// Element `i` of little-endian `src` as an exact value, and as the float32 the
/// NaN policy starts from (f64 rounds to f32 first, as torch does).
fn load(src: &[u8], dtype: DType, i: usize) -> (f64, f32) {
    let b = |n: usize| &src[n * i..n * i + n];
    let v = match dtype {
        DType::F64 => {
            let v = f64::from_le_bytes(b(8).try_into().unwrap_or_default());
            return (v, v as f32);
        }
        DType::F32 => {
            let v = f32::from_le_bytes(b(4).try_into().unwrap_or_default());
            return (v as f64, v);
        }
        DType::F16 => decode(u16::from_le_bytes([b(2)[0], b(2)[1]]) as u32, F16),
        DType::BF16 => decode(u16::from_le_bytes([b(2)[0], b(2)[1]]) as u32, BF16),
        DType::F8E4M3 => decode(b(1)[0] as u32, E4M3),
        DType::F8E5M2 => decode(b(1)[0] as u32, E5M2),
        _ => f64::NAN,
    };
    // Every value of these formats is exact in f32.
    (v, v as f32)
}

/// Converts little-endian `src` (dtype `from`) into `dst` (dtype `to`): a copy when
/// the dtypes are equal, else element by element by definition. The pairs are those
/// `dtype::can_convert` allows; others leave `dst` as it is.
pub(crate) fn convert(src: &[u8], from: DType, dst: &mut [u8], to: DType) {
    if from == to {
        dst.copy_from_slice(&src[..dst.len()]);
        return;
    }
    if !from.is_float() {
        return;
    }
    let n = dst.len() / to.size();
    for i in 0..n {
        let (exact, single) = load(src, from, i);
        match to {
            DType::F64 => dst[8 * i..8 * i + 8].copy_from_slice(&exact.to_le_bytes()),
            DType::F32 => dst[4 * i..4 * i + 4].copy_from_slice(&single.to_le_bytes()),
            DType::BF16 => {
                dst[2 * i..2 * i + 2].copy_from_slice(&f32_to_bf16(single).to_le_bytes())
            }
            DType::F16 => dst[2 * i..2 * i + 2].copy_from_slice(&f32_to_f16(single).to_le_bytes()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_formats_by_their_definitions() {
        assert_eq!(decode(0x3c00, F16), 1.0);
        assert_eq!(decode(0x0001, F16), pow2(-24));
        assert_eq!(decode(0x7bff, F16), 65504.0);
        assert_eq!(decode(0xfc00, F16), f64::NEG_INFINITY);
        assert!(decode(0x7c01, F16).is_nan());
        assert_eq!(decode(0x3f80, BF16), 1.0);
        assert_eq!(decode(0x0001, BF16), pow2(-133));
        assert_eq!(decode(0x7e, E4M3), 448.0);
        assert!(decode(0x7f, E4M3).is_nan());
        assert_eq!(decode(0x08, E4M3), pow2(-6));
        assert_eq!(decode(0x01, E4M3), pow2(-9));
        assert_eq!(decode(0x7b, E5M2), 57344.0);
        assert_eq!(decode(0x7c, E5M2), f64::INFINITY);
    }

    #[test]
    fn rounds_ties_to_even_and_overflows_past_the_largest_value() {
        // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: to even (1).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_8000)), 0x7f80);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
        assert_eq!(f32_to_bf16(f32::NAN), 0xffff);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(-65520.0), 0xfc00);
        // 2^-25 is halfway between 0 and the smallest subnormal: to even (0).
        assert_eq!(f32_to_f16(pow2(-25) as f32), 0x0000);
        assert_eq!(f32_to_f16(f32::from_bits(0x3300_0001)), 0x0001);
        assert_eq!(f32_to_f16(3.0 * pow2(-25) as f32), 0x0002);
        // The largest subnormal rounds up to the smallest normal.
        assert_eq!(f32_to_f16(f32::from_bits(0x387f_f000)), 0x0400);
        assert_eq!(f32_to_f16(f32::from_bits(0xffc0_2000)), 0xfe01);
    }

    #[test]
    fn converts_between_dtypes_through_exact_values() {
        let mut out = [0u8; 8];
        // float64 -> bfloat16 rounds to float32 first: 1 + 2^-8 + 2^-30 becomes the
        // tie 1 + 2^-8 in f32, then 1 (to even), where one rounding would give 1 + 2^-7.
        let x = 1.0 + pow2(-8) + pow2(-30);
        convert(&x.to_le_bytes(), DType::F64, &mut out[..2], DType::BF16);
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3f80);
        // float16 -> bfloat16: 1 + 2^-10 is less than half bf16's spacing above 1.
        convert(
            &0x3c01u16.to_le_bytes(),
            DType::F16,
            &mut out[..2],
            DType::BF16,
        );
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3f80);
        convert(
            &0x3c01u16.to_le_bytes(),
            DType::F16,
            &mut out[..8],
            DType::F64,
        );
        assert_eq!(f64::from_le_bytes(out), 1.0 + pow2(-10));
        convert(&[0x7e], DType::F8E4M3, &mut out[..4], DType::F32);
        assert_eq!(f32::from_le_bytes([out[0], out[1], out[2], out[3]]), 448.0);
        convert(&[1, 2, 3, 4], DType::I32, &mut out[..4], DType::I32);
        assert_eq!(out[..4], [1, 2, 3, 4]);
    }

    /// Every pair `dtype::can_convert` allows between different float dtypes, five
    /// elements each (so each element's place counts), against the bytes torch 2.15
    /// writes for `.to(dtype)` of a tensor built from these bit patterns: rounding up
    /// and to even, subnormals (with mantissas other than 1) in and out, overflow to
    /// infinity, an infinity, a negative zero. `fixtures/gen_convert_table.py` checks
    /// the table against torch (and prints the rows torch gives).
    #[test]
    fn every_float_pair_converts_as_torch_does() {
        #[rustfmt::skip]
        let table: [(DType, &[u8], DType, &[u8]); 20] = [
            (DType::F64, b"\x00\x00\x40\x00\x00\x10\xf0\x3f\x3a\x8c\x30\xe2\x8e\x79\x45\xbe\x9c\x75\x00\x88\x3c\xe4\x37\x7e\xe1\x7a\x14\xae\xff\xfd\xef\x40\x00\x00\x00\x00\x00\x00\x78\x3e", DType::F32, b"\x00\x80\x80\x3f\x77\xcc\x2b\xb2\x00\x00\x80\x7f\xfd\xef\x7f\x47\x00\x00\xc0\x33"),
            (DType::F64, b"\x00\x00\x40\x00\x00\x10\xf0\x3f\x3a\x8c\x30\xe2\x8e\x79\x45\xbe\x9c\x75\x00\x88\x3c\xe4\x37\x7e\xe1\x7a\x14\xae\xff\xfd\xef\x40\x00\x00\x00\x00\x00\x00\x78\x3e", DType::BF16, b"\x80\x3f\x2c\xb2\x80\x7f\x80\x47\xc0\x33"),
            (DType::F64, b"\x00\x00\x40\x00\x00\x10\xf0\x3f\x3a\x8c\x30\xe2\x8e\x79\x45\xbe\x9c\x75\x00\x88\x3c\xe4\x37\x7e\xe1\x7a\x14\xae\xff\xfd\xef\x40\x00\x00\x00\x00\x00\x00\x78\x3e", DType::F16, b"\x04\x3c\x00\x80\x00\x7c\xff\x7b\x02\x00"),
            (DType::F32, b"\x08\x80\x80\x3f\x00\x00\x49\xc0\x00\xb8\x88\x47\x00\x00\x80\x35\x00\x00\x00\x80", DType::F64, b"\x00\x00\x00\x00\x01\x10\xf0\x3f\x00\x00\x00\x00\x00\x20\x09\xc0\x00\x00\x00\x00\x00\x17\xf1\x40\x00\x00\x00\x00\x00\x00\xb0\x3e\x00\x00\x00\x00\x00\x00\x00\x80"),
            (DType::F32, b"\x08\x80\x80\x3f\x00\x00\x49\xc0\x00\xb8\x88\x47\x00\x00\x80\x35\x00\x00\x00\x80", DType::BF16, b"\x81\x3f\x49\xc0\x89\x47\x80\x35\x00\x80"),
            (DType::F32, b"\x08\x80\x80\x3f\x00\x00\x49\xc0\x00\xb8\x88\x47\x00\x00\x80\x35\x00\x00\x00\x80", DType::F16, b"\x04\x3c\x48\xc2\x00\x7c\x10\x00\x00\x80"),
            (DType::F16, b"\x01\x3c\x01\x00\xff\xfb\x48\x42\x03\x82", DType::F64, b"\x00\x00\x00\x00\x00\x04\xf0\x3f\x00\x00\x00\x00\x00\x00\x70\x3e\x00\x00\x00\x00\x00\xfc\xef\xc0\x00\x00\x00\x00\x00\x20\x09\x40\x00\x00\x00\x00\x00\x18\x00\xbf"),
            (DType::F16, b"\x01\x3c\x01\x00\xff\xfb\x48\x42\x03\x82", DType::F32, b"\x00\x20\x80\x3f\x00\x00\x80\x33\x00\xe0\x7f\xc7\x00\x00\x49\x40\x00\xc0\x00\xb8"),
            (DType::F16, b"\x01\x3c\x01\x00\xff\xfb\x48\x42\x03\x82", DType::BF16, b"\x80\x3f\x80\x33\x80\xc7\x49\x40\x01\xb8"),
            (DType::BF16, b"\x81\x3f\x01\x00\xf7\xc2\x7f\x7f\x80\x33", DType::F64, b"\x00\x00\x00\x00\x00\x20\xf0\x3f\x00\x00\x00\x00\x00\x00\xa0\x37\x00\x00\x00\x00\x00\xe0\x5e\xc0\x00\x00\x00\x00\x00\xe0\xef\x47\x00\x00\x00\x00\x00\x00\x70\x3e"),
            (DType::BF16, b"\x81\x3f\x01\x00\xf7\xc2\x7f\x7f\x80\x33", DType::F32, b"\x00\x00\x81\x3f\x00\x00\x01\x00\x00\x00\xf7\xc2\x00\x00\x7f\x7f\x00\x00\x80\x33"),
            (DType::BF16, b"\x81\x3f\x01\x00\xf7\xc2\x7f\x7f\x80\x33", DType::F16, b"\x08\x3c\x00\x00\xb8\xd7\x00\x7c\x01\x00"),
            (DType::F8E4M3, b"\x05\x7e\xb3\x40\x08", DType::F64, b"\x00\x00\x00\x00\x00\x00\x84\x3f\x00\x00\x00\x00\x00\x00\x7c\x40\x00\x00\x00\x00\x00\x00\xe6\xbf\x00\x00\x00\x00\x00\x00\x00\x40\x00\x00\x00\x00\x00\x00\x90\x3f"),
            (DType::F8E4M3, b"\x05\x7e\xb3\x40\x08", DType::F32, b"\x00\x00\x20\x3c\x00\x00\xe0\x43\x00\x00\x30\xbf\x00\x00\x00\x40\x00\x00\x80\x3c"),
            (DType::F8E4M3, b"\x05\x7e\xb3\x40\x08", DType::BF16, b"\x20\x3c\xe0\x43\x30\xbf\x00\x40\x80\x3c"),
            (DType::F8E4M3, b"\x05\x7e\xb3\x40\x08", DType::F16, b"\x00\x21\x00\x5f\x80\xb9\x00\x40\x00\x24"),
            (DType::F8E5M2, b"\x03\x7b\xb3\xfc\x40", DType::F64, b"\x00\x00\x00\x00\x00\x00\x08\x3f\x00\x00\x00\x00\x00\x00\xec\x40\x00\x00\x00\x00\x00\x00\xcc\xbf\x00\x00\x00\x00\x00\x00\xf0\xff\x00\x00\x00\x00\x00\x00\x00\x40"),
            (DType::F8E5M2, b"\x03\x7b\xb3\xfc\x40", DType::F32, b"\x00\x00\x40\x38\x00\x00\x60\x47\x00\x00\x60\xbe\x00\x00\x80\xff\x00\x00\x00\x40"),
            (DType::F8E5M2, b"\x03\x7b\xb3\xfc\x40", DType::BF16, b"\x40\x38\x60\x47\x60\xbe\x80\xff\x00\x40"),
            (DType::F8E5M2, b"\x03\x7b\xb3\xfc\x40", DType::F16, b"\x00\x03\x00\x7b\x00\xb3\x00\xfc\x00\x40"),
        ];
        for (from, src, to, want) in table {
            let mut got = vec![0xAA; want.len()];
            convert(src, from, &mut got, to);
            assert_eq!(got, want, "{from:?} -> {to:?}");
        }
    }
}
