//! Format detection: from the bytes and the directory layout, never from a flag.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::{
    dcp, deepspeed, fs, hf_dir, hf_sharded, hints, legacy, megatron, safetensors, sharded, torch,
    Blob, Checkpoint,
};
use crate::error::{Error, Result};

/// Serializes an input format as its stable id (`torch-zip`, `dcp`...).
pub(crate) fn format_id<S: serde::Serializer>(
    f: &Format,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(f.id())
}

/// The kinds of input unshard reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A `torch.save` zip archive (torch >= 1.6).
    TorchZip,
    /// A legacy `torch.save` stream (`_use_new_zipfile_serialization=False`).
    TorchLegacy,
    /// A single `.safetensors` file.
    Safetensors,
    /// A Hugging Face model directory.
    HfDir,
    /// A torch.distributed.checkpoint directory (`.metadata` + `*.distcp`).
    Dcp,
    /// One `torch.save` file per rank (verl's `model_world_size_N_rank_R.pt`).
    Ranks,
    /// A DeepSpeed ZeRO checkpoint (`latest` + `global_stepN/` of per-rank files).
    DeepSpeed,
    /// torch.distributed.checkpoint's HF storage writer saving distributed
    /// (`shard-0000R-model-0000K-of-0000N.safetensors` with `DCP_SHARDING_INFO`).
    HfSharded,
}

impl Format {
    /// A stable identifier (used in `inspect --json`).
    pub fn id(self) -> &'static str {
        match self {
            Format::TorchZip => "torch-zip",
            Format::TorchLegacy => "torch-legacy",
            Format::Safetensors => "safetensors",
            Format::HfDir => "hf-dir",
            Format::Dcp => "dcp",
            Format::Ranks => "ranks",
            Format::DeepSpeed => "deepspeed",
            Format::HfSharded => "hf-sharded",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::TorchZip => "torch.save zip archive",
            Format::TorchLegacy => "legacy torch.save stream",
            Format::Safetensors => "safetensors file",
            Format::HfDir => "Hugging Face model directory",
            Format::Dcp => "torch.distributed.checkpoint directory",
            Format::Ranks => "per-rank torch.save files",
            Format::DeepSpeed => "DeepSpeed ZeRO checkpoint",
            Format::HfSharded => "HF-sharded safetensors of torch.distributed.checkpoint",
        })
    }
}

/// How to read an input.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Dotted path of the tensor dict inside a pickle (`--key`).
    pub key: Option<String>,
    /// The DeepSpeed tag folder to read instead of the one `latest` names (`--tag`).
    pub tag: Option<String>,
}

/// Opens any supported input and describes its tensors.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    let is_dir = if fs::is_url(path) {
        // A prefix with objects below it ("a directory"), asked before the object
        // itself: a WebDAV server answers HEAD on a directory with 200 and 0 bytes.
        fs::is_dir(path)
    } else {
        let meta = std::fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
        meta.is_dir()
    };
    if is_dir {
        return open_dir(path, opts);
    }
    // `.metadata`, one `.distcp`, an `index.json`: parts of a checkpoint, never one.
    if let Some(e) = hints::wrong_input(path) {
        return Err(e);
    }
    let blob = Arc::new(fs::open(path)?);
    open_blob(blob, opts)
}

/// Bytes detection looks at: enough for every signature, and for telling text apart.
const HEAD: u64 = 4096;

/// Opens a single-file input from any byte source (a local file, bytes in memory).
pub fn open_blob(blob: Arc<Blob>, opts: &OpenOptions) -> Result<Checkpoint> {
    let path = blob.path.clone();
    let path = path.as_path();
    let head = blob.head(HEAD)?;
    if torch::is_zip(&head) {
        let payload = torch::read_zip_file(&blob)?;
        return from_payload(path, Format::TorchZip, blob, payload, opts);
    }
    if legacy::is_legacy(&head) {
        let payload = legacy::read_legacy_payload(&blob)?;
        return from_payload(path, Format::TorchLegacy, blob, payload, opts);
    }
    if safetensors::looks_like_safetensors(&head, blob.len()) {
        let header = safetensors::read_header_from(&blob)?;
        let tensors = safetensors::sources(0, header.data_start, header.tensors);
        return Ok(Checkpoint {
            format: Format::Safetensors,
            path: path.to_path_buf(),
            files: vec![blob],
            key: None,
            tensors,
            extras: header
                .metadata
                .iter()
                .map(|(k, v)| super::Extra {
                    name: format!("__metadata__.{k}"),
                    kind: format!("str '{v}'"),
                })
                .collect(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        });
    }
    Err(unknown(path, &head))
}

fn from_payload(
    path: &Path,
    format: Format,
    blob: Arc<Blob>,
    mut payload: torch::TorchPayload,
    opts: &OpenOptions,
) -> Result<Checkpoint> {
    if opts.key.is_none() && deepspeed::is_optim_states(&payload.pickle) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            msg: "a DeepSpeed optimizer-state file: one rank's flat partitions of the fp32 weights, which mean nothing without the other ranks' and the model-states file".into(),
            hint: Some("pass the folder that holds it (or the folder holding 'latest') with every rank's files".into()),
        });
    }
    // Deflated storage records, inflated in memory, are read as a second file.
    let mut files = vec![blob];
    if !payload.inflated.is_empty() {
        let bytes = std::mem::take(&mut payload.inflated);
        files.push(Arc::new(Blob::owned(path.to_path_buf(), bytes)));
        payload.inflated_file = Some(1);
    }
    let found = torch::find_tensors(&payload.pickle, path, opts.key.as_deref())?;
    let tensors = torch::plain_sources(&payload, 0, &found)?;
    let mut notes = Vec::new();
    if deepspeed::is_model_states(&payload.pickle) {
        if let Some(t) = tensors.iter().find(|t| t.shape == [0]) {
            return Err(Error::Incomplete {
                path: path.to_path_buf(),
                msg: format!(
                    "a DeepSpeed ZeRO-3 model-states file: its module holds [0]-shaped placeholders (e.g. '{}'); the weights are partitioned over every rank's optimizer-state file",
                    t.name
                ),
                hint: Some("pass the folder that holds this file (or the folder holding 'latest') with every rank's *_optim_states.pt".into()),
            });
        }
        notes.push("a DeepSpeed model-states file: its module is the 16-bit copy of the weights; the fp32 masters are in the optimizer-state files (pass the folder that holds them)".into());
    }
    if tensors.iter().any(|t| t.layout.is_some()) {
        notes.push("this file holds one rank's shards of distributed tensors; pass the directory of all rank files to merge them".into());
    }
    Ok(Checkpoint {
        format,
        path: path.to_path_buf(),
        files,
        key: found.key,
        tensors,
        extras: found.extras,
        notes,
        unsafe_calls: payload.unsafe_calls,
    })
}

