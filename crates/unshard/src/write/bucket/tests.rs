//! The bucket sink against object_store's in-memory store, wrapped in the test
//! store [`Cut`] (which logs what is written and deleted, and refuses requests on
//! demand): the run manifest, the order of the commit, the blocks of an upload,
//! the refusals before a run starts, and what a failed or cancelled run leaves.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::*;
use crate::bytes::remote::cut::Cut;
use crate::write::{Sink, WINDOW_BYTES};

const W: usize = WINDOW_BYTES as usize;

thread_local! {
    /// Whether this thread's tests run against the test server instead of memory.
    static ON_SERVER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A new test store, registered as `s3://NAME`: the in-memory store, or a new
/// bucket on the test server when [`every_test_against_a_real_server`] runs.
fn bucket(name: &str) -> Arc<Cut> {
    let cut = Arc::new(if ON_SERVER.get() {
        Cut::over(crate::bytes::remote::cut::server_bucket(name).1, &[])
    } else {
        Cut::new(&[])
    });
    store::register(&format!("s3://{name}"), cut.clone());
    cut
}

/// Every object in the store, by key.
fn objects(cut: &Cut) -> BTreeMap<String, Vec<u8>> {
    let metas = block_on(futures_util::TryStreamExt::try_collect::<Vec<_>>(
        cut.inner.list(None),
    ))
    .unwrap();
    metas
        .into_iter()
        .map(|m| {
            let got = block_on(cut.inner.get(&m.location)).unwrap();
            (
                m.location.to_string(),
                block_on(got.bytes()).unwrap().to_vec(),
            )
        })
        .collect()
}

fn keys(cut: &Cut) -> Vec<String> {
    objects(cut).into_keys().collect()
}

fn put(cut: &Cut, key: &str, bytes: &[u8]) {
    block_on(cut.inner.put(&key.into(), PutPayload::from(bytes.to_vec()))).unwrap();
}

/// Multipart uploads opened and neither completed nor aborted.
fn open_uploads(cut: &Cut) -> Vec<String> {
    let (opened, ended) = cut.uploads.lock().unwrap().clone();
    opened
        .into_iter()
        .filter(|id| !ended.contains(id))
        .collect()
}

fn log(cut: &Cut) -> Vec<String> {
    cut.log.lock().unwrap().clone()
}

/// Where `entry` is in the store's log.
fn at(log: &[String], entry: &str) -> usize {
    log.iter()
        .position(|l| l == entry)
        .unwrap_or_else(|| panic!("no {entry:?} in {log:?}"))
}

/// `n` bytes that differ from block to block.
fn body(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed ^ ((i / W) as u8))
        .collect()
}

