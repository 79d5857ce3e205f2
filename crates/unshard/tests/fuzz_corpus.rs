//! Replays the fuzz corpora and every committed crash reproducer through the same
//! entry points the fuzz targets call (`fuzz/fuzz_targets/*.rs`), so CI keeps fixed
//! findings fixed without a fuzzer. Each input must give a result or an error,
//! never a panic, and what a reader accepts must lie inside its file.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard::source::zip::{Archive, ZipIndex};
use unshard::source::{self, legacy, safetensors, torch, Blob, OpenOptions};
use unshard::write::read_tensor;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Corpus, regressions and (locally) artifacts of one target.
fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for sub in ["corpus", "regressions", "artifacts"] {
        let Ok(rd) = std::fs::read_dir(fuzz_dir().join(sub).join(target)) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep") {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

fn read_all(c: &source::Checkpoint) {
    for t in &c.tensors {
        if t.nbytes() <= 16 << 20 {
            let _ = read_tensor(&c.files, t, t.dtype);
        }
    }
}

#[test]
fn zip_corpus_replays() {
    let all = inputs("zip");
    assert!(all.len() >= 10);
    for (p, data) in all {
        if let Ok(index) = ZipIndex::parse(&data) {
            let blob = Blob::owned(p, data);
            let archive = Archive::whole(&blob);
            for e in &index.entries {
                if let Ok(b) = index.stored(&archive, e) {
                    assert_eq!(b.len() as u64, e.size);
                }
            }
        }
    }
}

#[test]
fn legacy_corpus_replays() {
    let all = inputs("legacy");
    assert!(!all.is_empty());
    for (p, data) in all {
        let blob = Blob::owned(p.clone(), data.clone());
        if let Ok(payload) = legacy::read_legacy_payload(&blob) {
            for loc in payload.storages.values() {
                assert!(loc.offset + loc.len <= data.len() as u64);
            }
            if let Ok(found) = torch::find_tensors(&payload.pickle, &p, None) {
                let _ = torch::plain_sources(&payload, 0, &found);
            }
        }
    }
}

#[test]
fn safetensors_header_corpus_replays() {
    let all = inputs("safetensors_header");
    assert!(!all.is_empty());
    for (p, data) in all {
        if let Ok(h) = safetensors::read_header(&p, &data) {
            for (_, _, _, begin, end) in &h.tensors {
                assert!(begin <= end && h.data_start + end <= data.len() as u64);
            }
        }
    }
}

#[test]
fn detect_corpus_replays() {
    let all = inputs("detect");
    assert!(all.len() >= 10);
    for (p, data) in all {
        if let Ok(c) = source::open(&p, &OpenOptions::default()) {
            read_all(&c);
        }
        let blob = Arc::new(Blob::owned(p, data));
        if let Ok(c) = source::open_blob(blob, &OpenOptions::default()) {
            read_all(&c);
        }
    }
}

#[test]
fn dcp_metadata_corpus_replays() {
    let all = inputs("dcp_metadata");
    assert!(all.len() >= 5);
    let fixtures =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/sharded/llama_w2_dcp");
    let dir = tempfile::tempdir().unwrap();
    for f in ["__0_0.distcp", "__1_0.distcp"] {
        std::fs::copy(fixtures.join(f), dir.path().join(f)).unwrap();
    }
    for (_, data) in all {
        std::fs::write(dir.path().join(".metadata"), &data).unwrap();
        if let Ok(c) = source::open(dir.path(), &OpenOptions::default()) {
            read_all(&c);
        }
    }
}
