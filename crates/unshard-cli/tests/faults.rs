//! Fault injection: signals mid-write, a killed run, unwritable outputs, an input
//! that changes under the reader. The output must appear complete or not at all.
//!
//! `UNSHARD_TEST_WINDOW_DELAY_MS` makes the binary sleep after every 8 MiB window so
//! that a signal reliably arrives while shards are being written.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{big_checkpoint, names, require, Tmpfs};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_unshard")
}

fn spawn_slow_merge(ckpt: &Path, out: &Path, delay_ms: u64) -> Child {
    Command::new(bin())
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            out.to_str().unwrap(),
        ])
        .env("UNSHARD_TEST_WINDOW_DELAY_MS", delay_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until a staging directory with at least one shard file appears in `parent`.
fn wait_for_staging(parent: &Path) -> PathBuf {
    let start = Instant::now();
    loop {
        for n in names(parent) {
            if n.contains(".unshard-tmp-") {
                let p = parent.join(&n);
                if std::fs::read_dir(&p)
                    .map(|mut r| r.next().is_some())
                    .unwrap_or(false)
                {
                    return p;
                }
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no staging directory appeared"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

fn interrupted_run_leaves_nothing(sig: i32) {
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 12);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("out");
    let child = spawn_slow_merge(&ckpt, &out, 150);
    wait_for_staging(parent.path());
    signal(&child, sig);
    let o = finish(child);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(128 + sig), "{err}");
    assert!(err.contains("error: interrupted"), "{err}");
    assert_eq!(err.matches("interrupted").count(), 1, "{err}");
    assert!(
        names(parent.path()).is_empty(),
        "left behind: {:?}",
        names(parent.path())
    );
}

/// A signal while the checkpoint is still being read (nothing staged yet) ends the
/// run at once instead of when writing would have begun.
fn interrupted_while_reading_exits_at_once(sig: i32) {
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("out");
    let ckpt = common::fixtures().join("ckpt/llama_policy.pt");
    let mut child = Command::new(bin())
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            out.to_str().unwrap(),
            "--weights-only",
        ])
        // The reading stage takes 20 s; without an immediate exit the run would
        // finish (exit 0) after that.
        .env("UNSHARD_TEST_STAGE_DELAY_MS", "20000")
        // A plain progress line says when the reading stage has begun.
        .env("UNSHARD_PROGRESS_INTERVAL", "0.05")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut err = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        err.push_str(&line);
        err.push('\n');
        if line.starts_with("progress: reading ") {
            break;
        }
    }
    let sent = Instant::now();
    signal(&child, sig);
    for line in lines {
        err.push_str(&line.unwrap());
        err.push('\n');
    }
    let status = child.wait().unwrap();
    let took = sent.elapsed();
    assert_eq!(status.code(), Some(128 + sig), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(err.contains("error: interrupted"), "{err}");
    assert!(err.contains("hint: nothing was written"), "{err}");
    assert!(
        names(parent.path()).is_empty(),
        "left behind: {:?}",
        names(parent.path())
    );
}

#[test]
fn sigint_while_reading_exits_130_at_once() {
    interrupted_while_reading_exits_at_once(libc::SIGINT);
}

#[test]
fn sigterm_while_reading_exits_143_at_once() {
    interrupted_while_reading_exits_at_once(libc::SIGTERM);
}

/// What `pickle.dumps([{'k0': 0}, {'k1': 1}, ...], protocol=2)` writes (without the
/// memo, which changes nothing here): `n` one-entry dicts in a list, appended in
/// batches of 1000 as CPython's pickler does. Some 28 bytes per dict: 1M of them
/// take seconds to parse and audit in a debug build. Made here rather than
/// committed, being tens of MB.
fn slow_pickle(n: u32) -> Vec<u8> {
    let mut b = vec![0x80, 2, b']'];
    for batch in (0..n).collect::<Vec<_>>().chunks(1000) {
        b.push(b'(');
        for &i in batch {
            let key = format!("k{i}");
            b.push(b'}');
            b.push(b'X');
            b.extend_from_slice(&(key.len() as u32).to_le_bytes());
            b.extend_from_slice(key.as_bytes());
            b.push(b'J');
            b.extend_from_slice(&i.to_le_bytes());
            b.push(b's');
        }
        b.push(b'e');
    }
    b.push(b'.');
    b
}

/// A signal while a slow file is still being parsed (no test hook slows anything:
/// the parse itself takes seconds) ends `scan`, `inspect` and `merge` within a
/// second, leaving nothing behind.
#[test]
fn a_signal_while_a_slow_file_is_parsed_ends_every_reading_command_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("slow.pkl");
    std::fs::write(&input, slow_pickle(1_000_000)).unwrap();
    let inp = input.to_str().unwrap().to_string();
    let out = dir.path().join("out").to_str().unwrap().to_string();
    let runs: [(&[&str], i32); 4] = [
        (&["scan", &inp], libc::SIGINT),
        (&["inspect", &inp], libc::SIGTERM),
        (&["merge", &inp, &out], libc::SIGINT),
        (&["diff", &inp, &inp], libc::SIGTERM),
    ];
    for (args, sig) in runs {
        let mut child = Command::new(bin())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            child.try_wait().unwrap().is_none(),
            "{args:?} finished in 300 ms: the input no longer takes long to parse, make it larger"
        );
        let sent = Instant::now();
        signal(&child, sig);
        let status = child.wait().unwrap();
        let took = sent.elapsed();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(128 + sig), "{args:?}: {err}");
        assert!(took < Duration::from_secs(1), "{args:?} took {took:?}");
        assert!(err.contains("error: interrupted"), "{args:?}: {err}");
        assert_eq!(
            names(dir.path()),
            ["slow.pkl"],
            "{args:?} left something behind"
        );
    }
}