fn secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The host name, as the C library gives it.
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(r, 0);
    let end = buf.iter().position(|&b| b == 0).unwrap();
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The manifest says who writes (run id, host, process, start time) and lists each
/// file before its first byte is written; a name announced again does not rewrite
/// it; the commit removes it.
#[test]
fn the_run_manifest_names_the_run_and_each_file_before_it_is_written() {
    let cut = bucket("sink-manifest");
    let manifest = |cut: &Cut| -> serde_json::Value {
        serde_json::from_slice(&objects(cut)["out/.unshard-run.json"]).unwrap()
    };
    let t0 = secs();
    let sink = BucketSink::create(Path::new("s3://sink-manifest/out"), false).unwrap();
    let t1 = secs();
    let m = manifest(&cut);
    assert!(!sink.run_id().is_empty());
    assert_eq!(m["run_id"], sink.run_id());
    assert_eq!(m["host"], host());
    assert_eq!(m["pid"], std::process::id());
    let started = m["started"].as_u64().unwrap();
    assert!(
        t0 <= started && started <= t1,
        "{started} not in {t0}..={t1}"
    );
    assert_eq!(m["files"], serde_json::json!([]));
    let other = BucketSink::create(Path::new("s3://sink-manifest/other"), false).unwrap();
    assert_ne!(other.run_id(), sink.run_id());
    drop(other);

    let shard = sink.create_shard("model.safetensors", 10).unwrap();
    assert_eq!(m["run_id"], manifest(&cut)["run_id"]);
    assert_eq!(
        manifest(&cut)["files"],
        serde_json::json!(["model.safetensors"])
    );
    let writes = |cut: &Cut| {
        log(cut)
            .iter()
            .filter(|l| *l == "put out/.unshard-run.json")
            .count()
    };
    let before = writes(&cut);
    sink.announce(&["model.safetensors".to_string()]).unwrap();
    assert_eq!(writes(&cut), before, "the same name rewrote the manifest");
    sink.announce(&["config.json".to_string()]).unwrap();
    assert_eq!(writes(&cut), before + 1);
    assert_eq!(
        manifest(&cut)["files"],
        serde_json::json!(["model.safetensors", "config.json"])
    );
    shard.write_block(b"0123456789", 0).unwrap();
    shard.finish().unwrap();
    sink.write_file("config.json", b"{}").unwrap();
    Box::new(sink).commit().unwrap();
    assert_eq!(keys(&cut), ["out/config.json", "out/model.safetensors"]);
    assert_eq!(objects(&cut)["out/model.safetensors"], b"0123456789");
}

/// The small files land after the shards, the index next to last and config.json
/// last (loaders open them first); the manifest is rewritten to name them before
/// they are written and deleted after.
#[test]
fn the_commit_writes_the_index_then_the_config_last() {
    let cut = bucket("sink-order");
    let sink = BucketSink::create(Path::new("s3://sink-order/out"), false).unwrap();
    let shard = sink.create_shard("model.safetensors", 4).unwrap();
    shard.write_block(b"abcd", 0).unwrap();
    shard.finish().unwrap();
    sink.write_file("config.json", b"{\"a\": 1}").unwrap();
    sink.write_file("model.safetensors.index.json", b"{}")
        .unwrap();
    sink.write_file("tokenizer.json", b"tok").unwrap();
    Box::new(sink).commit().unwrap();
    let log = log(&cut);
    let puts: Vec<&str> = log
        .iter()
        .filter_map(|l| l.strip_prefix("put out/"))
        .filter(|k| !k.starts_with(".unshard"))
        .collect();
    assert_eq!(
        puts,
        [
            "tokenizer.json",
            "model.safetensors.index.json",
            "config.json"
        ]
    );
    let last_manifest = log
        .iter()
        .rposition(|l| l == "put out/.unshard-run.json")
        .unwrap();
    assert!(
        last_manifest < at(&log, "put out/tokenizer.json"),
        "{log:?}"
    );
    assert_eq!(log.last().unwrap(), "delete out/.unshard-run.json");
    assert_eq!(
        keys(&cut),
        [
            "out/config.json",
            "out/model.safetensors",
            "out/model.safetensors.index.json",
            "out/tokenizer.json"
        ]
    );
    assert_eq!(objects(&cut)["out/config.json"], b"{\"a\": 1}");
}

/// A small file written twice is written once, with its last bytes; a copy of a
/// local file is skipped when a file of that name was already written, and the
/// sink stages nothing locally.
#[test]
fn small_files_keep_their_last_bytes_and_copies_do_not_overwrite() {
    let cut = bucket("sink-small");
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("tokenizer.json");
    std::fs::write(&local, b"from disk").unwrap();
    let sink = BucketSink::create(Path::new("s3://sink-small/out"), false).unwrap();
    assert!(sink.staged_dir().is_none());
    sink.write_file("a.json", b"first").unwrap();
    sink.write_file("b.json", b"other").unwrap();
    sink.write_file("a.json", b"last").unwrap();
    assert!(!sink.copy_file("a.json", &local).unwrap());
    assert!(sink.copy_file("tokenizer.json", &local).unwrap());
    Box::new(sink).commit().unwrap();
    let got = objects(&cut);
    assert_eq!(got.len(), 3, "{:?}", got.keys());
    assert_eq!(got["out/a.json"], b"last");
    assert_eq!(got["out/b.json"], b"other");
    assert_eq!(got["out/tokenizer.json"], b"from disk");
    let a_puts = log(&cut).iter().filter(|l| *l == "put out/a.json").count();
    assert_eq!(a_puts, 1);
}

