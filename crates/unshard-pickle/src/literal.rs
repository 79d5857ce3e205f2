//! Decoding of opcode arguments that are not plain fixed-width integers: the text
//! literals of protocol 0 (`INT`, `LONG`, `FLOAT`, `STRING`, `UNICODE`, memo keys) and
//! the little-endian two's-complement integers of `LONG1`/`LONG4`.
//!
//! Each function follows what CPython's unpickler accepts for files that CPython's
//! pickler (2.x or 3.x) writes, and rejects the rest with a message for
//! [`crate::ErrorKind::BadLiteral`]. Deliberate narrowings: integers must be decimal
//! (CPython also takes `0x..` and `1_000`, which no pickler writes) and have at most
//! [`MAX_INT_DIGITS`] digits, the same default bound CPython ≥ 3.11 applies to `int(str)`,
//! which keeps the quadratic decimal-to-binary conversion cheap.

use crate::Value;

/// The most decimal digits an `INT`/`LONG` literal may have.
pub const MAX_INT_DIGITS: usize = 4300;

/// The value of a little-endian two's-complement integer (`LONG1`/`LONG4` payload):
/// [`Value::Int`] when it fits in an i64, otherwise [`Value::BigInt`] with redundant
/// sign bytes removed, so equal numbers always have equal bytes.
pub fn int_from_le(bytes: &[u8]) -> Value {
    let minimal = minimal_len(bytes);
    let bytes = bytes.get(..minimal).unwrap_or(bytes);
    if bytes.len() <= 8 {
        let negative = bytes.last().is_some_and(|&b| b & 0x80 != 0);
        let mut buf = if negative { [0xff; 8] } else { [0; 8] };
        for (dst, &src) in buf.iter_mut().zip(bytes) {
            *dst = src;
        }
        Value::Int(i64::from_le_bytes(buf))
    } else {
        Value::BigInt(bytes.to_vec())
    }
}

/// Length of `bytes` without the high bytes that only repeat the sign.
fn minimal_len(bytes: &[u8]) -> usize {
    let mut len = bytes.len();
    while len >= 2 {
        let (Some(&top), Some(&next)) = (bytes.get(len - 1), bytes.get(len - 2)) else {
            break;
        };
        let redundant = (top == 0x00 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
        if !redundant {
            break;
        }
        len -= 1;
    }
    len
}

/// An `INT` or `LONG` text argument (without the `L` suffix): optional surrounding
/// whitespace, an optional sign and decimal digits.
pub fn parse_int(text: &[u8]) -> Result<Value, String> {
    let trimmed = text.trim_ascii();
    let (negative, digits) = match trimmed.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, trimmed),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(format!("{} is not a decimal integer", preview(text)));
    }
    if digits.len() > MAX_INT_DIGITS {
        return Err(format!(
            "integer literal has {} digits (at most {MAX_INT_DIGITS} are read)",
            digits.len()
        ));
    }
    // Fast path: up to 18 digits always fit in an i64.
    if digits.len() <= 18 {
        let magnitude = digits
            .iter()
            .fold(0i64, |acc, &d| acc * 10 + i64::from(d - b'0'));
        return Ok(Value::Int(if negative { -magnitude } else { magnitude }));
    }
    Ok(int_from_le(&decimal_to_le(digits, negative)))
}

/// Two's-complement little-endian bytes of a decimal number given as ASCII digits.
fn decimal_to_le(digits: &[u8], negative: bool) -> Vec<u8> {
    // Magnitude in base 2^32 limbs, little-endian; fold in nine digits at a time.
    let mut limbs: Vec<u32> = Vec::new();
    for chunk in digits.chunks(9) {
        let mut scale: u64 = 1;
        let mut add: u64 = 0;
        for &d in chunk {
            scale *= 10;
            add = add * 10 + u64::from(d - b'0');
        }
        let mut carry = add;
        for limb in limbs.iter_mut() {
            let product = u64::from(*limb) * scale + carry;
            *limb = product as u32;
            carry = product >> 32;
        }
        if carry != 0 {
            limbs.push(carry as u32);
        }
    }
    let mut bytes: Vec<u8> = limbs.iter().flat_map(|l| l.to_le_bytes()).collect();
    bytes.push(0); // room for the sign bit
    if negative {
        // Two's complement: invert and add one.
        let mut carry = true;
        for b in bytes.iter_mut() {
            let (sum, overflow) = (!*b).overflowing_add(u8::from(carry));
            *b = sum;
            carry = overflow;
        }
    }
    bytes
}

/// A `FLOAT` text argument: what Python's `repr(float)` writes, including `inf` and `nan`.
pub fn parse_float(text: &[u8]) -> Result<f64, String> {
    std::str::from_utf8(text.trim_ascii())
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("{} is not a float", preview(text)))
}

