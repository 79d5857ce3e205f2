//! An output of `unshard merge ADAPTER --base BASE` against the directory peft's
//! own `merge_and_unload()` + `save_pretrained` wrote (read with the
//! `safetensors` crate).

use std::collections::BTreeSet;
use std::path::Path;

/// Values ordered like their bits: adjacent floats of a dtype differ by 1.
pub fn ordered(bytes: &[u8], dtype: safetensors::Dtype) -> Vec<i64> {
    match dtype {
        safetensors::Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| {
                let b = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64;
                if b < 0 {
                    -(b & 0x7fff_ffff)
                } else {
                    b
                }
            })
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| {
                let b = i16::from_le_bytes([c[0], c[1]]) as i64;
                if b < 0 {
                    -(b & 0x7fff)
                } else {
                    b
                }
            })
            .collect(),
    }
}

/// Compares an output dir's single shard with an expected dir's: same names,
/// dtypes and shapes; `fused` tensors within 1 ulp, the others byte-identical.
/// Returns how many fused tensors differ from peft's at all.
pub fn compare(out: &Path, expected: &Path, fused: &BTreeSet<String>, name: &str) -> usize {
    compare_within(out, expected, fused, name, |_, _| 1)
}

/// [`compare`], with `ulps(name, dtype)` the distance allowed for a fused tensor.
pub fn compare_within(
    out: &Path,
    expected: &Path,
    fused: &BTreeSet<String>,
    name: &str,
    ulps: impl Fn(&str, safetensors::Dtype) -> i64,
) -> usize {
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    let theirs = std::fs::read(expected.join("model.safetensors")).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&theirs).unwrap();
    let names = |s: &safetensors::SafeTensors| {
        s.names()
            .into_iter()
            .map(str::to_string)
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(names(&ours), names(&theirs), "{name}: tensor names");
    let mut inexact = 0;
    for n in names(&theirs) {
        let (a, b) = (ours.tensor(&n).unwrap(), theirs.tensor(&n).unwrap());
        assert_eq!(
            (a.dtype(), a.shape()),
            (b.dtype(), b.shape()),
            "{name}: {n}"
        );
        if !fused.contains(&n) {
            assert!(
                a.data() == b.data(),
                "{name}: {n} is not fused but differs from peft's"
            );
            continue;
        }
        let (x, y) = (ordered(a.data(), a.dtype()), ordered(b.data(), b.dtype()));
        let worst = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q).abs())
            .max()
            .unwrap_or(0);
        let allowed = ulps(&n, a.dtype());
        assert!(
            worst <= allowed,
            "{name}: {n} is {worst} ulp from peft's (allowed: {allowed})"
        );
        inexact += (a.data() != b.data()) as usize;
    }
    assert!(!fused.is_empty(), "{name}: nothing fused");
    inexact
}

/// The tensors peft's merge changed: those of `expected` whose bytes differ from
/// the base's, or that the base does not have.
pub fn changed(expected: &Path, base: &Path) -> BTreeSet<String> {
    let e = std::fs::read(expected.join("model.safetensors")).unwrap();
    let e = safetensors::SafeTensors::deserialize(&e).unwrap();
    let b = std::fs::read(base.join("model.safetensors")).unwrap();
    let b = safetensors::SafeTensors::deserialize(&b).unwrap();
    e.names()
        .into_iter()
        .filter(|n| {
            b.tensor(n)
                .map(|t| t.data() != e.tensor(n).unwrap().data())
                .unwrap_or(true)
        })
        .map(str::to_string)
        .collect()
}
