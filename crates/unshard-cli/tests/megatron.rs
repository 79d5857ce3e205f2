//! Megatron-Core `torch_dist` checkpoints merged onto config-only bases, against
//! the Hugging Face model each was made from.
//!
//! `fixtures/megatron/cases.json` lists per case the checkpoint (a save folder
//! with `latest_checkpointed_iteration.txt`, or a `torch_dist` directory), the
//! config-only base and the expected directory: the Hugging Face model's own
//! `save_pretrained`. Every case must reproduce it file for file and byte for
//! byte, and `unshard verify` must pass on the result.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{fixtures, model_names, names, text};

fn unshard<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    common::unshard_in(&fixtures().join("megatron"), args)
}

/// `(input, base, expected_dir)` of a case, relative to `fixtures/megatron/`.
fn case(name: &str) -> (String, String, String) {
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("megatron/cases.json")).unwrap(),
    )
    .unwrap();
    let c = &json["cases"][name];
    let s = |k: &str| c[k].as_str().unwrap().to_string();
    (s("input"), s("base"), s("expected_dir"))
}

/// Merges the case onto its config-only base, compares every file with the
/// expected directory's and runs `verify`; returns what the merge said.
fn matches_transformers(name: &str) -> String {
    let (input, base, expected) = case(name);
    let expected = fixtures().join("megatron").join(expected);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        &input,
        "--base",
        &base,
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(o.status.success(), "{name}: {said}");
    // The `.metadata` classes (torch's save plans, Megatron-Core 0.15's subclasses)
    // are plain dataclasses.
    assert!(!said.contains("would run code"), "{name}: {said}");
    assert_eq!(model_names(&out), names(&expected), "{name}: files");
    for f in names(&expected) {
        let a = std::fs::read(out.join(&f)).unwrap();
        let b = std::fs::read(expected.join(&f)).unwrap();
        assert!(a == b, "{name}: {f} differs from the Hugging Face model's");
    }
    let o = unshard(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        &input,
        "--base",
        &base,
    ]);
    assert!(o.status.success(), "{name}: verify: {}", text(&o));
    said
}

#[test]
fn stacked_layers_in_an_iteration_folder() {
    let said = matches_transformers("llama_tp2");
    assert!(said.contains("iter_0000100/"), "{said}");
    assert!(said.contains("Megatron-Core names"), "{said}");
}

#[test]
fn per_layer_keys() {
    matches_transformers("llama_tp2_per_layer");
}

#[test]
fn tied_embeddings_and_a_module_prefix() {
    matches_transformers("llama_tp2_tied_module_prefix");
}

#[test]
fn a_padded_vocabulary_is_trimmed_to_the_base_s() {
    let said = matches_transformers("llama_tp2_padded_vocab");
    assert!(said.contains("trimmed to the base's 251"), "{said}");
}

#[test]
fn qkv_biases_in_the_grouped_layout() {
    matches_transformers("qwen2_tp2_qkv_bias");
}

#[test]
fn stacked_experts_and_the_router() {
    matches_transformers("mixtral_tp2_moe");
}

#[test]
fn dense_and_moe_layers_with_qk_norms() {
    matches_transformers("qwen3_moe_tp2_dense_first");
}

#[test]
fn the_common_state_inside_the_dcp() {
    matches_transformers("llama_tp2_common_in_dcp");
}

#[test]
fn megatron_core_0_15_metadata() {
    matches_transformers("llama_tp2_mcore015");
}

#[test]
fn a_base_with_other_weights_gives_way_to_every_checkpoint_tensor() {
    let (input, _, expected) = case("llama_tp2");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        &input,
        "--base",
        "base/llama-bf16",
        "--strict",
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("0 from the base"), "{said}");
    let file = "model.safetensors";
    let a = std::fs::read(out.join(file)).unwrap();
    let b = std::fs::read(fixtures().join("megatron").join(expected).join(file)).unwrap();
    assert!(a == b, "{file} differs from the Hugging Face model's");
}

#[test]
fn megatron_names_without_a_config_or_training_arguments_ask_for_a_base() {
    // A torch_dist directory whose common.pt (the training arguments) is gone.
    let (input, _, _) = case("llama_tp2_per_layer");
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixtures().join("megatron").join(&input), &ckpt);
    std::fs::remove_file(ckpt.join("common.pt")).unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(!o.status.success(), "{said}");
    assert!(said.contains("is a Megatron-Core name"), "{said}");
    assert!(said.contains("nor training arguments"), "{said}");
    assert!(said.contains("--base"), "{said}");
    assert!(!out.exists());
}

/// `(name, dtype, shape, data)` of every tensor of a safetensors file.
fn tensors(file: &Path) -> Vec<(String, String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<_> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(k, v)| {
            let at = |i: usize| 8 + n + v["data_offsets"][i].as_u64().unwrap() as usize;
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let dtype = v["dtype"].as_str().unwrap().to_string();
            (k.clone(), dtype, shape, bytes[at(0)..at(1)].to_vec())
        })
        .collect();
    out.sort();
    out
}

