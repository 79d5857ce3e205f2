//! torch.distributed.checkpoint's HF storage writer saving distributed
//! (`HuggingFaceStorageWriter(save_distributed=True)`, 2 ranks, every tensor a
//! DTensor `Shard(0)`): `fixtures/torchtitan/hf_sharded/<case>/sharded/` holds the
//! rank files, `consolidated/` torch's own `consolidate_safetensors_files` of them,
//! and `cases.json` names the transformers weights they were saved from. A merge must
//! give those weights byte for byte, the same tensors as torch's consolidation, and
//! name the file or tensor at fault when a rank file is missing or boxes overlap or
//! leave a gap.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{fixtures, model_names, names, text};

fn dir() -> PathBuf {
    fixtures().join("torchtitan")
}

fn unshard<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    common::unshard_in(&dir(), args)
}

struct Case {
    name: String,
    sharded: String,
    consolidated: String,
    expected: String,
    dtype: String,
}

fn cases() -> Vec<Case> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    json["hf_sharded"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| Case {
            name: name.clone(),
            sharded: c["sharded"].as_str().unwrap().into(),
            consolidated: c["consolidated"].as_str().unwrap().into(),
            expected: c["expected"].as_str().unwrap().into(),
            dtype: c["dtype"].as_str().unwrap().into(),
        })
        .collect()
}

/// The base (config and tokenizer) of the case whose weights were saved.
fn base(expected: &str) -> String {
    expected.replace("/expected", "/base")
}

/// Every tensor of the safetensors files of `dir`: name -> (dtype, shape, bytes).
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for f in names(dir).iter().filter(|f| f.ends_with(".safetensors")) {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (n, v) in st.tensors() {
            out.insert(
                n.to_string(),
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            );
        }
    }
    out
}

fn merge(input: &str, base: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "merge",
        input,
        "--base",
        base,
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    unshard(&args)
}

#[test]
fn every_case_matches_the_weights_it_was_saved_from_and_torchs_consolidation() {
    let cases = cases();
    // Row boxes (2 ranks, float32 in 5 files, bfloat16 in 1), column boxes and
    // replicated vectors (2 ranks, bfloat16), boxes split on both dims (2x2 ranks).
    assert_eq!(cases.len(), 4);
    let tmp = tempfile::tempdir().unwrap();
    for c in &cases {
        let out = tmp.path().join(&c.name);
        let base = base(&c.expected);
        // A bfloat16 case holds the weights `.to(bfloat16)`: compared with
        // transformers' bfloat16 save where the fixtures have one.
        let (expected, mut extra) = if c.dtype == "bfloat16" {
            let bf16 = c.expected.replace("/expected", "/expected_bf16");
            let e = dir().join(&bf16).exists().then_some(bf16);
            (e, vec!["--dtype", "bfloat16"])
        } else {
            (Some(c.expected.clone()), vec![])
        };
        let expected = expected.map(|e| dir().join(e));
        let index = dir()
            .join(&c.expected)
            .join("model.safetensors.index.json")
            .exists();
        if index {
            // transformers wrote the Llama 3 weights with max_shard_size="40KB".
            extra.extend(["--max-shard-size", "40KB"]);
        }
        let o = merge(&c.sharded, &base, &out, &extra);
        let said = text(&o);
        assert!(o.status.success(), "{}: {said}", c.name);
        assert!(
            said.contains("HF-sharded safetensors"),
            "{}: {said}",
            c.name
        );
        let got = tensors(&out);
        assert_eq!(
            got,
            tensors(&dir().join(&c.consolidated)),
            "{}: tensors of torch's consolidation",
            c.name
        );
        if let Some(expected) = expected {
            assert_eq!(
                got,
                tensors(&expected),
                "{}: tensors of transformers",
                c.name
            );
            let files: Vec<String> = model_names(&out);
            assert_eq!(files, names(&expected), "{}: files", c.name);
            for f in &files {
                if index && (f.ends_with(".safetensors") || f.ends_with(".index.json")) {
                    // The shard order of transformers is not followed (docs/inputs.md).
                    continue;
                }
                let a = std::fs::read(out.join(f)).unwrap();
                let b = std::fs::read(expected.join(f)).unwrap();
                assert!(a == b, "{}: {f} differs from transformers' output", c.name);
            }
        }
        let o = unshard(&[
            "verify",
            out.to_str().unwrap(),
            "--against",
            &c.sharded,
            "--base",
            &base,
        ]);
        assert!(o.status.success(), "{}: verify: {}", c.name, text(&o));
    }
}

