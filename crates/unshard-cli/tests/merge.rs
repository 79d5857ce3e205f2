//! `unshard merge` end to end, against what transformers itself writes.
//!
//! `fixtures/expected/cases.json` lists checkpoints, bases and the directory that
//! transformers' `save_pretrained` wrote for them (`fixtures/gen_models.py`). Every
//! good case must reproduce that directory file for file and byte for byte: shards,
//! index, config.json, generation config and tokenizer files. Bad cases must fail
//! with exit code 1, name the culprit, and leave nothing behind.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fixtures, model_names, names, require, Tmpfs};

fn unshard(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Nothing was left in `parent` but what was there before (no output, no staging).
fn assert_left_nothing(parent: &Path) {
    let left = names(parent);
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn every_case_matches_transformers_byte_for_byte() {
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("expected/cases.json")).unwrap(),
    )
    .unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let tmp = tempfile::tempdir().unwrap();
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let out = tmp.path().join(name);
        let mut args = vec![
            "merge",
            c["checkpoint"].as_str().unwrap(),
            "--base",
            c["base"].as_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--dtype",
            c["dtype"].as_str().unwrap(),
            "--max-shard-size",
            c["max_shard_size"].as_str().unwrap(),
        ];
        if let Some(extra) = c["extra_args"].as_array() {
            args.extend(extra.iter().map(|a| a.as_str().unwrap()));
        }
        let o = unshard(&args, &fixtures());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let expected = fixtures().join(c["expected_dir"].as_str().unwrap());
        assert_eq!(model_names(&out), names(&expected), "{name}: files");
        for f in names(&expected) {
            let a = std::fs::read(out.join(&f)).unwrap();
            let b = std::fs::read(expected.join(&f)).unwrap();
            assert!(a == b, "{name}: {f} differs from transformers' output");
        }
    }
}

fn merge_fails(ckpt: &str, base: &str, extra: &[&str], must_name: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = vec![
        "merge",
        ckpt,
        "--base",
        base,
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = unshard(&args, &fixtures());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{ckpt}: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for n in must_name {
        assert!(err.contains(n), "{ckpt}: error should name {n}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert_left_nothing(tmp.path());
}

#[test]
fn an_unknown_tensor_is_named() {
    merge_fails(
        "ckpt/llama_extra_key.pt",
        "models/llama-bf16",
        &[],
        &["model.layers.0.mlp.extra_proj.weight", "not in the base"],
    );
}

#[test]
fn a_shape_mismatch_names_the_tensor_and_both_shapes() {
    let o = {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        unshard(
            &[
                "merge",
                "ckpt/llama_shape_mismatch.pt",
                "--base",
                "models/llama-bf16",
                "-o",
                out.to_str().unwrap(),
            ],
            &fixtures(),
        )
    };
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err.contains("different shape") && err.contains("checkpoint [") && err.contains("base ["),
        "{err}"
    );
    merge_fails(
        "ckpt/llama_shape_mismatch.pt",
        "models/llama-bf16",
        &[],
        &["shape"],
    );
}

#[test]
fn fp16_overflow_names_the_tensor_and_count() {
    merge_fails(
        "ckpt/qwen2_overflow.pt",
        "models/qwen2-fp16",
        &[],
        &["overflows", "become inf", "--allow-overflow"],
    );
}

/// Writes the base's tensors minus `skip` as a safetensors checkpoint.
fn checkpoint_without(skip: &str, dir: &Path) -> PathBuf {
    let bytes = std::fs::read(fixtures().join("models/llama-bf16/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != skip)
        .collect();
    let path = dir.join("partial.safetensors");
    safetensors::serialize_to_file(kept, None, &path).unwrap();
    path
}

#[test]
fn base_only_tensors_are_kept_and_reported_or_refused_under_strict() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = checkpoint_without("model.norm.weight", tmp.path());
    let out = tmp.path().join("out");
    let args = [
        "merge",
        ckpt.to_str().unwrap(),
        "--base",
        "models/llama-bf16",
        "-o",
        out.to_str().unwrap(),
    ];
    let o = unshard(&args, &fixtures());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("from base: model.norm.weight"),
        "{}",
        stderr(&o)
    );
    let a = std::fs::read(out.join("model.safetensors")).unwrap();
    let b = std::fs::read(fixtures().join("models/llama-bf16/model.safetensors")).unwrap();
    assert_eq!(a, b, "same tensors, same bytes: the output equals the base");
    std::fs::remove_dir_all(&out).unwrap();

    let mut strict = args.to_vec();
    strict.push("--strict");
    let o = unshard(&strict, &fixtures());
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--strict") && stderr(&o).contains("model.norm.weight"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}

#[test]
fn refuses_a_non_empty_output_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let args = [
        "merge",
        "ckpt/llama_policy.pt",
        "--base",
        "models/llama-bf16",
        "-o",
        out.to_str().unwrap(),
    ];
    let o = unshard(&args, &fixtures());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    let mut forced = args.to_vec();
    forced.push("--force");
    let o = unshard(&forced, &fixtures());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("model.safetensors").is_file());
    assert_eq!(names(tmp.path()), vec!["out"]);
}

#[test]
fn refuses_to_write_into_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir(&base).unwrap();
    for f in names(&fixtures().join("models/llama-bf16")) {
        std::fs::copy(fixtures().join("models/llama-bf16").join(&f), base.join(&f)).unwrap();
    }
    let before = names(&base);
    for out in [base.clone(), base.join("sub")] {
        let o = unshard(
            &[
                "merge",
                "ckpt/llama_policy.pt",
                "--base",
                base.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--force",
            ],
            &fixtures(),
        );
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stderr(&o).contains("input"), "{}", stderr(&o));
    }
    assert_eq!(names(&base), before);
}

