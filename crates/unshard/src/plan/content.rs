//! What a planned tensor holds: a copy of pieces of one input (the engine's fast
//! path), or a value computed from tensors of any inputs.
//!
//! [`Content::Copy`] is what every reader produces and what the block engine
//! streams: each output element is read from the one piece that holds it and
//! converted, with no per-element dispatch. [`Content::Computed`] is an [`Expr`]:
//! a tree whose leaves are tensors of the inputs (the checkpoint, the base, or a
//! further input such as an adapter, by [`Origin`]) and whose nodes rearrange or
//! combine them. The engine evaluates, in float32, the rows of a computed tensor
//! that each block holds (see `write::computed` for the memory bound), and converts
//! them once to the output dtype with the same kernels as a copy. `verify` evaluates
//! the same expression with its own code (`verify::reference`), so an evaluation
//! bug shows up as a mismatch rather than being reproduced.
//!
//! Adding a node (a LoRA `Fuse`, say) touches exactly these places (the compiler
//! points at each, as every `match` on [`Expr`] is exhaustive):
//! 1. a variant of [`Expr`] here, with its arm in [`Expr::shape`] (the shape rule
//!    and its checks) and in [`Expr::leaves`];
//! 2. its evaluation in the engine, `write::computed` (`Computed::rows`: the rows
//!    `[ra, rb)` of the node's value);
//! 3. its reference evaluation in `verify::reference` (`node` and `locate` for a
//!    node that moves elements; an arithmetic node such as `Fuse` computes each
//!    element from its leaves' elements at the traced coordinates there);
//! 4. a test that writes a tensor using it and compares the file with values
//!    computed independently (from the fixture's bytes, or by torch/peft in a
//!    fixture generator), and that verify catches a wrong one
//!    (`crates/unshard/tests/computed.rs`).

use crate::dtype::fuse::Layout;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::TensorSource;

use super::Origin;

/// Where a planned tensor's values come from.
#[derive(Clone, Debug)]
pub enum Content {
    /// The pieces of one input's tensor (of the planned tensor's `origin`),
    /// converted: the block engine's fast path.
    Copy(TensorSource),
    /// A value computed from tensors of the inputs.
    Computed(Expr),
}

/// A tensor of one input: a leaf of an expression.
#[derive(Clone, Debug)]
pub struct Leaf {
    /// Which input's files the pieces point into.
    pub input: Origin,
    /// The tensor, as that input's reader describes it.
    pub source: TensorSource,
}

/// A computed tensor, as a tree over tensors of the inputs. Values are float32
/// while an expression is evaluated, so every leaf must be a floating tensor
/// (checked by [`Expr::shape`]).
#[derive(Clone, Debug)]
pub enum Expr {
    /// A tensor of an input, as its reader describes it.
    Leaf(Leaf),
    /// Parts joined along `dim`; every other dimension is equal.
    Concat {
        /// The dimension joined along.
        dim: usize,
        /// The parts, in order.
        parts: Vec<Expr>,
    },
    /// Output row `i` (along dimension 0) is row `rows[i]` of `input`: a
    /// permutation (each row exactly once).
    PermuteRows {
        /// The input row of each output row.
        rows: Vec<u64>,
        /// The rows' tensor.
        input: Box<Expr>,
    },
    /// Indices `start..start + len` of `input` along `dim` (torch's `narrow`).
    Slice {
        /// The dimension narrowed.
        dim: usize,
        /// The first index kept.
        start: u64,
        /// How many indices are kept.
        len: u64,
        /// The tensor narrowed.
        input: Box<Expr>,
    },
    /// A LoRA / DoRA adapter fused into a 2-D weight, as peft's `merge_and_unload`
    /// computes it: `base + scale * (b @ a)` (the update transposed for
    /// `fan_in_fan_out` and embeddings, see [`Layout`]), then, with a DoRA
    /// `magnitude`, each output channel rescaled to `magnitude / ||row||`
    /// (`crate::dtype::fuse`).
    Fuse {
        /// The weight fused into, `[rows, cols]` as stored.
        base: Box<Expr>,
        /// `[r, ..]`: lora_A (or lora_embedding_A).
        a: Box<Expr>,
        /// `[.., r]`: lora_B (or lora_embedding_B).
        b: Box<Expr>,
        /// DoRA's magnitude, one per output channel.
        magnitude: Option<Box<Expr>>,
        /// `alpha / r` or `alpha / sqrt(r)`, as peft holds it.
        scale: f64,
        /// How the update lies over the weight (linear, Conv1D, embedding).
        layout: Layout,
    },
}

impl Expr {
    /// A leaf of `input`'s tensor `source`.
    pub fn leaf(input: Origin, source: TensorSource) -> Expr {
        Expr::Leaf(Leaf { input, source })
    }

