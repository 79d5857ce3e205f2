//! DeepSpeed ZeRO factors together: world size (1, 2, 3) x ZeRO stage (1, 2, 3) x
//! parameter groups (one; decay / no decay) x frozen parameters x tied
//! embeddings, as a pairwise covering matrix (`fixtures/deepspeed_combos/`,
//! written by DeepSpeed 0.19.8 on CPU with `fixtures/gen_deepspeed_combos.py`).
//! For each checkpoint, reading must give exactly the fp32 weights DeepSpeed's
//! own `zero_to_fp32` rebuilds (frozen parameters it leaves out: the module's),
//! and merging exactly the files transformers' `save_pretrained` wrote from them.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use unshard::merge::{self, MergeOptions};
use unshard::source::{self, OpenOptions};
use unshard::write::{read_tensor, NoProgress};
use unshard::DType;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixtures().join("deepspeed_combos/cases.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn s<'a>(c: &'a serde_json::Value, k: &str) -> &'a str {
    c[k].as_str().unwrap()
}

/// Every tensor of a checkpoint, read whole as float32 (exact for 16-bit values).
fn as_f32(path: &Path) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let ckpt = source::open(path, &OpenOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ckpt.tensors
        .iter()
        .map(|t| {
            let (bytes, _) = read_tensor(&ckpt.files, t, DType::F32)
                .unwrap_or_else(|e| panic!("{}: {}: {e}", path.display(), t.name));
            (t.name.clone(), (t.shape.clone(), bytes))
        })
        .collect()
}

#[test]
fn the_matrix_covers_every_pair_of_factor_levels() {
    let cases = cases();
    let level = |c: &serde_json::Value| -> [String; 5] {
        [
            c["world_size"].to_string(),
            c["zero_stage"].to_string(),
            c["param_groups"].to_string(),
            (!c["frozen"].is_null()).to_string(),
            c["tied"].to_string(),
        ]
    };
    let rows: Vec<[String; 5]> = cases.iter().map(level).collect();
    let levels: Vec<BTreeSet<&String>> = (0..5)
        .map(|i| rows.iter().map(|r| &r[i]).collect())
        .collect();
    let counts: Vec<usize> = levels.iter().map(BTreeSet::len).collect();
    assert_eq!(counts, [3, 3, 2, 2, 2]);
    for i in 0..5 {
        for j in i + 1..5 {
            for a in &levels[i] {
                for b in &levels[j] {
                    assert!(
                        rows.iter().any(|r| &r[i] == *a && &r[j] == *b),
                        "no case with factor {i} = {a} and factor {j} = {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_combination_reads_what_zero_to_fp32_rebuilds_and_merges_like_transformers() {
    for c in cases() {
        let name = s(&c, "name");
        let checkpoint = fixtures().join(s(&c, "checkpoint"));
        let got = as_f32(&checkpoint);
        let want = as_f32(&fixtures().join(s(&c, "expected_fp32")));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}: tensor names"
        );
        for (n, v) in &want {
            assert!(got[n] == *v, "{name}: {n} differs from zero_to_fp32's");
        }

        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let opts = MergeOptions {
            checkpoint,
            base: Some(fixtures().join(s(&c, "base"))),
            output: out.clone(),
            ..MergeOptions::default()
        };
        merge::merge(&opts, &NoProgress).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = fixtures().join(s(&c, "expected_dir"));
        let files = |d: &Path| -> BTreeSet<String> {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n != unshard::manifest::MANIFEST)
                .collect()
        };
        assert_eq!(files(&out), files(&expected), "{name}: files");
        for f in std::fs::read_dir(&expected).unwrap() {
            let f = f.unwrap().file_name();
            assert!(
                std::fs::read(out.join(&f)).unwrap() == std::fs::read(expected.join(&f)).unwrap(),
                "{name}: {} differs from transformers'",
                f.to_string_lossy()
            );
        }
    }
}
