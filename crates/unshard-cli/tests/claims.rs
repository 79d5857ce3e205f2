//! README claims that the main merge cases do not reach, each pinned by a test that
//! fails when the claim breaks.
//!
//! `fixtures/claims/cases.json` (written by `fixtures/gen_claims.py`) lists merges
//! whose right output transformers wrote: `--rename`, `--key`, the rotary buffers
//! dropped, each tied-embedding rule alone, a tensor larger than `--max-shard-size`.
//! The hostile files in `fixtures/claims/hostile/` are real torch / safetensors / DCP
//! files with one field made hostile, one per bound listed in docs/hostile-inputs.md.
//! The durability test records the merge's system calls with strace.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fixtures, names, require, Tmpfs};

fn unshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(fixtures())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn claims() -> PathBuf {
    fixtures().join("claims")
}

fn cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(claims().join("cases.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

/// Runs one case of `fixtures/claims/cases.json` and compares the output with
/// transformers' directory; returns the merge's report (stderr).
fn run_case(name: &str) -> String {
    let all = cases();
    let c = all
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no case '{name}' in fixtures/claims/cases.json"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = vec![
        "merge",
        c["checkpoint"].as_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend(
        c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap()),
    );
    // A case without a base has no config.json to write: its output is the
    // weights alone, which is what the case compares.
    if !args.contains(&"--base") {
        args.push("--weights-only");
    }
    let o = unshard(&args);
    assert!(o.status.success(), "{name}: {}", stderr(&o));
    let expected = fixtures().join(c["expected_dir"].as_str().unwrap());
    let files: Vec<String> = match c["files"].as_array() {
        Some(f) => f.iter().map(|f| f.as_str().unwrap().to_string()).collect(),
        None => names(&expected),
    };
    // Every weight file transformers wrote, and no other.
    let weights = |d: &Path| -> Vec<String> {
        names(d)
            .into_iter()
            .filter(|f| f.ends_with(".safetensors") || f.ends_with(".index.json"))
            .collect()
    };
    assert_eq!(weights(&out), weights(&expected), "{name}: weight files");
    for f in &files {
        let a = std::fs::read(out.join(f)).unwrap_or_default();
        let b = std::fs::read(expected.join(f)).unwrap();
        assert!(a == b, "{name}: {f} differs from transformers' output");
    }
    stderr(&o)
}

#[test]
fn every_claims_case_is_a_test() {
    // Each case below has its own test; this one fails when a case is added to the
    // generator without one.
    let mut got: Vec<String> = cases()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "key",
            "max_shard_size_10KB",
            "max_shard_size_equal_8192B",
            "rename",
            "rotary_buffers",
            "tie_base_lacks_head",
            "tie_config_says_so",
            "tie_shared_storage_no_base",
        ]
    );
}

#[test]
fn rename_rules_are_applied_in_order_with_groups() {
    run_case("rename");
}

#[test]
fn key_picks_the_state_dict() {
    run_case("key");
}

#[test]
fn key_is_honoured_by_inspect_and_verify() {
    let ckpt = "claims/ckpt/llama_two_state_dicts.pt";
    let o = unshard(&["inspect", ckpt, "--json", "--key", "ema_state"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["key"], "ema_state");
    assert_eq!(v["total_tensors"], 21);
    // transformers' output of the ema_state merge verifies against that key only.
    let out = "expected/llama_policy_into_llama-bf16";
    let args = |key: Option<&str>| {
        let mut a = vec![
            "verify",
            out,
            "--against",
            ckpt,
            "--base",
            "models/llama-bf16",
        ];
        if let Some(k) = key {
            a.extend(["--key", k]);
        }
        unshard(&a)
    };
    let o = args(Some("ema_state"));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = args(None);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn rotary_buffers_are_dropped() {
    run_case("rotary_buffers");
}

#[test]
fn tied_head_config_says_tie() {
    run_case("tie_config_says_so");
}

#[test]
fn tied_head_config_silent_and_base_lacks_it() {
    let report = run_case("tie_base_lacks_head");
    // GPT-2's embedding is found by name (no shared storage to point at it).
    assert!(
        report.contains("dropped: lm_head.weight (tied to transformer.wte.weight; written once)"),
        "{report}"
    );
}

#[test]
fn tied_head_shares_storage_with_the_embedding() {
    run_case("tie_shared_storage_no_base");
}

#[test]
fn a_tensor_over_the_shard_limit_gets_a_shard_of_its_own() {
    run_case("max_shard_size_10KB");
}

#[test]
fn a_tensor_of_exactly_the_shard_limit_is_not_set_apart() {
    run_case("max_shard_size_equal_8192B");
}

#[test]
fn two_tensors_renamed_to_one_name_are_an_error_naming_both() {
    // gate_proj and up_proj have one shape, so only the duplicate check stops this.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        "--base",
        "models/llama-bf16",
        "--rename",
        "gate_proj=up_proj",
        "--output",
        out.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("'model.layers.0.mlp.gate_proj.weight' and 'model.layers.0.mlp.up_proj.weight' both become 'model.layers.0.mlp.up_proj.weight'"),
        "{err}"
    );
    assert!(err.contains("hint: "), "{err}");
    assert!(names(tmp.path()).is_empty(), "left behind");
}

/// `unshard inspect` on a hostile file: exit 1, no panic, an error naming the file
/// and saying `what`.
fn refused(file: &str, what: &str) {
    let path = format!("claims/hostile/{file}");
    let o = unshard(&["inspect", &path]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{file}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains(file),
        "{file}: the error should name the file: {err}"
    );
    assert!(err.contains(what), "{file}: expected '{what}': {err}");
}

#[test]
fn a_zip_claiming_2e40_entries_is_refused_before_allocating() {
    refused(
        "zip_claims_2e40_entries.pt",
        "claims 1099511627776 entries but its central directory has room for at most",
    );
}

#[test]
fn safetensors_gaps_and_overlaps_are_refused() {
    refused("safetensors_gap.safetensors", "gap or overlap");
    refused("safetensors_overlap.safetensors", "gap or overlap");
}

#[test]
fn a_broadcast_view_over_1024x_its_storage_is_refused() {
    refused(
        "broadcast_1gib.pt",
        "would materialise 1073741828 bytes from a 4-byte storage",
    );
}

#[test]
fn a_zstd_bomb_in_a_dcp_item_is_capped() {
    refused(
        "dcp_zstd_bomb",
        "the zstd stream decompresses to more than the 16777280 bytes the chunk can hold",
    );
}

#[test]
#[ignore = "needs root to mount a tmpfs (see docs/testing.md)"]
fn a_full_disk_fails_before_any_work() {
    // The output (241 KiB as float32... here 483 KiB) cannot fit in 64 KiB: with the
    // space reserved up front, the error is the reservation's, before any tensor
    // data is read or written.
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("tiny");
    let tmpfs = require(Tmpfs::mount(&mnt, "size=64k"), "mount a tmpfs");
    let out = mnt.join("out");
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        "--weights-only",
        "--dtype",
        "float32",
        "-o",
        out.to_str().unwrap(),
    ]);
    let left = names(&mnt);
    drop(tmpfs);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot allocate space for") && err.contains("model.safetensors"),
        "the reservation should fail, not a later write: {err}"
    );
    assert!(err.contains("hint: the disk is full"), "{err}");
    assert!(left.is_empty(), "left behind on the full disk: {left:?}");
}

