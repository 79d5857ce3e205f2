//! Preparing an operation: open the checkpoint and the base, and plan the merge,
//! writing nothing. `merge` writes the plan; `verify` checks a directory against
//! it; both start here, so neither imports the other.
//!
//! [`Inputs`] is what a plan's tensors point into: every opened input, by
//! [`Origin`].

use std::path::Path;
use std::sync::Arc;

use crate::cancel::Cancel;
use crate::error::{Error, Result};
use crate::hub;
use crate::lora::{self, AdapterOptions, LoraFuse};
use crate::options::{MergeOptions, UnsafePolicy, VerifyOptions};
use crate::plan::conversion::ArchConversion;
use crate::plan::megatron::Megatron;
use crate::plan::torchtitan::Torchtitan;
pub use crate::plan::Inputs;
use crate::plan::{self, BaseView, ExpertLayout, Plan, PlanOptions};
use crate::source::audit::UnsafeCall;
use crate::source::hf_dir::HfDir;
use crate::source::{self, megatron, Checkpoint, OpenOptions};

/// The opened inputs and the plan, ready to write or to verify against.
pub struct Prepared {
    /// The checkpoint, opened.
    pub checkpoint: Checkpoint,
    /// The base, opened.
    pub base: Option<Base>,
    /// The plan.
    pub plan: Plan,
    /// When the checkpoint is a LoRA adapter: how it is fused.
    pub adapter: Option<Arc<LoraFuse>>,
}

impl Prepared {
    /// What the plan's tensors point into.
    pub fn inputs(&self) -> Inputs<'_> {
        Prepared::inputs_of(&self.checkpoint, self.base.as_ref())
    }

    /// [`Prepared::inputs`] from the parts, for a caller that took the struct apart.
    pub fn inputs_of<'a>(checkpoint: &'a Checkpoint, base: Option<&'a Base>) -> Inputs<'a> {
        Inputs {
            checkpoint,
            base: base.and_then(|b| b.weights.as_ref()),
            extra: &[],
        }
    }
}

/// Files a Trainer writes beside the model that are no part of it (by prefix).
const TRAINER_FILES: &[&str] = &[
    "trainer_state.json",
    "training_args",
    "optimizer",
    "scheduler",
    "rng_state",
    "scaler",
    "latest",
    "zero_to_fp32.py",
    "README.md",
];

/// Reads the base directory (if any): config, weights and extra files.
pub struct Base {
    /// The directory: config, tokenizer and other files.
    pub dir: HfDir,
    /// Its weights, when it has any.
    pub weights: Option<Checkpoint>,
    /// `metadata.total_parameters` of its index.
    pub total_parameters: Option<u64>,
}

impl Base {
    /// Opens a base: a model directory, or a Hub model id (`org/name[@rev]`)
    /// found in the local Hugging Face cache ([`crate::hub`]).
    pub fn open(path: &Path) -> Result<Base> {
        // A URL is a store's prefix, never a Hub id or a local path.
        let resolved = if source::fs::is_url(path) {
            None
        } else {
            hub::resolve_base(path)?
        };
        let path = resolved.as_deref().unwrap_or(path);
        if !source::fs::is_dir(path) {
            return Err(Error::plan(
                format!("the base {} is not a directory", path.display()),
                Some("pass the Hugging Face model directory the training started from (config.json, tokenizer, weights), or its Hub id (org/name) if it is in the local Hugging Face cache".into()),
            ));
        }
        let dir = HfDir::open(path)?;
        let weights = dir.weights()?;
        let total_parameters =
            source::fs::read_optional(&path.join("model.safetensors.index.json"))
                .ok()
                .flatten()
                .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
                .and_then(|v| v.get("metadata")?.get("total_parameters")?.as_u64());
        Ok(Base {
            dir,
            weights,
            total_parameters,
        })
    }

