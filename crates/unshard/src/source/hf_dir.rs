//! Hugging Face model directories: `config.json`, weights in any of the layouts
//! `save_pretrained` writes (single or sharded safetensors, `pytorch_model.bin`
//! single or sharded), or none at all, plus the small files that travel with a
//! model (generation config, tokenizer, chat template).
//!
//! Weights are read lazily: opening a directory parses headers and pickles only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{fs, legacy, safetensors, torch, Checkpoint, Format, TensorSource};
use crate::error::{Error, Result};

/// The file name of a merge's manifest (`unshard.json`), at the top of the output
/// directory: never taken for a base's extra file.
pub const MANIFEST: &str = "unshard.json";

/// Files larger than this are never copied into an output directory as "extras".
pub const MAX_EXTRA_FILE: u64 = 256 * 1024 * 1024;

/// Which kind of weight files a directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// `*.safetensors` files.
    Safetensors,
    /// `pytorch_model*.bin` files (`torch.save`).
    TorchBin,
}

/// A model directory, opened.
#[derive(Debug)]
pub struct HfDir {
    /// The directory.
    pub path: PathBuf,
    /// `config.json`, parsed (key order kept).
    pub config: Option<serde_json::Map<String, serde_json::Value>>,
    /// The kind of weight files, when there are any.
    pub weight_format: Option<WeightFormat>,
    /// Weight files in load order.
    pub weight_files: Vec<PathBuf>,
    /// Non-weight files to carry into an output directory (config.json excluded).
    pub extra_files: Vec<PathBuf>,
    /// Files left out, with the reason.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub skipped: Vec<(PathBuf, String)>,
}

/// Whether a file name is a weight or index file (never copied as an extra).
pub fn is_weight_file(name: &str) -> bool {
    const EXT: &[&str] = &[
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".gguf",
        ".onnx",
        ".distcp",
        ".npz",
    ];
    EXT.iter().any(|e| name.ends_with(e)) || name.ends_with(".index.json") || name == ".metadata"
}

/// Files a trainer writes beside a model's config (an HF Trainer `checkpoint-N/` of a
/// DeepSpeed run, used as the base config), which a model directory does not carry.
fn is_training_state(name: &str) -> bool {
    matches!(
        name,
        "latest" | "trainer_state.json" | "zero_to_fp32.py" | "zero_to_torch.py"
    )
}

/// Whether a directory looks like a model directory.
pub fn is_hf_dir(path: &Path) -> bool {
    [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ]
    .iter()
    .any(|f| fs::is_file(&path.join(f)))
}

impl HfDir {
    /// Opens a model directory: reads config.json and finds the weight files.
    pub fn open(path: &Path) -> Result<HfDir> {
        let config = match fs::read_optional(&path.join("config.json"))? {
            Some(text) => Some(serde_json::from_slice(&text).map_err(|e| {
                Error::corrupt(path.join("config.json"), format!("not a JSON object: {e}"))
            })?),
            None => None,
        };
        let (weight_format, weight_files) = find_weights(path)?;
        let mut extra_files = Vec::new();
        let mut skipped = Vec::new();
        for entry in fs::list(path)? {
            let p = entry.path;
            let name = entry.name;
            // A base that an earlier merge wrote: its manifest describes that merge.
            if name == "config.json" || name == MANIFEST || name.starts_with('.') {
                continue;
            }
            if entry.is_dir {
                skipped.push((p, "a directory".into()));
            } else if is_training_state(&name) {
                skipped.push((p, "training state, not part of a model".into()));
            } else if is_weight_file(&name) {
                continue;
            } else if entry.len > MAX_EXTRA_FILE {
                skipped.push((
                    p,
                    format!(
                        "{} bytes, larger than the {} MiB limit for extra files",
                        entry.len,
                        MAX_EXTRA_FILE >> 20
                    ),
                ));
            } else {
                extra_files.push(p);
            }
        }
        Ok(HfDir {
            path: path.to_path_buf(),
            config,
            weight_format,
            weight_files,
            extra_files,
            skipped,
        })
    }

