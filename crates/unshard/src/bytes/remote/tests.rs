//! The read path against an in-memory object store registered under an `s3://`
//! URL: how many requests a merge makes, and how many bytes they fetch.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::cut::Cut;
use super::source::fetched;
use super::store;
use crate::dtype::DType;
use crate::merge::merge;
use crate::options::MergeOptions;
use crate::plan::{DtypeChoice, PlanOptions};
use crate::write::NoProgress;

/// A safetensors file of `n` float32 tensors of `elems` elements each, as the
/// format specifies it (little-endian 8-byte header length, JSON header, data).
fn safetensors(n: usize, elems: usize) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    for i in 0..n {
        let at = i * elems * 4;
        header.insert(
            format!("layer{i:02}.weight"),
            serde_json::json!({"dtype": "F32", "shape": [elems], "data_offsets": [at, at + elems * 4]}),
        );
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for i in 0..n * elems {
        out.extend_from_slice(&(i as f32 * 0.25).to_le_bytes());
    }
    out
}

/// 24 tensors of 1 MiB each (float32) become 12 MiB of bfloat16: two output blocks
/// of 8 MiB, each reading a dozen tensors. Each block's input is fetched with one
/// request (not one per tensor), and each input byte once.
#[test]
fn each_block_reads_its_tensors_with_one_request() {
    let _one_at_a_time = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let mem = Arc::new(InMemory::new());
    store::register("s3://block-gets", mem.clone());
    let (n, elems) = (24, 1 << 18);
    let file = safetensors(n, elems);
    let data = (n * elems * 4) as u64;
    let len = file.len() as u64;
    store::block_on(mem.put(
        &"ckpt/model.safetensors".into(),
        PutPayload::from(file.clone()),
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = |checkpoint: std::path::PathBuf, out: &str| MergeOptions {
        checkpoint,
        output: dir.path().join(out),
        plan: PlanOptions {
            dtype: DtypeChoice::Fixed(DType::BF16),
            ..PlanOptions::default()
        },
        // A bare safetensors file with no config: the request count is the point.
        weights_only: true,
        ..MergeOptions::default()
    };
    let (gets0, bytes0) = fetched();
    merge(
        &opts("s3://block-gets/ckpt/model.safetensors".into(), "remote"),
        &NoProgress,
    )
    .unwrap();
    let (gets, bytes) = (fetched().0 - gets0, fetched().1 - bytes0);
    // Two blocks, plus a few small reads of the header; one request per tensor
    // would be 24 and more.
    assert!(gets <= 2 + 4, "{gets} requests");
    assert!(
        bytes >= data && bytes <= len + (64 << 10),
        "{bytes} bytes fetched for {data} bytes of tensor data"
    );
    // The same bytes as from the local disk.
    let local = dir.path().join("model.safetensors");
    std::fs::write(&local, &file).unwrap();
    merge(&opts(local, "local"), &NoProgress).unwrap();
    let name = "model.safetensors";
    assert_eq!(
        std::fs::read(dir.path().join("remote").join(name)).unwrap(),
        std::fs::read(dir.path().join("local").join(name)).unwrap()
    );
}

/// A DCP checkpoint of eight ranks read from the store merges to the bytes
/// transformers writes, as it does from a local directory.
#[test]
fn a_dcp_checkpoint_in_a_store_merges_bit_exactly() {
    let mem = Arc::new(InMemory::new());
    store::register("s3://dcp-gets", mem.clone());
    let fixtures = crate::fixtures();
    for e in std::fs::read_dir(fixtures.join("sharded/llama_w8_dcp")).unwrap() {
        let e = e.unwrap();
        let key = format!("ckpt/{}", e.file_name().to_string_lossy());
        let bytes = std::fs::read(e.path()).unwrap();
        store::block_on(mem.put(&key.as_str().into(), PutPayload::from(bytes))).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let name = "model.safetensors";
    let expected = std::fs::read(
        fixtures
            .join("expected/llama_policy_into_llama-bf16")
            .join(name),
    )
    .unwrap();
    let output = dir.path().join("out");
    let opts = MergeOptions {
        checkpoint: "s3://dcp-gets/ckpt".into(),
        base: Some(fixtures.join("models/llama-bf16")),
        output: output.clone(),
        ..MergeOptions::default()
    };
    crate::merge::merge(&opts, &NoProgress).unwrap();
    assert_eq!(std::fs::read(output.join(name)).unwrap(), expected);
}

/// The request counters are global: tests that read them run one at a time.
pub(super) static COUNTED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One checkpoint of each family the readers know, as the fixtures hold it.
struct Family {
    name: &'static str,
    /// The folder (or file) copied into the store, relative to `fixtures/`.
    upload: &'static str,
    /// The checkpoint passed to the merge: `upload` or a path below it.
    checkpoint: &'static str,
    base: Option<&'static str>,
    key: Option<&'static str>,
}

const FAMILIES: &[Family] = &[
    Family {
        name: "torch_save_policy",
        upload: "ckpt/llama_policy.pt",
        checkpoint: "ckpt/llama_policy.pt",
        base: Some("models/llama-bf16"),
        key: None,
    },
    Family {
        name: "dcp",
        upload: "sharded/llama_w2_dcp",
        checkpoint: "sharded/llama_w2_dcp",
        base: Some("models/llama-bf16"),
        key: None,
    },
    Family {
        name: "rank_files",
        upload: "sharded/llama_w2_ranks",
        checkpoint: "sharded/llama_w2_ranks",
        base: Some("models/llama-bf16"),
        key: None,
    },
    Family {
        name: "deepspeed_zero2",
        upload: "deepspeed/llama_z2_fp16_w3_aligned",
        checkpoint: "deepspeed/llama_z2_fp16_w3_aligned",
        base: Some("deepspeed/base/llama12-fp16"),
        key: None,
    },
    Family {
        name: "deepspeed_zero3",
        upload: "deepspeed/llama_z3_bf16_w2",
        checkpoint: "deepspeed/llama_z3_bf16_w2",
        base: Some("deepspeed/base/llama-bf16"),
        key: None,
    },
    Family {
        name: "deepspeed_tag_folder",
        upload: "deepspeed/llama_z3_bf16_w2",
        checkpoint: "deepspeed/llama_z3_bf16_w2/global_step1",
        base: Some("deepspeed/base/llama-bf16"),
        key: None,
    },
    Family {
        name: "deepspeed_trainer_no_base",
        upload: "deepspeed/llama_trainer_z3_w2",
        checkpoint: "deepspeed/llama_trainer_z3_w2",
        base: None,
        key: None,
    },
    Family {
        name: "lora_adapter",
        upload: "lora/adapters/llama_lora",
        checkpoint: "lora/adapters/llama_lora",
        base: Some("models/llama-bf16"),
        key: None,
    },
    Family {
        name: "megatron_torch_dist",
        upload: "megatron/ckpt/llama_tp2",
        checkpoint: "megatron/ckpt/llama_tp2",
        base: Some("megatron/base/llama"),
        key: None,
    },
    Family {
        name: "torchtitan",
        upload: "torchtitan/llama3/checkpoint",
        checkpoint: "torchtitan/llama3/checkpoint/step-10",
        base: Some("torchtitan/llama3/base"),
        key: None,
    },
    Family {
        name: "moe_policy",
        upload: "moe/mixtral/policy.pt",
        checkpoint: "moe/mixtral/policy.pt",
        base: Some("moe/mixtral/base"),
        key: Some("state"),
    },
    Family {
        name: "moe_dcp",
        upload: "moe/mixtral/dcp",
        checkpoint: "moe/mixtral/dcp",
        base: Some("moe/mixtral/base"),
        key: None,
    },
    Family {
        name: "megatron_legacy",
        upload: "megatron/ckpt/llama_tp2_pp2_legacy",
        checkpoint: "megatron/ckpt/llama_tp2_pp2_legacy",
        base: Some("megatron/base/llama_4layers"),
        key: None,
    },
    Family {
        name: "hf_sharded",
        upload: "torchtitan/hf_sharded/qwen3_f32_2x2",
        checkpoint: "torchtitan/hf_sharded/qwen3_f32_2x2",
        base: Some("torchtitan/qwen3/base"),
        key: None,
    },
];

/// Copies a local file, or a folder recursively, to `key` in `mem`.
fn upload(mem: &dyn ObjectStore, local: &std::path::Path, key: &str) {
    if local.is_dir() {
        for e in std::fs::read_dir(local).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            upload(mem, &e.path(), &format!("{key}/{name}"));
        }
    } else {
        let bytes = std::fs::read(local).unwrap();
        store::block_on(mem.put(&key.into(), PutPayload::from(bytes))).unwrap();
    }
}

/// Every file below `dir`, by path relative to it.
fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Every family of checkpoint (and its base) read from a store merges to the same
/// bytes as from the local disk: detection and listing go through the store layer
/// for every format. `unshard.json`, which names its inputs, is compared with the
/// URLs put back to the local paths.
#[test]
fn every_fixture_family_merges_from_a_store_as_from_disk() {
    // Its requests would count in the request-counting test's figures.
    let _one_at_a_time = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let fixtures = crate::fixtures().canonicalize().unwrap();
    let mem = Arc::new(InMemory::new());
    store::register("s3://families", mem.clone());
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for f in FAMILIES {
        let url = format!("s3://families/{}", f.name);
        upload(&mem, &fixtures.join(f.upload), &format!("{}/ckpt", f.name));
        let sub = f.checkpoint.strip_prefix(f.upload).unwrap();
        let remote_ckpt = format!("{url}/ckpt{sub}");
        let remote_base = f.base.map(|b| {
            upload(&mem, &fixtures.join(b), &format!("{}/base", f.name));
            format!("{url}/base")
        });
        let opts = |checkpoint: std::path::PathBuf, base: Option<std::path::PathBuf>, out: &str| {
            MergeOptions {
                checkpoint,
                base,
                output: dir.path().join(f.name).join(out),
                open: crate::source::OpenOptions {
                    key: f.key.map(str::to_string),
                    ..Default::default()
                },
                ..MergeOptions::default()
            }
        };
        let local = opts(
            fixtures.join(f.checkpoint),
            f.base.map(|b| fixtures.join(b)),
            "local",
        );
        let remote = opts(
            remote_ckpt.clone().into(),
            remote_base.clone().map(Into::into),
            "remote",
        );
        if let Err(e) = merge(&local, &NoProgress) {
            failures.push(format!("{}: the local merge failed: {e}", f.name));
            continue;
        }
        if let Err(e) = merge(&remote, &NoProgress) {
            failures.push(format!("{}: the merge from the store failed: {e}", f.name));
            continue;
        }
        let (want, mut got) = (tree(&local.output), tree(&remote.output));
        if let Some(j) = got.get_mut("unshard.json") {
            let mut text = String::from_utf8(j.clone()).unwrap();
            text = text.replace(&remote_ckpt, &fixtures.join(f.checkpoint).to_string_lossy());
            if let (Some(rb), Some(b)) = (&remote_base, f.base) {
                text = text.replace(rb.as_str(), &fixtures.join(b).to_string_lossy());
            }
            *j = text.into_bytes();
        }
        let names =
            |t: &std::collections::BTreeMap<String, Vec<u8>>| t.keys().cloned().collect::<Vec<_>>();
        if names(&want) != names(&got) {
            failures.push(format!(
                "{}: files {:?} locally, {:?} from the store",
                f.name,
                names(&want),
                names(&got)
            ));
            continue;
        }
        for (name, bytes) in &want {
            if got[name] != *bytes {
                failures.push(format!("{}: {name} differs from the local merge's", f.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A URL given with user info and a query (a presigned URL's signature) is read,
/// and neither appears in any file of the output; `unshard.json` says the URL was
/// recorded without them.
#[test]
fn secrets_in_a_url_are_never_written() {
    let mem = Arc::new(InMemory::new());
    store::register("s3://secret-urls", mem.clone());
    let fixtures = crate::fixtures();
    upload(
        &mem,
        &fixtures.join("ckpt/llama_policy.pt"),
        "ckpt/policy.pt",
    );
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out");
    let opts = MergeOptions {
        checkpoint:
            "s3://AKIDUSER:PASSWORD1234@secret-urls/ckpt/policy.pt?X-Amz-Signature=SIGNATURE5678"
                .into(),
        base: Some(fixtures.join("models/llama-bf16")),
        output: output.clone(),
        ..MergeOptions::default()
    };
    merge(&opts, &NoProgress).unwrap();
    let files = tree(&output);
    assert!(files.contains_key("model.safetensors"));
    for (name, bytes) in &files {
        let text = String::from_utf8_lossy(bytes);
        for secret in ["PASSWORD1234", "SIGNATURE5678", "AKIDUSER"] {
            assert!(!text.contains(secret), "{name} holds {secret}");
        }
    }
    let manifest: serde_json::Value = serde_json::from_slice(&files["unshard.json"]).unwrap();
    assert_eq!(
        manifest["inputs"]["checkpoint"],
        "s3://secret-urls/ckpt/policy.pt"
    );
    assert!(
        manifest["inputs"]["urls_redacted"].is_string(),
        "{manifest}"
    );
}

/// An error about a missing object names its URL without the user info or query.
#[test]
fn an_error_names_the_url_without_its_secrets() {
    let mem = Arc::new(InMemory::new());
    store::register("s3://secret-errors", mem);
    let dir = tempfile::tempdir().unwrap();
    let opts = MergeOptions {
        checkpoint: "s3://U:PASSWORD1234@secret-errors/none/policy.pt?sig=SIGNATURE5678".into(),
        output: dir.path().join("out"),
        weights_only: true,
        ..MergeOptions::default()
    };
    let e = merge(&opts, &NoProgress).unwrap_err();
    let shown = format!("{e} {e:?}");
    assert!(
        shown.contains("s3://secret-errors/none/policy.pt"),
        "{shown}"
    );
    assert!(
        !shown.contains("PASSWORD1234") && !shown.contains("SIGNATURE5678"),
        "{shown}"
    );
}

/// Eight workers read 64 blocks, each announcing ranges of two objects, through
/// sources whose read-ahead budget is 256 KiB (four blocks of 64 KiB): the bytes
/// fetched and not yet let go never exceed it, though the workers together ask for
/// twice that, and every read returns the object's bytes.
#[test]
fn bytes_fetched_ahead_never_exceed_the_budget() {
    use super::source::{Budget, ObjectSource};
    use crate::bytes::ByteSource;
    let mem = Arc::new(InMemory::new());
    store::register("s3://ahead-budget", mem.clone());
    let (blocks, half) = (64u64, 32u64 << 10);
    let body = |seed: u8| -> Vec<u8> {
        (0..blocks * half)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    };
    let (a, b) = (body(1), body(2));
    for (key, bytes) in [("a", &a), ("b", &b)] {
        store::block_on(mem.put(&key.into(), PutPayload::from(bytes.clone()))).unwrap();
    }
    let limit = 4 * 2 * half;
    let budget: &'static Budget = Box::leak(Box::new(Budget::new(limit)));
    let open = |key: &str| {
        let loc = store::locate(std::path::Path::new(&format!("s3://ahead-budget/{key}"))).unwrap();
        ObjectSource::open(loc, None).unwrap().with_budget(budget)
    };
    let sources = [(open("a"), &a), (open("b"), &b)];
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if k >= blocks {
                    break;
                }
                let ranges = [(k * half, half)];
                for (src, _) in &sources {
                    src.will_need_together(&ranges);
                }
                for (src, want) in &sources {
                    for piece in 0..4 {
                        let at = k * half + piece * (half / 4);
                        let mut buf = vec![0u8; (half / 4) as usize];
                        src.read_at(at, &mut buf).unwrap();
                        assert_eq!(buf, want[at as usize..at as usize + buf.len()]);
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                for (src, _) in &sources {
                    src.done_with(&ranges);
                }
            });
        }
    });
    let peak = budget.peak();
    assert!(
        peak <= limit,
        "{peak} bytes held ahead, over the budget of {limit}"
    );
    assert!(
        peak >= limit / 2,
        "{peak} bytes: the workers never overlapped"
    );
}

/// Connections cut in the middle of a merge from a store to a store, before the
/// server did the work (reads, parts) and after it (small files, the completion of
/// an upload, whose repeat finds the upload gone): every request is made again,
/// and the output is the local merge's, byte for byte.
#[test]
fn requests_cut_off_by_the_network_are_made_again() {
    let _one_at_a_time = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let fixtures = crate::fixtures();
    let plan = [
        ("get", 2, false),
        ("put_part", 2, false),
        ("put", 2, true),
        ("complete", 1, true),
    ];
    let input = Arc::new(Cut::new(&plan));
    let output = Arc::new(Cut::new(&plan));
    store::register("s3://cut-in", input.clone());
    store::register("s3://cut-out", output.clone());
    upload(
        input.inner.as_ref(),
        &fixtures.join("ckpt/llama_policy.pt"),
        "ckpt/policy.pt",
    );
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let opts = |checkpoint: std::path::PathBuf, out: std::path::PathBuf| MergeOptions {
        checkpoint,
        base: Some(fixtures.join("models/llama-bf16")),
        output: out,
        ..MergeOptions::default()
    };
    merge(
        &opts(fixtures.join("ckpt/llama_policy.pt"), local.clone()),
        &NoProgress,
    )
    .unwrap();
    merge(
        &opts(
            "s3://cut-in/ckpt/policy.pt".into(),
            "s3://cut-out/out".into(),
        ),
        &NoProgress,
    )
    .unwrap();
    let cut = |s: &Cut| s.cut.lock().unwrap().clone();
    assert_eq!(cut(&input), ["get", "get"]);
    let mut out_cuts = cut(&output);
    out_cuts.sort_unstable();
    assert_eq!(out_cuts, ["complete", "put", "put", "put_part", "put_part"]);
    let got = dir.path().join("got");
    for meta in store::block_on(futures_util::TryStreamExt::try_collect::<Vec<_>>(
        output.inner.list(Some(&"out".into())),
    ))
    .unwrap()
    {
        let name = meta.location.filename().unwrap().to_string();
        let bytes = store::block_on(output.inner.get(&meta.location)).unwrap();
        let bytes = store::block_on(bytes.bytes()).unwrap();
        std::fs::create_dir_all(&got).unwrap();
        std::fs::write(got.join(name), bytes).unwrap();
    }
    let (want, mut have) = (tree(&local), tree(&got));
    let manifest = |t: &mut std::collections::BTreeMap<String, Vec<u8>>| t.remove("unshard.json");
    assert!(manifest(&mut have).is_some());
    let mut want = want;
    manifest(&mut want);
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        have.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &want {
        assert!(
            have[name] == *bytes,
            "{name} differs from the local merge's"
        );
    }
}

/// A merge into a store that refuses a request in the middle of the upload (a
/// server's answer, not a cut: not retried) fails, and what it wrote is gone: no
/// object under the output, every multipart upload it opened completed and then
/// deleted, or aborted.
#[test]
fn a_merge_refused_mid_upload_leaves_nothing_in_the_store() {
    let _one_at_a_time = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let fixtures = crate::fixtures();
    for (kind, skip) in [("put_part", 1), ("complete", 1), ("put", 2)] {
        let output = Arc::new(Cut::new(&[]));
        output.refuse(kind, skip, 1);
        let url = format!("s3://refused-{}", kind.replace('_', "-"));
        store::register(&url, output.clone());
        let plan = PlanOptions {
            max_shard_size: 100_000,
            ..PlanOptions::default()
        };
        let r = merge(
            &MergeOptions {
                checkpoint: fixtures.join("ckpt/llama_policy.pt"),
                base: Some(fixtures.join("models/llama-bf16")),
                output: format!("{url}/out").into(),
                plan,
                ..MergeOptions::default()
            },
            &NoProgress,
        );
        let err = r.expect_err(kind);
        let mut chain = err.to_string();
        let mut cause = std::error::Error::source(&err);
        while let Some(c) = cause {
            chain.push_str(&format!(": {c}"));
            cause = c.source();
        }
        assert!(
            chain.contains("refused by the test store"),
            "{kind}: {chain}"
        );
        let left = store::block_on(futures_util::TryStreamExt::try_collect::<Vec<_>>(
            output.inner.list(None),
        ))
        .unwrap();
        assert!(left.is_empty(), "{kind}: left behind: {left:?}");
        let (opened, ended) = output.uploads.lock().unwrap().clone();
        assert!(!opened.is_empty(), "{kind}: no upload opened");
        let open: Vec<_> = opened.iter().filter(|id| !ended.contains(id)).collect();
        assert!(open.is_empty(), "{kind}: uploads left open: {open:?}");
    }
}

/// A connection cut on every try is given up on when the time for retries is over,
/// and an answer from the server (an object not found) is returned at once.
#[test]
fn cut_requests_are_tried_again_only_until_the_time_is_over() {
    let tries = std::sync::atomic::AtomicUsize::new(0);
    let start = Instant::now();
    let r: object_store::Result<()> =
        store::block_on(store::again_within(Duration::from_millis(800), || {
            tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err(Cut::error()) }
        }));
    assert!(r.is_err());
    let n = tries.swap(0, std::sync::atomic::Ordering::SeqCst);
    // Waits of 0.1, 0.2 and 0.4 s fit in 0.8 s: four tries, three on a slow machine.
    assert!((3..=4).contains(&n), "{n} tries");
    assert!(start.elapsed() < Duration::from_secs(5));
    let r: object_store::Result<()> =
        store::block_on(store::again_within(Duration::from_secs(60), || {
            tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async {
                Err(object_store::Error::NotFound {
                    path: "x".into(),
                    source: "gone".into(),
                })
            }
        }));
    assert!(matches!(r, Err(object_store::Error::NotFound { .. })));
    assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A plain HTTP server on 127.0.0.1 that answers each connection with the next of
/// `answers` (status line, body), then with 404; what it was asked (the request
/// lines) is in the returned list.
fn http_server(
    answers: Vec<(&'static str, &'static [u8])>,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = asked.clone();
    std::thread::spawn(move || {
        let mut answers = answers.into_iter();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            log.lock().unwrap().push(line.trim_end().to_string());
            loop {
                let mut header = String::new();
                match reader.read_line(&mut header) {
                    Ok(n) if n > 0 && header != "\r\n" => {}
                    _ => break,
                }
            }
            let (status, body) = answers.next().unwrap_or(("404 Not Found", b""));
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(body);
        }
    });
    (base, asked)
}

/// An `http://` URL is read through a plain-HTTP client (allowed because the URL
/// says http), without multipart uploads, and a server error (503) is retried by
/// that client until the object comes.
#[test]
fn a_plain_http_url_is_read_and_its_server_errors_retried() {
    let (base, asked) = http_server(vec![
        ("503 Service Unavailable", b""),
        ("200 OK", b"hello over http"),
    ]);
    let loc = store::locate(std::path::Path::new(&format!("{base}/files/x.bin"))).unwrap();
    assert!(loc.multipart.is_none());
    assert_eq!(
        loc.url,
        std::path::PathBuf::from(format!("{base}/files/x.bin"))
    );
    let got = store::get_whole(&loc).unwrap();
    assert_eq!(got.as_deref(), Some(&b"hello over http"[..]));
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(
        asked.iter().all(|l| l.starts_with("GET /files/x.bin ")),
        "{asked:?}"
    );
    // The 404 that follows is no object, not an error.
    assert_eq!(store::get_whole(&loc).unwrap(), None);
    assert_eq!(store::head(&loc).unwrap(), None);
}

/// Object-store errors keep their kind as I/O errors (a missing object stays
/// `NotFound`, a refused write `AlreadyExists`, a refused login `PermissionDenied`),
/// and an S3, GCS or Azure endpoint given as http:// names the variable that
/// allows it.
#[test]
fn store_errors_keep_their_kind_and_plain_http_names_its_variable() {
    use std::io::ErrorKind;
    let kind =
        |e: object_store::Error| match store::io_error("read", std::path::Path::new("s3://b/k"), e)
        {
            crate::error::Error::Io { source, .. } => source.kind(),
            other => panic!("{other}"),
        };
    type Source = Box<dyn std::error::Error + Send + Sync>;
    let src = || -> Source { "test".into() };
    let path = || "k".to_string();
    use object_store::Error as E;
    type AboutAPath = fn(String, Source) -> E;
    let about_a_path: [(AboutAPath, ErrorKind); 5] = [
        (
            |path, source| E::NotFound { path, source },
            ErrorKind::NotFound,
        ),
        (
            |path, source| E::AlreadyExists { path, source },
            ErrorKind::AlreadyExists,
        ),
        (
            |path, source| E::Precondition { path, source },
            ErrorKind::AlreadyExists,
        ),
        (
            |path, source| E::PermissionDenied { path, source },
            ErrorKind::PermissionDenied,
        ),
        (
            |path, source| E::Unauthenticated { path, source },
            ErrorKind::PermissionDenied,
        ),
    ];
    for (error, want) in about_a_path {
        let e = error(path(), src());
        let shown = e.to_string();
        assert_eq!(kind(e), want, "{shown}");
    }
    let generic = E::Generic {
        store: "t",
        source: src(),
    };
    assert_eq!(kind(generic), ErrorKind::Other);
    // The URL is named without its user info and query.
    let e = store::io_error(
        "read",
        std::path::Path::new("s3://AKID:PASSWORD@b/k?sig=SIGNATURE"),
        object_store::Error::NotFound {
            path: path(),
            source: src(),
        },
    );
    assert_eq!(e.to_string(), "cannot read s3://b/k");
    // A client that refuses plain http, as one built for an https endpoint does.
    store::install_crypto();
    let https_only = object_store::http::HttpBuilder::new()
        .with_url("http://127.0.0.1:1")
        .with_retry(object_store::RetryConfig {
            max_retries: 0,
            ..Default::default()
        })
        .build()
        .unwrap();
    for (url, var) in [
        ("s3://b/k", "AWS_ALLOW_HTTP"),
        ("gs://b/k", "GOOGLE_ALLOW_HTTP"),
        ("az://c/k", "AZURE_ALLOW_HTTP"),
    ] {
        let e = store::block_on(https_only.get(&"k".into())).unwrap_err();
        let e = store::io_error("read", std::path::Path::new(url), e);
        let shown = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(shown.contains(&format!("set {var}=true")), "{url}: {shown}");
    }
}

/// Each kind of store URL gets a client of its kind from the environment (building
/// one makes no request): S3, GCS and Azure with multipart uploads, keyed by the
/// path below the bucket; what is no object store URL is refused with the forms to
/// write.
#[test]
fn each_store_url_gets_its_client_and_other_urls_are_refused() {
    for url in [
        "s3://locate-s3/a/b.bin",
        "gs://locate-gcs/a/b.bin",
        "abfss://container@account.dfs.core.windows.net/a/b.bin",
    ] {
        let loc = store::locate(std::path::Path::new(url)).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(loc.multipart.is_some(), "{url}");
        assert_eq!(loc.key.as_ref(), "a/b.bin", "{url}");
    }
    // A store the environment does not configure (an Azure container without an
    // account) is refused with where credentials come from.
    let Err(e) = store::locate(std::path::Path::new("az://container/a/b.bin")) else {
        panic!("{} was located", "az://container/a/b.bin");
    };
    assert!(
        e.to_string().contains("object store configuration")
            && e.hint()
                .unwrap_or_default()
                .contains("AZURE_STORAGE_ACCOUNT_NAME"),
        "{e}"
    );
    for url in ["ftp://host/x.bin", "not a url"] {
        let Err(e) = store::locate(std::path::Path::new(url)) else {
            panic!("{} was located", url);
        };
        assert!(
            e.hint().unwrap_or_default().contains("s3://bucket/key"),
            "{url}: {e}"
        );
    }
}

/// By default a request whose connection is cut keeps being made again for longer
/// than a second (an outage of a few seconds is outlasted).
#[test]
fn a_request_cut_for_more_than_a_second_is_made_again_by_default() {
    let start = Instant::now();
    let tries = std::sync::atomic::AtomicUsize::new(0);
    let r = store::block_on(store::again(|| {
        tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let cut = start.elapsed() < Duration::from_millis(1300);
        async move {
            if cut {
                Err(Cut::error())
            } else {
                Ok(())
            }
        }
    }));
    assert!(r.is_ok(), "given up after {:?}", start.elapsed());
    assert!(tries.load(std::sync::atomic::Ordering::SeqCst) > 1);
}

/// Once a prefix is listed, its listing answers whether an object below it is
/// there: no HEAD request is made (here every HEAD is refused, which would say no).
#[test]
fn a_listed_prefix_answers_for_its_objects() {
    let cut = Arc::new(Cut::new(&[]));
    store::register("s3://listed-prefix", cut.clone());
    store::block_on(
        cut.inner
            .put(&"d/a.bin".into(), PutPayload::from(vec![1u8; 3])),
    )
    .unwrap();
    let path = |p: &str| std::path::PathBuf::from(format!("s3://listed-prefix/{p}"));
    assert!(crate::bytes::fs::is_dir(&path("d")));
    cut.refuse("head", 0, usize::MAX);
    assert!(crate::bytes::fs::is_file(&path("d/a.bin")));
    assert!(!crate::bytes::fs::is_file(&path("d/b.bin")));
}
