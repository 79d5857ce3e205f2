//! `--part I/N` swept: part counts 1..=4 x outputs of 1, 3 and 5 shards x a part
//! killed (SIGKILL) before it writes, while it writes, or after its shards are in
//! place but before its done-marker, then run again. Every output must be
//! byte-identical to the one-process merge, which for 1 and 3 shards must be the
//! files transformers wrote (`fixtures/expected/`), and no staging is left.
//!
//! A part is slowed down, so that it can be killed at a known point, with the
//! progress hooks `UNSHARD_TEST_STAGE_DELAY_MS` (a pause at each stage: before
//! anything is read, and once the shards are published) and
//! `UNSHARD_TEST_WINDOW_DELAY_MS` (a pause after each window of bytes written).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{fixtures, model_names, names};

/// One output layout: `--max-shard-size`, the base, the shard count it gives and
/// the directory transformers wrote for it, where a fixture has one.
struct Layout {
    shards: usize,
    size: &'static str,
    base: &'static str,
    transformers: Option<&'static str>,
}

const LAYOUTS: &[Layout] = &[
    Layout {
        shards: 1,
        size: "5GB",
        base: "models/llama-bf16",
        transformers: Some("expected/llama_policy_into_llama-bf16"),
    },
    Layout {
        shards: 3,
        size: "100KB",
        base: "models/llama-bf16-sharded",
        transformers: Some("expected/llama_policy_into_llama-bf16-sharded"),
    },
    Layout {
        shards: 5,
        size: "60KB",
        base: "models/llama-bf16",
        transformers: None,
    },
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kill {
    /// Every part runs at once, none killed.
    None,
    /// Killed while it plans, before any byte of it is on disk.
    BeforeWrite,
    /// Killed once one of its shards is open under a temporary name.
    MidWrite,
    /// Killed once its shards are published, before its done-marker exists.
    AfterShards,
}

const KILLS: [Kill; 4] = [
    Kill::None,
    Kill::BeforeWrite,
    Kill::MidWrite,
    Kill::AfterShards,
];

fn args(l: &Layout) -> Vec<String> {
    let fx = fixtures();
    vec![
        fx.join("ckpt/llama_policy.pt").to_str().unwrap().into(),
        "--base".into(),
        fx.join(l.base).to_str().unwrap().into(),
        "--max-shard-size".into(),
        l.size.into(),
    ]
}

fn merge_cmd(args: &[String], out: &Path, part: Option<(usize, usize)>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_unshard"));
    cmd.arg("merge").args(args).arg("-o").arg(out);
    if let Some((i, n)) = part {
        cmd.args(["--part", &format!("{i}/{n}")]);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Same file names, same bytes (unshard.json included).
fn same_dirs(a: &Path, b: &Path, what: &str) {
    assert_eq!(names(a), names(b), "{what}");
    for n in names(a) {
        assert!(
            std::fs::read(a.join(&n)).unwrap() == std::fs::read(b.join(&n)).unwrap(),
            "{what}: {n} differs from the one-process merge"
        );
    }
}

/// The staging directory of the output `out`, once a part made it.
fn staging(out: &Path) -> Option<PathBuf> {
    let parent = out.parent().unwrap();
    let prefix = format!(
        ".{}.unshard-parts-",
        out.file_name().unwrap().to_str().unwrap()
    );
    names(parent)
        .into_iter()
        .find(|n| n.starts_with(&prefix))
        .map(|n| parent.join(n))
}

/// What part `k` has in the staging directory: (temporary shards, published
/// shards, its done-marker).
fn staged(out: &Path, k: usize, n: usize) -> (usize, usize, bool) {
    let Some(dir) = staging(out) else {
        return (0, 0, false);
    };
    // The directory may be renamed into place between the listing and the read.
    let files = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let tmp = files
        .iter()
        .filter(|f| f.ends_with(&format!(".part{k}.tmp")))
        .count();
    let published = files
        .iter()
        .filter(|f| f.ends_with(".safetensors") && !f.starts_with('.'))
        .count();
    let done = files.iter().any(|f| *f == format!("done-{k}-of-{n}"));
    (tmp, published, done)
}

/// Starts part `k` of `n` slowed down, kills it at `kill`, and checks what it
/// left: nothing, an open temporary shard, or published shards without a marker.
fn kill_part(args: &[String], out: &Path, k: usize, n: usize, kill: Kill, what: &str) {
    let (var, ms) = match kill {
        Kill::MidWrite => ("UNSHARD_TEST_WINDOW_DELAY_MS", "5000"),
        Kill::BeforeWrite => ("UNSHARD_TEST_STAGE_DELAY_MS", "5000"),
        // Long enough to be caught between publishing and marking, short enough
        // that the pause before reading costs little.
        _ => ("UNSHARD_TEST_STAGE_DELAY_MS", "1000"),
    };
    let mut child: Child = merge_cmd(args, out, Some((k, n)))
        .env(var, ms)
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        let (tmp, published, done) = staged(out, k, n);
        assert!(!done, "{what}: the part finished before it was killed");
        let reached = match kill {
            Kill::BeforeWrite => start.elapsed() > Duration::from_millis(150),
            Kill::MidWrite => tmp > 0,
            _ => tmp == 0 && published > 0,
        };
        if reached {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: never reached the kill point"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (tmp, published, done) = staged(out, k, n);
    let left = match kill {
        Kill::BeforeWrite => tmp == 0 && published == 0,
        Kill::MidWrite => tmp > 0 && published == 0,
        _ => tmp == 0 && published > 0,
    };
    assert!(
        left && !done,
        "{what}: killed part left {tmp} temporary and {published} published shard(s), marker {done}"
    );
}

/// One scenario into `dir/out`: the parts, a kill and its rerun; returns the output.
fn run(args: &[String], dir: &Path, n: usize, kill: Kill, what: &str) -> PathBuf {
    let out = dir.join("out");
    if kill == Kill::None {
        let children: Vec<Child> = (0..n)
            .map(|i| merge_cmd(args, &out, Some((i, n))).spawn().unwrap())
            .collect();
        let mut committed = 0;
        for c in children {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{what}: {}", stderr(&o));
            committed += usize::from(stderr(&o).contains("committed"));
        }
        assert_eq!(committed, 1, "{what}: exactly one part commits");
        return out;
    }
    // Part 0 always owns a shard (the largest goes to it).
    kill_part(args, &out, 0, n, kill, what);
    for i in 1..n {
        let o = merge_cmd(args, &out, Some((i, n))).output().unwrap();
        let err = stderr(&o);
        assert!(
            o.status.success() && err.contains("waiting for part(s) 0"),
            "{what}: part {i}: {err}"
        );
    }
    assert!(!out.exists(), "{what}: committed without part 0");
    let o = merge_cmd(args, &out, Some((0, n))).output().unwrap();
    let err = stderr(&o);
    assert!(
        o.status.success() && err.contains("committed"),
        "{what}: part 0 run again: {err}"
    );
    out
}

/// The layout's one-process merge, checked against transformers' files where a
/// fixture has them, then every part count and kill point against it; returns how
/// many scenarios ran.
fn sweep(l: &Layout) -> usize {
    let args = args(l);
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("single");
    let o = merge_cmd(&args, &single, None).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let shards = names(&single)
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .count();
    assert_eq!(shards, l.shards, "{}", l.size);
    if let Some(t) = l.transformers {
        let t = fixtures().join(t);
        assert_eq!(model_names(&single), names(&t), "{}", t.display());
        for f in names(&t) {
            assert!(
                std::fs::read(single.join(&f)).unwrap() == std::fs::read(t.join(&f)).unwrap(),
                "{f} differs from transformers' {}",
                t.display()
            );
        }
    }
    let mut scenarios = 0;
    for n in 1..=4 {
        for kill in KILLS {
            let what = format!("{} shard(s), {n} part(s), {kill:?}", l.shards);
            let dir = tempfile::tempdir().unwrap();
            let out = run(&args, dir.path(), n, kill, &what);
            same_dirs(&single, &out, &what);
            assert_eq!(names(dir.path()), ["out"], "{what}: staging left behind");
            scenarios += 1;
        }
    }
    scenarios
}

#[test]
fn every_part_count_shard_count_and_kill_point_gives_the_one_process_output() {
    // The layouts run side by side: most of the time is the parts' pauses.
    let scenarios: usize = std::thread::scope(|s| {
        let runs: Vec<_> = LAYOUTS.iter().map(|l| s.spawn(move || sweep(l))).collect();
        runs.into_iter().map(|r| r.join().unwrap()).sum()
    });
    assert_eq!(scenarios, 48);
}
