//! The merge plan: what to write, and why.
//!
//! Planning is pure. It takes descriptions (the checkpoint's tensors, the base's
//! config and tensors) and options, and returns a [`Plan`] — every output tensor
//! with its source and output dtype, the shard layout, the new config — plus a
//! [`Report`] of every renamed, dropped, base-filled, cast or tied tensor. Or it
//! returns an error naming the offending tensors. Nothing is written before a plan
//! is complete and valid, so bad input costs no disk and leaves nothing behind.
//!
//! [`plan`] runs one function per step, each in the file named after its job and
//! each unit-tested on checkpoints built in memory:
//! 1. [`names`]: strip the wrapper components FSDP, activation checkpointing,
//!    torch.compile and DDP insert; apply the user's renames; align a constant
//!    prefix difference with the base's names; refuse two tensors with one name.
//! 2. [`keep`]: drop known non-persistent buffers (recomputed by transformers) and
//!    a tied output head (written once, as transformers does).
//!    Before overlaying, [`layout`] refuses zero-element placeholders.
//! 3. [`overlay`]: the checkpoint's tensors over the base's tensor set; a name the
//!    base lacks or a shape that differs is an error, a base tensor the checkpoint
//!    lacks is copied from the base (an error with `strict`).
//!    Without base weights, [`layout`] checks names and shapes against what the
//!    config calls for (and step 1 aligns a prefix with those names).
//! 4. [`cast`]: the output dtype of each floating tensor (fixed, or the base's),
//!    and the config with its dtype key updated.
//! 5. [`shard`](mod@shard): split into shard files as huggingface_hub does and lay out each
//!    file's header; the index when there is more than one shard.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use regex::Regex;
use serde_json::{Map, Value};

use crate::dtype::DType;
use crate::error::Result;
use crate::source::{Checkpoint, TensorSource};

pub mod cast;
pub mod content;
pub mod conversion;
mod inputs;
pub mod keep;
pub mod layout;
pub mod mapping;
pub mod megatron;
pub mod names;
pub mod overlay;
pub mod shard;
pub mod torchtitan;

pub use content::{Content, Expr, Leaf};
pub use inputs::Inputs;
pub use mapping::{Candidate, MapInputs, Mapping};

#[cfg(feature = "internals")]
pub use cast::config_dtype_of;
#[cfg(feature = "internals")]
pub use keep::is_nonpersistent_buffer;
pub use names::{natural_cmp, strip_wrappers};
#[cfg(feature = "internals")]
pub use shard::shard;

/// The dtype the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DtypeChoice {
    /// The base config's dtype, else the base weights', else the checkpoint's.
    #[default]
    Auto,
    /// This dtype for every floating tensor.
    Fixed(DType),
}

/// Which layout a mixture-of-experts model's expert tensors are written in, for
/// a model type transformers converts (`arch/conversions.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// The layout of the base's files (per expert unless the base holds packed
    /// tensors); without base weights, the files' per-expert layout.
    #[default]
    Base,
    /// transformers' in-memory layout, what `model.state_dict()` holds: every
    /// expert of a layer stacked in one tensor, gate and up concatenated.
    Packed,
    /// The files' layout `save_pretrained` writes: one tensor per expert and
    /// projection.
    Original,
}

/// Why a rename rule could not be read (see [`parse_rename`]).
#[derive(Debug)]
pub enum RenameError {
    /// No `=` between the expression and its replacement.
    MissingEquals,
    /// The part before the first `=` is not a regular expression.
    Regex(regex::Error),
}

/// Reads a rename rule `REGEX=REPLACEMENT` (split at the first `=`; `$1` in the
/// replacement names a group): the one syntax every front end accepts.
pub fn parse_rename(rule: &str) -> std::result::Result<(Regex, String), RenameError> {
    let (re, rep) = rule.split_once('=').ok_or(RenameError::MissingEquals)?;
    let re = Regex::new(re).map_err(RenameError::Regex)?;
    Ok((re, rep.to_string()))
}