    /// The shape of the value, after checking that every node fits its inputs; the
    /// error names `name`, the tensor being planned.
    pub fn shape(&self, name: &str) -> Result<Vec<u64>> {
        let bad = |msg: String| Error::plan(format!("computed tensor '{name}': {msg}"), None);
        match self {
            Expr::Leaf(l) => {
                if !l.source.dtype.is_float() {
                    return Err(bad(format!(
                        "'{}' is {}; only floating tensors can be computed",
                        l.source.name, l.source.dtype
                    )));
                }
                Ok(l.source.shape.clone())
            }
            Expr::Concat { dim, parts } => {
                let mut shapes = parts.iter().map(|p| p.shape(name));
                let mut out = shapes
                    .next()
                    .ok_or_else(|| bad("a concatenation of nothing".into()))??;
                if *dim >= out.len() {
                    return Err(bad(format!(
                        "cannot concatenate {}-dimensional tensors along dimension {dim}",
                        out.len()
                    )));
                }
                for s in shapes {
                    let s = s?;
                    let fits =
                        s.len() == out.len() && (0..s.len()).all(|d| d == *dim || s[d] == out[d]);
                    if !fits {
                        return Err(bad(format!(
                            "cannot concatenate shapes {out:?} and {s:?} along dimension {dim}"
                        )));
                    }
                    out[*dim] += s[*dim];
                }
                Ok(out)
            }
            Expr::PermuteRows { rows, input } => {
                let s = input.shape(name)?;
                let n = s.first().copied().unwrap_or(0);
                let mut seen = vec![false; usize::try_from(n).unwrap_or(0)];
                let is_perm = rows.len() as u64 == n
                    && rows.iter().all(|&r| {
                        usize::try_from(r)
                            .ok()
                            .and_then(|r| seen.get_mut(r))
                            .is_some_and(|s| !std::mem::replace(s, true))
                    });
                if s.is_empty() || !is_perm {
                    return Err(bad(format!(
                        "the row order is not a permutation of the {n} rows of a {s:?} tensor"
                    )));
                }
                Ok(s)
            }
            Expr::Slice {
                dim,
                start,
                len,
                input,
            } => {
                let mut s = input.shape(name)?;
                let fits = *dim < s.len() && start.checked_add(*len).is_some_and(|e| e <= s[*dim]);
                if !fits {
                    return Err(bad(format!(
                        "indices {start}..{} along dimension {dim} are outside a {s:?} tensor",
                        start.saturating_add(*len)
                    )));
                }
                s[*dim] = *len;
                Ok(s)
            }
            Expr::Fuse {
                base,
                a,
                b,
                magnitude,
                layout,
                ..
            } => {
                let s = base.shape(name)?;
                let (sa, sb) = (a.shape(name)?, b.shape(name)?);
                let [rows, cols] = s[..] else {
                    return Err(bad(format!(
                        "an adapter can only be fused into a 2-D weight, not {s:?}"
                    )));
                };
                let r = sa.first().copied().unwrap_or(0);
                let (want_a, want_b) = layout.factor_shapes(rows, cols, r);
                if sa != want_a || sb != want_b {
                    return Err(bad(format!(
                        "adapter factors {sa:?} and {sb:?} do not fit a {s:?} weight ({layout:?})"
                    )));
                }
                if let Some(m) = magnitude {
                    let sm = m.shape(name)?;
                    let want = [layout.out_channels(rows, cols)];
                    if sm != want {
                        return Err(bad(format!(
                            "DoRA magnitude {sm:?} does not fit a {s:?} weight"
                        )));
                    }
                }
                Ok(s)
            }
        }
    }

    /// The leaves, left to right.
    pub fn leaves(&self) -> Vec<&Leaf> {
        let mut out = Vec::new();
        let mut stack = vec![self];
        while let Some(e) = stack.pop() {
            match e {
                Expr::Leaf(l) => out.push(l),
                Expr::Concat { parts, .. } => stack.extend(parts.iter().rev()),
                Expr::PermuteRows { input, .. } | Expr::Slice { input, .. } => stack.push(input),
                Expr::Fuse {
                    base,
                    a,
                    b,
                    magnitude,
                    ..
                } => {
                    stack.extend(magnitude.as_deref());
                    stack.extend([&**b, &**a, &**base]);
                }
            }
        }
        out
    }

