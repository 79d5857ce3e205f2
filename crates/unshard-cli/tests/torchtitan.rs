//! torchtitan checkpoints merged onto their bases, against transformers' own files.
//!
//! `fixtures/torchtitan/cases.json` (`fixtures/gen_torchtitan.py`, torchtitan 0.3.0)
//! lists per case the DCP `checkpoint/step-N/` that torchtitan's `CheckpointManager`
//! wrote from 2 ranks (model, optimizer, scheduler, dataloader and train state), the
//! base (config and tokenizer, no weights) and `expected/`, transformers'
//! `save_pretrained` of the weights the checkpoint was made from. Every case must
//! reproduce it file for file and byte for byte (Llama's q/k rows reordered from
//! torchtitan's RoPE order, Qwen3's tied head left out, experts split per expert),
//! and `unshard verify` must pass on it.
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
    checkpoint: String,
    base: String,
    expected: String,
}

fn cases() -> Vec<Case> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    json["cases"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| Case {
            name: name.clone(),
            checkpoint: c["checkpoint"].as_str().unwrap().into(),
            base: c["base"].as_str().unwrap().into(),
            expected: c["expected"].as_str().unwrap().into(),
        })
        .collect()
}

fn merge(checkpoint: &str, base: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "merge",
        checkpoint,
        "--base",
        base,
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    unshard(&args)
}

/// `out` holds exactly the files of `expected`, byte for byte (and unshard.json).
fn assert_same_files(name: &str, out: &Path, expected: &Path) {
    assert_eq!(model_names(out), names(expected), "{name}: files");
    for f in names(expected) {
        let a = std::fs::read(out.join(&f)).unwrap();
        let b = std::fs::read(expected.join(&f)).unwrap();
        assert!(a == b, "{name}: {f} differs from transformers' output");
    }
}

/// Every tensor of the safetensors files of `dir`: name -> (dtype, shape, bytes).
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for f in names(dir).iter().filter(|f| f.ends_with(".safetensors")) {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (n, v) in st.tensors() {
            let t = (
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                v.data().to_vec(),
            );
            assert!(out.insert(n.clone(), t).is_none(), "{n} twice");
        }
    }
    out
}

/// `out` holds the tensors of a sharded `expected`, byte for byte, and every other
/// file of it byte for byte. The tensors' order across shards is not compared:
/// transformers 5.25 fills shards in the model's module order (the embedding
/// first, the head last), which the shard layout does not follow yet.
fn assert_same_tensors(name: &str, out: &Path, expected: &Path) {
    let index = "model.safetensors.index.json";
    let files = |d: &Path| -> Vec<String> {
        names(d)
            .into_iter()
            .filter(|f| f != "unshard.json")
            .collect()
    };
    assert_eq!(files(out), files(expected), "{name}: files");
    for f in files(expected) {
        if f.ends_with(".safetensors") || f == index {
            continue;
        }
        let a = std::fs::read(out.join(&f)).unwrap();
        let b = std::fs::read(expected.join(&f)).unwrap();
        assert!(a == b, "{name}: {f} differs from transformers' output");
    }
    let (a, b) = (tensors(out), tensors(expected));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{name}: tensors"
    );
    for (n, t) in &b {
        assert!(
            a[n] == *t,
            "{name}: tensor {n} differs from transformers' output"
        );
    }
    let meta = |d: &Path| {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join(index)).unwrap()).unwrap();
        v["metadata"].clone()
    };
    assert_eq!(meta(out), meta(expected), "{name}: index metadata");
}

#[test]
fn every_case_matches_transformers_byte_for_byte() {
    let cases = cases();
    // Llama 3 of both naming eras, Qwen3, Qwen3-MoE, DeepSeek-V3.
    assert_eq!(cases.len(), 5);
    let tmp = tempfile::tempdir().unwrap();
    for c in &cases {
        let out = tmp.path().join(&c.name);
        let expected = dir().join(&c.expected);
        // transformers wrote the Llama 3 weights with max_shard_size="40KB".
        let sharded = expected.join("model.safetensors.index.json").exists();
        let extra: &[&str] = if sharded {
            &["--max-shard-size", "40KB"]
        } else {
            &[]
        };
        let o = merge(&c.checkpoint, &c.base, &out, extra);
        let said = text(&o);
        assert!(o.status.success(), "{}: {said}", c.name);
        assert!(
            said.contains("the checkpoint holds torchtitan"),
            "{}: {said}",
            c.name
        );
        if sharded {
            assert_same_tensors(&c.name, &out, &expected);
        } else {
            assert_same_files(&c.name, &out, &expected);
        }
        let o = unshard(&[
            "verify",
            out.to_str().unwrap(),
            "--against",
            &c.checkpoint,
            "--base",
            &c.base,
        ]);
        assert!(o.status.success(), "{}: verify: {}", c.name, text(&o));
    }
}

#[test]
fn a_torchtitan_name_no_rule_explains_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("titan.safetensors");
    let bytes: Vec<u8> = [0.5f32; 4 * 32]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 32], &bytes).unwrap();
    safetensors::serialize_to_file(
        [
            ("tok_embeddings.weight", view.clone()),
            ("layers.0.attention.wz.weight", view),
        ],
        None,
        &ckpt,
    )
    .unwrap();
    let out = tmp.path().join("out");
    let o = merge(ckpt.to_str().unwrap(), "llama3/base", &out, &[]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(
        said.contains("'layers.0.attention.wz.weight' [4, 32]"),
        "{said}"
    );
    assert!(said.contains("no rule maps this one"), "{said}");
    assert!(!out.exists());
}

#[test]
fn the_model_only_bfloat16_last_step_matches_transformers_in_bfloat16() {
    // torchtitan's last step (`last_save_model_only`, `export_dtype="bfloat16"`):
    // the model keys only, cast; transformers' `.to(bfloat16)` + `save_pretrained`.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = merge(
        "qwen3/checkpoint/step-20",
        "qwen3/base",
        &out,
        &["--dtype", "bfloat16"],
    );
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("dropped: lm_head.weight (tied"), "{said}");
    assert_same_files("qwen3 bf16", &out, &dir().join("qwen3/expected_bf16"));
}

#[test]
fn verify_names_a_flipped_byte_in_a_reordered_query_row() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = merge("llama3/checkpoint/step-10", "llama3/base", &out, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let file = out.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = "model.layers.0.self_attn.q_proj.weight";
    let start = 8 + n + header[t]["data_offsets"][0].as_u64().unwrap() as usize;
    // Element [1, 2] of the [32, 32] float32 q_proj: torchtitan's row 2 of head 0.
    bytes[start + (32 + 2) * 4] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    let o = unshard(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        "llama3/checkpoint/step-10",
        "--base",
        "llama3/base",
    ]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("tensor '{t}': 1 of")), "{said}");
    assert!(said.contains("first at [1, 2]"), "{said}");
}
