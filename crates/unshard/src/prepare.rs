//! Preparing an operation: open the checkpoint and the base, and plan the merge,
//! writing nothing. `merge` writes the plan; `verify` checks a directory against
//! it; both start here, so neither imports the other.
//!
//! [`Inputs`] is what a plan's tensors point into: every opened input, by
//! [`Origin`].

use std::path::Path;
use std::sync::Arc;

use crate::cancel::Cancel;
use crate::options::{MergeOptions, VerifyOptions};
use crate::plan::{self, BaseView, Origin, Plan, PlanOptions};
use crate::source::hf_dir::HfDir;
use crate::source::{self, Blob, Checkpoint, OpenOptions};
use crate::{Error, Result};

/// The opened inputs and the plan, ready to write or to verify against.
pub struct Prepared {
    /// The checkpoint, opened.
    pub checkpoint: Checkpoint,
    /// The base, opened.
    pub base: Option<Base>,
    /// The plan.
    pub plan: Plan,
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

/// The inputs a plan's tensors point into, by [`Origin`].
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// The checkpoint.
    pub checkpoint: &'a Checkpoint,
    /// The base's weights.
    pub base: Option<&'a Checkpoint>,
    /// Further inputs (an adapter...): `Origin::Input(i)` is `extra[i]`.
    pub extra: &'a [&'a Checkpoint],
}

impl<'a> Inputs<'a> {
    /// The input a tensor comes from, if it was opened.
    pub fn get(&self, origin: Origin) -> Option<&'a Checkpoint> {
        match origin {
            Origin::Checkpoint => Some(self.checkpoint),
            Origin::Base => self.base,
            Origin::Input(i) => self.extra.get(i).copied(),
        }
    }

    /// The files of the input a tensor comes from (none if it was not opened:
    /// reading a piece then names the missing file).
    pub fn files(&self, origin: Origin) -> &'a [Arc<Blob>] {
        self.get(origin).map_or(&[], |c| &c.files)
    }

    /// Every opened input.
    pub fn all(&self) -> impl Iterator<Item = &'a Checkpoint> {
        std::iter::once(self.checkpoint)
            .chain(self.base)
            .chain(self.extra.iter().copied())
    }
}

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
    /// Opens a base model directory.
    pub fn open(path: &Path) -> Result<Base> {
        if !source::fs::is_dir(path) {
            return Err(Error::plan(
                format!("the base {} is not a directory", path.display()),
                Some("pass the Hugging Face model directory the training started from (config.json, tokenizer, weights)".into()),
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

    /// The base as planning sees it.
    pub fn view(&self) -> BaseView<'_> {
        BaseView {
            config: self.dir.config.as_ref(),
            weights: self.weights.as_ref(),
            total_parameters: self.total_parameters,
        }
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
            cancel: &o.cancel,
        }
    }
}

/// Opens the checkpoint and the base and plans the merge, writing nothing.
pub fn prepare<'a>(opts: impl Into<Sources<'a>>) -> Result<Prepared> {
    let opts: Sources<'a> = opts.into();
    let ckpt = source::open(opts.checkpoint, opts.open)?;
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
        None => source::config_dir_for(opts.checkpoint)
            .map(|d| Base::open(&d))
            .transpose()?,
    };
    opts.cancel.check()?;
    let view = base.as_ref().map(Base::view).unwrap_or_default();
    let plan = plan::plan(&ckpt, view, &[], opts.plan)?;
    Ok(Prepared {
        checkpoint: ckpt,
        base,
        plan,
    })
}
