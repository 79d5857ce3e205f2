//! Computed tensors ([`Content::Computed`]): each is evaluated whole, in float32,
//! one tensor at a time, then converted once to its output dtype with the same
//! kernels as a copy, and written at its place in its shard.
//!
//! Memory: evaluating a node holds its own float32 values and, while it is built,
//! those of the one child being evaluated (a concatenation copies each part in and
//! drops it before the next). So a computed tensor costs at most (depth of its
//! expression + 1) × 4 bytes × the elements of the largest tensor in it, plus the
//! tensor once in its output dtype: for the usual remaps (a concatenation of
//! leaves, a permuted or narrowed leaf), twice the largest tensor in float32 and
//! one copy in the output dtype. Only one computed tensor is in memory at a time.
//!
//! The block engine runs first and leaves the bytes of computed tensors zero; this
//! pass then writes them (buffered positioned writes; the file is fsynced after).

use crate::dtype::{self, ConvertStats};
use crate::plan::{Content, Expr, Plan};
use crate::prepare::Inputs;
use crate::{DType, Result};

use super::read::read_tensor;
use super::sink::ShardFile;
use crate::cancel::Cancel;

/// Bytes of one float32 element.
const F32: usize = 4;

/// Evaluates and writes every computed tensor of the plan; returns what conversion
/// saw, per planned tensor index.
pub(crate) fn write_computed(
    plan: &Plan,
    inputs: Inputs<'_>,
    files: &[Box<dyn ShardFile>],
    cancel: &Cancel,
) -> Result<Vec<(usize, ConvertStats)>> {
    let mut stats = Vec::new();
    for (shard, s) in plan.shards.iter().enumerate() {
        for &(ti, offset) in &s.entries {
            let t = &plan.tensors[ti];
            let Content::Computed(expr) = &t.content else {
                continue;
            };
            cancel.check()?;
            let values = eval(expr, inputs)?;
            let mut out = vec![0u8; values.len() / F32 * t.dtype.size()];
            stats.push((ti, dtype::convert(&values, DType::F32, &mut out, t.dtype)));
            files[shard].write_at(&out, offset)?;
        }
    }
    Ok(stats)
}

/// The value of `e` as little-endian float32 bytes, in C order.
pub(crate) fn eval(e: &Expr, inputs: Inputs<'_>) -> Result<Vec<u8>> {
    match e {
        Expr::Leaf(l) => Ok(read_tensor(inputs.files(l.input), &l.source, DType::F32)?.0),
        Expr::Concat { dim, parts } => {
            let shape = e.shape("?")?;
            let outer: u64 = shape[..*dim].iter().product();
            let out_row = bytes(&shape[*dim..]);
            let mut out = vec![0u8; outer as usize * out_row];
            let mut at = 0;
            for p in parts {
                let part_row = bytes(&p.shape("?")?[*dim..]);
                let v = eval(p, inputs)?;
                for o in 0..outer as usize {
                    out[o * out_row + at..o * out_row + at + part_row]
                        .copy_from_slice(&v[o * part_row..(o + 1) * part_row]);
                }
                at += part_row;
            }
            Ok(out)
        }
        Expr::PermuteRows { rows, input } => {
            let shape = input.shape("?")?;
            let row = bytes(&shape[1..]);
            let v = eval(input, inputs)?;
            let mut out = vec![0u8; v.len()];
            for (i, &r) in rows.iter().enumerate() {
                let r = r as usize;
                out[i * row..(i + 1) * row].copy_from_slice(&v[r * row..(r + 1) * row]);
            }
            Ok(out)
        }
        Expr::Slice {
            dim,
            start,
            len,
            input,
        } => {
            let shape = input.shape("?")?;
            let outer: u64 = shape[..*dim].iter().product();
            let inner = bytes(&shape[dim + 1..]);
            let (in_row, out_row) = (shape[*dim] as usize * inner, *len as usize * inner);
            let from = *start as usize * inner;
            let v = eval(input, inputs)?;
            let mut out = vec![0u8; outer as usize * out_row];
            for o in 0..outer as usize {
                out[o * out_row..(o + 1) * out_row]
                    .copy_from_slice(&v[o * in_row + from..o * in_row + from + out_row]);
            }
            Ok(out)
        }
    }
}

/// Bytes of a float32 block of `shape`.
fn bytes(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize * F32
}