/// Block `k` of a shard is part `k`, whatever order the blocks come in; a write
/// that is not one whole block (or the short last one) is refused, as is a write
/// at an arbitrary offset; a shard missing a block is not completed.
#[test]
fn each_block_is_one_part_in_any_order_and_other_writes_are_refused() {
    let cut = bucket("sink-blocks");
    let sink = BucketSink::create(Path::new("s3://sink-blocks/out"), false).unwrap();
    let size = 2 * W + 100;
    let want = body(size, 3);
    let shard = sink.create_shard("s.safetensors", size as u64).unwrap();
    for bad in [(1, W), (0, W - 1), (W, W + 1), (3 * W, W), (2 * W + 1, 99)] {
        let e = shard
            .write_block(&want[..bad.1.min(want.len())], bad.0 as u64)
            .unwrap_err();
        assert!(
            e.to_string().contains("is not one of the 8 MiB blocks"),
            "{bad:?}: {e}"
        );
    }
    for k in [2, 0, 1] {
        let range = k * W..((k + 1) * W).min(size);
        shard
            .write_block(&want[range.clone()], range.start as u64)
            .unwrap();
    }
    let e = shard.write_at(b"x", 5).unwrap_err();
    assert!(e.to_string().contains("computed tensor"), "{e}");
    assert!(e.hint().unwrap().contains("merge into a local directory"));
    shard.finish().unwrap();

    let missing = sink.create_shard("t.safetensors", W as u64 + 1).unwrap();
    missing.write_block(&want[..W], 0).unwrap();
    let e = missing.finish().unwrap_err();
    assert!(e.to_string().contains("never written"), "{e}");
    drop(missing);

    sink.write_file("config.json", b"{}").unwrap();
    Box::new(sink).commit().unwrap();
    assert_eq!(objects(&cut)["out/s.safetensors"], want);
    assert!(!objects(&cut).contains_key("out/t.safetensors"));
}

/// A shard of 10 000 blocks is the most a multipart upload takes; one more byte is
/// refused, with the option to lower.
#[test]
fn a_shard_of_more_than_ten_thousand_parts_is_refused() {
    bucket("sink-parts");
    let sink = BucketSink::create(Path::new("s3://sink-parts/out"), false).unwrap();
    let most = 10_000 * WINDOW_BYTES;
    sink.create_shard("most.safetensors", most).unwrap();
    let e = sink
        .create_shard("over.safetensors", most + 1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("needs 10001 parts"), "{e}");
    assert_eq!(e.hint().as_deref(), Some("lower --max-shard-size"));
    sink.create_shard("small.safetensors", 1).unwrap();
}

/// What is written before a failure, as it happens in a merge: a shard completed,
/// one still uploading (a block in), a small file held for the commit.
fn half_written(sink: &BucketSink) {
    let done = sink.create_shard("a.safetensors", W as u64 + 1).unwrap();
    done.write_block(&body(W, 1), 0).unwrap();
    done.write_block(b"z", WINDOW_BYTES).unwrap();
    done.finish().unwrap();
    let open = sink.create_shard("b.safetensors", W as u64).unwrap();
    open.write_block(&body(W, 2), 0).unwrap();
    sink.write_file("config.json", b"{}").unwrap();
}

