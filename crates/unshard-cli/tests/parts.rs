//! `--part I/N`: one merge split over N processes sharing the output's filesystem.
//! The parts together write exactly what one process writes; the last to finish
//! commits; a part killed and run again finishes the job; parts of different plans
//! refuse to join.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{big_checkpoint, fixtures, names};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_unshard")
}

fn merge_cmd(args: &[String], out: &Path) -> Command {
    let mut cmd = Command::new(bin());
    cmd.arg("merge").args(args).arg("-o").arg(out);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn finish(c: Child) -> Output {
    c.wait_with_output().unwrap()
}

fn same_dirs(a: &Path, b: &Path) {
    assert_eq!(names(a), names(b));
    for n in names(a) {
        if a.join(&n).is_dir() {
            same_dirs(&a.join(&n), &b.join(&n));
            continue;
        }
        let (x, y) = (
            std::fs::read(a.join(&n)).unwrap(),
            std::fs::read(b.join(&n)).unwrap(),
        );
        assert!(x == y, "{n} differs");
    }
}

/// The llama fixture merged with `--max-shard-size` `size`: `(args, shards)`.
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

/// Runs `n` parts at once and checks the output equals a single-process merge.
fn split_equals_single(args: &[String], n: usize) -> usize {
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("single");
    let o = merge_cmd(args, &single).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = tmp.path().join("split");
    let children: Vec<Child> = (0..n)
        .map(|i| {
            let mut c = merge_cmd(args, &out);
            c.args(["--part", &format!("{i}/{n}")]);
            c.spawn().unwrap()
        })
        .collect();
    let mut committed = 0;
    for c in children {
        let o = finish(c);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        committed += usize::from(err.contains("committed"));
    }
    assert_eq!(committed, 1, "exactly one part commits");
    same_dirs(&single, &out);
    // Nothing else is left beside the output.
    assert_eq!(names(tmp.path()), ["single", "split"]);
    names(&out)
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .count()
}

#[test]
fn two_three_and_seven_parts_with_more_shards_than_parts_equal_one_process() {
    let args = llama("40KB");
    for n in [2, 3, 7] {
        let shards = split_equals_single(&args, n);
        assert!(
            shards > 7,
            "the fixture must have more shards than parts: {shards}"
        );
    }
}

/// A LoRA adapter (DoRA, whose fuse rescales each row) and a training checkpoint
/// of a peft-wrapped model: every part plans the same fuses and the owner of a
/// shard computes its weights, so 2 and 3 parts write what one process writes;
/// with `--no-fuse`, the adapter directory too.
#[test]
fn lora_adapters_split_into_parts_equal_one_process() {
    let fx = fixtures();
    let lora = |adapter: &str, more: &[&str]| {
        let mut args: Vec<String> = vec![
            fx.join(adapter).to_str().unwrap().into(),
            "--base".into(),
            fx.join("models/llama-bf16").to_str().unwrap().into(),
            "--max-shard-size".into(),
            "40KB".into(),
        ];
        args.extend(more.iter().map(|s| s.to_string()));
        args
    };
    for n in [2, 3] {
        let shards = split_equals_single(&lora("lora/adapters/llama_dora", &[]), n);
        assert!(shards > n, "more shards than parts: {shards}");
        split_equals_single(&lora("lora/train/llama_lora_pt/policy.pt", &[]), n);
    }
    let args = lora("lora/adapters/llama_lora", &["--no-fuse"]);
    split_equals_single(&args, 2);
}

#[test]
fn more_parts_than_shards_equal_one_process() {
    let args = llama("5GB");
    for n in [2, 3, 7] {
        assert_eq!(split_equals_single(&args, n), 1);
    }
}

#[test]
fn parts_run_one_after_another_and_only_the_last_commits() {
    let args = llama("40KB");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    for i in [2, 0] {
        let o = merge_cmd(&args, &out)
            .args(["--part", &format!("{i}/3")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && err.contains("waiting for part(s)"),
            "{err}"
        );
        assert!(!out.exists());
    }
    let o = merge_cmd(&args, &out)
        .args(["--part", "1/3"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("committed"));
    let single = tmp.path().join("single");
    assert!(merge_cmd(&args, &single).output().unwrap().status.success());
    same_dirs(&single, &out);
}

/// A part refuses an existing output without `--force` before it writes anything,
/// as a single-process merge does; with `--force` the parts replace it.
#[test]
fn a_part_refuses_an_existing_output_without_force() {
    let args = llama("40KB");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    assert!(merge_cmd(&args, &out).output().unwrap().status.success());
    let before = std::fs::read(out.join("config.json")).unwrap();
    let o = merge_cmd(&args, &out)
        .args(["--part", "0/2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("--force") && err.contains("out"), "{err}");
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), before);
    // Nothing staged beside it: the refusal came before the part's work.
    assert_eq!(names(tmp.path()), ["out"]);
    for i in 0..2 {
        let o = merge_cmd(&args, &out)
            .args(["--part", &format!("{i}/2"), "--force"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let single = tmp.path().join("single");
    assert!(merge_cmd(&args, &single).output().unwrap().status.success());
    same_dirs(&single, &out);
}

/// A checkpoint of six 4 MiB float32 tensors, one shard each once in bfloat16.
fn six_shards(dir: &Path) -> Vec<String> {
    let ckpt: PathBuf = big_checkpoint(dir, 6);
    vec![
        ckpt.to_str().unwrap().into(),
        "--weights-only".into(),
        "--dtype".into(),
        "bfloat16".into(),
        "--max-shard-size".into(),
        "3MB".into(),
    ]
}

#[test]
fn a_killed_part_run_again_finishes_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let args = six_shards(tmp.path());
    let out = tmp.path().join("out");
    // Part 1 is slowed down and killed once it has started writing.
    let mut slow = merge_cmd(&args, &out);
    slow.args(["--part", "1/3"])
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", "2000");
    let mut slow = slow.spawn().unwrap();
    let start = Instant::now();
    loop {
        let staged = names(tmp.path())
            .into_iter()
            .find(|n| n.starts_with(".out.unshard-parts-"))
            .map(|d| names(&tmp.path().join(d)));
        if staged.is_some_and(|f| f.iter().any(|n| n.ends_with(".tmp"))) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "part 1 never started writing"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    slow.kill().unwrap();
    slow.wait().unwrap();
    for i in [0, 2] {
        let o = merge_cmd(&args, &out)
            .args(["--part", &format!("{i}/3")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && err.contains("waiting for part(s) 1"),
            "{err}"
        );
    }
    assert!(!out.exists(), "committed without part 1");
    let o = merge_cmd(&args, &out)
        .args(["--part", "1/3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("committed"), "{err}");
    let single = tmp.path().join("single");
    assert!(merge_cmd(&args, &single).output().unwrap().status.success());
    same_dirs(&single, &out);
    // Six shards, the index and unshard.json: no part's bookkeeping is left.
    assert_eq!(names(&out).len(), 8, "{:?}", names(&out));
}

#[test]
fn parts_started_with_different_options_refuse_to_join() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let a = llama("40KB");
    let o = merge_cmd(&a, &out)
        .args(["--part", "0/2"])
        .output()
        .unwrap();
    assert!(o.status.success());
    for (b, why) in [
        (llama("60KB"), "another shard size"),
        (
            [llama("40KB"), vec!["--dtype".into(), "float32".into()]].concat(),
            "another dtype",
        ),
        (llama("40KB"), "another number of parts"),
    ] {
        let part = if why == "another number of parts" {
            "1/3"
        } else {
            "1/2"
        };
        let o = merge_cmd(&b, &out).args(["--part", part]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{why}: {err}");
        assert!(
            err.contains("another plan") && err.contains("done-0-of-2"),
            "{why}: {err}"
        );
        assert!(!out.exists());
    }
    // The right part still finishes the job.
    let o = merge_cmd(&a, &out)
        .args(["--part", "1/2"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("committed"));
}

#[test]
fn part_auto_reads_the_launcher_variables() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = llama("40KB");
    for (r, w) in [("1", "2"), ("0", "2")] {
        let o = merge_cmd(&args, &out)
            .args(["--part", "auto"])
            .env("RANK", r)
            .env("WORLD_SIZE", w)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && err.contains(&format!("part {r}/{w}")),
            "{err}"
        );
    }
    assert!(out.join("config.json").exists());
    let o = merge_cmd(&args, &tmp.path().join("x"))
        .args(["--part", "auto"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS")
        .env_remove("SLURM_ARRAY_TASK_ID")
        .env_remove("SLURM_ARRAY_TASK_COUNT")
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `torchrun` to launch parts with, from `UNSHARD_TORCHRUN` or the PATH.
fn torchrun() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UNSHARD_TORCHRUN").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("torchrun"))
            .find(|p| p.is_file())
    })
}

#[test]
#[ignore = "needs torchrun: UNSHARD_TORCHRUN or torch's bin directory on PATH (see docs/testing.md)"]
fn torchrun_no_python_launches_the_parts() {
    let torchrun = torchrun().expect(
        "no torchrun: set UNSHARD_TORCHRUN or put torch's bin directory on PATH (docs/testing.md)",
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = llama("40KB");
    let o = Command::new(&torchrun)
        .args(["--no-python", "--nproc-per-node", "3", bin(), "merge"])
        .args(&args)
        .arg("-o")
        .arg(&out)
        .args(["--part", "auto"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for i in 0..3 {
        assert!(err.contains(&format!("part {i}/3: wrote")), "{err}");
    }
    let single = tmp.path().join("single");
    assert!(merge_cmd(&args, &single).output().unwrap().status.success());
    same_dirs(&single, &out);
}
