//! The `unshard` binary on DeepSpeed ZeRO checkpoints (`fixtures/deepspeed/`, written
//! by DeepSpeed itself): merge, verify against the DeepSpeed folder, inspect, --tag,
//! and broken folders that fail clearly and leave nothing behind.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ds(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/deepspeed")
        .join(name)
}

fn unshard(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `merge CHECKPOINT [--base BASE] -o OUT -q EXTRA...`
fn merge(checkpoint: &Path, base: Option<&Path>, out: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = vec!["merge".as_ref(), checkpoint.as_os_str()];
    if let Some(b) = base {
        args.extend(["--base".as_ref(), b.as_os_str()]);
    }
    args.extend(["--output".as_ref(), out.as_os_str(), "-q".as_ref()]);
    args.extend(extra.iter().map(|s| std::ffi::OsStr::new(*s)));
    unshard(&args)
}

fn same_files(out: &Path, expected: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // unshard's record of the merge aside, the files transformers writes.
    let mut found = list(out);
    assert!(found.contains(&"unshard.json".to_string()));
    found.retain(|n| n != "unshard.json");
    assert_eq!(found, list(expected));
    for f in list(expected) {
        assert!(
            std::fs::read(out.join(&f)).unwrap() == std::fs::read(expected.join(&f)).unwrap(),
            "{f} differs from {}",
            expected.display()
        );
    }
}

#[test]
fn merged_output_verifies_against_the_deepspeed_folder() {
    for (case, base) in [
        ("llama_z3_bf16_w2", Some("base/llama-bf16")),
        ("qwen2_z2_bf16_w3_frozen", Some("base/qwen2-bf16")),
        ("llama_bf16_optimizer_w2", Some("base/llama-bf16")),
        ("llama_trainer_z3_w2", None),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let base = base.map(ds);
        let o = merge(&ds(case), base.as_deref(), &out, &[]);
        assert!(o.status.success(), "{case}: {}", text(&o.stderr));
        same_files(&out, &ds("expected").join(case));
        let mut args: Vec<&std::ffi::OsStr> =
            vec!["verify".as_ref(), out.as_os_str(), "--against".as_ref()];
        let ckpt = ds(case);
        args.push(ckpt.as_os_str());
        if let Some(b) = &base {
            args.extend(["--base".as_ref(), b.as_os_str()]);
        }
        args.push("-q".as_ref());
        let v = unshard(&args);
        assert!(
            v.status.success() && text(&v.stdout).starts_with("ok: "),
            "{case}: verify: {}{}",
            text(&v.stdout),
            text(&v.stderr)
        );
    }
}

/// The ZeRO factor combinations (`fixtures/deepspeed_combos/`): the binary merges
/// each into transformers' files and `verify` accepts the output against the
/// DeepSpeed folder.
#[test]
fn every_zero_combination_merges_and_verifies() {
    let dir = ds("../deepspeed_combos");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("cases.json")).unwrap()).unwrap();
    let fixtures = dir.join("..");
    for c in cases["cases"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let ckpt = fixtures.join(c["checkpoint"].as_str().unwrap());
        let base = fixtures.join(c["base"].as_str().unwrap());
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = merge(&ckpt, Some(&base), &out, &[]);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        same_files(&out, &fixtures.join(c["expected_dir"].as_str().unwrap()));
        let v = unshard(&[
            "verify".as_ref(),
            out.as_os_str(),
            "--against".as_ref(),
            ckpt.as_os_str(),
            "--base".as_ref(),
            base.as_os_str(),
            "-q".as_ref(),
        ]);
        assert!(
            v.status.success() && text(&v.stdout).starts_with("ok: "),
            "{name}: verify: {}{}",
            text(&v.stdout),
            text(&v.stderr)
        );
    }
}

#[test]
fn verify_notices_a_changed_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let base = ds("base/llama-bf16");
    assert!(merge(&ds("llama_z3_bf16_w2"), Some(&base), &out, &[])
        .status
        .success());
    // Verify against another run's checkpoint of the same model: values differ.
    let v = unshard(&[
        "verify".as_ref(),
        out.as_os_str(),
        "--against".as_ref(),
        ds("llama_z1_bf16_w2").as_os_str(),
        "--base".as_ref(),
        base.as_os_str(),
        "-q".as_ref(),
    ]);
    assert!(!v.status.success(), "{}", text(&v.stdout));
}

#[test]
fn inspect_shows_rebuilt_tensors_and_what_was_skipped() {
    let o = unshard(&["inspect".as_ref(), ds("qwen2_z3_bf16_w3").as_os_str()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let t = text(&o.stdout);
    assert!(t.contains("DeepSpeed ZeRO checkpoint"), "{t}");
    assert!(t.contains("model.layers.0.self_attn.q_proj.bias"), "{t}");
    assert!(t.contains("ZeRO-3 fp32 master, 3 rank(s)"), "{t}");
    assert!(t.contains("tied to model.embed_tokens.weight"), "{t}");
    assert!(t.contains("exp_avg") && t.contains("not read"), "{t}");

    let o = unshard(&[
        "inspect".as_ref(),
        "--json".as_ref(),
        ds("llama_trainer_z3_w2").as_os_str(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "deepspeed");
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 21);
    let down = tensors
        .iter()
        .find(|t| t["name"] == "model.layers.1.mlp.down_proj.weight")
        .unwrap();
    assert_eq!(down["shape"], serde_json::json!([16, 43]));
    assert_eq!(down["dtype"], "F32");
    let notes = v["notes"].to_string();
    assert!(notes.contains("exp_avg"), "{notes}");
    assert!(notes.contains("scheduler.pt"), "{notes}");
}

#[test]
fn tag_flag_picks_the_tag_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let base = ds("base/llama-bf16");
    // `latest` names a missing tag: the error says to pass --tag ...
    let o = merge(&ds("broken_latest"), Some(&base), &out, &[]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--tag global_step1"),
        "{}",
        text(&o.stderr)
    );
    assert!(!out.exists());
    // ... and with it the merge gives what the intact checkpoint gives.
    let o = merge(
        &ds("broken_latest"),
        Some(&base),
        &out,
        &["--tag", "global_step1"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    same_files(&out, &ds("expected/llama_z3_bf16_w2"));
}

#[test]
fn broken_folders_fail_and_leave_nothing() {
    let base = ds("base/llama-bf16");
    for (input, says) in [
        (
            "broken_missing_rank",
            "rank 2's optimizer-state file is missing",
        ),
        ("broken_mixed", "world size 2"),
        (
            "llama_z3_bf16_w2/global_step1/zero_pp_rank_1_mp_rank_00_model_states.pt",
            "[0]-shaped placeholders",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = merge(&ds(input), Some(&base), &out, &[]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{input}: {err}");
        assert!(
            err.contains(says) && err.contains("hint:"),
            "{input}: {err}"
        );
        assert!(!out.exists(), "{input}: output left behind");
    }
}
