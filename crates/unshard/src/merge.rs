//! `merge`: open, plan, write, commit. The one entry point the binary calls.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::plan::{self, BaseView, Plan, PlanOptions};
use crate::scan::UnsafeCall;
use crate::source::hf_dir::HfDir;
use crate::source::{self, Checkpoint, OpenOptions};
use crate::verify::{self, VerifyReport};
use crate::write::{self, Inputs, Progress, WriteOptions, WriteSummary};
use crate::{Error, Result};

/// Everything `unshard merge` takes.
#[derive(Clone, Debug, Default)]
pub struct MergeOptions {
    pub checkpoint: PathBuf,
    pub base: Option<PathBuf>,
    pub output: PathBuf,
    pub open: OpenOptions,
    pub plan: PlanOptions,
    pub force: bool,
    pub allow_overflow: bool,
    /// Read the written output back and verify it before moving it into place.
    pub verify: bool,
    /// NaN or inf in the output is an error instead of a warning.
    pub fail_on_nonfinite: bool,
    /// Refuse, writing nothing, if a pickle read would run code under `torch.load`.
    pub refuse_unsafe: bool,
    /// Told what the pickles read would run, as soon as the inputs are read (before
    /// any refusal), so that the user hears of it even if the merge then fails.
    pub on_unsafe: Option<fn(&[UnsafeCall])>,
}

/// What a merge did.
#[derive(Debug)]
pub struct MergeOutcome {
    pub plan: Plan,
    pub write: WriteSummary,
    pub checkpoint_format: source::Format,
    pub checkpoint_key: Option<String>,
    pub checkpoint_notes: Vec<String>,
    /// Where the config came from, if not from `--base`.
    pub config_from: Option<PathBuf>,
    /// What `--verify` found (always a pass: a failure is an error).
    pub verified: Option<VerifyReport>,
    pub elapsed: Duration,
}

/// Reads the base directory (if any): config, weights and extra files.
pub struct Base {
    pub dir: HfDir,
    pub weights: Option<Checkpoint>,
    pub total_parameters: Option<u64>,
}