/// Options that shape a plan.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// The dtype of the floating tensors written.
    pub dtype: DtypeChoice,
    /// Base-only tensors are an error instead of a note.
    pub strict: bool,
    /// `--rename REGEX=REPLACEMENT`, applied in order after prefix stripping.
    pub renames: Vec<(Regex, String)>,
    /// Largest shard, in bytes.
    pub max_shard_size: u64,
    /// Format or architecture mappings, applied in order after the renames.
    pub mappings: Vec<Arc<dyn Mapping>>,
    /// The layout of expert tensors written.
    pub layout: ExpertLayout,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            dtype: DtypeChoice::Auto,
            strict: false,
            renames: Vec::new(),
            max_shard_size: 5_000_000_000,
            mappings: Vec::new(),
            layout: ExpertLayout::Base,
        }
    }
}

/// The base model as planning sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct BaseView<'a> {
    /// Its config.json.
    pub config: Option<&'a Map<String, Value>>,
    /// Its weights, when it has any.
    pub weights: Option<&'a Checkpoint>,
    /// `metadata.total_parameters` of the base's index, if it has one.
    pub total_parameters: Option<u64>,
}

/// Which input a tensor comes from. The set is open: an operation that reads more
/// than a checkpoint and a base (an adapter...) passes them as further inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The checkpoint being merged.
    Checkpoint,
    /// The base model.
    Base,
    /// The further input at this position of `Inputs::extra`.
    Input(usize),
}

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    /// Output name.
    pub name: String,
    /// The input it comes from (a computed tensor's main input).
    pub origin: Origin,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The dtype of the values before conversion: the stored dtype of a copy,
    /// float32 for a computed tensor.
    pub source_dtype: DType,
    /// The dtype written.
    pub dtype: DType,
    /// Where its values come from.
    pub content: Content,
}

impl PlannedTensor {
    /// The planned form of a candidate, written in its own dtype until the dtype
    /// policy says otherwise.
    pub fn from_candidate(c: Candidate) -> PlannedTensor {
        PlannedTensor {
            name: c.name,
            origin: c.origin,
            shape: c.shape,
            source_dtype: c.dtype,
            dtype: c.dtype,
            content: c.content,
        }
    }

    /// Elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes written.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }

    /// The pieces the engine copies, for a tensor that is a copy.
    pub fn copied(&self) -> Option<&TensorSource> {
        match &self.content {
            Content::Copy(s) => Some(s),
            Content::Computed(_) => None,
        }
    }
}

/// One output file: which tensors, where.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    /// Its name in the output directory.
    pub file_name: String,
    /// The serialized header including the 8-byte length prefix and padding.
    pub header: Vec<u8>,
    /// `(tensor index into Plan::tensors, byte offset of its data in the file)`,
    /// in header (file) order.
    pub entries: Vec<(usize, u64)>,
    /// Total file size.
    pub file_size: u64,
}

/// What planning decided, for the user.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `(old name, new name)`.
    pub renamed: Vec<(String, String)>,
    /// `(name, reason)`.
    pub dropped: Vec<(String, String)>,
    /// Base tensors the checkpoint does not have.
    pub from_base: Vec<String>,
    /// Tensors whose dtype changes: `(from, to, count)`.
    pub casts: Vec<(DType, DType, usize)>,
    /// Decisions worth knowing (a prefix aligned with the base's names...).
    pub notes: Vec<String>,
    /// Things that may be wrong with the result (no config...).
    pub warnings: Vec<String>,
}

/// Everything the writer needs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Every tensor to write, in natural name order.
    pub tensors: Vec<PlannedTensor>,
    /// Every file to write.
    pub shards: Vec<ShardPlan>,
    /// The dtype written into config.json (the first floating tensor's).
    pub dtype: Option<DType>,
    /// The config to write, dtype updated; `None` when there is no config at all.
    pub config: Option<Map<String, Value>>,
    /// `model.safetensors.index.json`, when there is more than one shard.
    pub index: Option<String>,
    /// Bytes of tensor data.
    pub total_size: u64,
    /// What planning decided, for the user.
    pub report: Report,
}

