//! Object storage: every input format read from a real S3-compatible server
//! (moto_server, started by `.ci/run`) and from Azurite, outputs byte-identical to
//! merging the same files from the local disk; `inspect`, `verify` and `diff` on
//! URLs; a missing or vanishing object fails cleanly, naming it; outputs written to
//! either server, interrupted or cut off by an outage.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::s3::{bucket_name, endpoint, Bucket, Server};
use common::{big_checkpoint, fixtures, names};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_unshard")
}

fn run(bucket: Option<&Bucket>, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    if let Some(b) = bucket {
        b.env(&mut cmd);
    }
    cmd.output().unwrap()
}

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{:?}\n{err}", o.status);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `unshard.json` without what names the inputs (local paths against URLs), its
/// files by name (a bucket is written in another order).
fn manifest_without_inputs(bytes: &[u8]) -> serde_json::Value {
    let mut m: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    m.as_object_mut().unwrap().remove("inputs");
    for k in ["adapter", "adapter_config"] {
        m["options"].as_object_mut().unwrap().remove(k);
    }
    let files = m["files"].as_array_mut().unwrap();
    assert!(
        files.iter().all(|f| f["checksum"].is_string()),
        "every file has its checksum: {files:?}"
    );
    files.sort_by_key(|f| f["name"].as_str().unwrap().to_string());
    m
}