/// A run dropped before its commit (an error, Ctrl-C) leaves nothing: the open
/// upload aborted, the completed shard and the manifest deleted.
#[test]
fn a_sink_dropped_before_its_commit_leaves_nothing() {
    let cut = bucket("sink-dropped");
    let sink = BucketSink::create(Path::new("s3://sink-dropped/out"), false).unwrap();
    half_written(&sink);
    assert_eq!(open_uploads(&cut).len(), 1);
    assert!(keys(&cut).contains(&"out/a.safetensors".to_string()));
    drop(sink);
    assert!(keys(&cut).is_empty(), "{:?}", keys(&cut));
    assert!(open_uploads(&cut).is_empty());
    // The cleanup itself removed everything it had to: nothing is reported left.
    let sink = BucketSink::create(Path::new("s3://sink-dropped/again"), false).unwrap();
    half_written(&sink);
    assert_eq!(sink.undo(), Vec::<String>::new());
    assert!(keys(&cut).is_empty(), "{:?}", keys(&cut));
    assert!(open_uploads(&cut).is_empty());
}

/// A part's sink writes no manifest; on failure it aborts its open upload and, when
/// asked to, keeps the shards it completed (another run of the part may have
/// written the same objects).
#[test]
fn a_parts_sink_keeps_its_completed_shards_when_asked() {
    for keep in [true, false] {
        let name = format!("sink-part-{keep}");
        let cut = bucket(&name);
        let url = format!("s3://{name}/out");
        let sink = BucketSink::for_part(Path::new(&url), Vec::new(), keep).unwrap();
        half_written(&sink);
        drop(sink);
        let want: &[&str] = if keep { &["out/a.safetensors"] } else { &[] };
        assert_eq!(keys(&cut), want, "keep: {keep}");
        assert!(open_uploads(&cut).is_empty(), "keep: {keep}");
        assert!(
            !log(&cut).iter().any(|l| l.contains(MANIFEST)),
            "keep: {keep}: {:?}",
            log(&cut)
        );
    }
}

/// A cleanup the store refuses says what it left, each item with the command that
/// removes it; a cleanup that left nothing says nothing.
#[test]
fn a_refused_cleanup_names_what_it_left_and_how_to_remove_it() {
    let cut = bucket("sink-left");
    let sink = BucketSink::create(Path::new("s3://sink-left/out"), false).unwrap();
    half_written(&sink);
    let id = open_uploads(&cut).pop().unwrap();
    cut.refuse("abort", 0, 1);
    cut.refuse("delete", 0, 100);
    let left = sink.undo();
    let upload: Vec<&String> = left.iter().filter(|l| l.contains("upload")).collect();
    assert_eq!(upload.len(), 1, "{left:?}");
    assert!(
        upload[0].contains(&format!(
            "aws s3api abort-multipart-upload --bucket sink-left --key out/b.safetensors --upload-id {id}"
        )),
        "{}",
        upload[0]
    );
    let shard: Vec<&String> = left
        .iter()
        .filter(|l| l.contains("a.safetensors"))
        .collect();
    assert_eq!(shard.len(), 1, "{left:?}");
    assert!(
        shard[0].contains("refused by the test store")
            && shard[0].contains("aws s3 rm s3://sink-left/out/a.safetensors"),
        "{}",
        shard[0]
    );
    let warning = sink.left_behind(&left).unwrap();
    assert!(
        warning.starts_with(&format!(
            "warning: the failed run's cleanup in s3://sink-left/out could not remove {} item(s):\n",
            left.len()
        )),
        "{warning}"
    );
    for l in &left {
        assert!(warning.contains(&format!("\n  - {l}\n")), "{warning}");
    }
    assert_eq!(sink.left_behind(&[]), None);
    drop(sink);
    // What it could not delete is still there, and nothing else of this run.
    assert_eq!(
        keys(&cut),
        ["out/.unshard-run.json", "out/a.safetensors"],
        "{left:?}"
    );
}

