//! The mapping stage, between the readers and the planning policies: what output
//! tensors the inputs make.
//!
//! A reader describes the tensors of an input; planning decides which to write,
//! under which dtype and in which file. In between, a [`Mapping`] may rewrite the
//! list of [`Candidate`]s: rename one (the user's renames and the wrapper
//! stripping are the simplest mappings), split one into several (Megatron's fused
//! QKV into q, k and v, with [`Expr::Slice`]), join several into one
//! ([`Expr::Concat`]), reorder one ([`Expr::PermuteRows`], e.g. rotary halves), or
//! compute one from tensors of several inputs (a LoRA adapter fused into the base
//! weight). A mapping sees every input through [`MapInputs`] and never reads tensor
//! bytes: it describes, the engine evaluates.
//!
//! How a LoRA adapter plugs in (the `Fuse` node is the next [`Expr`] variant): the
//! adapter is opened as a further input, `Origin::Input(0)`, and is the checkpoint
//! of the merge or one of [`MapInputs::extra`]. A `LoraFuse` mapping groups, per
//! module path `P`, the adapter's `P.lora_A.weight` (r × in) and `P.lora_B.weight`
//! (out × r) with the base's `P.weight` (out × in), checks the shapes, and replaces
//! the two adapter candidates by one candidate named `P.weight` (in the base's
//! names, after stripping the adapter's `base_model.model.` prefix) whose content is
//! `Computed(Fuse { base: leaf(Base, P.weight), a: leaf(Input(0), A), b:
//! leaf(Input(0), B), scale: alpha / r, dora: None })`. The overlay step then finds
//! `P.weight` in the base with the same shape and writes the fused value in place
//! of the base's; every other base tensor is copied as today.

use std::fmt;

use super::{Content, Expr, Origin};
use crate::dtype::DType;
use crate::error::Result;
use crate::source::{Checkpoint, StorageId, TensorSource};

/// A tensor the output may hold, before the planning policies.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The output name so far.
    pub name: String,
    /// The name of the input tensor it was made from (the first, if several), as
    /// its reader named it: what reports and errors quote.
    pub source_name: String,
    /// The input it is attributed to: a copy's input, or a computed tensor's main one.
    pub origin: Origin,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The dtype of the values before conversion.
    pub dtype: DType,
    /// The storage it views, for tie detection (copies of the checkpoint only).
    pub storage: Option<StorageId>,
    /// Where its values come from.
    pub content: Content,
}

impl Candidate {
    /// A tensor of `origin` copied as it is: what every reader's tensor starts as.
    pub fn copy(origin: Origin, t: &TensorSource) -> Candidate {
        Candidate {
            name: t.name.clone(),
            source_name: t.name.clone(),
            origin,
            shape: t.shape.clone(),
            dtype: t.dtype,
            storage: t.storage.clone(),
            content: Content::Copy(t.clone()),
        }
    }

    /// A copy of part of this candidate's tensor: `t` (pieces of the same input,
    /// rearranged by a mapping) under the output name `name`, quoting the same
    /// source tensor in reports.
    pub fn part(&self, name: String, t: TensorSource) -> Candidate {
        Candidate {
            name,
            source_name: self.source_name.clone(),
            origin: self.origin,
            shape: t.shape.clone(),
            dtype: self.dtype,
            storage: None,
            content: Content::Copy(t),
        }
    }

    /// A tensor computed by `expr`, attributed to `origin`; the expression is
    /// checked and gives the shape.
    pub fn computed(
        name: impl Into<String>,
        source_name: impl Into<String>,
        origin: Origin,
        expr: Expr,
    ) -> Result<Candidate> {
        let name = name.into();
        let shape = expr.shape(&name)?;
        Ok(Candidate {
            name,
            source_name: source_name.into(),
            origin,
            shape,
            dtype: expr.dtype(),
            storage: None,
            content: Content::Computed(expr),
        })
    }
}

/// What a mapping may look at: every opened input.
#[derive(Clone, Copy, Debug, Default)]
pub struct MapInputs<'a> {
    /// The checkpoint being merged.
    pub checkpoint: Option<&'a Checkpoint>,
    /// The base model's weights.
    pub base: Option<&'a Checkpoint>,
    /// Further inputs (an adapter...), `Origin::Input(i)` for `extra[i]`.
    pub extra: &'a [&'a Checkpoint],
}

/// A rewrite of the candidate list: a format's or an architecture's way of naming
/// and arranging tensors, applied in [`super::PlanOptions::mappings`] order after
/// wrapper stripping and the user's renames, before prefix alignment and the
/// planning policies. Errors name the tensor at fault.
pub trait Mapping: fmt::Debug + Send + Sync {
    /// Rewrites `candidates`.
    fn map(&self, candidates: Vec<Candidate>, inputs: MapInputs<'_>) -> Result<Vec<Candidate>>;
}

/// Checks what mappings made: a computed candidate's expression fits together and
/// gives the candidate's shape, so the engine and verify can trust both.
pub(crate) fn check(cands: &[Candidate]) -> Result<()> {
    for c in cands {
        if let Content::Computed(e) = &c.content {
            let shape = e.shape(&c.name)?;
            if shape != c.shape {
                return Err(crate::error::Error::plan(
                    format!(
                        "computed tensor '{}': its expression gives shape {shape:?}, not {:?}",
                        c.name, c.shape
                    ),
                    None,
                ));
            }
        }
    }
    Ok(())
}

/// The candidates of a checkpoint before any mapping: each tensor copied as is.
pub fn candidates(ckpt: &Checkpoint) -> Vec<Candidate> {
    ckpt.tensors
        .iter()
        .map(|t| Candidate::copy(Origin::Checkpoint, t))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::plan::testing::tensor;

    #[test]
    fn a_computed_candidate_whose_shape_is_not_its_expressions_is_refused() {
        // A mapping outside this crate may build a candidate by hand.
        let expr = Expr::Slice {
            dim: 0,
            start: 1,
            len: 2,
            input: Box::new(Expr::leaf(
                Origin::Checkpoint,
                tensor("qkv", DType::F32, &[6, 4]),
            )),
        };
        let good = Candidate::computed("k", "qkv", Origin::Checkpoint, expr).unwrap();
        assert_eq!(good.shape, [2, 4]);
        check(std::slice::from_ref(&good)).unwrap();
        let bad = Candidate {
            shape: vec![4, 2],
            ..good
        };
        let e = check(&[bad]).unwrap_err().to_string();
        assert!(
            e.contains("computed tensor 'k': its expression gives shape [2, 4], not [4, 2]"),
            "{e}"
        );
    }
}
