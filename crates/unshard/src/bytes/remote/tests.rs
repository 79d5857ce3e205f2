//! The read path against an in-memory object store registered under an `s3://`
//! URL: how many requests a merge makes, and how many bytes they fetch.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::{ObjectStoreExt, PutPayload};

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
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
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
static COUNTED: std::sync::Mutex<()> = std::sync::Mutex::new(());