/// The commands given for what a cleanup left, in each store's own tool.
#[test]
fn the_advice_for_what_is_left_is_in_each_stores_tool() {
    let (gcs, azure, s3) = (
        Some(&ObjectStoreScheme::GoogleCloudStorage),
        Some(&ObjectStoreScheme::MicrosoftAzure),
        Some(&ObjectStoreScheme::AmazonS3),
    );
    assert!(abort_upload_advice(gcs, "b", "k/x", "ID").contains("DELETE of gs://b/k/x?uploadId=ID"));
    assert!(abort_upload_advice(azure, "b", "k/x", "ID").contains("seven days"));
    for s in [s3, None] {
        assert!(abort_upload_advice(s, "b", "k/x", "ID")
            .contains("aws s3api abort-multipart-upload --bucket b --key k/x --upload-id ID"));
    }
    assert!(delete_object_advice(gcs, "b", "k/x").contains("`gcloud storage rm gs://b/k/x`"));
    assert!(delete_object_advice(azure, "b", "k/x")
        .contains("`az storage blob delete --container-name b --name k/x`"));
    for s in [s3, None] {
        assert!(delete_object_advice(s, "b", "k/x").contains("`aws s3 rm s3://b/k/x`"));
    }
}

/// Before a run writes: an empty prefix is taken; anything else is refused without
/// `--force` (a run that did not finish is named by its manifest); with it, only
/// what an earlier unshard output or unfinished run lists is replaced; a store
/// without uploads is refused.
#[test]
fn a_prefix_is_taken_empty_or_forced_over_an_earlier_output_only() {
    let cut = bucket("sink-check");
    let check = |prefix: &str, force: bool| {
        check_output(Path::new(&format!("s3://sink-check/{prefix}")), force)
    };
    check("empty", false).unwrap();

    put(&cut, "foreign/notes.txt", b"mine");
    let e = check("foreign", false).unwrap_err();
    assert!(e.to_string().contains("not empty (1 object(s))"), "{e}");
    assert!(e.hint().unwrap().contains("--force"));
    let e = check("foreign", true).unwrap_err().to_string();
    assert!(
        e.contains("1 object(s) here are not part of one") && e.contains("notes.txt"),
        "{e}"
    );

    let listing = serde_json::json!({"files": [
        {"name": "model.safetensors"}, {"name": "config.json"}, {"name": "extra.json"}
    ]});
    put(&cut, "older/unshard.json", listing.to_string().as_bytes());
    for k in ["model.safetensors", "config.json", "extra.json"] {
        put(&cut, &format!("older/{k}"), b"old");
    }
    let e = check("older", false).unwrap_err();
    assert!(e.to_string().contains("not empty (4 object(s))"), "{e}");
    check("older", true).unwrap();
    put(&cut, "older/mine.txt", b"not unshard's");
    let e = check("older", true).unwrap_err().to_string();
    assert!(e.contains("mine.txt") && !e.contains("extra.json"), "{e}");

    let stale = r#"{"run_id": "r-stale", "files": ["model-1.safetensors"]}"#;
    put(&cut, "stale/.unshard-run.json", stale.as_bytes());
    let e = check("stale", false).unwrap_err().to_string();
    assert!(
        e.contains("left by a run that did not finish") && e.contains("r-stale"),
        "{e}"
    );
    put(&cut, "stale/model-1.safetensors", b"half");
    check("stale", true).unwrap();
    put(&cut, "stale/model-2.safetensors", b"not listed");
    let e = check("stale", true).unwrap_err().to_string();
    assert!(e.contains("model-2.safetensors"), "{e}");

    for e in [
        check_output(Path::new("http://127.0.0.1:9/out"), false).unwrap_err(),
        BucketSink::create(Path::new("http://127.0.0.1:9/out"), false)
            .err()
            .unwrap(),
        BucketSink::for_part(Path::new("http://127.0.0.1:9/out"), Vec::new(), false)
            .err()
            .unwrap(),
    ] {
        assert!(e.to_string().contains("read-only"), "{e}");
        assert!(e.hint().unwrap().contains("s3://"));
    }
    // Refused before a byte is written.
    let e = BucketSink::create(Path::new("s3://sink-check/foreign"), true)
        .err()
        .unwrap();
    assert!(e.to_string().contains("notes.txt"), "{e}");
    assert_eq!(
        keys(&cut).iter().filter(|k| k.contains(MANIFEST)).count(),
        1
    );
}

