//! DeepSpeed ZeRO checkpoints.
//!
//! The fixtures in `fixtures/deepspeed/` were written by DeepSpeed 0.19.8 on CPU
//! (`fixtures/gen_deepspeed.py`): ZeRO-1/2/3, bf16 and fp16, world sizes 2 and 3, one
//! and two parameter groups, frozen modules, a tied Qwen2, a `BF16_Optimizer` run
//! and an HF Trainer `checkpoint-N/`. For each, `<case>.expected.safetensors` holds
//! the fp32 weights DeepSpeed's own `zero_to_fp32` rebuilt (or, where it refuses,
//! the engine's live masters), and `expected/<case>/` what transformers'
//! `save_pretrained` wrote from them. Reading must give exactly those values and
//! merging exactly those files.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use unshard::merge::{self, MergeOptions};
use unshard::source::{self, Checkpoint, Format, OpenOptions, TensorSource};
use unshard::write::{read_tensor, NoProgress};
use unshard::{DType, Error};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn ds(name: &str) -> PathBuf {
    fixtures().join("deepspeed").join(name)
}

fn cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(ds("cases.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn s<'a>(c: &'a serde_json::Value, k: &str) -> &'a str {
    c[k].as_str().unwrap()
}

fn open(path: &Path) -> unshard::Result<source::Checkpoint> {
    source::open(path, &OpenOptions::default())
}

/// Every tensor, read whole and converted to float32 (exact for 16-bit values).
fn as_f32(ckpt: &source::Checkpoint) -> HashMap<String, (Vec<u64>, Vec<u8>)> {
    ckpt.tensors
        .iter()
        .map(|t| {
            let (bytes, _) = read_tensor(&ckpt.files, t, DType::F32)
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
            (t.name.clone(), (t.shape.clone(), bytes))
        })
        .collect()
}

/// The files of `dir` that transformers writes too: unshard's own record of the
/// merge (`unshard.json`, required here, checked in tests/manifest.rs) aside.
fn files_of(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != unshard::manifest::MANIFEST)
        .collect();
    v.sort();
    v
}

#[test]
fn every_case_reads_the_fp32_weights_deepspeed_rebuilds() {
    for c in cases() {
        let ckpt = open(&fixtures().join(s(&c, "checkpoint"))).unwrap();
        assert_eq!(ckpt.format, Format::DeepSpeed, "{}", s(&c, "name"));
        let got = as_f32(&ckpt);
        let want = as_f32(&open(&fixtures().join(s(&c, "expected_fp32"))).unwrap());
        let mut names: Vec<&String> = got.keys().collect();
        names.sort();
        let mut want_names: Vec<&String> = want.keys().collect();
        want_names.sort();
        assert_eq!(names, want_names, "{}", s(&c, "name"));
        for (n, v) in &want {
            assert!(got[n] == *v, "{}: tensor {n} differs", s(&c, "name"));
        }
        // Trained parameters come from the fp32 masters, never the 16-bit module.
        let q = ckpt
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.dtype, DType::F32, "{}", s(&c, "name"));
    }
}

#[test]
fn every_case_merges_into_the_files_transformers_wrote() {
    for c in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let opts = MergeOptions {
            checkpoint: fixtures().join(s(&c, "checkpoint")),
            base: c["base"].as_str().map(|b| fixtures().join(b)),
            output: out.clone(),
            ..MergeOptions::default()
        };
        merge::merge(&opts, &NoProgress).unwrap_or_else(|e| panic!("{}: {e}", s(&c, "name")));
        let expected = fixtures().join(s(&c, "expected_dir"));
        assert!(out.join(unshard::manifest::MANIFEST).is_file());
        assert_eq!(files_of(&out), files_of(&expected), "{}", s(&c, "name"));
        for f in files_of(&expected) {
            assert!(
                std::fs::read(out.join(&f)).unwrap() == std::fs::read(expected.join(&f)).unwrap(),
                "{}: {f} differs",
                s(&c, "name")
            );
        }
    }
}

#[test]
fn a_parameter_straddles_two_ranks_and_the_last_partition_is_short() {
    // ZeRO-2 over 3 ranks: some parameter lives in two ranks' files, and rank 2's
    // partition was saved without its padding.
    let ckpt = open(&ds("qwen2_z2_bf16_w3_frozen")).unwrap();
    let straddles = ckpt.tensors.iter().any(|t| {
        let mut files: Vec<usize> = t.pieces.iter().map(|p| p.file).collect();
        files.dedup();
        files.len() > 1
    });
    assert!(straddles);
    for t in &ckpt.tensors {
        source::check_coverage(&ckpt.path, t).unwrap();
    }
    // ZeRO-3 cuts every parameter over every rank.
    let ckpt = open(&ds("qwen2_z3_bf16_w3")).unwrap();
    let embed = named(&ckpt, "model.embed_tokens.weight");
    let mut files: Vec<usize> = embed.pieces.iter().map(|p| p.file).collect();
    files.dedup();
    assert_eq!(files.len(), 3);
}

#[test]
fn ranks_holding_padding_only_are_empty_and_skipped() {
    // ZeRO-2 over 12 ranks: the no-decay group (60 elements) is padded to 72, so
    // ranks 10 and 11 hold padding only and DeepSpeed saved their partitions
    // empty, as a small group over thousands of ranks. The weights are the ones
    // zero_to_fp32 rebuilds (every_case_... above); no piece is in those files.
    let ckpt = open(&ds("llama12_z2_fp16_w12")).unwrap();
    let norm = named(&ckpt, "model.norm.weight");
    assert!(norm.pieces.iter().all(|p| p.file < 10), "{:?}", norm.pieces);
    let files: Vec<usize> = norm.pieces.iter().map(|p| p.file).collect();
    assert_eq!(files.last(), Some(&9));
}

