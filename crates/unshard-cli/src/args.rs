//! Argument groups that several subcommands share, declared once and pulled in
//! with `#[command(flatten)]`, so a flag is spelled, documented and parsed the
//! same way everywhere.

use std::path::PathBuf;

use clap::ValueEnum;
use unshard::{AdapterOptions, DtypeChoice, ExpertLayout, PlanOptions};
use unshard::{DType, Error, RenameError};

/// `--key`: where the state dict sits inside a pickle.
#[derive(clap::Args, Debug)]
pub struct KeyArg {
    /// Dotted path of the state dict inside the pickle (e.g. `state`, `model.module`).
    /// By default unshard finds it.
    #[arg(long, value_name = "PATH")]
    pub key: Option<String>,

    /// DeepSpeed checkpoints: the tag folder to read instead of the one named by
    /// `latest` (e.g. `global_step500`).
    #[arg(long, value_name = "TAG")]
    pub tag: Option<String>,
}

/// `--json`: a machine-readable result on stdout.
#[derive(clap::Args, Debug)]
pub struct JsonArg {
    /// Print one JSON object on stdout instead of text (schema in README.md); the
    /// exit code is the same.
    #[arg(long)]
    pub json: bool,
}

/// dtype of the floating-point tensors written. Besides the names `--help` lists,
/// the spellings people carry over from torch and other tools are accepted, in
/// any case (`bf16`, `fp16`, `half`, `fp32`, `float`, `torch.bfloat16`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// The base config's dtype, else the base weights', else the checkpoint's.
    Auto,
    #[value(aliases = ["fp16", "f16", "half", "torch.float16", "torch.half"])]
    Float16,
    #[value(aliases = ["bf16", "torch.bfloat16"])]
    Bfloat16,
    #[value(aliases = ["fp32", "f32", "float", "torch.float32", "torch.float"])]
    Float32,
}

impl DtypeArg {
    /// The library's dtype choice.
    pub fn choice(self) -> DtypeChoice {
        match self {
            DtypeArg::Auto => DtypeChoice::Auto,
            DtypeArg::Float16 => DtypeChoice::Fixed(DType::F16),
            DtypeArg::Bfloat16 => DtypeChoice::Fixed(DType::BF16),
            DtypeArg::Float32 => DtypeChoice::Fixed(DType::F32),
        }
    }
}

/// The layout of a mixture-of-experts model's expert tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// transformers' in-memory layout, what `model.state_dict()` holds: each
    /// layer's experts stacked in one tensor per projection (gate and up joined).
    Packed,
    /// The per-expert tensors `save_pretrained` writes.
    Original,
}

/// The options that decide what a merge writes, shared by `merge` (which writes
/// it) and `verify` (which re-derives it: pass the same values).
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The Hugging Face model directory training started from: supplies config.json,
    /// tokenizer files, the dtype, and any weights the checkpoint lacks. A Hub id
    /// (`org/name`, `org/name@revision`) is looked up in the local Hugging Face
    /// cache, offline; a directory of that name wins. A path to a config.json
    /// stands for its folder.
    #[arg(long, value_name = "DIR|ORG/NAME")]
    pub base: Option<PathBuf>,

    /// dtype of the floating-point tensors written (also accepted: bf16, fp16, half,
    /// fp32, float, torch.bfloat16, ..., in any case).
    #[arg(long, value_enum, ignore_case = true, default_value = "auto")]
    pub dtype: DtypeArg,

    /// Largest shard file: decimal units as transformers (5GB = 5e9 bytes), or
    /// binary units (GiB, MiB). A tensor larger than this gets a shard of its own.
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    pub max_shard_size: String,

    /// Fail when the base has tensors the checkpoint lacks (instead of copying them).
    #[arg(long)]
    pub strict: bool,

    #[command(flatten)]
    pub key: KeyArg,

    /// Rename tensors: a regular expression and its replacement (`$1` for groups),
    /// applied after wrapper prefixes are stripped. Repeatable.
    #[arg(long, value_name = "REGEX=REPLACEMENT")]
    pub rename: Vec<String>,

    /// Mixture-of-experts models: write the expert tensors packed (transformers'
    /// in-memory layout, fewer tensors; transformers 5 loads it) or original (one
    /// tensor per expert, as save_pretrained writes). By default, as the base's
    /// files hold them.
    #[arg(long, value_enum, value_name = "LAYOUT")]
    pub layout: Option<LayoutArg>,

    #[command(flatten)]
    pub adapter: AdapterArgs,
}

/// How a LoRA/DoRA adapter (a peft adapter directory, or a checkpoint of a
/// peft-wrapped model) is fused into the base.
#[derive(clap::Args, Debug)]
pub struct AdapterArgs {
    /// The adapter to fuse when the input holds several (peft's adapter names).
    #[arg(long, value_name = "NAME")]
    pub adapter: Option<String>,

    /// The adapter_config.json the adapter was trained with (a file or its
    /// directory). By default: the adapter directory's own, or the one beside the
    /// checkpoint, in its parent, or in --base.
    #[arg(long, value_name = "PATH")]
    pub adapter_config: Option<PathBuf>,

    /// Do not fuse: write the base weights unchanged, and the adapter in OUT/adapter/
    /// as a peft adapter directory (with its real lora_alpha).
    #[arg(long)]
    pub no_fuse: bool,
}

impl AdapterArgs {
    /// The library's adapter options.
    pub fn options(&self) -> AdapterOptions {
        AdapterOptions {
            name: self.adapter.clone(),
            config: self.adapter_config.clone(),
            no_fuse: self.no_fuse,
        }
    }
}

impl PlanArgs {
    /// `--base`, with a path to a `config.json` file taken as the directory that
    /// holds it.
    pub fn base_dir(&self) -> Option<PathBuf> {
        let base = self.base.as_ref()?;
        let is_config = base.file_name().is_some_and(|n| n == "config.json") && base.is_file();
        Some(match base.parent() {
            Some(dir) if is_config && dir.as_os_str().is_empty() => PathBuf::from("."),
            Some(dir) if is_config => dir.to_path_buf(),
            _ => base.clone(),
        })
    }

    /// The library's plan options; a malformed size or rename is a usage error.
    pub fn plan_options(&self) -> Result<PlanOptions, Error> {
        let size = &self.max_shard_size;
        let max_shard_size = unshard::parse_size(size)
            .filter(|&s| s > 0)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "--max-shard-size '{size}' is not a size (examples: 5GB, 500MB, 2GiB)"
                ))
            })?;
        let mut renames = Vec::new();
        for r in &self.rename {
            renames.push(unshard::parse_rename(r).map_err(|e| match e {
                RenameError::MissingEquals => {
                    Error::Usage(format!("--rename '{r}' must be REGEX=REPLACEMENT"))
                }
                RenameError::Regex(e) => {
                    Error::Usage(format!("--rename '{r}': invalid regular expression: {e}"))
                }
            })?);
        }
        Ok(PlanOptions {
            dtype: self.dtype.choice(),
            strict: self.strict,
            renames,
            max_shard_size,
            layout: match self.layout {
                None => ExpertLayout::Base,
                Some(LayoutArg::Packed) => ExpertLayout::Packed,
                Some(LayoutArg::Original) => ExpertLayout::Original,
            },
            ..PlanOptions::default()
        })
    }
}