fn json_of(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Every case merged without `--base`: the config comes from the training
/// arguments the checkpoint holds. The tensors are the Hugging Face model's,
/// byte for byte (what the merge onto the config-only base writes), but for the
/// padded vocabulary, kept whole (its first rows are the model's); config.json
/// has every field of transformers' but the token ids; verify passes.
#[test]
fn every_case_merges_without_a_base_from_its_training_arguments() {
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("megatron/cases.json")).unwrap(),
    )
    .unwrap();
    let m = fixtures().join("megatron");
    for name in json["cases"].as_object().unwrap().keys() {
        let (input, base, expected) = case(name);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = unshard(&["merge", &input, "--output", out.to_str().unwrap()]);
        let said = text(&o);
        assert!(o.status.success(), "{name}: {said}");
        assert!(
            said.contains("config.json was derived from the Megatron training arguments"),
            "{name}: {said}"
        );
        assert!(said.contains("vocab_size"), "{name}: {said}");
        assert_eq!(
            model_names(&out),
            ["config.json", "model.safetensors"],
            "{name}"
        );
        let got = tensors(&out.join("model.safetensors"));
        let want = tensors(&m.join(&expected).join("model.safetensors"));
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((&g.0, &g.1), (&w.0, &w.1), "{name}");
            if g.2 == w.2 {
                assert!(
                    g.3 == w.3,
                    "{name}: {} differs from the Hugging Face model's",
                    g.0
                );
            } else {
                // The padded vocabulary: 256 rows for the tokenizer's 251.
                assert_eq!(name, "llama_tp2_padded_vocab");
                assert_eq!(
                    (g.2[0], w.2[0], &g.2[1..]),
                    (256, 251, &w.2[1..]),
                    "{}",
                    g.0
                );
                assert!(
                    g.3[..w.3.len()] == w.3[..],
                    "{name}: {}'s first rows differ",
                    g.0
                );
            }
        }
        let cfg = json_of(&out.join("config.json"));
        let want = json_of(&m.join(&base).join("config.json"));
        for (k, v) in &want {
            match k.as_str() {
                "bos_token_id" | "eos_token_id" | "pad_token_id" => {
                    assert_eq!(cfg[k], serde_json::Value::Null, "{name}: {k}")
                }
                "transformers_version" => assert!(!cfg.contains_key(k)),
                "vocab_size" if name == "llama_tp2_padded_vocab" => assert_eq!(cfg[k], 256),
                _ => assert_eq!(cfg.get(k), Some(v), "{name}: config field {k}"),
            }
        }
        assert!(cfg.keys().all(|k| want.contains_key(k)), "{name}: {cfg:?}");
        let o = unshard(&["verify", out.to_str().unwrap(), "--against", &input]);
        assert!(o.status.success(), "{name}: verify: {}", text(&o));
    }
}

/// A copy of case `name`'s checkpoint in `tmp/ckpt` whose `common.pt` is the one
/// of the training arguments `args` (`fixtures/megatron/args/<args>/`).
fn with_common_pt(name: &str, args: &str, tmp: &Path) -> PathBuf {
    let (input, _, _) = case(name);
    let m = fixtures().join("megatron");
    let ckpt = tmp.join("ckpt");
    copy_dir(&m.join(&input), &ckpt);
    std::fs::copy(
        m.join("args").join(args).join("common.pt"),
        ckpt.join("common.pt"),
    )
    .unwrap();
    ckpt
}

#[test]
fn training_arguments_no_derived_config_expresses_are_refused_by_name() {
    // A torch_dist directory whose training arguments turn on Llama 3.1's rope
    // scaling: a config without it would load and compute another model.
    let (_, base, expected) = case("llama_tp2_per_layer");
    let m = fixtures().join("megatron");
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = with_common_pt("llama_tp2_per_layer", "llama_rope_scaling", tmp.path());
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains("use_rope_scaling = True"), "{said}");
    assert!(said.contains("common.pt"), "{said}");
    assert!(
        said.contains("hint: pass --base <HF model dir or Hub id>"),
        "{said}"
    );
    assert!(!out.exists());
    // With a base, the arguments are not read.
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--base",
        &base,
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let a = std::fs::read(out.join("model.safetensors")).unwrap();
    let b = std::fs::read(m.join(&expected).join("model.safetensors")).unwrap();
    assert!(a == b);
}

