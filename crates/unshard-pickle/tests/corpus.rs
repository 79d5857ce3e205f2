//! Replays the fuzz corpus and every committed crash reproducer through the parser, so
//! a fixed fuzz finding stays fixed without running the fuzzer.

use std::path::{Path, PathBuf};

use unshard_pickle::{parse, parse_prefix, Limits};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Every file in `dir`, or nothing if the directory does not exist.
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

fn replay(path: &Path) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // As the fuzz target does: default limits, then the target's small ones.
    if let Ok(pickle) = parse(&data) {
        for id in pickle.ids() {
            let _ = pickle.describe(id);
        }
    }
    let small = Limits {
        max_nodes: 100_000,
        max_container_len: 100_000,
        max_payload_bytes: 1 << 20,
        max_memo: 100_000,
        max_marks: 1_000,
    };
    if let Ok((pickle, end)) = parse_prefix(&data, &small) {
        assert!(end <= data.len(), "{}", path.display());
        for id in pickle.ids() {
            let _ = pickle.describe(id);
        }
    }
}

#[test]
fn fuzz_corpus_replays_without_panic() {
    let files = files_in(&fuzz_dir().join("corpus/pickle"));
    assert!(!files.is_empty(), "fuzz/corpus/pickle is missing");
    for path in files {
        replay(&path);
    }
}

#[test]
fn fuzz_regressions_and_artifacts_replay_without_panic() {
    let dirs = ["regressions/pickle", "artifacts/pickle"];
    for dir in dirs {
        for path in files_in(&fuzz_dir().join(dir)) {
            replay(&path);
        }
    }
}