/// Builds the plan for merging `ckpt` onto `base`; `extra` are further inputs
/// (`Origin::Input(i)`) the mappings may draw on.
pub fn plan(
    ckpt: &Checkpoint,
    base: BaseView<'_>,
    extra: &[&Checkpoint],
    opts: &PlanOptions,
) -> Result<Plan> {
    cast::refuse_quantized_base(base.config)?;
    let mut report = Report::default();
    let base_names: Option<HashSet<&str>> = base
        .weights
        .map(|w| w.tensors.iter().map(|t| t.name.as_str()).collect());
    let base_map: Option<HashMap<&str, &TensorSource>> = base
        .weights
        .map(|w| w.tensors.iter().map(|t| (t.name.as_str(), t)).collect());

    let expected = layout::expected_layout(base, &mut report);

    let mut cands = mapping::candidates(ckpt);
    names::rename(&mut cands, &opts.renames);
    let inputs = MapInputs {
        checkpoint: Some(ckpt),
        base: base.weights,
        extra,
    };
    for m in &opts.mappings {
        cands = m.map(cands, inputs)?;
    }
    mapping::check(&cands)?;
    let mut names: Vec<String> = cands.iter().map(|c| c.name.clone()).collect();
    if let Some(bn) = &base_names {
        names::align_with_base(&mut names, bn, "the base's names", &mut report);
    } else if let Some(e) = &expected {
        let target = format!("the {} layout of config.json", e.family.class);
        names::align_with_base(&mut names, &layout::expected_names(e), &target, &mut report);
    }
    names::record_renames(&cands, &names, &mut report);
    names::check_duplicates(&cands, &names)?;

    let mut keep = keep::drop_buffers(&names, base_map.as_ref(), &mut report);
    keep::drop_tied_head(
        &cands,
        &names,
        base_map.as_ref(),
        base.config,
        &mut keep,
        &mut report,
    );

    layout::check_placeholders(&cands, &names, &keep, base_map.as_ref(), expected.as_ref())?;

    let mut tensors = overlay::overlay(
        cands,
        &names,
        &keep,
        base.weights.zip(base_map.as_ref()),
        opts.strict,
        &mut report,
    )?;

    if let Some(e) = &expected {
        let shape_hint = crate::source::hf_sharded::shape_hint(ckpt);
        layout::check_against_config(&tensors, e, shape_hint)?;
    }

    cast::apply_dtype_policy(&mut tensors, base, opts.dtype)?;
    report.casts = cast::count_casts(&tensors);
    let out_dtype = cast::model_dtype(&tensors);
    let config = cast::output_config(base.config, out_dtype, base.weights.is_some(), &mut report);

    // transformers (v5) sorts the state dict by natural key before splitting it, so
    // shards group tensors as its output does.
    tensors.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    let (shards, total_size) = shard::shard(&tensors, opts.max_shard_size);
    let index = (shards.len() > 1).then(|| {
        let params = shard::total_parameters(&tensors, base, base_names.as_ref());
        shard::index_json(&tensors, &shards, total_size, params)
    });
    Ok(Plan {
        tensors,
        shards,
        dtype: out_dtype,
        config,
        index,
        total_size,
        report,
    })
}