/// The checkpoint's tensor of that name.
fn named<'a>(ckpt: &'a Checkpoint, name: &str) -> &'a TensorSource {
    ckpt.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

#[test]
fn tied_alias_shares_the_embeddings_storage() {
    let ckpt = open(&ds("qwen2_z3_bf16_w3")).unwrap();
    let get = |n: &str| ckpt.tensors.iter().find(|t| t.name == n).unwrap();
    let (head, embed) = (get("lm_head.weight"), get("model.embed_tokens.weight"));
    assert!(head.storage.is_some() && head.storage == embed.storage);
    assert_eq!(head.pieces, embed.pieces);
}

#[test]
fn the_tag_folder_and_tag_option_are_taken() {
    let via_tag_dir = open(&ds("llama_z3_bf16_w2/global_step1")).unwrap();
    assert_eq!(via_tag_dir.format, Format::DeepSpeed);
    assert_eq!(via_tag_dir.tensors.len(), 21);
    let acc = open(&ds("llama_z2_bf16_w2_accelerate")).unwrap();
    assert!(acc.notes[0].contains("pytorch_model"), "{:?}", acc.notes);
    // `latest` names a missing tag; --tag picks the one that is there.
    let opts = OpenOptions {
        tag: Some("global_step1".into()),
        ..OpenOptions::default()
    };
    let c = source::open(&ds("broken_latest"), &opts).unwrap();
    assert_eq!(c.tensors.len(), 21);
    assert!(c.notes[0].contains("--tag"), "{:?}", c.notes);
}

#[test]
fn notes_say_what_was_skipped() {
    let c = open(&ds("llama_trainer_z3_w2")).unwrap();
    let notes = c.notes.join("\n");
    assert!(notes.contains("exp_avg"), "{notes}");
    assert!(notes.contains("not read"), "{notes}");
    assert!(notes.contains("rng_state_0.pth"), "{notes}");
    let c = open(&ds("llama_z1_bf16_w2")).unwrap();
    let notes = c.notes.join("\n");
    // ZeRO-1 records no frozen_param_shapes: the frozen embedding comes from the module.
    assert!(notes.contains("model.embed_tokens.weight"), "{notes}");
    assert!(notes.contains("16-bit"), "{notes}");
    // The stage is read from the pickled ZeroStageEnum; BF16_Optimizer records none.
    for (case, label) in [
        ("llama_z1_bf16_w2", "DeepSpeed ZeRO-1 checkpoint"),
        ("llama_z2_bf16_w2_accelerate", "DeepSpeed ZeRO-2 checkpoint"),
        ("llama_bf16_optimizer_w2", "DeepSpeed BF16_Optimizer"),
    ] {
        let c = open(&ds(case)).unwrap();
        assert!(c.notes[0].starts_with(label), "{case}: {:?}", c.notes);
    }
}

/// The error an input gives, with its hint.
fn error_of(path: &Path, opts: &OpenOptions) -> (Error, String, String) {
    let e = source::open(path, opts).unwrap_err();
    let hint = e.hint().unwrap_or_default();
    let msg = e.to_string();
    (e, msg, hint)
}

#[test]
fn broken_checkpoints_are_clear_errors() {
    let d = OpenOptions::default();
    let (_, msg, hint) = error_of(&ds("broken_missing_rank"), &d);
    assert!(
        msg.contains("zero_pp_rank_2_mp_rank_00_optim_states.pt") && msg.contains("rank 2"),
        "{msg}"
    );
    assert!(hint.contains("3"), "{hint}");

    let (_, msg, hint) = error_of(&ds("broken_latest"), &d);
    assert!(msg.contains("global_step7"), "{msg}");
    assert!(hint.contains("--tag global_step1"), "{hint}");

    let (_, msg, _) = error_of(&ds("broken_mixed"), &d);
    assert!(
        msg.contains("bf16_zero_pp_rank_1") && msg.contains("world size 2"),
        "{msg}"
    );

    let lone = ds("llama_z3_bf16_w2/global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt");
    let (_, msg, hint) = error_of(&lone, &d);
    assert!(
        msg.contains("[0]") && msg.contains("zero_pp_rank_0_mp_rank_00_model_states.pt"),
        "{msg}"
    );
    assert!(hint.contains("optim_states"), "{hint}");

    let optim = ds("llama_z1_bf16_w2/global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt");
    let (_, msg, hint) = error_of(&optim, &d);
    assert!(msg.contains("optimizer-state file"), "{msg}");
    assert!(hint.contains("folder"), "{hint}");

    let tagged = OpenOptions {
        tag: Some("global_step9".into()),
        ..OpenOptions::default()
    };
    let (_, msg, hint) = error_of(&ds("llama_z3_bf16_w2"), &tagged);
    assert!(msg.contains("global_step9"), "{msg}");
    assert!(hint.contains("global_step1"), "{hint}");
    let (e, _, _) = error_of(&fixtures().join("models/llama-bf16"), &tagged);
    assert!(matches!(e, Error::Usage(_)), "{e}");
}

#[test]
fn a_folder_without_optimizer_states_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, model) in [
        (
            "llama_z3_bf16_w2",
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
        ),
        ("llama_z2_fp16_w3_aligned", "mp_rank_00_model_states.pt"),
    ] {
        let dir = tmp.path().join(case);
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(ds(case).join("global_step1").join(model), dir.join(model)).unwrap();
        let (_, msg, hint) = error_of(&dir, &OpenOptions::default());
        assert!(msg.contains("optim_states"), "{msg}");
        assert!(
            hint.contains("zero_pp_rank_R_mp_rank_00_optim_states.pt"),
            "{hint}"
        );
    }
}