#[test]
fn usage_errors_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    for args in [
        vec!["merge", "ckpt/llama_policy.pt"],
        vec![
            "merge",
            "ckpt/llama_policy.pt",
            "-o",
            out.to_str().unwrap(),
            "--max-shard-size",
            "lots",
        ],
        vec![
            "merge",
            "ckpt/llama_policy.pt",
            "-o",
            out.to_str().unwrap(),
            "--rename",
            "(",
        ],
        vec![
            "merge",
            "ckpt/llama_policy.pt",
            "-o",
            out.to_str().unwrap(),
            "--dtype",
            "float8",
        ],
    ] {
        let o = unshard(&args, &fixtures());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    assert_left_nothing(tmp.path());
}

/// A bare state dict with no config anywhere (no --base, none beside it) would give
/// a directory transformers cannot load: refused before anything is written, with
/// the options that fix it named; `--weights-only` writes the weights alone.
#[test]
fn without_a_config_anywhere_the_merge_is_refused_unless_weights_only() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("policy.pt");
    std::fs::copy(fixtures().join("ckpt/llama_policy.pt"), &ckpt).unwrap();
    let c = ckpt.to_str().unwrap();
    for part in [None, Some("0/2")] {
        let mut args = vec!["merge", c, "out"];
        args.extend(part.iter().flat_map(|p| ["--part", p]));
        let o = unshard(&args, tmp.path());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("policy.pt: no config.json") && err.contains("transformers cannot load"),
            "{err}"
        );
        assert!(
            err.contains("hint: pass --base") && err.contains("--weights-only"),
            "{err}"
        );
        assert_eq!(names(tmp.path()), ["policy.pt"], "{args:?}: written");
    }

    let o = unshard(&["merge", c, "out", "--weights-only", "-q"], tmp.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let written = names(&tmp.path().join("out"));
    assert_eq!(written, ["model.safetensors", "unshard.json"]);
}

/// A base that has weights but no config.json is refused the same way, naming it.
#[test]
fn a_base_without_a_config_is_refused_unless_weights_only() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("weights");
    std::fs::create_dir(&base).unwrap();
    std::fs::copy(
        fixtures().join("models/llama-bf16/model.safetensors"),
        base.join("model.safetensors"),
    )
    .unwrap();
    let ckpt = fixtures().join("ckpt/llama_policy.pt");
    let args = [
        "merge",
        ckpt.to_str().unwrap(),
        "--base",
        "weights",
        "-o",
        "out",
    ];
    let o = unshard(&args, tmp.path());
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("weights: the base has no config.json"),
        "{err}"
    );
    assert!(err.contains("hint: pass as --base"), "{err}");
    assert_eq!(names(tmp.path()), ["weights"]);
    let o = unshard(&[&args[..], &["--weights-only"]].concat(), tmp.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!tmp.path().join("out/config.json").exists());
}