#[test]
fn training_arguments_that_would_run_code_are_reported_and_refused_on_request() {
    // common.pt is no file of the DCP reader: its pickle is audited when the
    // arguments are read for a derived config.
    let (_, _, expected) = case("llama_tp2_per_layer");
    let m = fixtures().join("megatron");
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = with_common_pt("llama_tp2_per_layer", "llama_hostile", tmp.path());
    let out = tmp.path().join("out");
    let merge = |extra: &[&str]| {
        let mut args = vec![
            "merge",
            ckpt.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        unshard(&args)
    };
    let o = merge(&["--refuse-unsafe"]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(
        said.contains("common.pt") && said.contains("posix.system"),
        "{said}"
    );
    assert!(!out.exists());
    let o = merge(&[]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("would run code") && said.contains("posix.system"),
        "{said}"
    );
    let a = std::fs::read(out.join("model.safetensors")).unwrap();
    let b = std::fs::read(m.join(&expected).join("model.safetensors")).unwrap();
    assert!(a == b);
}

#[test]
fn a_verl_dist_ckpt_folder_takes_the_huggingface_folder_beside_it() {
    // verl's Megatron backend: `actor/dist_ckpt/` passed itself, with
    // `actor/huggingface/` beside it. Its config (vocab_size 251) trims the padded
    // vocabulary, which a config derived from the arguments would keep.
    let (input, base, expected) = case("llama_tp2_padded_vocab");
    let m = fixtures().join("megatron");
    let tmp = tempfile::tempdir().unwrap();
    let actor = tmp.path().join("actor");
    copy_dir(&m.join(&input), &actor.join("dist_ckpt"));
    copy_dir(&m.join(&base), &actor.join("huggingface"));
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        actor.join("dist_ckpt").to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("taken from") && said.contains("huggingface"),
        "{said}"
    );
    assert!(!said.contains("derived"), "{said}");
    assert_eq!(model_names(&out), names(&m.join(&expected)));
    for f in names(&m.join(&expected)) {
        let a = std::fs::read(out.join(&f)).unwrap();
        let b = std::fs::read(m.join(&expected).join(&f)).unwrap();
        assert!(a == b, "{f} differs from the Hugging Face model's");
    }
}

#[test]
fn the_legacy_layout_of_tensor_and_pipeline_ranks() {
    // mp_rank_TT_PPP folders: local layer numbers per stage, SwiGLU fc1 as
    // [gate_i; up_i] per rank, column- and row-parallel slices.
    let said = matches_transformers("llama_tp2_pp2_legacy");
    assert!(said.contains("iter_0000100/"), "{said}");
    assert!(
        said.contains("2 tensor x 2 pipeline rank folder(s) joined (4 layers)"),
        "{said}"
    );
}

#[test]
fn a_missing_rank_folder_is_named() {
    let (input, base, _) = case("llama_tp2_pp2_legacy");
    let m = fixtures().join("megatron");
    let tmp = tempfile::tempdir().unwrap();
    let iter = tmp.path().join("iter_0000100");
    for r in ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000"] {
        copy_dir(&m.join(&input).join("iter_0000100").join(r), &iter.join(r));
    }
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        iter.to_str().unwrap(),
        "--base",
        m.join(&base).to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(!o.status.success(), "{said}");
    assert!(
        said.contains("mp_rank_01_001/ (tensor rank 1, pipeline stage 1) is missing"),
        "{said}"
    );
    assert!(said.contains("copy every rank folder"), "{said}");
    assert!(!out.exists());
}

/// The header length and the data offset of `tensor` in a safetensors file.
fn data_offset(file: &Path, tensor: &str) -> usize {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize
}

#[test]
fn verify_names_a_flipped_byte_in_a_split_q_projection() {
    let (input, base, _) = case("llama_tp2");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        &input,
        "--base",
        &base,
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // Layer 1's q_proj, row 40 (query group 1's rows), column 3: bf16 of 64 columns.
    let t = "model.layers.1.self_attn.q_proj.weight";
    let file = out.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[data_offset(&file, t) + (40 * 64 + 3) * 2] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    let o = unshard(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        &input,
        "--base",
        &base,
    ]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("tensor '{t}': 1 of")), "{said}");
    assert!(said.contains("first at [40, 3]"), "{said}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_verl_actor_folder_reads_dist_ckpt_with_huggingface_as_the_base() {
    // verl's Megatron backend: `actor/dist_ckpt/` beside `actor/huggingface/`.
    let (input, base, expected) = case("llama_tp2_per_layer");
    let m = fixtures().join("megatron");
    let tmp = tempfile::tempdir().unwrap();
    let actor = tmp.path().join("actor");
    copy_dir(&m.join(&input), &actor.join("dist_ckpt"));
    copy_dir(&m.join(&base), &actor.join("huggingface"));
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        actor.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("dist_ckpt/ inside"), "{said}");
    let file = "model.safetensors";
    let a = std::fs::read(out.join(file)).unwrap();
    let b = std::fs::read(m.join(expected).join(file)).unwrap();
    assert!(a == b, "{file} differs from the Hugging Face model's");
}