#[test]
fn the_folder_holding_sharded_is_read_through_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = merge(
        "hf_sharded/qwen3_bf16_1file",
        "qwen3/base",
        &out,
        &["--dtype", "bfloat16"],
    );
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("read the rank files of sharded/"), "{said}");
    assert_eq!(
        tensors(&out),
        tensors(&dir().join("qwen3/expected_bf16")),
        "{said}"
    );
}

/// A copy of the 2-rank bfloat16 case's rank files, for breaking.
fn copy_case(tmp: &Path) -> PathBuf {
    let src = dir().join("hf_sharded/qwen3_bf16_1file/sharded");
    let to = tmp.join("in");
    std::fs::create_dir_all(&to).unwrap();
    for f in names(&src) {
        std::fs::copy(src.join(&f), to.join(&f)).unwrap();
    }
    to
}

/// Replaces `from` by `to` (the same length) in the header of `file`.
fn patch_header(file: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    assert!(header.contains(from), "{header}");
    let patched = header.replacen(from, to, 1);
    bytes[8..8 + n].copy_from_slice(patched.as_bytes());
    std::fs::write(file, bytes).unwrap();
}

fn refused(input: &Path, tmp: &Path) -> String {
    let out = tmp.join("out");
    let o = merge(input.to_str().unwrap(), "qwen3/base", &out, &[]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(!out.exists(), "{said}");
    said
}

#[test]
fn a_missing_rank_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_case(tmp.path());
    std::fs::remove_file(input.join("shard-00001-model-00001-of-00001.safetensors")).unwrap();
    let said = refused(&input, tmp.path());
    assert!(
        said.contains("rank 1's files (shard-00001-model-00001-of-00001.safetensors"),
        "{said}"
    );
}

#[test]
fn overlapping_boxes_name_the_tensor_and_its_files() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_case(tmp.path());
    // Rank 2's embedding rows start at 125 instead of 126: row 125 is saved twice.
    patch_header(
        &input.join("shard-00002-model-00001-of-00001.safetensors"),
        r#"\"model.embed_tokens.weight\": {\"saved_offsets\": [126, 0]}"#,
        r#"\"model.embed_tokens.weight\": {\"saved_offsets\": [125, 0]}"#,
    );
    let said = refused(&input, tmp.path());
    assert!(said.contains("'model.embed_tokens.weight'"), "{said}");
    assert!(
        said.contains("chunks overlap: [0..126, 0..32] and [125..250, 0..32]"),
        "{said}"
    );
    assert!(
        said.contains("shard-00001-model-00001-of-00001.safetensors, shard-00002-model-00001-of-00001.safetensors"),
        "{said}"
    );
}

#[test]
fn a_gap_between_boxes_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_case(tmp.path());
    // Rank 2's embedding rows start at 127: row 126 is saved by no rank.
    patch_header(
        &input.join("shard-00002-model-00001-of-00001.safetensors"),
        r#"\"model.embed_tokens.weight\": {\"saved_offsets\": [126, 0]}"#,
        r#"\"model.embed_tokens.weight\": {\"saved_offsets\": [127, 0]}"#,
    );
    let said = refused(&input, tmp.path());
    assert!(said.contains("'model.embed_tokens.weight'"), "{said}");
    assert!(
        said.contains("a chunk or a rank's shard is missing"),
        "{said}"
    );
}

#[test]
fn a_file_without_the_sharding_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_case(tmp.path());
    patch_header(
        &input.join("shard-00002-model-00001-of-00001.safetensors"),
        "DCP_SHARDING_INFO",
        "DCP_SHARDING_XXXX",
    );
    let said = refused(&input, tmp.path());
    assert!(
        said.contains("shard-00002-model-00001-of-00001.safetensors: ")
            && said.contains("has no DCP_SHARDING_INFO"),
        "{said}"
    );
}

#[test]
fn the_last_rank_missing_leaves_shapes_the_config_refuses() {
    // The files record neither the full shapes nor the rank count: without rank 2,
    // rank 1's boxes look whole, and the base's config names the short tensors; the
    // hint names the files that may be missing rather than another model size alone.
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_case(tmp.path());
    std::fs::remove_file(input.join("shard-00002-model-00001-of-00001.safetensors")).unwrap();
    let said = refused(&input, tmp.path());
    assert!(
        said.contains("'model.embed_tokens.weight' is [126, 32] but the config gives [251, 32]"),
        "{said}"
    );
    assert!(
        said.contains("ranks 1 to 1")
            && said.contains("(shard-00002-model-00001-of-00001.safetensors, ...) are missing"),
        "{said}"
    );
}
