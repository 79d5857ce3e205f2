//! Near misses name the right thing to pass: a part of a DCP directory, an
//! index.json, a training run's folder, a DCP directory that
//! lacks a rank's file. Each exits 1, writes nothing, and the hint names a path.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::fixtures;

fn merge(input: &Path) -> (Output, String) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args([
            "merge",
            input.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .args(["--base", "models/llama-config-only"])
        .current_dir(fixtures())
        .output()
        .unwrap();
    assert!(!out.exists(), "{}: output left behind", input.display());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, err)
}

fn refused(input: &str, says: &[&str]) -> String {
    let (o, err) = merge(Path::new(input));
    assert_eq!(o.status.code(), Some(1), "{input}: {err}");
    for s in says {
        assert!(err.contains(s), "{input}: expected {s:?} in:\n{err}");
    }
    err
}

#[test]
fn one_distcp_file_or_the_metadata_points_at_the_directory() {
    refused(
        "sharded/llama_w2_dcp/__0_0.distcp",
        &[
            "one rank's data file of a torch.distributed.checkpoint directory",
            "hint: pass the directory",
            "sharded/llama_w2_dcp",
        ],
    );
    refused(
        "sharded/llama_w2_dcp/.metadata",
        &[
            "the index file of a torch.distributed.checkpoint directory",
            "hint: pass the directory",
            "sharded/llama_w2_dcp",
        ],
    );
}

#[test]
fn an_index_json_points_at_its_directory() {
    refused(
        "models/llama-bf16-sharded/model.safetensors.index.json",
        &[
            "the index of a sharded model",
            "hint: pass the directory that holds it",
            "models/llama-bf16-sharded",
        ],
    );
}

#[test]
fn a_training_run_folder_lists_its_checkpoints_and_suggests_the_latest() {
    let err = refused(
        "arch_cases/run",
        &[
            "a training run's output folder",
            "checkpoint-1/",
            "checkpoint-2/",
            "the latest is arch_cases/run/checkpoint-2",
        ],
    );
    assert!(err.contains("hint: "), "{err}");
}

#[test]
fn a_dcp_directory_without_a_rank_file_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("dcp");
    std::fs::create_dir(&dir).unwrap();
    for f in [".metadata", "__0_0.distcp"] {
        std::fs::copy(fixtures().join("sharded/llama_w2_dcp").join(f), dir.join(f)).unwrap();
    }
    let (o, err) = merge(&dir);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("lacks __1_0.distcp (rank 1's data)"), "{err}");
    assert!(
        err.contains("hint: every rank writes its own file"),
        "{err}"
    );
}

/// A quantized base (torchao int8 weight-only, saved by transformers: int8 data and
/// scales, a `quantization_config`) is refused before anything is written, naming
/// the method and asking for the unquantized release; with a LoRA adapter too.
#[test]
fn a_quantized_base_is_refused_naming_the_method() {
    for input in ["ckpt/llama_policy.pt", "lora/adapters/llama_lora"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args(["merge", input, "-o", out.to_str().unwrap()])
            .args(["--base", "models/llama-torchao-int8"])
            .current_dir(fixtures())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{input}: {err}");
        assert!(
            err.contains("the base is quantized") && err.contains("quant_method 'torchao'"),
            "{input}: {err}"
        );
        assert!(
            err.contains("hint: pass the unquantized base"),
            "{input}: {err}"
        );
        assert!(!out.exists(), "{input}: output left behind");
    }
}