/// A memo key of `PUT`/`GET`: a non-negative decimal integer.
pub fn parse_memo_key(text: &[u8]) -> Result<u64, String> {
    let digits = text.trim_ascii();
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(format!("{} is not a memo key", preview(text)));
    }
    digits
        .iter()
        .try_fold(0u64, |acc, &d| {
            acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .ok_or_else(|| format!("{} is not a memo key", preview(text)))
}

/// The bytes of a `STRING` argument: a quoted Python 2 `repr` of a byte string.
/// Strips the matching quotes, then undoes the escapes as `codecs.escape_decode` does.
pub fn parse_quoted_string(text: &[u8]) -> Result<Vec<u8>, String> {
    let inner = match text {
        [q, inner @ .., last] if (*q == b'\'' || *q == b'"') && q == last => inner,
        _ => return Err(format!("STRING argument {} must be quoted", preview(text))),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    while let Some(&c) = inner.get(i) {
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let Some(&e) = inner.get(i) else {
            return Err("STRING argument ends with a lone backslash".to_string());
        };
        i += 1;
        match e {
            b'\n' => {}
            b'\\' | b'\'' | b'"' => out.push(e),
            b'a' => out.push(0x07),
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(0x0b),
            b'0'..=b'7' => {
                // Up to three octal digits; values above 0o377 wrap as in CPython.
                let mut value = u32::from(e - b'0');
                for _ in 0..2 {
                    match inner.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push((value & 0xff) as u8);
            }
            b'x' => {
                let hex = inner
                    .get(i..i + 2)
                    .and_then(hex_value)
                    .ok_or_else(|| format!("invalid \\x escape at position {}", i - 2))?;
                out.push(hex as u8);
                i += 2;
            }
            // Unknown escapes stay as written, backslash included.
            other => {
                out.push(b'\\');
                out.push(other);
            }
        }
    }
    Ok(out)
}

/// The text of a `UNICODE` argument, decoded as `raw-unicode-escape`: every byte is a
/// latin-1 character, except `\uXXXX` and `\UXXXXXXXX` after an odd number of
/// backslashes. A UTF-16 surrogate pair written as two `\u` escapes (Python 2 narrow
/// builds) is combined; a lone surrogate cannot be held in a Rust string and is an error.
pub fn parse_raw_unicode_escape(text: &[u8]) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while let Some(&c) = text.get(i) {
        if c != b'\\' {
            out.push(char::from(c));
            i += 1;
            continue;
        }
        let run_start = i;
        while text.get(i) == Some(&b'\\') {
            i += 1;
        }
        let run = i - run_start;
        let width = match text.get(i) {
            Some(b'u') if run % 2 == 1 => 4,
            Some(b'U') if run % 2 == 1 => 8,
            _ => {
                out.extend((0..run).map(|_| '\\'));
                continue;
            }
        };
        out.extend((1..run).map(|_| '\\'));
        let code = read_hex_escape(text, i + 1, width)?;
        i += 1 + width;
        let code = if (0xd800..0xdc00).contains(&code) {
            // A high surrogate must be followed by `\u` and a low surrogate.
            let low = match (text.get(i), text.get(i + 1)) {
                (Some(b'\\'), Some(b'u')) => read_hex_escape(text, i + 2, 4).ok(),
                _ => None,
            };
            match low {
                Some(low @ 0xdc00..=0xdfff) => {
                    i += 6;
                    0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00)
                }
                _ => return Err(format!("lone surrogate \\u{code:04x} in UNICODE argument")),
            }
        } else {
            code
        };
        let ch = char::from_u32(code).ok_or_else(|| {
            format!("\\U{code:08x} in UNICODE argument is not a unicode character")
        })?;
        out.push(ch);
    }
    Ok(out)
}

/// The value of `width` hex digits at `text[at..]`.
fn read_hex_escape(text: &[u8], at: usize, width: usize) -> Result<u32, String> {
    text.get(at..at + width).and_then(hex_value).ok_or_else(|| {
        format!(
            "truncated \\u or \\U escape at position {}",
            at.saturating_sub(2)
        )
    })
}

/// The value of a short run of hex digits, or `None` if one is not a hex digit.
fn hex_value(digits: &[u8]) -> Option<u32> {
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = char::from(d).to_digit(16)?;
        Some(acc.checked_mul(16)? | v)
    })
}

