//! A merge split into parts, run part after part in one process: into a local
//! directory and into a store (object_store's in-memory store), each output against
//! the one-process merge of the same options, byte for byte.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::*;
use crate::write::NoProgress;

/// The Llama fixture onto its base, in shards of 40 kB: more shards than parts.
fn llama(output: PathBuf) -> MergeOptions {
    MergeOptions {
        checkpoint: crate::fixtures().join("ckpt/llama_policy.pt"),
        base: Some(crate::fixtures().join("models/llama-bf16")),
        output,
        plan: crate::plan::PlanOptions {
            max_shard_size: 40_000,
            ..Default::default()
        },
        ..MergeOptions::default()
    }
}

/// The files of `dir` (flat), by name, with their bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            assert!(e.file_type().unwrap().is_file(), "{}", e.path().display());
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// The one-process merge of `opts` into `dir`: what every split must give.
fn one_process(opts: &MergeOptions, dir: &Path) -> Vec<(String, Vec<u8>)> {
    let single = MergeOptions {
        output: dir.to_path_buf(),
        ..opts.clone()
    };
    crate::merge::merge(&single, &NoProgress).unwrap();
    let found = files(dir);
    let shards = found
        .iter()
        .filter(|(n, _)| n.ends_with(".safetensors"))
        .count();
    assert!(shards > 3, "{shards} shard(s): fewer than the parts");
    assert!(found.iter().any(|(n, _)| n == MANIFEST));
    found
}

/// What a part reports at each stage, with the staging directory's names at that
/// moment (none when there is no staging directory yet).
struct Stages {
    parent: PathBuf,
    seen: Mutex<Vec<(String, Vec<String>)>>,
}

impl Progress for Stages {
    fn stage(&self, what: &str) {
        let mut names = Vec::new();
        for e in std::fs::read_dir(&self.parent).unwrap() {
            let e = e.unwrap();
            if e.file_name().to_string_lossy().contains("unshard-parts-") {
                for f in std::fs::read_dir(e.path()).unwrap() {
                    names.push(f.unwrap().file_name().to_string_lossy().into_owned());
                }
            }
        }
        names.sort();
        self.seen.lock().unwrap().push((what.to_string(), names));
    }
}

/// Two parts into a local directory, one after the other: the first writes its
/// shards into the staging directory that `staging_dir` names beside the output,
/// says so once they are published and before its done-marker, and waits for the
/// second, which a part of another plan cannot be; the second commits the
/// one-process output (its `unshard.json` with every shard's checksum) and leaves no
/// staging directory, and a part started again is refused the existing output. One
/// part alone writes every shard and commits at once.
#[test]
fn parts_into_a_directory_meet_beside_it_and_give_the_one_process_output() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = one_process(&llama(PathBuf::new()), &tmp.path().join("single"));

    let out = tmp.path().join("out");
    let opts = llama(out.clone());
    let stages = Stages {
        parent: tmp.path().to_path_buf(),
        seen: Mutex::new(Vec::new()),
    };
    let first = merge_part(&opts, Part { index: 0, count: 2 }, &stages).unwrap();
    assert!(!first.committed);
    assert_eq!(first.waiting_for, [1]);
    assert!(!first.shards.is_empty());
    assert_eq!(first.staging, staging_dir(&out, &first.plan_hash));
    assert!(first.staging.is_dir());
    assert!(!out.exists());
    let seen = stages.seen.into_inner().unwrap();
    let (last, names) = seen.last().unwrap();
    assert_eq!(last, "part 0 of 2: shards written, marking the part done");
    for s in &first.shards {
        assert!(
            names.contains(s),
            "{s} not published before the stage: {names:?}"
        );
    }
    assert!(!names.iter().any(|n| n.starts_with("done-")), "{names:?}");

    // A part of another plan (another shard size) does not join, and leaves the
    // staging directory as it found it.
    let other = MergeOptions {
        plan: crate::plan::PlanOptions {
            max_shard_size: 60_000,
            ..Default::default()
        },
        ..opts.clone()
    };
    let err = merge_part(&other, Part { index: 1, count: 2 }, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("another plan"), "{err}");
    assert!(first.staging.is_dir() && !out.exists());

    let second = merge_part(&opts, Part { index: 1, count: 2 }, &NoProgress).unwrap();
    assert!(second.committed);
    assert!(second.waiting_for.is_empty());
    assert_eq!(second.plan_hash, first.plan_hash);
    assert_eq!(
        second.total_shards,
        first.shards.len() + second.shards.len()
    );
    assert!(!first.staging.exists());
    assert!(files(&out) == expected, "two parts differ from one process");
    // The output now exists: a part refuses it without `force` before any work,
    // leaving nothing staged beside it.
    let err = merge_part(&opts, Part { index: 0, count: 2 }, &NoProgress).unwrap_err();
    assert!(matches!(err, Error::OutputExists { .. }), "{err}");
    assert!(!first.staging.exists());

    let alone = tmp.path().join("alone");
    let one = merge_part(
        &llama(alone.clone()),
        Part { index: 0, count: 1 },
        &NoProgress,
    )
    .unwrap();
    assert!(one.committed);
    assert_eq!(one.shards.len(), one.total_shards);
    assert!(
        files(&alone) == expected,
        "one part differs from one process"
    );
}

/// Every part count from 1 to 3 into a store (object_store's in-memory store),
/// part after part: each part but the last waits for those after it, the last
/// commits, and the objects under the prefix are the one-process merge's files
/// byte for byte (`unshard.json` with every shard's checksum), no bookkeeping left.
#[cfg(feature = "remote")]
#[test]
fn parts_into_a_store_give_the_one_process_output_and_only_the_last_commits() {
    use crate::bytes::remote::store;
    store::register(
        "s3://parts-merge",
        std::sync::Arc::new(object_store::memory::InMemory::new()),
    );
    let tmp = tempfile::tempdir().unwrap();
    let expected = one_process(&llama(PathBuf::new()), &tmp.path().join("single"));
    for n in 1..=3 {
        let out = PathBuf::from(format!("s3://parts-merge/out{n}"));
        let mut written = Vec::new();
        for i in 0..n {
            let o = merge_part(
                &llama(out.clone()),
                Part { index: i, count: n },
                &NoProgress,
            )
            .unwrap();
            assert_eq!(o.committed, i + 1 == n, "part {i} of {n}");
            assert_eq!(
                o.waiting_for,
                (i + 1..n).collect::<Vec<_>>(),
                "part {i} of {n}"
            );
            written.extend(o.shards);
        }
        written.sort();
        let shards: Vec<String> = expected
            .iter()
            .map(|(name, _)| name.clone())
            .filter(|name| name.ends_with(".safetensors"))
            .collect();
        assert_eq!(written, shards, "{n} part(s) between them");
        let loc = store::locate(&out).unwrap();
        let mut got: Vec<(String, Vec<u8>)> = store::list_all(&loc)
            .unwrap()
            .into_iter()
            .map(|(k, _)| {
                let bytes = store::get_whole(&loc.child(&k)).unwrap().unwrap();
                (k, bytes)
            })
            .collect();
        got.sort();
        let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&expected), "{n} part(s)");
        assert!(got == expected, "{n} part(s) differ from one process");
    }
}