    /// The config (and tokenizer files) of a checkpoint directory that carries its
    /// own, as a Trainer's `checkpoint-N/` does: used when no base is given.
    /// Its weights are the checkpoint itself, so none are opened as a base, and
    /// the trainer's own files are not carried into the output.
    pub fn own_config(checkpoint: &Path) -> Result<Option<Base>> {
        if !source::fs::is_file(&checkpoint.join("config.json")) {
            return Ok(None);
        }
        let mut dir = HfDir::open(checkpoint)?;
        dir.extra_files.retain(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default();
            !TRAINER_FILES.iter().any(|t| name.starts_with(t))
        });
        Ok(Some(Base {
            dir,
            weights: None,
            total_parameters: None,
        }))
    }

    /// Whether the directory holds a tokenizer (any of the files transformers and
    /// sentencepiece tokenizers are loaded from).
    pub fn has_tokenizer(&self) -> bool {
        self.dir.extra_files.iter().any(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default();
            name.starts_with("tokenizer") || name == "vocab.json" || name.ends_with(".model")
        })
    }

    /// The base as planning sees it.
    pub fn view(&self) -> BaseView<'_> {
        BaseView {
            config: self.dir.config.as_ref(),
            weights: self.weights.as_ref(),
            total_parameters: self.total_parameters,
        }
    }
}

/// A config-only base derived from a Megatron save's training arguments.
struct Derived {
    /// Its path is the file the arguments were read from.
    base: Base,
    /// What the user should check in the config.
    warnings: Vec<String>,
    /// What the arguments' pickle would run under `torch.load`.
    unsafe_calls: Vec<UnsafeCall>,
}

impl Derived {
    /// The base derived from the training arguments of the Megatron save in
    /// `dir`; `None` when the save holds none.
    fn from_megatron_args(dir: &Path) -> Result<Option<Derived>> {
        let Some(args) = megatron::args::read(dir)? else {
            return Ok(None);
        };
        let config = megatron::config::hf_config(&args)?;
        Ok(Some(Derived {
            base: Base {
                dir: HfDir::config_only(&args.file, config.config),
                weights: None,
                total_parameters: None,
            },
            warnings: config.warnings,
            unsafe_calls: args.unsafe_calls,
        }))
    }
}

/// What to open and how to plan: the part of [`MergeOptions`] and
/// [`VerifyOptions`] that describes the merge.
pub struct Sources<'a> {
    /// The checkpoint.
    pub checkpoint: &'a Path,
    /// The base model directory.
    pub base: Option<&'a Path>,
    /// How to find the tensors in the checkpoint.
    pub open: &'a OpenOptions,
    /// How to plan.
    pub plan: &'a PlanOptions,
    /// How a LoRA adapter input is fused.
    pub adapter: &'a AdapterOptions,
    /// What to do about pickles that would run code.
    pub unsafe_pickles: UnsafePolicy,
    /// Checked once each input is parsed.
    pub cancel: &'a Cancel,
}

impl<'a> From<&'a MergeOptions> for Sources<'a> {
    fn from(o: &'a MergeOptions) -> Self {
        Sources {
            checkpoint: &o.checkpoint,
            base: o.base.as_deref(),
            open: &o.open,
            plan: &o.plan,
            adapter: &o.adapter,
            unsafe_pickles: o.unsafe_pickles,
            cancel: &o.cancel,
        }
    }
}

impl<'a> From<&'a VerifyOptions> for Sources<'a> {
    fn from(o: &'a VerifyOptions) -> Self {
        Sources {
            checkpoint: &o.checkpoint,
            base: o.base.as_deref(),
            open: &o.open,
            plan: &o.plan,
            adapter: &o.adapter,
            unsafe_pickles: o.unsafe_pickles,
            cancel: &o.cancel,
        }
    }
}

