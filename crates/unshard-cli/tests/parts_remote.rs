//! `--part I/N` with the output in object storage (a real S3-compatible server,
//! moto_server, started by `.ci/run`): the parts meet through conditional puts, the
//! output equals a one-process local merge byte for byte, a killed part run again
//! finishes the job, parts of different plans refuse to join, an older output is
//! refused without `--force`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::s3::{bucket_name, endpoint, Bucket};
use common::{big_checkpoint, fixtures, names};

fn merge_cmd(b: &Bucket, args: &[String], out: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_unshard"));
    b.env(&mut cmd);
    cmd.arg("merge").args(args).args(["-o", out]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn part(b: &Bucket, args: &[String], out: &str, p: &str) -> Output {
    merge_cmd(b, args, out)
        .args(["--part", p])
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The llama fixture with `--max-shard-size` `size` (more shards than parts at 40KB).
fn llama(size: &str) -> Vec<String> {
    let fx = fixtures();
    vec![
        fx.join("ckpt/llama_policy.pt").to_str().unwrap().into(),
        "--base".into(),
        fx.join("models/llama-bf16").to_str().unwrap().into(),
        "--max-shard-size".into(),
        size.into(),
    ]
}

/// `ckpt` (a `big_checkpoint`) to bfloat16 in 3 MB shards: one shard a tensor.
fn to_bf16_in_3mb_shards(ckpt: &Path) -> Vec<String> {
    vec![
        ckpt.to_str().unwrap().into(),
        "--weights-only".into(),
        "--dtype".into(),
        "bfloat16".into(),
        "--max-shard-size".into(),
        "3MB".into(),
    ]
}

/// A local one-process merge of `args` into `dir`.
fn single(args: &[String], dir: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
        .arg("merge")
        .args(args)
        .arg("-o")
        .arg(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Asserts the objects under `prefix/` are exactly the files of `dir`, byte for byte
/// (no bookkeeping left behind).
fn same_as_dir(b: &Bucket, prefix: &str, dir: &Path) {
    let keys: Vec<String> = b
        .keys()
        .into_iter()
        .filter_map(|k| k.strip_prefix(&format!("{prefix}/")).map(str::to_string))
        .collect();
    assert_eq!(keys, names(dir), "objects under {prefix}/");
    for n in names(dir) {
        let got = b.get(&format!("{prefix}/{n}")).unwrap();
        assert!(got == std::fs::read(dir.join(&n)).unwrap(), "{n} differs");
    }
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn two_and_three_parts_into_a_bucket_equal_one_local_process() {
    let ep = endpoint("parts-bucket");
    let b = Bucket::create(&ep, &bucket_name("parts-bucket"));
    let args = llama("40KB");
    let tmp = tempfile::tempdir().unwrap();
    single(&args, &tmp.path().join("single"));
    for n in [2, 3] {
        let out = b.url(&format!("out{n}"));
        let children: Vec<Child> = (0..n)
            .map(|i| {
                merge_cmd(&b, &args, &out)
                    .args(["--part", &format!("{i}/{n}")])
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut committed = 0;
        for c in children {
            let o = c.wait_with_output().unwrap();
            let err = stderr(&o);
            assert!(o.status.success(), "{err}");
            committed += usize::from(err.contains("committed"));
        }
        assert_eq!(committed, 1, "exactly one part commits ({n} parts)");
        same_as_dir(&b, &format!("out{n}"), &tmp.path().join("single"));
    }
    let shards = names(&tmp.path().join("single"))
        .iter()
        .filter(|n| n.ends_with(".safetensors"))
        .count();
    assert!(shards > 3, "more shards than parts: {shards}");
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_killed_part_run_again_finishes_the_job_in_a_bucket() {
    let ep = endpoint("parts-bucket-killed");
    let b = Bucket::create(&ep, &bucket_name("parts-bucket-killed"));
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(tmp.path(), 6);
    let args = to_bf16_in_3mb_shards(&ckpt);
    let out = b.url("out");
    // Part 1 is slowed down and killed once the parts' plan is in the bucket.
    let mut slow = merge_cmd(&b, &args, &out)
        .args(["--part", "1/3"])
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "2000")
        .spawn()
        .unwrap();
    let start = Instant::now();
    while b.get("out/.unshard-parts/plan").is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "part 1 never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    slow.kill().unwrap();
    slow.wait().unwrap();
    for i in [0, 2] {
        let o = part(&b, &args, &out, &format!("{i}/3"));
        let err = stderr(&o);
        assert!(
            o.status.success() && err.contains("waiting for part(s) 1"),
            "{err}"
        );
    }
    assert!(
        b.get("out/config.json").is_none() && b.get("out/model.safetensors.index.json").is_none()
    );
    let o = part(&b, &args, &out, "1/3");
    let err = stderr(&o);
    assert!(o.status.success() && err.contains("committed"), "{err}");
    single(&args, &tmp.path().join("single"));
    same_as_dir(&b, "out", &tmp.path().join("single"));
    // Run again after the commit: the output is there, and is not written over.
    let o = part(&b, &args, &out, "0/3");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("not empty"), "{}", stderr(&o));
    same_as_dir(&b, "out", &tmp.path().join("single"));
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn parts_with_different_options_refuse_to_join_in_a_bucket() {
    let ep = endpoint("parts-bucket-mismatch");
    let b = Bucket::create(&ep, &bucket_name("parts-bucket-mismatch"));
    let out = b.url("out");
    let a = llama("40KB");
    let o = part(&b, &a, &out, "0/2");
    assert!(o.status.success(), "{}", stderr(&o));
    let before = b.keys();
    for (args, p, why) in [
        (llama("60KB"), "1/2", "another shard size"),
        (
            [llama("40KB"), vec!["--dtype".into(), "float32".into()]].concat(),
            "1/2",
            "another dtype",
        ),
        (llama("40KB"), "1/3", "another number of parts"),
    ] {
        let o = part(&b, &args, &out, p);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{why}: {err}");
        assert!(
            err.contains("another plan") && err.contains("done-0-of-2"),
            "{why}: {err}"
        );
        assert_eq!(b.keys(), before, "{why}: a refused part wrote nothing");
    }
    let o = part(&b, &a, &out, "1/2");
    assert!(stderr(&o).contains("committed"), "{}", stderr(&o));
    let tmp = tempfile::tempdir().unwrap();
    single(&a, &tmp.path().join("single"));
    same_as_dir(&b, "out", &tmp.path().join("single"));
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn parts_refuse_an_older_output_without_force_and_replace_it_with_force() {
    let ep = endpoint("parts-bucket-force");
    let b = Bucket::create(&ep, &bucket_name("parts-bucket-force"));
    let out = b.url("out");
    b.put("out/config.json", b"{}".to_vec());
    b.put("out/stale.safetensors", b"old".to_vec());
    let args = llama("40KB");
    let o = part(&b, &args, &out, "0/2");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not empty") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(b.keys(), ["out/config.json", "out/stale.safetensors"]);
    let forced = [args.clone(), vec!["--force".into()]].concat();
    for p in ["0/2", "1/2"] {
        let o = part(&b, &forced, &out, p);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let tmp = tempfile::tempdir().unwrap();
    single(&args, &tmp.path().join("single"));
    same_as_dir(&b, "out", &tmp.path().join("single"));
}

#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn a_part_stopped_with_ctrl_c_keeps_its_completed_shards_and_a_rerun_commits() {
    let ep = endpoint("parts-bucket-sigint");
    let b = Bucket::create(&ep, &bucket_name("parts-bucket-sigint"));
    let tmp = tempfile::tempdir().unwrap();
    // 24 shards of 2 MiB, 12 per part, completed one after another once written.
    let ckpt = big_checkpoint(tmp.path(), 24);
    let args = to_bf16_in_3mb_shards(&ckpt);
    let out = b.url("out");
    let o = part(&b, &args, &out, "0/2");
    assert!(o.status.success(), "{}", stderr(&o));
    let shards_now = || {
        b.keys()
            .into_iter()
            .filter(|k| k.ends_with(".safetensors"))
            .count()
    };
    let first = shards_now();
    let slow = merge_cmd(&b, &args, &out)
        .args(["--part", "1/2"])
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "1500")
        .spawn()
        .unwrap();
    let start = Instant::now();
    while shards_now() == first {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "part 1 never finished a shard"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let seen = shards_now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(slow.id() as i32, libc::SIGINT) };
    let o = slow.wait_with_output().unwrap();
    let err = stderr(&o);
    // Stopped (130), or done already if the signal came after its last step.
    assert!(matches!(o.status.code(), Some(130) | Some(0)), "{err}");
    let kept = shards_now();
    assert!(
        kept >= seen && kept > first,
        "completed shards were deleted: {seen} seen, {kept} kept\n{err}"
    );
    assert!(b.get("out/config.json").is_none());
    let o = part(&b, &args, &out, "1/2");
    assert!(stderr(&o).contains("committed"), "{}", stderr(&o));
    single(&args, &tmp.path().join("single"));
    same_as_dir(&b, "out", &tmp.path().join("single"));
}