/// Asserts two output directories hold the same files with the same bytes
/// (`unshard.json`: the same options and files, whatever the inputs' names).
fn same_dirs(a: &Path, b: &Path) {
    assert_eq!(names(a), names(b));
    for n in names(a) {
        let (x, y) = (
            std::fs::read(a.join(&n)).unwrap(),
            std::fs::read(b.join(&n)).unwrap(),
        );
        if n == "unshard.json" {
            assert_eq!(manifest_without_inputs(&x), manifest_without_inputs(&y));
            continue;
        }
        assert!(
            x == y,
            "{n} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Merges `ckpt` (and `base`), given relative to fixtures/, once from the local disk
/// and once from an S3 bucket, and compares the outputs byte for byte.
fn merge_both_ways(test: &str, ckpt: &str, base: Option<&str>, extra: &[&str]) {
    merge_both_ways_on(Server::S3, test, ckpt, base, extra);
}

/// [`merge_both_ways`] with the bucket on `server`.
fn merge_both_ways_on(server: Server, test: &str, ckpt: &str, base: Option<&str>, extra: &[&str]) {
    let b = Bucket::on(server, test);
    let fx = fixtures();
    b.upload(&fx.join(ckpt), ckpt);
    if let Some(base) = base {
        b.upload(&fx.join(base), base);
    }
    let tmp = tempfile::tempdir().unwrap();
    let (local, remote) = (tmp.path().join("local"), tmp.path().join("remote"));
    let local_ckpt = fx.join(ckpt);
    let local_base = base.map(|x| fx.join(x));
    let mut args: Vec<String> = vec!["merge".into(), local_ckpt.to_str().unwrap().into()];
    if let Some(lb) = &local_base {
        args.extend(["--base".into(), lb.to_str().unwrap().into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["-o".into(), local.to_str().unwrap().into()]);
    ok(&run(
        None,
        &args.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    ));

    let mut args: Vec<String> = vec!["merge".into(), b.url(ckpt)];
    if let Some(base) = base {
        args.extend(["--base".into(), b.url(base)]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["-o".into(), remote.to_str().unwrap().into()]);
    ok(&run(
        Some(&b),
        &args.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    ));
    same_dirs(&local, &remote);
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_torch_save_file_and_an_hf_base_from_a_bucket_merge_as_from_disk() {
    merge_both_ways(
        "pt-and-base",
        "ckpt/llama_policy.pt",
        Some("models/llama-bf16"),
        &[],
    );
}

/// One checkpoint of every family the readers know (the same list as the library's
/// in-memory store test, `bytes::remote::tests::FAMILIES`): `(test name,
/// checkpoint, base, extra arguments)`, relative to fixtures/.
const FAMILIES: &[(&str, &str, Option<&str>, &[&str])] = &[
    (
        "fam-pt",
        "ckpt/llama_policy.pt",
        Some("models/llama-bf16"),
        &[],
    ),
    (
        "fam-dcp",
        "sharded/llama_w2_dcp",
        Some("models/llama-bf16"),
        &[],
    ),
    (
        "fam-ranks",
        "sharded/llama_w2_ranks",
        Some("models/llama-bf16"),
        &[],
    ),
    (
        "fam-ds-z2",
        "deepspeed/llama_z2_fp16_w3_aligned",
        Some("deepspeed/base/llama12-fp16"),
        &[],
    ),
    (
        "fam-ds-z3",
        "deepspeed/llama_z3_bf16_w2",
        Some("deepspeed/base/llama-bf16"),
        &[],
    ),
    (
        "fam-ds-tag",
        "deepspeed/llama_z3_bf16_w2/global_step1",
        Some("deepspeed/base/llama-bf16"),
        &[],
    ),
    ("fam-ds-trainer", "deepspeed/llama_trainer_z3_w2", None, &[]),
    (
        "fam-lora",
        "lora/adapters/llama_lora",
        Some("models/llama-bf16"),
        &[],
    ),
    (
        "fam-megatron",
        "megatron/ckpt/llama_tp2",
        Some("megatron/base/llama"),
        &[],
    ),
    (
        "fam-titan",
        "torchtitan/llama3/checkpoint/step-10",
        Some("torchtitan/llama3/base"),
        &[],
    ),
    (
        "fam-moe-pt",
        "moe/mixtral/policy.pt",
        Some("moe/mixtral/base"),
        &["--key", "state"],
    ),
    (
        "fam-moe-dcp",
        "moe/mixtral/dcp",
        Some("moe/mixtral/base"),
        &[],
    ),
];

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn every_fixture_family_from_a_bucket_merges_as_from_disk() {
    for (name, ckpt, base, extra) in FAMILIES {
        merge_both_ways(name, ckpt, *base, extra);
    }
}

#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn every_fixture_family_from_azure_merges_as_from_disk() {
    for (name, ckpt, base, extra) in FAMILIES {
        merge_both_ways_on(Server::Azure, &format!("az-{name}"), ckpt, *base, extra);
    }
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_sharded_hf_base_and_small_shards_from_a_bucket() {
    merge_both_ways(
        "pt-sharded-base",
        "ckpt/qwen2_policy.pt",
        Some("models/qwen2-fp16-sharded"),
        &["--max-shard-size", "100KB"],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_legacy_torch_save_file_from_a_bucket() {
    merge_both_ways(
        "legacy",
        "ckpt/llama_policy_legacy.pt",
        Some("models/llama-bf16"),
        &[],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_dcp_directory_from_a_bucket() {
    merge_both_ways(
        "dcp",
        "sharded/llama_w2_dcp",
        Some("models/llama-bf16"),
        &[],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_zstd_dcp_directory_from_a_bucket() {
    merge_both_ways(
        "dcp-zstd",
        "sharded/llama_w2_dcp_zstd",
        Some("models/llama-bf16"),
        &[],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_accelerate_checkpoint_dir_with_optimizer_state_from_a_bucket() {
    merge_both_ways(
        "accelerate",
        "sharded/accelerate_dcp",
        Some("models/llama-bf16"),
        &[],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn per_rank_files_with_their_config_dir_from_a_bucket() {
    // No --base: the config comes from the `huggingface/` prefix beside the rank files.
    merge_both_ways("ranks", "sharded/llama_w2_ranks", None, &[]);
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn hf_sharded_rank_files_from_a_bucket() {
    // torch's HF storage writer saving distributed, 2x2 ranks; the folder holding
    // `sharded/` and `consolidated/` is passed, as on disk.
    merge_both_ways(
        "hf-sharded",
        "torchtitan/hf_sharded/qwen3_f32_2x2",
        Some("torchtitan/qwen3/base"),
        &[],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_hf_directory_as_the_checkpoint_from_a_bucket() {
    merge_both_ways(
        "hf-dir",
        "models/llama-fp32-bin",
        None,
        &["--dtype", "bfloat16"],
    );
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_converting_merge_of_multi_mib_tensors_from_a_bucket_matches_local() {
    // 4 MiB float32 tensors cast to bfloat16: each block's input span is fetched
    // ahead with one GET and read back in 1 MiB chunks.
    let ep = endpoint("converting");
    let b = Bucket::create(&ep, &bucket_name("converting"));
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 5);
    b.upload(&ckpt, "big.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    let (local, remote) = (tmp.path().join("local"), tmp.path().join("remote"));
    let args = [
        "--weights-only",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "5MB",
        "-o",
    ];
    let mut a = vec!["merge", ckpt.to_str().unwrap()];
    a.extend(args);
    a.push(local.to_str().unwrap());
    ok(&run(None, &a));
    let url = b.url("big.safetensors");
    let mut a = vec!["merge", url.as_str()];
    a.extend(args);
    a.push(remote.to_str().unwrap());
    ok(&run(Some(&b), &a));
    same_dirs(&local, &remote);
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn inspect_verify_and_diff_take_urls() {
    let ep = endpoint("inspect-verify-diff");
    let b = Bucket::create(&ep, &bucket_name("inspect-verify-diff"));
    let fx = fixtures();
    b.upload(&fx.join("sharded/llama_w2_dcp"), "dcp");
    b.upload(&fx.join("models/llama-bf16"), "base");
    let local = ok(&run(
        None,
        &[
            "inspect",
            "--json",
            fx.join("sharded/llama_w2_dcp").to_str().unwrap(),
        ],
    ));
    let remote = ok(&run(Some(&b), &["inspect", "--json", &b.url("dcp")]));
    let strip = |s: &str| -> serde_json::Value {
        let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
        v.as_object_mut().unwrap().remove("path");
        v
    };
    assert_eq!(strip(&local), strip(&remote));

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    ok(&run(
        Some(&b),
        &[
            "merge",
            &b.url("dcp"),
            "--base",
            &b.url("base"),
            "-o",
            out.to_str().unwrap(),
        ],
    ));
    let v = ok(&run(
        Some(&b),
        &[
            "verify",
            "--against",
            &b.url("dcp"),
            "--base",
            &b.url("base"),
            out.to_str().unwrap(),
        ],
    ));
    assert!(!v.is_empty());
    let d = run(
        Some(&b),
        &[
            "diff",
            &b.url("base/model.safetensors"),
            out.join("model.safetensors").to_str().unwrap(),
        ],
    );
    // The checkpoint changed the weights: diff runs and reports differences.
    assert!(
        d.status.code() == Some(0) || d.status.code() == Some(1),
        "{d:?}"
    );
    assert!(!d.stdout.is_empty(), "{d:?}");
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_missing_object_is_a_clear_error_naming_it() {
    let ep = endpoint("missing");
    let b = Bucket::create(&ep, &bucket_name("missing"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        Some(&b),
        &["merge", &b.url("nope.pt"), "-o", out.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&b.url("nope.pt")), "{err}");
    assert!(!out.exists());
    // A DCP directory whose chunk file is gone: the error names that object.
    b.upload(&fixtures().join("sharded/llama_w2_dcp"), "dcp");
    b.delete("dcp/__1_0.distcp");
    let o = run(
        Some(&b),
        &["merge", &b.url("dcp"), "-o", out.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("__1_0.distcp"), "{err}");
    assert!(!out.exists());
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_object_deleted_during_the_merge_fails_cleanly_and_leaves_nothing() {
    let ep = endpoint("deleted-mid-merge");
    let b = Bucket::create(&ep, &bucket_name("deleted-mid-merge"));
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 24);
    b.upload(&ckpt, "big.safetensors");
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("out");
    let mut cmd = Command::new(bin());
    b.env(&mut cmd);
    let child = cmd
        .args([
            "merge",
            &b.url("big.safetensors"),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
        ])
        .arg(&out)
        // One read in flight, and each block slowed down: the object is gone before
        // most blocks are read.
        .env("UNSHARD_REMOTE_READERS", "1")
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "200")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while names(parent.path()).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no staging directory"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    b.delete("big.safetensors");
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "must fail cleanly: {err}");
    assert!(err.contains(&b.url("big.safetensors")), "{err}");
    assert!(
        names(parent.path()).is_empty(),
        "left behind: {:?}",
        names(parent.path())
    );
}

/// Downloads every object under `prefix/` into a local directory.
fn download(b: &Bucket, prefix: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for k in b.keys() {
        if let Some(rel) = k.strip_prefix(&format!("{prefix}/")) {
            std::fs::write(to.join(rel), b.get(&k).unwrap()).unwrap();
        }
    }
}

fn keys_under(b: &Bucket, prefix: &str) -> Vec<String> {
    b.keys()
        .into_iter()
        .filter(|k| k.starts_with(&format!("{prefix}/")))
        .collect()
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_output_written_to_a_bucket_equals_the_local_one() {
    output_equals_local(Server::S3, "output");
}

#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn an_output_written_to_azure_equals_the_local_one() {
    output_equals_local(Server::Azure, "az-output");
}

/// A merge written to a bucket on `server` equals the local one; `--verify` to a
/// bucket is refused before any work; `verify` reads the output back and notices a
/// changed byte; writing again needs `--force`, which replaces only what an earlier
/// output wrote.
fn output_equals_local(server: Server, test: &str) {
    let b = Bucket::on(server, test);
    let fx = fixtures();
    let tmp = tempfile::tempdir().unwrap();
    let local = tmp.path().join("local");
    let (ckpt, base) = (
        fx.join("ckpt/qwen2_policy.pt"),
        fx.join("models/qwen2-fp16-sharded"),
    );
    let args = |out: &str| -> Vec<String> {
        vec![
            "merge".into(),
            ckpt.to_str().unwrap().into(),
            "--base".into(),
            base.to_str().unwrap().into(),
            "--max-shard-size".into(),
            "100KB".into(),
            "-o".into(),
            out.into(),
        ]
    };
    let a = args(local.to_str().unwrap());
    ok(&run(
        None,
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    ));
    // --verify needs a local copy to read back: refused before any work.
    let mut a = args(&b.url("out"));
    a.push("--verify".into());
    let o = run(Some(&b), &a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(b.keys().is_empty(), "{:?}", b.keys());
    let a = args(&b.url("out"));
    ok(&run(
        Some(&b),
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    ));
    let got = tmp.path().join("got");
    download(&b, "out", &got);
    // No manifest left: the run finished.
    same_dirs(&local, &got);
    assert!(names(&local).len() > 3, "{:?}", names(&local));
    // verify reads the output from the bucket, and notices a changed byte there.
    let verify = |out: &str| {
        let a = [
            "verify",
            "--against",
            ckpt.to_str().unwrap(),
            "--base",
            base.to_str().unwrap(),
            "--max-shard-size",
            "100KB",
            out,
        ];
        run(Some(&b), &a)
    };
    ok(&verify(&b.url("out")));
    let shard = b
        .keys()
        .into_iter()
        .find(|k| k.starts_with("out/model-00002"))
        .unwrap();
    let mut bytes = b.get(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    b.put(&shard, bytes);
    let o = verify(&b.url("out"));
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Writing again needs --force; with it, objects of the old output (listed in
    // its unshard.json) that the new one lacks are gone, and an object no output
    // lists is refused by name and kept.
    let mut m: serde_json::Value =
        serde_json::from_slice(&b.get("out/unshard.json").unwrap()).unwrap();
    m["files"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "old-shard.safetensors", "size": 3, "checksum": null}));
    b.put("out/unshard.json", serde_json::to_vec(&m).unwrap());
    b.put("out/old-shard.safetensors", b"old".to_vec());
    b.put("out/stale-file.txt", b"old".to_vec());
    let a = args(&b.url("out"));
    let o = run(Some(&b), &a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--force") && err.contains("not empty"),
        "{err}"
    );
    let mut a = args(&b.url("out"));
    a.push("--force".into());
    let o = run(Some(&b), &a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("stale-file.txt") && !err.contains("old-shard"),
        "{err}"
    );
    assert!(b.get("out/stale-file.txt").is_some());
    b.delete("out/stale-file.txt");
    ok(&run(
        Some(&b),
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    ));
    assert!(b.get("out/old-shard.safetensors").is_none());
    let again = tmp.path().join("again");
    download(&b, "out", &again);
    same_dirs(&local, &again);
}

/// Fused LoRA and DoRA weights (computed tensors) go to a bucket through the same
/// blocks as copies: the output equals the local one byte for byte, shards cut
/// small so that fused weights straddle parts; and with the adapter read from the
/// bucket too.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn fused_adapters_written_to_a_bucket_equal_the_local_output() {
    let ep = endpoint("lora-output");
    let b = Bucket::create(&ep, &bucket_name("lora-output"));
    let fx = fixtures();
    let base = fx.join("models/llama-bf16");
    for (i, adapter) in [
        "lora/adapters/llama_dora",
        "lora/train/llama_lora_pt/policy.pt",
    ]
    .into_iter()
    .enumerate()
    {
        let tmp = tempfile::tempdir().unwrap();
        let local = tmp.path().join("local");
        let args = |ckpt: &str, out: &str| -> Vec<String> {
            vec![
                "merge".into(),
                ckpt.into(),
                "--base".into(),
                base.to_str().unwrap().into(),
                "--max-shard-size".into(),
                "40KB".into(),
                "-o".into(),
                out.into(),
            ]
        };
        let adapter_path = fx.join(adapter);
        let a = args(adapter_path.to_str().unwrap(), local.to_str().unwrap());
        ok(&run(
            None,
            &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        ));
        let out = format!("out{i}");
        let a = args(adapter_path.to_str().unwrap(), &b.url(&out));
        ok(&run(
            Some(&b),
            &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        ));
        let got = tmp.path().join("got");
        download(&b, &out, &got);
        same_dirs(&local, &got);
        assert!(names(&local).len() > 4, "{:?}", names(&local));
        // The adapter itself in the bucket (with its config beside it).
        let dir = if adapter.ends_with(".pt") {
            Path::new(adapter).parent().unwrap()
        } else {
            Path::new(adapter)
        };
        b.upload(&fx.join(dir), dir.to_str().unwrap());
        let out = format!("from-bucket{i}");
        let a = args(&b.url(adapter), &b.url(&out));
        ok(&run(
            Some(&b),
            &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        ));
        let again = tmp.path().join("again");
        download(&b, &out, &again);
        same_dirs(&local, &again);
    }
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn no_fuse_into_a_bucket_is_refused_before_anything_is_written() {
    // The adapter directory is written with local file calls: refused up front, in
    // one process and with --part, and the bucket stays empty.
    let ep = endpoint("lora-nofuse");
    let b = Bucket::create(&ep, &bucket_name("lora-nofuse"));
    let fx = fixtures();
    let base = fx.join("models/llama-bf16");
    let adapter = fx.join("lora/adapters/llama_dora");
    for extra in [&[][..], &["--part", "1/2"][..]] {
        let out = b.url("out");
        let mut args = vec![
            "merge",
            adapter.to_str().unwrap(),
            "--base",
            base.to_str().unwrap(),
            "--no-fuse",
            "-o",
            &out,
        ];
        args.extend_from_slice(extra);
        let o = run(Some(&b), &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains("local output directory"), "{extra:?}: {err}");
        assert!(
            keys_under(&b, "").is_empty(),
            "{extra:?}: {:?}",
            keys_under(&b, "")
        );
    }
}

/// Starts a slow merge of a 96 MiB checkpoint into `bucket/out` and waits until
/// its manifest appears (the sink is open and uploads are about to start).
fn slow_upload(b: &Bucket, inputs: &Path) -> std::process::Child {
    let ckpt = big_checkpoint(inputs, 24);
    let mut cmd = Command::new(bin());
    b.env(&mut cmd);
    let child = cmd
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            &b.url("out"),
        ])
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "300")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while b.get("out/.unshard-run.json").is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "no manifest");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_interrupted_upload_leaves_no_object() {
    interrupted_upload_leaves_nothing(Server::S3, "interrupted-upload");
}

#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn an_interrupted_upload_to_azure_leaves_no_object() {
    interrupted_upload_leaves_nothing(Server::Azure, "az-interrupted-upload");
}

/// Ctrl-C during an upload to `server`: exit 130, no object left under the output.
fn interrupted_upload_leaves_nothing(server: Server, test: &str) {
    let b = Bucket::on(server, test);
    let inputs = tempfile::tempdir().unwrap();
    let child = slow_upload(&b, inputs.path());
    std::thread::sleep(Duration::from_millis(400));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert_eq!(keys_under(&b, "out"), Vec::<String>::new(), "{err}");
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_killed_upload_is_reported_as_a_stale_run_and_replaced_with_force() {
    let ep = endpoint("stale-run");
    let b = Bucket::create(&ep, &bucket_name("stale-run"));
    let inputs = tempfile::tempdir().unwrap();
    let mut child = slow_upload(&b, inputs.path());
    child.kill().unwrap();
    child.wait().unwrap();
    let manifest = String::from_utf8(b.get("out/.unshard-run.json").unwrap()).unwrap();
    let run_id = serde_json::from_str::<serde_json::Value>(&manifest).unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_string();
    let ckpt = inputs.path().join("big.safetensors");
    let o = run(
        Some(&b),
        &[
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            &b.url("out"),
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("did not finish") && err.contains(&run_id),
        "{err}"
    );
    ok(&run(
        Some(&b),
        &[
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            &b.url("out"),
            "--force",
        ],
    ));
    assert_eq!(
        keys_under(&b, "out"),
        ["out/model.safetensors", "out/unshard.json"],
        "only the new output remains"
    );
}

/// User info and a query in the URLs (a password, a presigned URL's signature) are
/// in no output file, not in stdout or stderr, whether the merge succeeds or
/// fails, and not in an output written to the bucket.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn secrets_in_urls_are_never_printed_or_written() {
    const SECRETS: [&str; 2] = ["PASSWORD1234", "SIGNATURE5678"];
    let with_secrets = |url: String| {
        format!(
            "{}?X-Amz-Signature=SIGNATURE5678",
            url.replacen("s3://", "s3://AKID:PASSWORD1234@", 1)
        )
    };
    let clean = |what: &str, text: &str| {
        for s in SECRETS {
            assert!(!text.contains(s), "{what} holds {s}:\n{text}");
        }
    };
    let ep = endpoint("secrets");
    let b = Bucket::create(&ep, &bucket_name("secrets"));
    let fx = fixtures();
    b.upload(&fx.join("ckpt/llama_policy.pt"), "ckpt/llama_policy.pt");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let base = fx.join("models/llama-bf16");
    let o = run(
        Some(&b),
        &[
            "merge",
            &with_secrets(b.url("ckpt/llama_policy.pt")),
            "--base",
            base.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
    );
    clean("stderr", &String::from_utf8_lossy(&o.stderr));
    clean("stdout", &ok(&o));
    for n in names(&out) {
        clean(
            &n,
            &String::from_utf8_lossy(&std::fs::read(out.join(&n)).unwrap()),
        );
    }
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("unshard.json")).unwrap()).unwrap();
    assert_eq!(m["inputs"]["checkpoint"], b.url("ckpt/llama_policy.pt"));
    assert!(m["inputs"]["urls_redacted"].is_string(), "{m}");

    // To the bucket, and a failure naming a missing object.
    let o = run(
        Some(&b),
        &[
            "merge",
            &with_secrets(b.url("ckpt/llama_policy.pt")),
            "--base",
            base.to_str().unwrap(),
            "-o",
            &with_secrets(b.url("out")),
        ],
    );
    clean("stderr", &String::from_utf8_lossy(&o.stderr));
    clean("stdout", &ok(&o));
    let dl = tmp.path().join("dl");
    download(&b, "out", &dl);
    for n in names(&dl) {
        clean(
            &n,
            &String::from_utf8_lossy(&std::fs::read(dl.join(&n)).unwrap()),
        );
    }
    let o = run(
        Some(&b),
        &[
            "merge",
            &with_secrets(b.url("ckpt/missing.pt")),
            "-o",
            tmp.path().join("x").to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    clean("stderr", &err);
    assert!(err.contains(&b.url("ckpt/missing.pt")), "{err}");
}

/// A TCP proxy in front of the test server that can be taken down: while down it
/// cuts every open connection and closes each new one at once, as a server being
/// restarted or a broken network path does.
struct Proxy {
    port: u16,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    open: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(target: &str) -> Proxy {
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let target = target.trim_start_matches("http://").to_string();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let p = Proxy {
            port,
            down: Default::default(),
            open: Default::default(),
        };
        let (down, open) = (p.down.clone(), p.open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if down.load(Ordering::SeqCst) {
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                {
                    let mut open = open.lock().unwrap();
                    open.push(client.try_clone().unwrap());
                    open.push(server.try_clone().unwrap());
                }
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        p
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Down for `d`, then up again; returns at once.
    fn outage(&self, d: Duration) {
        use std::sync::atomic::Ordering;
        self.down.store(true, Ordering::SeqCst);
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let down = self.down.clone();
        std::thread::spawn(move || {
            std::thread::sleep(d);
            down.store(false, Ordering::SeqCst);
        });
    }
}

/// The server unreachable for 10 s in the middle of a multipart upload: every
/// request is retried until it is back, and the output is the same as a local
/// merge's.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_ten_second_outage_during_an_upload_is_survived() {
    outage_is_survived(Server::S3, "outage");
}

#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn a_ten_second_outage_during_an_upload_to_azure_is_survived() {
    outage_is_survived(Server::Azure, "az-outage");
}

/// The server on `server` unreachable for 10 s during an upload to it: the merge
/// waits it out and writes the local merge's bytes.
fn outage_is_survived(server: Server, test: &str) {
    let b = Bucket::on(server, test);
    let proxy = Proxy::start(&b.endpoint);
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 24);
    let args = |out: &str| -> Vec<String> {
        [
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            out,
        ]
        .map(str::to_string)
        .to_vec()
    };
    let local = inputs.path().join("local");
    ok(&run(
        None,
        &args(local.to_str().unwrap())
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let mut cmd = Command::new(bin());
    b.env_via(&mut cmd, &proxy.endpoint());
    let child = cmd
        .args(args(&b.url("out")))
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "1000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while b.get("out/.unshard-run.json").is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "no run manifest");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let outage = Instant::now();
    proxy.outage(Duration::from_secs(10));
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}\n{err}", o.status);
    assert!(
        outage.elapsed() >= Duration::from_secs(10),
        "the merge ended {:?} into the outage: it did not write during it",
        outage.elapsed()
    );
    let dl = inputs.path().join("dl");
    download(&b, "out", &dl);
    same_dirs(&local, &dl);
}

/// An outage longer than the retries (`UNSHARD_RETRY_SECONDS=2`): the merge fails,
/// and its cleanup, which cannot reach the server either, says what it left and
/// the command that removes it.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn an_outage_longer_than_the_retries_fails_and_says_what_it_left() {
    let err = long_outage_fails(Server::S3, "long-outage");
    assert!(
        err.contains("abort-multipart-upload") || err.contains("aws s3 rm"),
        "{err}"
    );
}

#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn an_outage_longer_than_the_retries_on_azure_fails_and_says_what_it_left() {
    let err = long_outage_fails(Server::Azure, "az-long-outage");
    assert!(err.contains("az storage blob delete"), "{err}");
    assert!(
        !err.contains("aws "),
        "no S3 command for an Azure container: {err}"
    );
}

/// An outage of the server on `server` longer than the retries: the merge fails and
/// names what its cleanup could not remove; returns stderr.
fn long_outage_fails(server: Server, test: &str) -> String {
    let b = Bucket::on(server, test);
    let proxy = Proxy::start(&b.endpoint);
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 24);
    let mut cmd = Command::new(bin());
    b.env_via(&mut cmd, &proxy.endpoint());
    let child = cmd
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            &b.url("out"),
        ])
        .env("UNSHARD_RETRY_SECONDS", "2")
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "1000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while b.get("out/.unshard-run.json").is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "no run manifest");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    proxy.outage(Duration::from_secs(20));
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("could not remove"), "{err}");
    assert!(err.contains(&bucket_name(test)), "{err}");
    err.into_owned()
}

/// `--force` replaces an earlier unshard output (the files its `unshard.json` lists)
/// and refuses, naming them, objects no unshard output wrote, at a prefix or at the
/// bucket's root; they are left in place.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn force_replaces_only_what_unshard_wrote() {
    let ep = endpoint("force-own");
    let b = Bucket::create(&ep, &bucket_name("force-own"));
    let fx = fixtures();
    let ckpt = fx.join("ckpt/llama_policy.pt");
    let base = fx.join("models/llama-bf16");
    let merge_to = |out: &str| {
        run(
            Some(&b),
            &[
                "merge",
                ckpt.to_str().unwrap(),
                "--base",
                base.to_str().unwrap(),
                "-o",
                out,
                "--force",
            ],
        )
    };
    // An earlier output is replaced.
    ok(&merge_to(&b.url("out")));
    ok(&merge_to(&b.url("out")));
    assert!(b.get("out/unshard.json").is_some());
    // An object beside it that no unshard.json lists is named and kept.
    b.put("out/notes.txt", b"mine".to_vec());
    let o = merge_to(&b.url("out"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("notes.txt") && err.contains("not part of"),
        "{err}"
    );
    assert_eq!(b.get("out/notes.txt").unwrap(), b"mine");
    assert!(
        b.get("out/config.json").is_some(),
        "the earlier output is left whole"
    );
    // At the bucket's root: every other object is foreign.
    let root = format!("s3://{}", bucket_name("force-own"));
    let o = merge_to(&root);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("out/notes.txt"), "{err}");
    assert_eq!(b.get("out/notes.txt").unwrap(), b"mine");
}

/// The WebDAV server `.ci/run` starts (wsgidav) serving fixtures/ at
/// `UNSHARD_TEST_WEBDAV_ENDPOINT`.
fn webdav() -> String {
    std::env::var("UNSHARD_TEST_WEBDAV_ENDPOINT").unwrap_or_else(|_| {
        panic!("no WebDAV test server: start wsgidav serving fixtures/ and set UNSHARD_TEST_WEBDAV_ENDPOINT=http://127.0.0.1:PORT (docs/testing.md; .ci/run does this)")
    })
}

/// Every fixture family read over plain http:// from a WebDAV server (which answers
/// HEAD on a directory with 200 and 0 bytes: directories are listed first),
/// checkpoint and base, merges as from disk.
#[test]
#[ignore = "needs a WebDAV server on UNSHARD_TEST_WEBDAV_ENDPOINT (see docs/testing.md)"]
fn every_fixture_family_over_webdav_merges_as_from_disk() {
    let dav = webdav();
    let fx = fixtures();
    for (name, ckpt, base, extra) in FAMILIES {
        let tmp = tempfile::tempdir().unwrap();
        let (local, remote) = (tmp.path().join("local"), tmp.path().join("remote"));
        let merge = |ckpt: String, base: Option<String>, out: &Path| {
            let mut a: Vec<String> = vec!["merge".into(), ckpt];
            if let Some(b) = base {
                a.extend(["--base".into(), b]);
            }
            a.extend(extra.iter().map(|s| s.to_string()));
            a.extend(["-o".into(), out.to_str().unwrap().into()]);
            let o = run(None, &a.iter().map(String::as_str).collect::<Vec<_>>());
            assert!(
                o.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        merge(
            fx.join(ckpt).to_str().unwrap().into(),
            base.map(|b| fx.join(b).to_str().unwrap().to_string()),
            &local,
        );
        merge(
            format!("{dav}/{ckpt}"),
            base.map(|b| format!("{dav}/{b}")),
            &remote,
        );
        same_dirs(&local, &remote);
    }
}

/// An S3 endpoint given as http:// without AWS_ALLOW_HTTP is refused, and the
/// error names the variable.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn s3_over_plain_http_without_the_opt_in_names_it() {
    let ep = endpoint("no-allow-http");
    let b = Bucket::create(&ep, &bucket_name("no-allow-http"));
    b.upload(&fixtures().join("ckpt/llama_policy.pt"), "p.pt");
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin());
    b.env(&mut cmd);
    let o = cmd
        .args([
            "merge",
            &b.url("p.pt"),
            "-o",
            tmp.path().join("o").to_str().unwrap(),
        ])
        .env_remove("AWS_ALLOW_HTTP")
        .env("UNSHARD_RETRY_SECONDS", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("AWS_ALLOW_HTTP=true"), "{err}");
}

/// An Azure account endpoint given as http:// (Azurite reached as an account, not
/// through the emulator switch) without AZURE_ALLOW_HTTP is refused, and the error
/// names that variable, not the S3 one; with it, the merge runs.
#[test]
#[ignore = "needs Azurite on UNSHARD_TEST_AZURE_ENDPOINT (see docs/testing.md)"]
fn azure_over_plain_http_without_the_opt_in_names_it() {
    let b = Bucket::on(Server::Azure, "az-no-allow-http");
    b.upload(&fixtures().join("ckpt/llama_policy.pt"), "p.pt");
    b.upload(&fixtures().join("models/llama-bf16"), "base");
    let tmp = tempfile::tempdir().unwrap();
    let merge = |allow: bool, out: &str| {
        let mut cmd = Command::new(bin());
        cmd.args([
            "merge",
            &b.url("p.pt"),
            "--base",
            &b.url("base"),
            "-o",
            tmp.path().join(out).to_str().unwrap(),
        ])
        .env_remove("AZURE_STORAGE_USE_EMULATOR")
        .env("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
        .env("AZURE_STORAGE_ACCOUNT_KEY", common::s3::AZURITE_KEY)
        .env(
            "AZURE_STORAGE_ENDPOINT",
            format!("{}/devstoreaccount1", b.endpoint),
        )
        .env("UNSHARD_RETRY_SECONDS", "1");
        if allow {
            cmd.env("AZURE_ALLOW_HTTP", "true");
        } else {
            cmd.env_remove("AZURE_ALLOW_HTTP");
        }
        cmd.output().unwrap()
    };
    let o = merge(false, "refused");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("AZURE_ALLOW_HTTP=true") && !err.contains("AWS_ALLOW_HTTP"),
        "{err}"
    );
    assert!(!tmp.path().join("refused").exists());
    ok(&merge(true, "merged"));
    assert!(tmp.path().join("merged/config.json").exists());
}