/// Opens the checkpoint and the base and plans the merge, writing nothing.
pub fn prepare<'a>(opts: impl Into<Sources<'a>>) -> Result<Prepared> {
    let opts: Sources<'a> = opts.into();
    // A peft adapter (directory, or a checkpoint of a peft-wrapped model) is the
    // checkpoint here, resolved against its config before anything is planned.
    let (mut ckpt, adapter) =
        lora::input::open(opts.checkpoint, opts.base, opts.adapter, opts.open)?;
    // Parsing a checkpoint of thousands of ranks takes a while: stop here if asked.
    opts.cancel.check()?;
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
    let base = match opts.base {
        Some(b) => Some(Base::open(b)?),
        None => match source::config_dir_for(opts.checkpoint) {
            Some(d) => Some(Base::open(&d)?),
            None => Base::own_config(opts.checkpoint)?,
        },
    };
    // A Megatron-Core checkpoint with no config anywhere: derived from the
    // training arguments it holds.
    let (mut base, derived) = match base {
        None if Megatron::names_in(&ckpt) => match Derived::from_megatron_args(&ckpt.path)? {
            Some(d) => {
                // Audited with the checkpoint: the reader may have read the same
                // pickle (a legacy rank file, the DCP's common state) or not
                // (`common.pt`).
                for call in d.unsafe_calls {
                    if !ckpt.unsafe_calls.contains(&call) {
                        ckpt.unsafe_calls.push(call);
                    }
                }
                (Some(d.base), d.warnings)
            }
            None => (None, Vec::new()),
        },
        b => (b, Vec::new()),
    };
    check_unsafe(opts.unsafe_pickles, &ckpt, base.as_ref())?;
    opts.cancel.check()?;
    // A checkpoint in transformers' in-memory layout (packed experts) is written in
    // the layout of the base's files, or the one asked for: the base's tensors are
    // read in that layout first.
    let config = base.as_ref().and_then(|b| b.dir.config.as_ref());
    let conversion = ArchConversion::for_config(config, opts.plan.layout).map(Arc::new);
    let mut layout_note = None;
    if opts.plan.layout != ExpertLayout::Base && conversion.is_none() {
        let mt = config
            .and_then(|c| c.get("model_type")?.as_str())
            .unwrap_or("none");
        layout_note = Some(format!(
            "layout: the base's model_type ({mt}) has no conversion between transformers' in-memory and file layouts: the layout asked for changes nothing"
        ));
    }
    if let (Some(c), Some(w)) = (&conversion, base.as_mut().and_then(|b| b.weights.as_mut())) {
        c.read_base(w)?;
    }
    let view = base.as_ref().map(Base::view).unwrap_or_default();
    let model_type = view
        .config
        .and_then(|c| c.get("model_type"))
        .and_then(|v| v.as_str());
    let adapter = adapter.map(|mut r| {
        r.use_layer_classes(model_type);
        Arc::new(LoraFuse::new(r, opts.adapter.no_fuse))
    });
    let mut plan_opts = opts.plan.clone();
    if let Some(a) = &adapter {
        plan_opts.mappings.insert(0, a.clone());
    }
    // Megatron-Core names and fused layouts become the base's Hugging Face names.
    let megatron = Arc::new(Megatron::for_config(view.config));
    plan_opts.mappings.push(megatron.clone());
    // A torchtitan checkpoint is written under transformers' names of the base.
    let titan = Torchtitan::for_config(view.config).map(Arc::new);
    if let Some(t) = &titan {
        plan_opts.mappings.push(t.clone());
    }
    if let Some(c) = &conversion {
        plan_opts.mappings.push(c.clone());
    }
    let mut plan = plan::plan(&ckpt, view, &[], &plan_opts)?;
    if let Some(a) = &adapter {
        lora::summary::add(a, &ckpt, &mut plan.report)?;
    }
    if let Some(c) = &conversion {
        c.note(&mut plan.report);
    }
    plan.report.notes.extend(layout_note);
    megatron.note(&mut plan.report);
    if let Some(t) = &titan {
        t.note(&mut plan.report);
    }
    // A derived config's warnings say what is missing, the tokenizer included.
    plan.report.warnings.extend(derived.iter().cloned());
    if let Some(b) = base.as_ref().filter(|_| derived.is_empty()) {
        if b.dir.config.is_some() && !b.has_tokenizer() {
            plan.report.warnings.push(format!(
                "{} has no tokenizer files: the output has no tokenizer (copy tokenizer.json and tokenizer_config.json from the model's repository into it)",
                b.dir.path.display()
            ));
        }
    }
    Ok(Prepared {
        checkpoint: ckpt,
        base,
        plan,
        adapter,
    })
}

/// Reports what the checkpoint's and the base's pickles would run under
/// `torch.load`, and refuses them if asked to.
fn check_unsafe(policy: UnsafePolicy, ckpt: &Checkpoint, base: Option<&Base>) -> Result<()> {
    crate::source::audit::apply_policy(policy, &unsafe_calls(ckpt, base))
}

/// What the checkpoint's and the base's pickles would run under `torch.load`
/// (unshard runs none of it): what a merge reports and records in `unshard.json`.
pub fn unsafe_calls(ckpt: &Checkpoint, base: Option<&Base>) -> Vec<UnsafeCall> {
    let mut calls = ckpt.unsafe_calls.clone();
    if let Some(w) = base.and_then(|b| b.weights.as_ref()) {
        calls.extend(w.unsafe_calls.iter().cloned());
    }
    calls
}
