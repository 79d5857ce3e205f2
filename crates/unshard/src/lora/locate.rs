//! Where an adapter and its config are on disk.
//!
//! An adapter directory is what peft's `save_pretrained` writes: the adapter
//! called `default` at the top (`adapter_config.json` + `adapter_model.safetensors`
//! or `.bin`), every other adapter in a subdirectory named after it. A training
//! checkpoint of a peft-wrapped model carries no scale: its config is looked for
//! beside it, in its parent directory, then in the base, unless `--adapter-config`
//! names it. Nothing is guessed: no config, no merge.

use std::path::{Path, PathBuf};

use super::config::CONFIG_FILE;
use super::{adapter_error, remedy_error, AdapterOption, AdapterRemedy};
use crate::bytes::fs;
use crate::error::Result;

/// The weight files peft writes, in the order it prefers them.
const WEIGHT_FILES: &[&str] = &["adapter_model.safetensors", "adapter_model.bin"];

/// The name peft gives the adapter at the top of a directory.
pub const DEFAULT_ADAPTER: &str = "default";

/// One adapter of an adapter directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirAdapter {
    /// peft's name for it (`default` at the top).
    pub name: String,
    /// Its `adapter_config.json`.
    pub config: PathBuf,
    /// Its `adapter_model.safetensors` (or `.bin`).
    pub weights: PathBuf,
}

/// Whether `path` is a peft adapter directory (an adapter at the top, or in a
/// subdirectory).
pub fn is_adapter_dir(path: &Path) -> bool {
    fs::is_dir(path) && (adapter_at(path).is_some() || !adapters_in(path).is_empty())
}

fn adapter_at(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let config = dir.join(CONFIG_FILE);
    if !fs::is_file(&config) {
        return None;
    }
    let weights = WEIGHT_FILES
        .iter()
        .map(|f| dir.join(f))
        .find(|p| fs::is_file(p))?;
    Some((config, weights))
}

/// Every adapter of a directory, `default` (the top) first, then the
/// subdirectories in name order.
pub fn adapters_in(dir: &Path) -> Vec<DirAdapter> {
    let mut out = Vec::new();
    if let Some((config, weights)) = adapter_at(dir) {
        out.push(DirAdapter {
            name: DEFAULT_ADAPTER.into(),
            config,
            weights,
        });
    }
    let mut subs: Vec<PathBuf> = fs::list(dir)
        .map(|entries| {
            entries
                .into_iter()
                .filter(|e| e.is_dir)
                .map(|e| e.path)
                .collect()
        })
        .unwrap_or_default();
    subs.sort();
    for sub in subs {
        let Some(name) = sub.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
            continue;
        };
        if let Some((config, weights)) = adapter_at(&sub) {
            out.push(DirAdapter {
                name,
                config,
                weights,
            });
        }
    }
    out
}

/// Picks the adapter of a directory: the one named, or the only one.
pub fn select_in_dir(dir: &Path, wanted: Option<&str>) -> Result<DirAdapter> {
    let all = adapters_in(dir);
    let names = || {
        all.iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match wanted {
        Some(w) => all.iter().find(|a| a.name == w).cloned().ok_or_else(|| {
            remedy_error(
                dir,
                format!("no adapter named '{w}' (adapters here: {})", names()),
                AdapterRemedy::PickListed,
            )
        }),
        None => match all.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(adapter_error(
                dir,
                format!("no adapter here: {CONFIG_FILE} with adapter_model.safetensors or adapter_model.bin"),
                "pass the directory peft's save_pretrained wrote",
            )),
            _ => Err(remedy_error(
                dir,
                format!("holds several adapters: {}", names()),
                AdapterRemedy::NameOne,
            )),
        },
    }
}

/// The config of a training checkpoint: `explicit` (a file, or a directory holding
/// one), else beside the checkpoint, in its parent, or in the base.
pub fn config_for_checkpoint(
    checkpoint: &Path,
    base: Option<&Path>,
    explicit: Option<&Path>,
) -> Result<PathBuf> {
    if let Some(p) = explicit {
        let file = if fs::is_dir(p) {
            p.join(CONFIG_FILE)
        } else {
            p.to_path_buf()
        };
        if fs::is_file(&file) {
            return Ok(file);
        }
        return Err(remedy_error(
            p,
            format!("{}: no {CONFIG_FILE} here", AdapterOption::Config.words()),
            AdapterRemedy::ConfigAbsent,
        ));
    }
    let beside = if fs::is_dir(checkpoint) {
        Some(checkpoint.to_path_buf())
    } else {
        checkpoint.parent().map(Path::to_path_buf)
    };
    let parent = beside
        .as_deref()
        .and_then(Path::parent)
        .map(Path::to_path_buf);
    let mut looked = Vec::new();
    for dir in [beside, parent, base.map(Path::to_path_buf)]
        .into_iter()
        .flatten()
    {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let file = dir.join(CONFIG_FILE);
        if fs::is_file(&file) {
            return Ok(file);
        }
        looked.push(dir.display().to_string());
    }
    Err(remedy_error(
        checkpoint,
        format!(
            "holds LoRA weights but no {CONFIG_FILE} was found (looked in: {}); the scale lora_alpha / r is not in the weights",
            looked.join(", ")
        ),
        AdapterRemedy::ConfigNotFound,
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// What `save_pretrained` leaves for one adapter (the contents do not matter here).
    fn adapter(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), "{}").unwrap();
        std::fs::write(dir.join(WEIGHT_FILES[0]), "").unwrap();
    }

    #[test]
    fn an_adapter_at_the_top_or_in_a_subdirectory_makes_an_adapter_directory() {
        let top = tempfile::tempdir().unwrap();
        assert!(!is_adapter_dir(top.path()));
        adapter(top.path());
        assert!(is_adapter_dir(top.path()));
        let sub = tempfile::tempdir().unwrap();
        adapter(&sub.path().join("second"));
        assert!(is_adapter_dir(sub.path()));
    }

    #[test]
    fn the_adapter_named_is_the_one_selected() {
        let dir = tempfile::tempdir().unwrap();
        adapter(dir.path());
        adapter(&dir.path().join("second"));
        for name in ["default", "second"] {
            assert_eq!(select_in_dir(dir.path(), Some(name)).unwrap().name, name);
        }
        let e = select_in_dir(dir.path(), None).unwrap_err();
        assert!(
            e.to_string()
                .contains("holds several adapters: default, second"),
            "{e}"
        );
    }

    #[test]
    fn a_directory_without_an_adapter_says_what_it_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let e = select_in_dir(dir.path(), None).unwrap_err();
        assert!(e.to_string().contains("no adapter here"), "{e}");
    }
}