    /// A directory that is only a config made elsewhere (derived from training
    /// arguments): no weights, no files to carry. `path` says where it came from.
    pub fn config_only(path: &Path, config: serde_json::Map<String, serde_json::Value>) -> HfDir {
        HfDir {
            path: path.to_path_buf(),
            config: Some(config),
            weight_format: None,
            weight_files: Vec::new(),
            extra_files: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// Opens the weights as a checkpoint (headers and pickles only), or `None` for a
    /// config-only directory.
    pub fn weights(&self) -> Result<Option<Checkpoint>> {
        let Some(format) = self.weight_format else {
            return Ok(None);
        };
        let mut files = Vec::new();
        let mut tensors: Vec<TensorSource> = Vec::new();
        let mut notes = Vec::new();
        let mut unsafe_calls = Vec::new();
        for (id, f) in self.weight_files.iter().enumerate() {
            let blob = Arc::new(fs::open(f)?);
            match format {
                WeightFormat::Safetensors => {
                    let header = safetensors::read_header_from(&blob)?;
                    tensors.extend(safetensors::sources(id, header.data_start, header.tensors));
                }
                WeightFormat::TorchBin => {
                    let mut payload = if legacy::is_legacy(&blob.head(64)?) {
                        legacy::read_legacy_payload(&blob)?
                    } else {
                        torch::read_zip_file(&blob)?
                    };
                    unsafe_calls.append(&mut payload.unsafe_calls);
                    let found = torch::find_tensors(&payload.pickle, f, None)?;
                    tensors.extend(torch::plain_sources(&payload, id, &found)?);
                }
            }
            files.push(blob);
        }
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::corrupt(
                    &self.path,
                    format!("tensor '{}' appears in more than one weight file", t.name),
                ));
            }
        }
        if self.weight_files.len() > 1 {
            notes.push(format!("{} weight shards", self.weight_files.len()));
        }
        Ok(Some(Checkpoint {
            format: Format::HfDir,
            path: self.path.clone(),
            files,
            key: None,
            tensors,
            extras: Vec::new(),
            notes,
            unsafe_calls,
        }))
    }

    /// The dtype the config declares, and the key it uses (`dtype` in transformers
    /// >= 4.56, `torch_dtype` before).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn config_dtype(&self) -> Option<(&'static str, crate::dtype::DType)> {
        let cfg = self.config.as_ref()?;
        for key in ["dtype", "torch_dtype"] {
            if let Some(d) = cfg
                .get(key)
                .and_then(|v| v.as_str())
                .and_then(crate::dtype::DType::from_torch_name)
            {
                return Some((key, d));
            }
        }
        None
    }
}

/// Finds weight files: safetensors index, single safetensors, bin index, single bin.
fn find_weights(path: &Path) -> Result<(Option<WeightFormat>, Vec<PathBuf>)> {
    for (index, single, format) in [
        (
            "model.safetensors.index.json",
            "model.safetensors",
            WeightFormat::Safetensors,
        ),
        (
            "pytorch_model.bin.index.json",
            "pytorch_model.bin",
            WeightFormat::TorchBin,
        ),
    ] {
        let index_path = path.join(index);
        if fs::is_file(&index_path) {
            let text = fs::read(&index_path)?;
            let json: serde_json::Value = serde_json::from_slice(&text)
                .map_err(|e| Error::corrupt(&index_path, format!("not valid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::corrupt(&index_path, "no weight_map object"))?;
            let mut files: Vec<String> = Vec::new();
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    Error::corrupt(
                        &index_path,
                        format!("weight_map entry '{name}' is not a file name"),
                    )
                })?;
                if f.contains('/') || f.contains('\\') || f == ".." {
                    return Err(Error::corrupt(
                        &index_path,
                        format!("weight_map entry '{name}' points outside the directory: '{f}'"),
                    ));
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
            }
            files.sort();
            let files: Vec<PathBuf> = files.into_iter().map(|f| path.join(f)).collect();
            for f in &files {
                if !fs::is_file(f) {
                    return Err(Error::corrupt(
                        &index_path,
                        format!("lists {} but the file is missing", f.display()),
                    ));
                }
            }
            return Ok((Some(format), files));
        }
        if fs::is_file(&path.join(single)) {
            return Ok((Some(format), vec![path.join(single)]));
        }
    }
    Ok((None, Vec::new()))
}