/// `--base DIR/config.json` is taken as `--base DIR`.
#[test]
fn a_base_given_as_its_config_json_is_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "models/llama-bf16/config.json",
            "-o",
            out.to_str().unwrap(),
        ],
        &fixtures(),
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16");
    assert_eq!(model_names(&out), names(&expected));
    for f in names(&expected) {
        assert!(
            std::fs::read(out.join(&f)).unwrap() == std::fs::read(expected.join(&f)).unwrap(),
            "{f} differs from transformers' output"
        );
    }
}

/// `--json`: the merge report on stdout, listing every file written; the summary
/// is not printed.
#[test]
fn json_prints_the_report_with_the_files_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(
        &[
            "merge",
            "ckpt/llama_fsdp_prefixed.pt",
            "--base",
            "models/llama-bf16-sharded",
            "--max-shard-size",
            "100KB",
            "-o",
            out.to_str().unwrap(),
            "--json",
        ],
        &fixtures(),
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        !err.contains("wrote ") && !err.contains("tensors: "),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut files: Vec<String> = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    files.sort();
    assert_eq!(files, names(&out), "{v}");
    assert!(files.iter().filter(|f| f.ends_with(".safetensors")).count() > 1);
    assert_eq!(v["checkpoint_format"], "torch-zip", "{v}");
    assert_eq!(v["tensors_written"], 21, "{v}");
    assert!(v["renamed"].as_array().unwrap().len() == 23, "{v}");
    assert!(v["dropped"].as_array().unwrap().len() == 2, "{v}");
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(out.join(f)).unwrap().len())
        .sum();
    assert!(v["bytes_written"].as_u64().unwrap() <= bytes, "{v}");

    // With --part the report is each part's: refused as a usage error.
    let o = unshard(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "x",
            "--part",
            "0/2",
            "--json",
        ],
        &fixtures(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn without_a_base_the_output_is_the_checkpoint_minus_buffers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(
        &[
            "merge",
            "ckpt/llama_fsdp_prefixed.pt",
            "-o",
            out.to_str().unwrap(),
            "--weights-only",
        ],
        &fixtures(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rotary_emb.inv_freq"), "{err}");
    assert!(err.contains("no config.json"), "{err}");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut got: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    got.sort();
    let expected_bytes =
        std::fs::read(fixtures().join("expected/llama_policy_into_llama-bf16/model.safetensors"))
            .unwrap();
    let expected = safetensors::SafeTensors::deserialize(&expected_bytes).unwrap();
    let mut want: Vec<String> = expected.names().into_iter().map(str::to_string).collect();
    want.sort();
    assert_eq!(got, want, "prefixes stripped, inv_freq dropped");
    // No base: dtype is the checkpoint's own (float32), nothing widened or narrowed.
    assert!(st
        .tensors()
        .iter()
        .all(|(_, v)| v.dtype() == safetensors::Dtype::F32));
}

#[test]
#[ignore = "needs root to mount a tmpfs (see docs/testing.md)"]
fn a_full_disk_is_a_clear_error_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("tiny");
    let tmpfs = require(Tmpfs::mount(&mnt, "size=64k"), "mount a tmpfs");
    let out = mnt.join("out");
    let o = unshard(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--weights-only",
            "--dtype",
            "float32",
            "-o",
            out.to_str().unwrap(),
        ],
        &fixtures(),
    );
    let left = names(&mnt);
    drop(tmpfs);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("No space left on device") || err.contains("disk is full"),
        "{err}"
    );
    assert!(err.contains("hint: the disk is full"), "{err}");
    assert!(left.is_empty(), "left behind on the full disk: {left:?}");
}

