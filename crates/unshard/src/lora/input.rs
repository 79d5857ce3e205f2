//! Opening an adapter input: an adapter directory, or a checkpoint of a
//! peft-wrapped model in any format unshard reads.

use std::path::{Path, PathBuf};

use super::config::AdapterConfig;
use super::locate;
use super::names;
use super::resolve::{resolve, Resolved};
use super::{AdapterOption, AdapterRemedy};
use crate::error::{Error, Result};
use crate::plan::strip_wrappers;
use crate::source::{self, Checkpoint, OpenOptions};

/// `--adapter`, `--adapter-config` and `--no-fuse`.
#[derive(Clone, Debug, Default)]
pub struct AdapterOptions {
    /// The adapter to fuse when the input holds several.
    pub name: Option<String>,
    /// The `adapter_config.json` to use (a file, or a directory holding one).
    pub config: Option<PathBuf>,
    /// Keep the base weights unchanged and write the adapter beside them, in
    /// `OUT/adapter/`, as a peft adapter directory.
    pub no_fuse: bool,
}

/// An adapter, opened and resolved.
#[derive(Debug)]
pub struct AdapterInput {
    /// The tensors read (the adapter's weight file, or the whole checkpoint).
    pub checkpoint: Checkpoint,
    /// Its tensors and fuses under base names.
    pub resolved: Resolved,
    /// Whether the input was an adapter directory (else a training checkpoint).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub from_dir: bool,
}

/// Whether a checkpoint's tensors are those of a peft-wrapped model.
pub fn is_peft_checkpoint(ckpt: &Checkpoint) -> bool {
    ckpt.tensors
        .iter()
        .any(|t| names::looks_like_peft(&strip_wrappers(&t.name)))
}

/// Opens the merge's input: an adapter directory, or a checkpoint (which is an
/// adapter input when its names are peft's). The adapter options on anything else
/// are an error, so that a flag is never silently ignored.
pub fn open(
    path: &Path,
    base: Option<&Path>,
    opts: &AdapterOptions,
    open: &OpenOptions,
) -> Result<(Checkpoint, Option<Resolved>)> {
    if locate::is_adapter_dir(path) {
        let input = open_dir(path, opts, open)?;
        return Ok((input.checkpoint, Some(input.resolved)));
    }
    let ckpt = source::open(path, open)?;
    if is_peft_checkpoint(&ckpt) {
        let input = from_checkpoint(ckpt, base, opts)?;
        return Ok((input.checkpoint, Some(input.resolved)));
    }
    let option = [
        (opts.name.is_some(), AdapterOption::Name),
        (opts.config.is_some(), AdapterOption::Config),
        (opts.no_fuse, AdapterOption::NoFuse),
    ]
    .into_iter()
    .find_map(|(set, o)| set.then_some(o));
    if let Some(option) = option {
        return Err(super::remedy_error(
            path,
            format!(
                "{} applies to LoRA adapters, and this input holds none (no lora_A / lora_B tensors)",
                option.words()
            ),
            AdapterRemedy::NotAnAdapter(option),
        ));
    }
    Ok((ckpt, None))
}

/// Opens an adapter directory (`adapter_config.json` + `adapter_model.*`).
pub fn open_dir(dir: &Path, opts: &AdapterOptions, open: &OpenOptions) -> Result<AdapterInput> {
    let chosen = locate::select_in_dir(dir, opts.name.as_deref())?;
    let config_path = match &opts.config {
        Some(p) => locate::config_for_checkpoint(dir, None, Some(p))?,
        None => chosen.config.clone(),
    };
    let config = AdapterConfig::read(&config_path)?;
    let checkpoint = source::open(&chosen.weights, open)?;
    let resolved = resolve(&checkpoint, config, Some(&chosen.name), None)?;
    Ok(AdapterInput {
        checkpoint,
        resolved,
        from_dir: true,
    })
}

/// Resolves an already opened training checkpoint of a peft-wrapped model; its
/// config comes from `--adapter-config`, beside it, its parent or the base.
pub fn from_checkpoint(
    checkpoint: Checkpoint,
    base: Option<&Path>,
    opts: &AdapterOptions,
) -> Result<AdapterInput> {
    let config_path = locate::config_for_checkpoint(
        &checkpoint.path,
        base,
        opts.config.as_deref(),
    )
    .map_err(|e| match e {
        // Say which tensors made it an adapter: one stray `lora_A` may be a mistake.
        Error::Adapter { msg, remedy } => {
            let peft: Vec<&str> = checkpoint
                .tensors
                .iter()
                .filter(|t| names::looks_like_peft(&strip_wrappers(&t.name)))
                .map(|t| t.name.as_str())
                .collect();
            let more = match peft.len() {
                0 | 1 => String::new(),
                n => format!(" and {} more", n - 1),
            };
            let msg = match peft.first() {
                Some(first) => format!(
                    "{msg}; it is read as a LoRA adapter because of tensor '{first}'{more} (a peft LoRA name)"
                ),
                None => msg,
            };
            Error::Adapter { msg, remedy }
        }
        e => e,
    })?;
    let config = AdapterConfig::read(&config_path)?;
    let resolved = resolve(&checkpoint, config, None, opts.name.as_deref())?;
    Ok(AdapterInput {
        checkpoint,
        resolved,
        from_dir: false,
    })
}