/// Bytes read as latin-1 (each byte is the code point of the same value), as
/// Python 3 does with Python 2 `str` when loaded with `encoding='latin1'`.
pub fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// A short printable rendering of a literal for error messages.
pub fn preview(text: &[u8]) -> String {
    const MAX: usize = 40;
    let shown = text.get(..MAX).unwrap_or(text);
    let ellipsis = if text.len() > MAX { "…" } else { "" };
    format!("'{}{ellipsis}'", shown.escape_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn le_integers_shrink_to_i64_or_minimal_bytes() {
        assert_eq!(int_from_le(&[]), Value::Int(0));
        assert_eq!(int_from_le(&[0xff]), Value::Int(-1));
        assert_eq!(int_from_le(&[0xff, 0x00]), Value::Int(255));
        assert_eq!(int_from_le(&[0x00, 0x80]), Value::Int(-32768));
        assert_eq!(
            int_from_le(&[0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]),
            Value::Int(1)
        );
        let max = i64::MAX.to_le_bytes();
        assert_eq!(int_from_le(&max), Value::Int(i64::MAX));
        let min = i64::MIN.to_le_bytes();
        assert_eq!(int_from_le(&min), Value::Int(i64::MIN));
        // 2**63 needs a ninth byte for the sign.
        assert_eq!(
            int_from_le(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0]),
            Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0])
        );
        assert_eq!(
            int_from_le(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0, 0, 0]),
            Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0])
        );
    }

    #[test]
    fn decimal_integers_match_their_binary_form() {
        assert_eq!(parse_int(b"42"), Ok(Value::Int(42)));
        assert_eq!(parse_int(b" -7 "), Ok(Value::Int(-7)));
        assert_eq!(parse_int(b"9223372036854775807"), Ok(Value::Int(i64::MAX)));
        assert_eq!(parse_int(b"-9223372036854775808"), Ok(Value::Int(i64::MIN)));
        assert_eq!(
            parse_int(b"9223372036854775808"),
            Ok(Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]))
        );
        assert_eq!(
            parse_int(b"-9223372036854775809"),
            Ok(Value::BigInt(vec![
                0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff
            ]))
        );
        // 2**80 and -(2**80)
        let mut pos = vec![0u8; 10];
        pos.push(1);
        assert_eq!(
            parse_int(b"1208925819614629174706176"),
            Ok(Value::BigInt(pos))
        );
        let mut neg = vec![0u8; 10];
        neg.push(0xff);
        assert_eq!(
            parse_int(b"-1208925819614629174706176"),
            Ok(Value::BigInt(neg))
        );
        assert!(parse_int(b"").is_err());
        assert!(parse_int(b"-").is_err());
        assert!(parse_int(b"12a").is_err());
        assert!(parse_int(&vec![b'9'; MAX_INT_DIGITS + 1]).is_err());
        assert!(parse_int(&vec![b'9'; MAX_INT_DIGITS]).is_ok());
    }

    #[test]
    fn floats_include_python_spellings() {
        assert_eq!(parse_float(b"1.5"), Ok(1.5));
        assert_eq!(parse_float(b"-2.25e-300"), Ok(-2.25e-300));
        assert_eq!(parse_float(b"1e+100"), Ok(1e100));
        assert_eq!(parse_float(b"inf"), Ok(f64::INFINITY));
        assert_eq!(parse_float(b"-inf"), Ok(f64::NEG_INFINITY));
        assert!(parse_float(b"nan").is_ok_and(f64::is_nan));
        assert!(parse_float(b"1.5x").is_err());
    }

    #[test]
    fn quoted_strings_undo_python_2_escapes() {
        assert_eq!(parse_quoted_string(b"'abc'"), Ok(b"abc".to_vec()));
        assert_eq!(parse_quoted_string(b"\"it's\""), Ok(b"it's".to_vec()));
        assert_eq!(
            parse_quoted_string(br"'\x41\101\n\t\\\'\q\0'"),
            Ok(b"AA\n\t\\'\\q\0".to_vec())
        );
        assert_eq!(parse_quoted_string(br"'\xff\377'"), Ok(vec![0xff, 0xff]));
        assert!(parse_quoted_string(b"abc").is_err());
        assert!(parse_quoted_string(b"'abc\"").is_err());
        assert!(parse_quoted_string(b"'").is_err());
        assert!(parse_quoted_string(br"'\x4'").is_err());
        assert!(parse_quoted_string(br"'\'").is_err());
    }

    #[test]
    fn raw_unicode_escape_decodes_like_python() {
        assert_eq!(parse_raw_unicode_escape(b"abc"), Ok("abc".to_string()));
        assert_eq!(parse_raw_unicode_escape(b"\xe9"), Ok("é".to_string()));
        assert_eq!(parse_raw_unicode_escape(br"\u20ac"), Ok("€".to_string()));
        assert_eq!(
            parse_raw_unicode_escape(br"\U0001f600"),
            Ok("😀".to_string())
        );
        assert_eq!(
            parse_raw_unicode_escape(br"\ud83d\ude00"),
            Ok("😀".to_string())
        );
        // An even run of backslashes leaves the `u` alone.
        assert_eq!(
            parse_raw_unicode_escape(br"\\u0041"),
            Ok(r"\\u0041".to_string())
        );
        assert_eq!(
            parse_raw_unicode_escape(br"\\\u0041"),
            Ok(r"\\A".to_string())
        );
        assert_eq!(parse_raw_unicode_escape(br"a\b"), Ok(r"a\b".to_string()));
        assert_eq!(parse_raw_unicode_escape(br"\"), Ok(r"\".to_string()));
        assert!(parse_raw_unicode_escape(br"\u12").is_err());
        assert!(parse_raw_unicode_escape(br"\ud800").is_err());
        assert!(parse_raw_unicode_escape(br"\U00110000").is_err());
    }

    #[test]
    fn memo_keys_are_non_negative_decimals() {
        assert_eq!(parse_memo_key(b"0"), Ok(0));
        assert_eq!(parse_memo_key(b"18446744073709551615"), Ok(u64::MAX));
        assert!(parse_memo_key(b"18446744073709551616").is_err());
        assert!(parse_memo_key(b"-1").is_err());
        assert!(parse_memo_key(b"").is_err());
    }
}