    /// The dtype of the values before conversion: float32, the evaluation dtype.
    pub fn dtype(&self) -> DType {
        DType::F32
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::plan::testing::tensor;

    fn leaf(name: &str, shape: &[u64]) -> Expr {
        Expr::leaf(Origin::Checkpoint, tensor(name, DType::BF16, shape))
    }

    #[test]
    fn shapes_follow_the_nodes_and_misfits_name_the_tensor() {
        let qkv = Expr::Concat {
            dim: 0,
            parts: vec![leaf("q", &[4, 2]), leaf("k", &[2, 2]), leaf("v", &[2, 2])],
        };
        assert_eq!(qkv.shape("qkv").unwrap(), [8, 2]);
        let names: Vec<&str> = qkv
            .leaves()
            .iter()
            .map(|l| l.source.name.as_str())
            .collect();
        assert_eq!(names, ["q", "k", "v"]);
        let k = Expr::Slice {
            dim: 0,
            start: 4,
            len: 2,
            input: Box::new(qkv.clone()),
        };
        assert_eq!(k.shape("k").unwrap(), [2, 2]);
        let p = Expr::PermuteRows {
            rows: vec![1, 0, 3, 2, 5, 4, 7, 6],
            input: Box::new(qkv),
        };
        assert_eq!(p.shape("p").unwrap(), [8, 2]);

        let bad = Expr::Concat {
            dim: 0,
            parts: vec![leaf("q", &[4, 2]), leaf("k", &[2, 3])],
        };
        let e = bad.shape("qkv").unwrap_err().to_string();
        assert!(
            e.starts_with("computed tensor 'qkv': cannot concatenate"),
            "{e}"
        );
        let twice = Expr::PermuteRows {
            rows: vec![0, 0],
            input: Box::new(leaf("w", &[2, 2])),
        };
        assert!(twice
            .shape("w")
            .unwrap_err()
            .to_string()
            .contains("not a permutation"));
        let past = Expr::Slice {
            dim: 1,
            start: 1,
            len: 2,
            input: Box::new(leaf("w", &[2, 2])),
        };
        assert!(past.shape("w").unwrap_err().to_string().contains("outside"));
        let ints = Expr::leaf(Origin::Checkpoint, tensor("steps", DType::I64, &[1]));
        assert!(ints
            .shape("s")
            .unwrap_err()
            .to_string()
            .contains("only floating"));
    }

    #[test]
    fn a_slice_along_a_dimension_the_tensor_lacks_is_refused() {
        let past = Expr::Slice {
            dim: 2,
            start: 0,
            len: 1,
            input: Box::new(leaf("w", &[2, 2])),
        };
        let e = past.shape("w").unwrap_err().to_string();
        assert!(
            e.contains("along dimension 2 are outside a [2, 2] tensor"),
            "{e}"
        );
    }

    #[test]
    fn a_fuse_keeps_the_weight_shape_and_checks_its_factors() {
        let f32s = |name: &str, shape: &[u64]| {
            Expr::leaf(Origin::Checkpoint, tensor(name, DType::F32, shape))
        };
        let fuse = |a: &[u64], b: &[u64], layout| Expr::Fuse {
            base: Box::new(leaf("w", &[6, 4])),
            a: Box::new(f32s("a", a)),
            b: Box::new(f32s("b", b)),
            magnitude: None,
            scale: 2.0,
            layout,
        };
        // nn.Linear: W [out=6, in=4], A [r, in], B [out, r].
        assert_eq!(
            fuse(&[2, 4], &[6, 2], Layout::Linear).shape("w").unwrap(),
            [6, 4]
        );
        // Conv1D: W [in=6, out=4], A [r, in], B [out, r].
        assert_eq!(
            fuse(&[2, 6], &[4, 2], Layout::FanInFanOut)
                .shape("w")
                .unwrap(),
            [6, 4]
        );
        let e = fuse(&[2, 6], &[4, 2], Layout::Linear)
            .shape("w")
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not fit"), "{e}");
        // One factor that does not fit is enough: here lora_B only.
        let e = fuse(&[2, 4], &[4, 2], Layout::Linear)
            .shape("w")
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not fit"), "{e}");
        let with_m = Expr::Fuse {
            base: Box::new(leaf("w", &[6, 4])),
            a: Box::new(f32s("a", &[2, 4])),
            b: Box::new(f32s("b", &[6, 2])),
            // One per output channel would be [6].
            magnitude: Some(Box::new(f32s("m", &[4]))),
            scale: 2.0,
            layout: Layout::Linear,
        };
        assert!(with_m
            .shape("w")
            .unwrap_err()
            .to_string()
            .contains("DoRA magnitude"));
        let linear = fuse(&[2, 4], &[6, 2], Layout::Linear);
        let names: Vec<&str> = linear
            .leaves()
            .iter()
            .map(|l| l.source.name.as_str())
            .collect();
        assert_eq!(names, ["w", "a", "b"]);
    }
}