fn open_dir(path: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    if let Some(found) = deepspeed::find(path, opts)? {
        return deepspeed::open(&found);
    }
    if let Some(tag) = &opts.tag {
        return Err(Error::Usage(format!(
            "--tag {tag} picks a DeepSpeed tag folder, but {} is not a DeepSpeed checkpoint folder (no 'latest' file or tag folders)",
            path.display()
        )));
    }
    if let Some((dir, note)) = megatron::iteration_dir(path)? {
        let mut c = open_dir(&dir, opts)?;
        c.notes.insert(0, note);
        return Ok(c);
    }
    if let Some(ranks) = megatron::legacy::find(path)? {
        return megatron::legacy::open_legacy(path, &ranks, opts);
    }
    if dcp::is_dcp_dir(path) {
        return dcp::open(path, opts).map_err(|e| hints::dcp_missing_file(path, e));
    }
    if let Some((dir, note)) = megatron::model_subdir(path) {
        let mut c = dcp::open(&dir, opts)?;
        c.notes.insert(0, note);
        return Ok(c);
    }
    if let Some((dir, note)) = hf_sharded::find(path)? {
        let mut c = hf_sharded::open(&dir)?;
        c.notes.splice(0..0, note);
        return Ok(c);
    }
    let hf = if hf_dir::is_hf_dir(path) {
        let dir = hf_dir::HfDir::open(path)?;
        if let Some(c) = dir.weights()? {
            return Ok(c);
        }
        true
    } else {
        false
    };
    if let Some(set) = sharded::find_rank_files(path)? {
        return sharded::open(&set, opts);
    }
    // A trainer's `checkpoint-N/` holding `pytorch_model_fsdp_0/` (and `optimizer_0/`).
    if let Some((sub, skipped)) = dcp::find_model_subdir(path)? {
        let mut c = dcp::open(&sub, opts)?;
        let name = sub
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut notes = vec![format!(
            "read the torch.distributed.checkpoint directory {name}/ inside {}",
            path.display()
        )];
        for s in skipped {
            notes.push(format!("skipped {s}/ (optimizer state)"));
        }
        notes.append(&mut c.notes);
        c.notes = notes;
        return Ok(c);
    }
    if hf {
        return Err(Error::NoTensors {
            path: path.to_path_buf(),
            at: None,
            hint: Some("the directory has a config.json but no weight files".into()),
        });
    }
    megatron::refuse_unread(path)?;
    if let Some(e) = hints::wrong_input(path) {
        return Err(e);
    }
    let mut names: Vec<String> = fs::list(path)?.into_iter().map(|e| e.name).collect();
    names.sort();
    Err(Error::UnknownFormat {
        path: path.to_path_buf(),
        found: if names.is_empty() {
            "an empty directory".into()
        } else {
            format!("a directory holding {}", crate::text::list_some(&names, 8))
        },
    })
}

/// Says what an unreadable file looks like, from its first bytes.
fn unknown(path: &Path, data: &[u8]) -> Error {
    if data.len() > 262 && &data[257..262] == b"ustar" {
        return Error::Unsupported {
            path: path.to_path_buf(),
            what: "the tar-based torch.save format of torch < 0.4".into(),
            hint: Some("load it with an old torch and save it again with a recent one".into()),
        };
    }
    if data.starts_with(b"PYTORCH1") {
        return Error::Unsupported {
            path: path.to_path_buf(),
            what: "the preview-release PYTORCH1 archive format".into(),
            hint: None,
        };
    }
    if data.starts_with(&[0x80]) {
        return Error::UnknownFormat {
            path: path.to_path_buf(),
            found: "a bare pickle without torch's container (pickle.dump, not torch.save)".into(),
        };
    }
    let found = if data.is_empty() {
        "the file is empty".to_string()
    } else if data
        .iter()
        .take(512)
        .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace())
    {
        "it looks like text".to_string()
    } else {
        let head: Vec<String> = data.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("unrecognised leading bytes {}", head.join(" "))
    };
    Error::UnknownFormat {
        path: path.to_path_buf(),
        found,
    }
}
