//! Argument groups that several subcommands share, declared once and pulled in
//! with `#[command(flatten)]`, so a flag is spelled, documented and parsed the
//! same way everywhere.

use std::path::PathBuf;

use clap::ValueEnum;
use unshard::merge;
use unshard::plan::{DtypeChoice, PlanOptions};
use unshard::{DType, Error};

/// `--key`: where the state dict sits inside a pickle.
#[derive(clap::Args, Debug)]
pub struct KeyArg {
    /// Dotted path of the state dict inside the pickle (e.g. `state`, `model.module`).
    /// By default unshard finds it.
    #[arg(long, value_name = "PATH")]
    pub key: Option<String>,
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

/// The options that decide what a merge writes, shared by `merge` (which writes
/// it) and `verify` (which re-derives it: pass the same values).
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The Hugging Face model directory training started from: supplies config.json,
    /// tokenizer files, the dtype, and any weights the checkpoint lacks.
    #[arg(long, value_name = "DIR")]
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
}

impl PlanArgs {
    /// The library's plan options; a malformed size or rename is a usage error.
    pub fn plan_options(&self) -> Result<PlanOptions, Error> {
        let size = &self.max_shard_size;
        let max_shard_size = merge::parse_size(size).filter(|&s| s > 0).ok_or_else(|| {
            Error::Usage(format!(
                "--max-shard-size '{size}' is not a size (examples: 5GB, 500MB, 2GiB)"
            ))
        })?;
        let mut renames = Vec::new();
        for r in &self.rename {
            let (re, rep) = r
                .split_once('=')
                .ok_or_else(|| Error::Usage(format!("--rename '{r}' must be REGEX=REPLACEMENT")))?;
            let re = regex::Regex::new(re).map_err(|e| {
                Error::Usage(format!("--rename '{r}': invalid regular expression: {e}"))
            })?;
            renames.push((re, rep.to_string()));
        }
        let dtype = match self.dtype {
            DtypeArg::Auto => DtypeChoice::Auto,
            DtypeArg::Float16 => DtypeChoice::Fixed(DType::F16),
            DtypeArg::Bfloat16 => DtypeChoice::Fixed(DType::BF16),
            DtypeArg::Float32 => DtypeChoice::Fixed(DType::F32),
        };
        Ok(PlanOptions {
            dtype,
            strict: self.strict,
            renames,
            max_shard_size,
            ..PlanOptions::default()
        })
    }
}