/// Checkpoints built in memory for the steps' tests: tensors with names, dtypes
/// and shapes, and no files.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;

    use crate::dtype::DType;
    use crate::source::{Checkpoint, Format, StorageId, TensorSource};

    /// A described tensor with no pieces.
    pub fn tensor(name: &str, dtype: DType, shape: &[u64]) -> TensorSource {
        TensorSource {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces: Vec::new().into(),
            storage: None,
            layout: None,
        }
    }

    /// The same tensor, viewing storage `key` (for tie detection).
    pub fn sharing(mut t: TensorSource, key: &str) -> TensorSource {
        t.storage = Some(StorageId {
            file: 0,
            key: key.into(),
        });
        t
    }

    /// A checkpoint of `tensors`.
    pub fn checkpoint(path: &str, tensors: Vec<TensorSource>) -> Checkpoint {
        Checkpoint {
            format: Format::TorchZip,
            path: PathBuf::from(path),
            files: Vec::new(),
            key: None,
            tensors,
            extras: Vec::new(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        }
    }

    /// float32 tensors of the given names and shapes.
    pub fn f32s(named: &[(&str, &[u64])]) -> Vec<TensorSource> {
        named
            .iter()
            .map(|(n, s)| tensor(n, DType::F32, s))
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::testing::*;
    use super::*;

    fn config(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_checkpoint_alone_keeps_its_names_dtypes_and_warns_of_no_config() {
        let ckpt = checkpoint(
            "c",
            f32s(&[("_orig_mod.b.weight", &[2]), ("a.weight", &[3, 2])]),
        );
        let p = plan(&ckpt, BaseView::default(), &[], &PlanOptions::default()).unwrap();
        let names: Vec<&str> = p.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a.weight", "b.weight"]);
        assert_eq!(p.dtype, Some(DType::F32));
        assert!(p.config.is_none() && p.report.warnings.len() == 1);
        assert_eq!(p.shards.len(), 1);
        assert_eq!(p.total_size, 4 * 8);
    }

    #[test]
    fn an_index_is_written_only_for_more_than_one_shard() {
        // Two float32 tensors of 16 bytes each.
        let ckpt = checkpoint("c", f32s(&[("a.weight", &[4]), ("b.weight", &[4])]));
        let one = plan(&ckpt, BaseView::default(), &[], &PlanOptions::default()).unwrap();
        assert_eq!(one.shards.len(), 1);
        assert!(one.index.is_none());
        let opts = PlanOptions {
            max_shard_size: 16,
            ..PlanOptions::default()
        };
        let two = plan(&ckpt, BaseView::default(), &[], &opts).unwrap();
        assert_eq!(two.shards.len(), 2);
        let index = two.index.unwrap();
        assert!(
            index.contains("\"b.weight\": \"model-00002-of-00002.safetensors\""),
            "{index}"
        );
    }

    #[test]
    fn a_copy_exposes_its_pieces_and_a_computed_tensor_none() {
        let t = testing::tensor("w", DType::F32, &[2, 2]);
        let copy = PlannedTensor::from_candidate(Candidate::copy(Origin::Checkpoint, &t));
        assert_eq!(copy.copied().map(|s| s.name.as_str()), Some("w"));
        let expr = Expr::leaf(Origin::Checkpoint, t);
        let computed = Candidate::computed("v", "w", Origin::Checkpoint, expr).unwrap();
        assert!(PlannedTensor::from_candidate(computed).copied().is_none());
    }

    #[test]
    fn a_base_gives_names_dtype_config_and_missing_tensors() {
        let ckpt = checkpoint("c", f32s(&[("layers.0.w", &[4])]));
        let base_w = checkpoint(
            "b",
            vec![
                testing::tensor("model.layers.0.w", DType::BF16, &[4]),
                testing::tensor("model.norm.w", DType::BF16, &[4]),
            ],
        );
        let cfg = config(r#"{"torch_dtype": "float32", "text_config": {"dtype": "float32"}}"#);
        let base = BaseView {
            config: Some(&cfg),
            weights: Some(&base_w),
            total_parameters: None,
        };
        let p = plan(&ckpt, base, &[], &PlanOptions::default()).unwrap();
        assert_eq!(p.report.from_base, ["model.norm.w"]);
        assert_eq!(p.report.casts, [(DType::F32, DType::BF16, 1)]);
        let c = p.config.unwrap();
        assert_eq!(c["torch_dtype"], "bfloat16");
        assert_eq!(c["text_config"]["dtype"], "bfloat16");
        assert!(!c.contains_key("dtype"));
    }
}