/// A forced run over an earlier output: the old config and index go before any new
/// file lands, objects the new output does not have go at the commit, and the
/// shards it rewrote stay with their new bytes.
#[test]
fn a_forced_commit_replaces_the_earlier_output() {
    let cut = bucket("sink-force");
    let listing = serde_json::json!({"files": [
        {"name": "model.safetensors"}, {"name": "config.json"},
        {"name": "model.safetensors.index.json"}, {"name": "old-2.safetensors"}
    ]});
    put(&cut, "out/unshard.json", listing.to_string().as_bytes());
    for k in [
        "model.safetensors",
        "config.json",
        "model.safetensors.index.json",
        "old-2.safetensors",
    ] {
        put(&cut, &format!("out/{k}"), b"old");
    }
    let sink = BucketSink::create(Path::new("s3://sink-force/out"), true).unwrap();
    let shard = sink.create_shard("model.safetensors", 3).unwrap();
    shard.write_block(b"new", 0).unwrap();
    shard.finish().unwrap();
    sink.write_file("config.json", b"{}").unwrap();
    sink.write_file("unshard.json", b"{\"files\": []}").unwrap();
    Box::new(sink).commit().unwrap();
    let got = objects(&cut);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        [
            "out/config.json",
            "out/model.safetensors",
            "out/unshard.json"
        ]
    );
    assert_eq!(got["out/model.safetensors"], b"new");
    assert_eq!(got["out/config.json"], b"{}");
    let log = log(&cut);
    let first_new = at(&log, "put out/unshard.json");
    assert!(at(&log, "delete out/config.json") < first_new, "{log:?}");
    assert!(
        at(&log, "delete out/model.safetensors.index.json") < first_new,
        "{log:?}"
    );
    assert!(
        !log.contains(&"delete out/model.safetensors".to_string()),
        "{log:?}"
    );
}

/// A completion the store refuses is an error even when an object of the shard's
/// size is already at its key (an earlier output's, being replaced): only a
/// completion repeated after a cut connection may find its object made.
#[test]
fn a_refused_completion_fails_though_an_older_object_has_the_size() {
    let cut = bucket("sink-complete");
    put(
        &cut,
        "out/unshard.json",
        br#"{"files": [{"name": "s.safetensors"}]}"#,
    );
    put(&cut, "out/s.safetensors", b"old");
    let sink = BucketSink::create(Path::new("s3://sink-complete/out"), true).unwrap();
    let shard = sink.create_shard("s.safetensors", 3).unwrap();
    shard.write_block(b"new", 0).unwrap();
    cut.refuse("complete", 0, 1);
    let e = shard.finish().unwrap_err();
    assert!(e.to_string().contains("finish uploading"), "{e}");
    // Cut off after the server made it: the repeat finds the object, at its size.
    cut.arm("complete", 1, true);
    shard.finish().unwrap();
    drop(shard);
    sink.write_file("config.json", b"{}").unwrap();
    Box::new(sink).commit().unwrap();
    assert_eq!(objects(&cut)["out/s.safetensors"], b"new");
}

