//! The reference evaluation of a computed tensor, for `verify`: deliberately
//! unlike the engine's (`write::computed`), which copies whole rows and blocks.
//! Here every output element is traced by its coordinates down the expression to
//! the one leaf element it comes from, and leaves are read with verify's own
//! gather. Values are float32, as the engine evaluates them, converted to the
//! output dtype with the shared kernels (tested bit for bit against torch).
//!
//! Memory: every leaf of the tensor in float32, and the tensor twice (float32 and
//! its output dtype).

use crate::dtype;
use crate::plan::Expr;
use crate::prepare::Inputs;
use crate::{DType, Error, Result};

use super::gather::{gather, GatherBufs};

/// An expression with what tracing an element needs computed once.
enum Node<'e> {
    /// Index into the leaves, with the leaf's shape.
    Leaf(usize, &'e [u64]),
    /// `ends[k]`: one past the last index along `dim` that part `k` holds.
    Concat {
        dim: usize,
        ends: Vec<u64>,
        parts: Vec<Node<'e>>,
    },
    Permute {
        rows: &'e [u64],
        input: Box<Node<'e>>,
    },
    Slice {
        dim: usize,
        start: u64,
        input: Box<Node<'e>>,
    },
}

/// The expected bytes of a computed tensor of shape `shape`, in dtype `to`.
pub(crate) fn expected(e: &Expr, shape: &[u64], to: DType, inputs: Inputs<'_>) -> Result<Vec<u8>> {
    let mut leaves = Vec::new();
    let root = node(e, &mut leaves)?;
    let mut values: Vec<Vec<u8>> = Vec::with_capacity(leaves.len());
    let mut bufs = GatherBufs::default();
    for l in &leaves {
        let n = l.source.numel();
        let mut raw = vec![0u8; n as usize * 4];
        gather(
            &l.source,
            inputs.files(l.input),
            DType::F32,
            0,
            n,
            &mut raw,
            &mut bufs,
        )?;
        values.push(raw);
    }
    let n: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(n as usize * 4);
    let mut idx = vec![0u64; shape.len()];
    for i in 0..n {
        // Coordinates of element i, C order.
        let mut r = i;
        for (x, &d) in idx.iter_mut().zip(shape).rev() {
            *x = r % d.max(1);
            r /= d.max(1);
        }
        let (k, leaf_shape) = locate(&root, &mut idx);
        let flat = idx
            .iter()
            .zip(leaf_shape)
            .fold(0u64, |acc, (&x, &d)| acc * d + x) as usize;
        let v = values[k].get(flat * 4..flat * 4 + 4).ok_or_else(|| {
            Error::plan(
                format!("computed tensor: element {i} traces outside the tensor it comes from"),
                None,
            )
        })?;
        out.extend_from_slice(v);
    }
    let mut converted = vec![0u8; n as usize * to.size()];
    dtype::convert(&out, DType::F32, &mut converted, to);
    Ok(converted)
}

fn node<'e>(e: &'e Expr, leaves: &mut Vec<&'e crate::plan::Leaf>) -> Result<Node<'e>> {
    Ok(match e {
        Expr::Leaf(l) => {
            leaves.push(l);
            Node::Leaf(leaves.len() - 1, &l.source.shape)
        }
        Expr::Concat { dim, parts } => {
            let mut ends = Vec::with_capacity(parts.len());
            let mut at = 0;
            for p in parts {
                let s = p.shape("?")?;
                at += s.get(*dim).ok_or_else(|| {
                    Error::plan("a concatenation along a missing dimension", None)
                })?;
                ends.push(at);
            }
            Node::Concat {
                dim: *dim,
                ends,
                parts: parts
                    .iter()
                    .map(|p| node(p, leaves))
                    .collect::<Result<_>>()?,
            }
        }
        Expr::PermuteRows { rows, input } => Node::Permute {
            rows,
            input: Box::new(node(input, leaves)?),
        },
        Expr::Slice {
            dim, start, input, ..
        } => Node::Slice {
            dim: *dim,
            start: *start,
            input: Box::new(node(input, leaves)?),
        },
    })
}

/// The leaf (index and shape) that holds the element at `idx`; `idx` becomes its
/// coordinates in that leaf.
fn locate<'e>(n: &Node<'e>, idx: &mut [u64]) -> (usize, &'e [u64]) {
    match n {
        Node::Leaf(k, shape) => (*k, shape),
        Node::Concat { dim, ends, parts } => {
            let k = ends.partition_point(|&e| e <= idx[*dim]);
            if k > 0 {
                idx[*dim] -= ends[k - 1];
            }
            locate(&parts[k.min(parts.len() - 1)], idx)
        }
        Node::Permute { rows, input } => {
            idx[0] = rows[idx[0] as usize];
            locate(input, idx)
        }
        Node::Slice { dim, start, input } => {
            idx[*dim] += start;
            locate(input, idx)
        }
    }
}
