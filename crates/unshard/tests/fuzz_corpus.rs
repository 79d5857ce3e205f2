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

/// Says the regressions of a target are empty, in the directory itself.
const EMPTY_NOTE: &str = "README.md";

/// Corpus, regressions and (locally) artifacts of one target. The corpus and the
/// regressions directory must exist; an empty regressions directory must say so
/// (its README.md), and one with reproducers must not.
fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for sub in ["corpus", "regressions", "artifacts"] {
        let dir = fuzz_dir().join(sub).join(target);
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            // artifacts/ is git-ignored: present only where the fuzzer ran.
            Err(_) if sub == "artifacts" => continue,
            Err(e) => panic!("{}: {e}", dir.display()),
        };
        let before = out.len();
        let mut note = None;
        for e in rd {
            let p = e.unwrap().path();
            if p.file_name().is_some_and(|n| n == EMPTY_NOTE) {
                note = Some(std::fs::read_to_string(&p).unwrap());
            } else if p.is_file() {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
        let found = out.len() - before;
        if sub == "regressions" {
            let says_empty = note.is_some_and(|n| n.starts_with("No reproducers"));
            assert_eq!(
                says_empty,
                found == 0,
                "{}: {found} reproducer(s); its {EMPTY_NOTE} must say 'No reproducers' exactly when there are none",
                dir.display()
            );
        } else if sub == "corpus" {
            assert!(found > 0, "{}: empty corpus", dir.display());
        }
    }
    out
}

/// Reads every tensor of what a reader accepted: each either whole (as many bytes
/// as its shape says) or an error naming the file.
fn read_all(c: &source::Checkpoint, file: &Path) {
    let name = file.file_name().unwrap().to_string_lossy();
    for t in &c.tensors {
        if t.nbytes() <= 16 << 20 {
            match read_tensor(&c.files, t, t.dtype) {
                Ok((bytes, _)) => assert_eq!(bytes.len() as u64, t.nbytes(), "{}", t.name),
                Err(e) => assert!(e.to_string().contains(&*name), "{}: {e}", t.name),
            }
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
                // Described or refused with an error naming the file.
                if let Err(e) = torch::plain_sources(&payload, 0, &found) {
                    let name = p.file_name().unwrap().to_string_lossy();
                    assert!(e.to_string().contains(&*name), "{e}");
                }
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
            read_all(&c, &p);
        }
        let blob = Arc::new(Blob::owned(p.clone(), data));
        if let Ok(c) = source::open_blob(blob, &OpenOptions::default()) {
            read_all(&c, &p);
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
            read_all(&c, dir.path());
        }
    }
}

#[test]
fn hf_sharded_corpus_replays() {
    let all = inputs("hf_sharded");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/torchtitan/hf_sharded/qwen3_bf16_1file/sharded");
    let rank1 = "shard-00001-model-00001-of-00001.safetensors";
    let rank2 = "shard-00002-model-00001-of-00001.safetensors";
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures.join(rank1), dir.path().join(rank1)).unwrap();
    let mut opened = 0;
    for (_, data) in all {
        std::fs::write(dir.path().join(rank2), &data).unwrap();
        if let Ok(c) = source::hf_sharded::open(dir.path()) {
            opened += 1;
            read_all(&c, dir.path());
        }
    }
    // The seed is the fixture's own rank 2 file.
    assert!(opened >= 1);
}