#[test]
fn sigint_mid_write_removes_the_staging_directory() {
    interrupted_run_leaves_nothing(libc::SIGINT);
}

#[test]
fn sigterm_mid_write_removes_the_staging_directory() {
    interrupted_run_leaves_nothing(libc::SIGTERM);
}

#[test]
fn a_killed_run_never_shows_a_half_written_output_and_is_cleaned_next_time() {
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 12);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("out");
    let mut child = spawn_slow_merge(&ckpt, &out, 150);
    let staging = wait_for_staging(parent.path());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.exists(), "a killed run must not leave an output");
    assert!(
        staging.exists(),
        "SIGKILL cannot be caught: the staging directory stays"
    );

    let o = Command::new(bin())
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            "bfloat16",
            "-o",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("left by an interrupted run"), "{err}");
    assert_eq!(names(parent.path()), vec!["out"]);
    assert!(out.join("model.safetensors").is_file());
}

#[test]
fn an_unwritable_output_parent_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let ckpt = fixtures.join("ckpt/llama_policy.pt");
    let out = file.join("out");
    let o = Command::new(bin())
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--weights-only",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("a-file"), "{err}");
    assert_eq!(names(tmp.path()), vec!["a-file"]);
}

/// A read-only filesystem (root ignores permission bits, so mount one).
#[test]
#[ignore = "needs root to mount a tmpfs (see docs/testing.md)"]
fn a_read_only_output_filesystem_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let ckpt = fixtures.join("ckpt/llama_policy.pt");
    let ro = tmp.path().join("ro");
    let tmpfs = require(Tmpfs::mount(&ro, "ro,size=64k"), "mount a tmpfs");
    let o = Command::new(bin())
        .args([
            "merge",
            ckpt.to_str().unwrap(),
            "-o",
            ro.join("out").to_str().unwrap(),
            "--weights-only",
        ])
        .output()
        .unwrap();
    let left = names(&ro);
    drop(tmpfs);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("Read-only file system"), "{err}");
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn an_input_truncated_during_the_merge_is_an_error_not_a_crash() {
    let inputs = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(inputs.path(), 12);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("out");
    let child = spawn_slow_merge(&ckpt, &out, 150);
    wait_for_staging(parent.path());
    let f = std::fs::OpenOptions::new().write(true).open(&ckpt).unwrap();
    f.set_len(1 << 20).unwrap();
    let o = finish(child);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(1),
        "must fail cleanly, not crash: {:?} {err}",
        o.status
    );
    assert!(err.contains("big.safetensors"), "{err}");
    assert!(
        names(parent.path()).is_empty(),
        "left behind: {:?}",
        names(parent.path())
    );
}