/// One system call strace recorded: its name and its whole line.
struct Call {
    name: String,
    line: String,
}

/// The file a `fsync(5</a/b>)` line syncs (strace -y prints the fd's path).
fn synced_path(line: &str) -> Option<&str> {
    let start = line.find('<')? + 1;
    let end = start + line[start..].find('>')?;
    Some(&line[start..end])
}

#[test]
#[ignore = "needs /usr/bin/strace and ptrace (see docs/testing.md)"]
fn every_output_file_and_directory_is_synced_around_one_rename() {
    let strace = Path::new("/usr/bin/strace");
    require(strace.exists().then_some(()), "run /usr/bin/strace");
    let tmp = tempfile::tempdir().unwrap();
    let parent = std::fs::canonicalize(tmp.path()).unwrap();
    let out = parent.join("out");
    let log = parent.join("strace.log");
    let o = Command::new(strace)
        .args(["-f", "-y", "-qq", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,write,pwrite64,pwritev,pwritev2,copy_file_range,sendfile",])
        .arg("-o")
        .arg(&log)
        .arg(env!("CARGO_BIN_EXE_unshard"))
        .args([
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "models/llama-bf16-sharded",
            "--max-shard-size",
            "100KB",
            "-o",
        ])
        .arg(&out)
        .current_dir(fixtures())
        .output()
        .unwrap();
    let err = stderr(&o);
    require(
        (!err.contains("PTRACE") && !err.contains("Operation not permitted")).then_some(()),
        "trace a process (ptrace)",
    );
    assert!(o.status.success(), "{err}");
    let calls: Vec<Call> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| {
            // "PID name(args) = ret"
            let rest = l.split_once(' ')?.1.trim_start();
            let name = rest.split('(').next()?.to_string();
            Some(Call {
                name,
                line: l.to_string(),
            })
        })
        .filter(|c| !c.line.contains("= -1"))
        .collect();
    let renames: Vec<usize> = (0..calls.len())
        .filter(|&i| calls[i].name.starts_with("rename"))
        .collect();
    assert_eq!(
        renames.len(),
        1,
        "one rename, of the staging directory: {:?}",
        renames.iter().map(|&i| &calls[i].line).collect::<Vec<_>>()
    );
    let rename = &calls[renames[0]].line;
    let staging = {
        let q: Vec<&str> = rename.split('"').collect();
        assert!(q.len() >= 4, "{rename}");
        assert_eq!(Path::new(q[3]), out, "{rename}");
        PathBuf::from(q[1])
    };
    assert_eq!(staging.parent(), Some(parent.as_path()), "{rename}");
    let is_sync = |c: &Call| c.name == "fsync" || c.name == "fdatasync";
    let synced_before: Vec<&str> = calls[..renames[0]]
        .iter()
        .filter(|c| is_sync(c))
        .filter_map(|c| synced_path(&c.line))
        .collect();
    let files = names(&out);
    assert!(files.len() >= 8, "{files:?}");
    for f in &files {
        let p = staging.join(f);
        let p = p.to_str().unwrap();
        // The last call touching the file before the rename is its sync: nothing
        // written after it.
        let last = calls[..renames[0]]
            .iter()
            .rfind(|c| c.line.contains(&format!("<{p}>")));
        assert!(
            last.is_some_and(is_sync),
            "{f} was not synced after its last write, before the rename: {:?}; synced: {synced_before:?}",
            last.map(|c| &c.line)
        );
    }
    assert!(
        synced_before.contains(&staging.to_str().unwrap()),
        "the staging directory was not synced before the rename: {synced_before:?}"
    );
    // The rename itself is made durable by syncing the directory that holds it.
    let synced_after: Vec<&str> = calls[renames[0] + 1..]
        .iter()
        .filter(|c| c.name == "fsync")
        .filter_map(|c| synced_path(&c.line))
        .collect();
    assert!(
        synced_after.contains(&parent.to_str().unwrap()),
        "the output's parent was not synced after the rename: {synced_after:?}"
    );
}