impl Base {
    pub fn open(path: &Path) -> Result<Base> {
        if !path.is_dir() {
            return Err(Error::plan(
                format!("--base {} is not a directory", path.display()),
                Some("pass the Hugging Face model directory the training started from (config.json, tokenizer, weights)".into()),
            ));
        }
        let dir = HfDir::open(path)?;
        let weights = dir.weights()?;
        let total_parameters = std::fs::read_to_string(path.join("model.safetensors.index.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("metadata")?.get("total_parameters")?.as_u64());
        Ok(Base {
            dir,
            weights,
            total_parameters,
        })
    }

    pub fn view(&self) -> BaseView<'_> {
        BaseView {
            config: self.dir.config.as_ref(),
            weights: self.weights.as_ref(),
            total_parameters: self.total_parameters,
        }
    }
}

/// Opens the checkpoint and the base and plans the merge, writing nothing.
pub fn prepare(opts: &MergeOptions) -> Result<(Checkpoint, Option<Base>, Plan)> {
    let ckpt = source::open(&opts.checkpoint, &opts.open)?;
    let local = ckpt.tensors.iter().find(|t| {
        t.layout
            .as_deref()
            .is_some_and(|l| l.contains(source::torch::LOCAL_SHARD))
    });
    if let Some(t) = local {
        return Err(Error::plan(
            format!(
                "{} holds one rank's shard of distributed tensors (e.g. '{}', local shape {:?}), not the whole model",
                opts.checkpoint.display(),
                t.name,
                t.shape
            ),
            Some("pass the directory that holds every rank's file; unshard reassembles them".into()),
        ));
    }
    let base = match &opts.base {
        Some(b) => Some(Base::open(b)?),
        None => source::config_dir_for(&opts.checkpoint)
            .map(|d| Base::open(&d))
            .transpose()?,
    };
    check_unsafe(opts, &ckpt, base.as_ref())?;
    let view = base.as_ref().map(Base::view).unwrap_or_default();
    let plan = plan::plan(&ckpt, view, &opts.plan)?;
    Ok((ckpt, base, plan))
}

/// Reports what the checkpoint's and the base's pickles would run under
/// `torch.load`, and refuses them if asked to.
fn check_unsafe(opts: &MergeOptions, ckpt: &Checkpoint, base: Option<&Base>) -> Result<()> {
    let mut calls: Vec<UnsafeCall> = ckpt.unsafe_calls.clone();
    if let Some(w) = base.and_then(|b| b.weights.as_ref()) {
        calls.extend(w.unsafe_calls.iter().cloned());
    }
    let Some(first) = calls.first() else {
        return Ok(());
    };
    if let Some(report) = opts.on_unsafe {
        report(&calls);
    }
    if opts.refuse_unsafe {
        return Err(Error::Unsafe {
            path: first.path.clone(),
            calls: calls.iter().map(|c| c.callable.clone()).collect(),
        });
    }
    Ok(())
}

/// Runs a whole merge.
pub fn merge(opts: &MergeOptions, progress: &dyn Progress) -> Result<MergeOutcome> {
    let started = Instant::now();
    let mut protected = vec![opts.checkpoint.clone()];
    protected.extend(opts.base.clone());
    let wopts = WriteOptions {
        force: opts.force,
        allow_overflow: opts.allow_overflow,
        extra_files: Vec::new(),
        protected,
    };
    // Output problems are cheap to find: report them before reading anything.
    let cleaned = write::check_output(&opts.output, &wopts)?;
    // A checkpoint of thousands of ranks takes seconds to open: say what is going on.
    progress.stage(&format!("reading {}", opts.checkpoint.display()));
    let (ckpt, base, mut plan) = prepare(opts)?;
    let wopts = WriteOptions {
        extra_files: base
            .as_ref()
            .map(|b| b.dir.extra_files.clone())
            .unwrap_or_default(),
        ..wopts
    };
    let staging = write::create_staging(&opts.output)?;
    let inputs = Inputs {
        checkpoint: &ckpt,
        base: base.as_ref().and_then(|b| b.weights.as_ref()),
    };
    if let Some(n) = verify::unchanged_from_base(&plan, inputs)? {
        plan.report.warnings.push(format!(
            "all {n} checkpoint tensor(s) equal the base's after conversion: the output is the base model again (an adapter-only export, or a checkpoint saved before training changed anything?)"
        ));
    }
    let mut summary = write::write_into(&plan, inputs, &staging.path, &wopts, progress)?;
    summary.cleaned = cleaned;
    if opts.fail_on_nonfinite {
        verify::check_finite(&plan, &summary.stats)?;
    }
    let verified = if opts.verify {
        verify::drop_cached(&staging.path, &plan);
        let report = verify::verify_dir(&staging.path, &plan, inputs, &write::NoProgress)?;
        if !report.is_ok() {
            return Err(report.to_error());
        }
        Some(report)
    } else {
        None
    };
    write::commit(staging, &opts.output)?;
    let config_from = match (&opts.base, &base) {
        (None, Some(b)) => Some(b.dir.path.clone()),
        _ => None,
    };
    Ok(MergeOutcome {
        plan,
        write: summary,
        checkpoint_format: ckpt.format,
        checkpoint_key: ckpt.key.clone(),
        checkpoint_notes: ckpt.notes.clone(),
        config_from,
        verified,
        elapsed: started.elapsed(),
    })
}

/// Parses a shard size: `5GB` (decimal, as transformers), `500MiB` (binary), or bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let units: [(&str, u64); 9] = [
        ("TIB", 1 << 40),
        ("GIB", 1 << 30),
        ("MIB", 1 << 20),
        ("KIB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ];
    for (u, m) in units {
        if let Some(num) = upper.strip_suffix(u) {
            let num = num.trim();
            if let Ok(n) = num.parse::<u64>() {
                return n.checked_mul(m);
            }
            let f: f64 = num.parse().ok()?;
            if !(f.is_finite() && f >= 0.0) {
                return None;
            }
            return Some((f * m as f64) as u64);
        }
    }
    upper.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_decimal_unless_binary_units_are_given() {
        assert_eq!(parse_size("5GB"), Some(5_000_000_000));
        assert_eq!(parse_size("200KB"), Some(200_000));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("1.5MB"), Some(1_500_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("five"), None);
        assert_eq!(parse_size("-1GB"), None);
    }
}
