//! Readers see a store, not a file system: no code under `src/source/` (format
//! detection and every reader) nor the base's opening (`src/prepare.rs`) asks the
//! local file system about a path that may be a URL. They ask `bytes::fs` (list a
//! prefix, is this an object or a prefix, read a small object, open an object for
//! ranged reads), which answers from the disk for a path and from object storage for
//! a URL. A new reader that calls `std::fs` or `Path::is_dir` fails here, before it
//! fails for every user whose checkpoint is in a bucket.
//!
//! The check reads the source as text, outside comments and test code (files named
//! `tests.rs` or under `tests/`, and everything after a file's first `#[cfg(test)]`).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

/// Calls that reach the local file system directly.
const FORBIDDEN: &[&str] = &[
    "std::fs::",
    "File::open(",
    "File::create(",
    "read_dir(",
    ".is_dir()",
    ".is_file()",
    ".exists()",
    ".metadata()",
    "Blob::open(",
    "LocalFile::open(",
];

/// Files allowed a local call, and why.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "source/detect.rs",
        "std::fs::metadata(path)",
        "the branch taken when the path is not a URL",
    ),
    ("source/detect.rs", "meta.is_dir()", "the same branch"),
    (
        "source/dcp/readahead.rs",
        "use std::fs::File;",
        "page-cache readahead of local files (below)",
    ),
    (
        "source/dcp/readahead.rs",
        "File::open(",
        "page-cache readahead of local files; a URL fails to open and is skipped",
    ),
    (
        "source/dcp/readahead.rs",
        "std::fs::read_to_string(\"/proc/meminfo\")",
        "the machine's memory, not an input",
    ),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "tests") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

/// The lines of `text` before its test code, without comments.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let code = line.split("//").next().unwrap_or("");
        out.push((i + 1, code.to_string()));
    }
    out
}

/// Whether `line` holds `pat` as a call of its own (`PooledFile::open(`, which
/// opens a local file only after `fs::is_url` said the path is none, is not
/// `File::open(`).
fn calls(line: &str, pat: &str) -> bool {
    line.match_indices(pat).any(|(at, _)| {
        pat.starts_with('.')
            || !line[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&src.join("source"), &mut files);
    files.push(src.join("prepare.rs"));
    let mut found = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(src)
            .unwrap_or(&f)
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (n, line) in code_lines(&text) {
            for pat in FORBIDDEN {
                if !calls(&line, pat) {
                    continue;
                }
                let allowed = ALLOWED
                    .iter()
                    .any(|(file, what, _)| *file == rel && line.contains(what));
                if !allowed {
                    found.push(format!("{rel}:{n}: {} ({pat})", line.trim()));
                }
            }
        }
    }
    found
}

#[test]
fn readers_ask_the_store_layer_not_the_file_system() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src);
    assert!(
        found.is_empty(),
        "readers calling the local file system on a path that may be a URL (use crate::bytes::fs: list, is_dir, is_file, read, read_optional, open):\n{}",
        found.join("\n")
    );
}

/// The check sees a call: a reader written the old way is caught.
#[test]
fn the_check_sees_a_local_call() {
    let dir = std::env::temp_dir().join(format!("unshard-readers-check-{}", std::process::id()));
    let source = dir.join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(
        source.join("new_format.rs"),
        "fn find(p: &Path) -> bool {\n    p.join(\"latest\").is_file() // here\n}\n#[cfg(test)]\nmod t { fn f() { std::fs::read(\"x\"); } }\n",
    )
    .unwrap();
    std::fs::write(dir.join("prepare.rs"), "").unwrap();
    let found = violations(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("source/new_format.rs:2:"), "{found:?}");
}