#[test]
fn the_os_system_pickle_never_runs() {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "malicious_os_system.pt",
        "malicious_legacy.pt",
        "malicious_eval.pt",
    ] {
        let p = fixtures().join("torch").join(f);
        let o = unshard(&["inspect", p.to_str().unwrap()], tmp.path());
        assert!(o.status.success(), "{f}: {}", stderr(&o));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("not executed"), "{f}: {text}");
        let out = tmp.path().join(format!("out-{f}"));
        let o = unshard(
            &[
                "merge",
                p.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ],
            tmp.path(),
        );
        assert!(o.status.success(), "{f}: {}", stderr(&o));
        assert!(
            !tmp.path().join("unshard_pwned_marker").exists(),
            "{f} ran its payload"
        );
        assert!(!Path::new("unshard_pwned_marker").exists());
    }
}

#[test]
fn broken_inputs_give_one_line_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "truncated.pt",
        "empty.pt",
        "random.pt",
        "not_a_checkpoint.txt",
    ] {
        let p = fixtures().join("torch").join(f);
        for cmd in ["inspect", "merge"] {
            let out = tmp.path().join("out");
            let args: Vec<&str> = if cmd == "inspect" {
                vec!["inspect", p.to_str().unwrap()]
            } else {
                vec!["merge", p.to_str().unwrap(), "-o", out.to_str().unwrap()]
            };
            let o = unshard(&args, tmp.path());
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{f}: {err}");
            let first = err.lines().next().unwrap_or("");
            assert!(
                first.starts_with("error: ") && first.contains(f),
                "{f}: {err}"
            );
            assert_left_nothing(tmp.path());
        }
    }
}

#[test]
fn a_single_rank_file_is_refused_with_a_pointer_to_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(
        &[
            "merge",
            "sharded/llama_w2_ranks/model_world_size_2_rank_0.pt",
            "--base",
            "models/llama-bf16",
            "-o",
            out.to_str().unwrap(),
        ],
        &fixtures(),
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("one rank's shard") && err.contains("hint: pass the directory"),
        "{err}"
    );
    assert_left_nothing(tmp.path());
}

/// An output whose directory cannot be written: the message names the output and
/// its directory, not the internal staging name, and says what to do.
#[test]
fn an_unwritable_output_directory_is_named_with_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures().join("ckpt/llama_policy.pt");
    let base = fixtures().join("models/llama-bf16");
    // /proc takes no new directories, even for root.
    let o = unshard(
        &[
            "merge",
            ckpt.to_str().unwrap(),
            "/proc/unshard-out",
            "--base",
            base.to_str().unwrap(),
        ],
        tmp.path(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/proc/unshard-out: cannot write into /proc"),
        "{err}"
    );
    assert!(
        err.contains("hint: choose an output in a directory you can write to"),
        "{err}"
    );
    assert!(!err.contains("unshard-tmp"), "{err}");
}

/// A folder holding a DeepSpeed checkpoint folder (`ckpt/latest`) among other
/// things points to that folder.
#[test]
fn a_folder_around_a_deepspeed_checkpoint_points_to_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let ckpt = run.join("ckpt");
    let src = fixtures().join("deepspeed/llama_bf16_optimizer_w2");
    for entry in walkdir(&src) {
        let to = ckpt.join(entry.strip_prefix(&src).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &to).unwrap();
    }
    std::fs::write(run.join("notes.txt"), "lr 1e-5").unwrap();
    std::fs::create_dir(run.join("logs")).unwrap();
    let out = tmp.path().join("out");
    let o = unshard(
        &[
            "merge",
            run.to_str().unwrap(),
            out.to_str().unwrap(),
            "--weights-only",
        ],
        tmp.path(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "hint: pass the checkpoint folder: {}",
            ckpt.display()
        )),
        "{err}"
    );
    assert!(!out.exists());
    // What the hint names merges.
    let o = unshard(
        &[
            "merge",
            ckpt.to_str().unwrap(),
            out.to_str().unwrap(),
            "--weights-only",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Every file under `dir`.
fn walkdir(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        } else {
            out.push(p);
        }
    }
    out
}
