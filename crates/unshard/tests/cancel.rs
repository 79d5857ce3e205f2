//! Cancellation is a token in the options, not process state: two merges run side
//! by side in one process, one is cancelled mid-write and leaves nothing behind,
//! the other completes with the bytes transformers wrote, and a merge after the
//! cancelled one is not affected by it.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use unshard::merge::{self, MergeOptions};
use unshard::plan::PlanOptions;
use unshard::write::{NoProgress, Progress};
use unshard::{Cancel, Error};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn options(out: &Path, cancel: Cancel) -> MergeOptions {
    MergeOptions {
        checkpoint: fixtures().join("ckpt/llama_policy.pt"),
        base: Some(fixtures().join("models/llama-bf16")),
        output: out.to_path_buf(),
        plan: PlanOptions {
            // Three shards: several blocks, so the cancellation lands mid-write.
            max_shard_size: 100_000,
            ..PlanOptions::default()
        },
        cancel,
        ..MergeOptions::default()
    }
}

/// Cancels its token as soon as the first block is written.
struct CancelAfterFirstBlock(Cancel);

impl Progress for CancelAfterFirstBlock {
    fn advance(&self, _bytes: u64) {
        self.0.cancel();
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn two_merges_in_one_process_are_cancelled_separately() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let cancel_a = Cancel::new();
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| {
            merge::merge(
                &options(&a, cancel_a.clone()),
                &CancelAfterFirstBlock(cancel_a.clone()),
            )
        });
        let hb = s.spawn(|| {
            let mut opts = options(&b, Cancel::new());
            opts.plan.max_shard_size = 5_000_000_000;
            merge::merge(&opts, &NoProgress)
        });
        (ha.join().unwrap(), hb.join().unwrap())
    });
    assert!(matches!(ra, Err(Error::Interrupted)), "{ra:?}");
    assert!(cancel_a.is_cancelled());
    // Nothing of the cancelled merge is left: no output, no staging directory.
    assert_eq!(entries(dir.path()), ["b"]);
    // The other one completed, with transformers' bytes.
    rb.unwrap();
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16");
    for f in ["model.safetensors", "config.json"] {
        assert!(
            std::fs::read(b.join(f)).unwrap() == std::fs::read(expected.join(f)).unwrap(),
            "{f} differs from transformers' output"
        );
    }

    // A later merge into the cancelled one's output, with a new token, succeeds.
    merge::merge(&options(&a, Cancel::new()), &NoProgress).unwrap();
    assert_eq!(
        entries(&a)
            .into_iter()
            .filter(|n| n.ends_with(".safetensors"))
            .count(),
        3
    );
}

#[test]
fn a_token_cancelled_before_the_merge_stops_it_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let cancel = Cancel::new();
    cancel.cancel();
    let r = merge::merge(&options(&out, cancel), &NoProgress);
    assert!(matches!(r, Err(Error::Interrupted)), "{r:?}");
    assert!(entries(dir.path()).is_empty());
}