/// A merge into a store cancelled after its first block fails as cancelled and
/// leaves nothing: no object, no upload open.
#[test]
fn a_merge_cancelled_mid_upload_leaves_nothing() {
    use crate::merge::{merge, MergeOptions};
    struct CancelAfterFirstBlock(crate::Cancel);
    impl crate::write::Progress for CancelAfterFirstBlock {
        fn advance(&self, _bytes: u64) {
            self.0.cancel();
        }
    }
    let cut = bucket("sink-cancel");
    let fixtures = crate::fixtures();
    let cancel = crate::Cancel::new();
    let opts = MergeOptions {
        checkpoint: fixtures.join("ckpt/llama_policy.pt"),
        base: Some(fixtures.join("models/llama-bf16")),
        output: "s3://sink-cancel/out".into(),
        plan: crate::plan::PlanOptions {
            // Several shards of several blocks: the cancellation lands mid-upload.
            max_shard_size: 100_000,
            ..Default::default()
        },
        cancel: cancel.clone(),
        ..MergeOptions::default()
    };
    let e = merge(&opts, &CancelAfterFirstBlock(cancel)).unwrap_err();
    assert!(matches!(e, crate::Error::Interrupted), "{e}");
    assert!(
        !cut.uploads.lock().unwrap().0.is_empty(),
        "no upload opened"
    );
    assert!(keys(&cut).is_empty(), "{:?}", keys(&cut));
    assert!(open_uploads(&cut).is_empty());
}

/// Every test above against a real S3-compatible server (moto_server, which
/// `.ci/run` starts; docs/testing.md), each in a new bucket: the conditional
/// writes, multipart uploads and deletes the sink relies on, as a server does them.
#[test]
#[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
fn every_test_against_a_real_server() {
    ON_SERVER.set(true);
    for (name, test) in ON_A_SERVER {
        eprintln!("against the server: {name}");
        test();
    }
}

/// `(name, test)` for each test function given, its name taken from the function.
macro_rules! named {
    ($($test:ident),* $(,)?) => {
        [$((stringify!($test), $test as fn())),*]
    };
}

/// The tests [`every_test_against_a_real_server`] runs: every other test of this
/// module ([`the_server_run_lists_every_test_of_this_module`] says so).
const ON_A_SERVER: [(&str, fn()); 13] = named![
    the_run_manifest_names_the_run_and_each_file_before_it_is_written,
    the_commit_writes_the_index_then_the_config_last,
    small_files_keep_their_last_bytes_and_copies_do_not_overwrite,
    each_block_is_one_part_in_any_order_and_other_writes_are_refused,
    a_shard_of_more_than_ten_thousand_parts_is_refused,
    a_sink_dropped_before_its_commit_leaves_nothing,
    a_parts_sink_keeps_its_completed_shards_when_asked,
    a_refused_cleanup_names_what_it_left_and_how_to_remove_it,
    the_advice_for_what_is_left_is_in_each_stores_tool,
    a_prefix_is_taken_empty_or_forced_over_an_earlier_output_only,
    a_forced_commit_replaces_the_earlier_output,
    a_refused_completion_fails_though_an_older_object_has_the_size,
    a_merge_cancelled_mid_upload_leaves_nothing,
];

/// A test added to this module without being added to [`ON_A_SERVER`] would run
/// against memory only: it fails here, named.
#[test]
fn the_server_run_lists_every_test_of_this_module() {
    let mut lines = include_str!("tests.rs").lines();
    let mut tests = Vec::new();
    while let Some(line) = lines.next() {
        if line == "#[test]" {
            // The function after the attributes.
            if let Some(f) = lines.by_ref().find_map(|l| l.strip_prefix("fn ")) {
                tests.push(f.split('(').next().unwrap_or(f));
            }
        }
    }
    let listed: Vec<&str> = ON_A_SERVER.iter().map(|&(name, _)| name).collect();
    let unlisted: Vec<&str> = tests
        .into_iter()
        .filter(|t| !listed.contains(t))
        .filter(|t| {
            !matches!(
                *t,
                "every_test_against_a_real_server"
                    | "the_server_run_lists_every_test_of_this_module"
            )
        })
        .collect();
    assert!(
        unlisted.is_empty(),
        "not run against the server: {unlisted:?}; add them to ON_A_SERVER"
    );
    let mut unique = listed.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), listed.len(), "listed twice: {listed:?}");
}
