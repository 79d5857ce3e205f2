//! "Pass this instead": recognising the near misses people make when they point
//! unshard at a checkpoint, and naming the right path.
//!
//! Each check here looks only at names and the directory layout, and runs only
//! when reading the input as given failed or would give the wrong thing: a
//! single `.distcp` or the `.metadata` of a DCP directory, an `index.json`, a
//! training run's folder of `checkpoint-N/`, a DeepSpeed folder, a DCP directory
//! missing one of its files. What each hint names is a path that exists.

use std::path::{Path, PathBuf};

use crate::bytes::fs;
use crate::error::Error;

/// The error for an input that is a part of (or the parent of) what should be
/// passed, or `None` when the path is none of those near misses.
pub fn wrong_input(path: &Path) -> Option<Error> {
    let wrong = |found: String, hint: String| Error::WrongInput {
        path: path.to_path_buf(),
        found,
        hint,
    };
    let name = path.file_name()?.to_string_lossy().into_owned();
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if fs::is_file(path) {
        if name == ".metadata" || name.ends_with(".distcp") {
            let what = if name == ".metadata" {
                "the index file of a torch.distributed.checkpoint directory".to_string()
            } else {
                "one rank's data file of a torch.distributed.checkpoint directory".to_string()
            };
            return Some(wrong(
                what,
                format!(
                    "pass the directory that holds .metadata and every __R_I.distcp file: {}",
                    parent.display()
                ),
            ));
        }
        if name.ends_with(".index.json") {
            return Some(wrong(
                "the index of a sharded model, not its weights".into(),
                format!(
                    "pass the directory that holds it and the shards it lists: {}",
                    parent.display()
                ),
            ));
        }
        return None;
    }
    if !fs::is_dir(path) {
        return None;
    }
    let runs = numbered_subdirs(path, "checkpoint-");
    if let Some((latest, _)) = runs.last() {
        let listed: Vec<String> = runs.iter().map(|(_, n)| format!("{n}/")).collect();
        return Some(wrong(
            format!(
                "a training run's output folder, holding {}",
                crate::text::list_some(&listed, 8)
            ),
            format!(
                "pass one checkpoint folder; the latest is {}",
                path.join(latest_name(&runs, *latest)).display()
            ),
        ));
    }
    // A folder with a DeepSpeed checkpoint (`latest`) or a DCP directory
    // (`.metadata`) one level down, among other things.
    let inside = checkpoint_subdirs(path);
    if let Some(first) = inside.first() {
        let listed: Vec<String> = inside.iter().map(|p| p.display().to_string()).collect();
        let hint = match inside.len() {
            1 => format!("pass the checkpoint folder: {}", first.display()),
            _ => format!(
                "pass one of the checkpoint folders: {}",
                crate::text::list_some(&listed, 8)
            ),
        };
        return Some(wrong(
            format!(
                "not a checkpoint, but a folder holding {}",
                crate::text::list_some(&listed, 8)
            ),
            hint,
        ));
    }
    None
}

/// Subdirectories of `path` that hold a DeepSpeed `latest` file or a DCP
/// `.metadata`, by name.
fn checkpoint_subdirs(path: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::list(path)
        .map(|entries| {
            entries
                .into_iter()
                .filter(|e| e.is_dir)
                .map(|e| e.path)
                .filter(|p| fs::is_file(&p.join("latest")) || fs::is_file(&p.join(".metadata")))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `(N, name)` of the subdirectories named `<prefix>N`, by N ascending.
fn numbered_subdirs(path: &Path, prefix: &str) -> Vec<(u64, String)> {
    let mut v: Vec<(u64, String)> = fs::list(path)
        .map(|entries| {
            entries
                .into_iter()
                .filter(|e| e.is_dir)
                .filter_map(|e| {
                    let n = e.name.strip_prefix(prefix)?.parse().ok()?;
                    Some((n, e.name))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn latest_name(runs: &[(u64, String)], n: u64) -> &str {
    runs.iter()
        .find(|(k, _)| *k == n)
        .map(|(_, s)| s.as_str())
        .unwrap_or_default()
}

/// Turns "cannot open DIR/__1_0.distcp: not found" while opening a DCP directory
/// into an error saying which rank's file is missing.
pub fn dcp_missing_file(dir: &Path, e: Error) -> Error {
    let missing = match &e {
        Error::Io { path, source, .. } if source.kind() == std::io::ErrorKind::NotFound => path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".distcp")),
        _ => None,
    };
    let Some(file) = missing else {
        return e;
    };
    let rank = file
        .strip_prefix("__")
        .and_then(|r| r.split('_').next())
        .map(|r| format!(" (rank {r}'s data)"))
        .unwrap_or_default();
    Error::Incomplete {
        path: dir.to_path_buf(),
        msg: format!("the torch.distributed.checkpoint directory lacks {file}{rank}, which its .metadata lists"),
        hint: Some("every rank writes its own file: copy the missing one from the node that saved it (all ranks must write to one shared directory), or pass the complete directory".into()),
    }
}
