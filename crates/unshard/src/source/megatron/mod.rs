//! Megatron-LM save folders: which directory of a save holds the model.
//!
//! A save folder holds `latest_checkpointed_iteration.txt` (an iteration number,
//! or `release`) beside one folder per saved iteration (`iter_0000100/`,
//! `release/`). The iteration named is read. NeMo 2 and verl keep the model in a
//! `weights/` or `dist_ckpt/` folder of their save folder, which is read. A
//! `torch_dist` directory is a torch.distributed.checkpoint directory that the
//! DCP reader opens, with `metadata.json` naming its backend and `common.pt`
//! holding the training arguments (not tensors). The legacy layout (`mp_rank_*`
//! folders of `model_optim_rng.pt`) is read by [`legacy`]. The training
//! arguments a save holds are read by [`args`], and [`config`] derives a
//! Hugging Face config from them when no base is given.

use std::path::{Path, PathBuf};

use crate::bytes::fs;
use crate::error::{Error, Result};

pub mod args;
pub mod config;
pub mod legacy;

/// The file naming the iteration a save folder's reader should take.
pub const LATEST: &str = "latest_checkpointed_iteration.txt";

/// The iteration folder `path`'s `latest_checkpointed_iteration.txt` names, and a
/// note saying so; `None` when `path` has no such file.
pub fn iteration_dir(path: &Path) -> Result<Option<(PathBuf, String)>> {
    let Some(text) = fs::read_optional(&path.join(LATEST))? else {
        return Ok(None);
    };
    let said = String::from_utf8_lossy(&text).trim().to_string();
    let folder = if said == "release" {
        "release".to_string()
    } else {
        match said.parse::<u64>() {
            Ok(n) => format!("iter_{n:07}"),
            Err(_) => {
                return Err(Error::Corrupt {
                    path: path.join(LATEST),
                    msg: format!("'{said}' is neither an iteration number nor 'release'"),
                })
            }
        }
    };
    let dir = path.join(&folder);
    if !fs::is_dir(&dir) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            msg: format!("{LATEST} names iteration '{said}', and there is no {folder}/ folder"),
            hint: Some("pass the iteration folder to read (iter_NNNNNNN/) itself".into()),
        });
    }
    if fs::is_file(&dir.join(LATEST)) {
        return Err(Error::Corrupt {
            path: dir.join(LATEST),
            msg: format!("the iteration folder {folder}/ names an iteration itself"),
        });
    }
    Ok(Some((
        dir,
        format!(
            "read {folder}/, the iteration {LATEST} names in {}",
            path.display()
        ),
    )))
}

/// The Megatron-Core `torch_dist` directory inside `path` that a training
/// framework's save folder keeps: NeMo 2's `weights/`, verl's `dist_ckpt/`; and a
/// note saying so. `None` when `path` holds neither.
pub fn model_subdir(path: &Path) -> Option<(PathBuf, String)> {
    ["weights", "dist_ckpt"].iter().find_map(|name| {
        let dir = path.join(name);
        let dcp = fs::is_file(&dir.join(".metadata")) && fs::is_file(&dir.join("metadata.json"));
        dcp.then(|| {
            let note = format!(
                "read the Megatron-Core torch_dist directory {name}/ inside {}",
                path.display()
            );
            (dir, note)
        })
    })
}

/// Refuses a Megatron folder unshard does not read: a `metadata.json` naming
/// another sharded backend.
pub fn refuse_unread(path: &Path) -> Result<()> {
    if let Some(text) = fs::read_optional(&path.join("metadata.json"))? {
        let backend = serde_json::from_slice::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("sharded_backend")?.as_str().map(str::to_string));
        if let Some(b) = backend.filter(|b| b != "torch_dist") {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                what: format!("a Megatron-Core distributed checkpoint with sharded backend '{b}'"),
                hint: Some(
                    "re-save it with Megatron's torch_dist backend (--ckpt-format torch_dist)"
                        .into(),
                ),
            });
        }
    }
    Ok(())
}
