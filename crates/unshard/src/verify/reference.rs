//! The reference evaluation of a computed tensor, for `verify`: deliberately
//! unlike the engine's (`write::computed`), which copies whole rows and blocks.
//! Here every output element is traced by its coordinates down the expression to
//! the one leaf element it comes from, and leaves are read with verify's own
//! gather. Values are float32, as the engine evaluates them, converted to the
//! output dtype by definition (`convert`), not with the writer's kernels.
//!
//! Memory: every leaf of the tensor in float32, and the tensor twice (float32 and
//! its output dtype).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::Expr;
use crate::prepare::Inputs;

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

/// What a computed tensor must hold: exact bytes for nodes that move elements, or
/// for arithmetic (a fused adapter) values with the error each element may carry.
pub(crate) enum Reference {
    Exact(Vec<u8>),
    /// `values[i]` (float64) within `allowed[i]`, absolute.
    Within {
        values: Vec<f64>,
        allowed: Vec<f64>,
    },
}

/// The reference value of a computed tensor of shape `shape`, in dtype `to`. A
/// fused adapter at the root is evaluated by `crate::lora::reference` (plain
/// float64 loops over its operands, each gathered exactly by [`expected`]); every
/// other expression is traced element by element.
pub(crate) fn reference(
    e: &Expr,
    shape: &[u64],
    to: DType,
    inputs: Inputs<'_>,
) -> Result<Reference> {
    let Expr::Fuse {
        base,
        a,
        b,
        magnitude,
        scale,
        layout,
    } = e
    else {
        return Ok(Reference::Exact(expected(e, shape, to, inputs)?));
    };
    let operand = |x: &Expr| -> Result<Vec<f64>> {
        let s = x.shape("?")?;
        let bytes = expected(x, &s, DType::F32, inputs)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect())
    };
    let (w, av, bv) = (operand(base)?, operand(a)?, operand(b)?);
    let m = magnitude.as_deref().map(operand).transpose()?;
    let (rows, cols) = (shape[0] as usize, shape[1] as usize);
    let in_dim = if layout.transposed() { rows } else { cols };
    let e = crate::lora::reference::evaluate(&crate::lora::reference::Operands {
        layout: *layout,
        w: &w,
        rows,
        cols,
        a: &av,
        b: &bv,
        rank: av.len().checked_div(in_dim).unwrap_or(0),
        scale: *scale,
        dora_magnitude: m.as_deref(),
    });
    let allowed = (0..e.values.len()).map(|i| e.allowed(i, to)).collect();
    Ok(Reference::Within {
        values: e.values,
        allowed,
    })
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
    super::convert::convert(&out, DType::F32, &mut converted, to);
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
        // An arithmetic node is evaluated whole by `reference`, at the root only.
        Expr::Fuse { .. } => {
            return Err(Error::plan(
                "verify evaluates a fused adapter only as a whole tensor, not inside another node",
                None,
            ))
        }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::fuse::Layout;
    use crate::plan::Origin;
    use crate::source::test_input::MemInput;
    use crate::source::Checkpoint;

    /// Float32 tensors laid out back to back in one file of the checkpoint,
    /// each a leaf named by its offset.
    #[derive(Default)]
    struct File(MemInput);

    impl File {
        fn leaf(&mut self, values: &[f32], shape: &[u64]) -> Expr {
            let name = format!("leaf@{}", self.0.bytes_len());
            Expr::leaf(Origin::Checkpoint, self.0.tensor(&name, values, shape))
        }

        fn checkpoint(self) -> Checkpoint {
            self.0.checkpoint()
        }
    }

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// `expected` of `e`, whose leaves are in `file`, as float32.
    fn eval(file: File, e: &Expr, shape: &[u64]) -> Result<Vec<f32>> {
        let ckpt = file.checkpoint();
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        Ok(f32s(&expected(e, shape, DType::F32, inputs)?))
    }

    fn new() -> File {
        File::default()
    }

    #[test]
    fn a_concatenation_takes_each_element_from_its_part() {
        // Along columns: [[0, 1], [2, 3]] and [[10], [11]].
        let mut f = new();
        let parts = vec![
            f.leaf(&[0.0, 1.0, 2.0, 3.0], &[2, 2]),
            f.leaf(&[10.0, 11.0], &[2, 1]),
        ];
        let e = Expr::Concat { dim: 1, parts };
        assert_eq!(
            eval(f, &e, &[2, 3]).unwrap(),
            [0.0, 1.0, 10.0, 2.0, 3.0, 11.0]
        );
        // Along rows, three parts of 1, 2 and 1 rows.
        let mut f = new();
        let parts = vec![
            f.leaf(&[0.0, 1.0], &[1, 2]),
            f.leaf(&[2.0, 3.0, 4.0, 5.0], &[2, 2]),
            f.leaf(&[6.0, 7.0], &[1, 2]),
        ];
        let e = Expr::Concat { dim: 0, parts };
        assert_eq!(
            eval(f, &e, &[4, 2]).unwrap(),
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
        );
    }

    #[test]
    fn permuted_rows_and_slices_are_traced_to_their_elements() {
        // Output row i is input row rows[i].
        let mut f = new();
        let input = Box::new(f.leaf(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2]));
        let e = Expr::PermuteRows {
            rows: vec![2, 0, 1],
            input,
        };
        assert_eq!(
            eval(f, &e, &[3, 2]).unwrap(),
            [4.0, 5.0, 0.0, 1.0, 2.0, 3.0]
        );
        // Columns 1..3 of [[0, 1, 2, 3], [4, 5, 6, 7]].
        let mut f = new();
        let input = Box::new(f.leaf(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[2, 4]));
        let e = Expr::Slice {
            dim: 1,
            start: 1,
            len: 2,
            input,
        };
        assert_eq!(eval(f, &e, &[2, 2]).unwrap(), [1.0, 2.0, 5.0, 6.0]);
        // Rows 1..3 of the concatenation of [[0, 1]] and [[2, 3], [4, 5]], the rows
        // then reversed.
        let mut f = new();
        let parts = vec![
            f.leaf(&[0.0, 1.0], &[1, 2]),
            f.leaf(&[2.0, 3.0, 4.0, 5.0], &[2, 2]),
        ];
        let sliced = Expr::Slice {
            dim: 0,
            start: 1,
            len: 2,
            input: Box::new(Expr::Concat { dim: 0, parts }),
        };
        let e = Expr::PermuteRows {
            rows: vec![1, 0],
            input: Box::new(sliced),
        };
        assert_eq!(eval(f, &e, &[2, 2]).unwrap(), [4.0, 5.0, 2.0, 3.0]);
    }

    #[test]
    fn the_values_are_converted_to_the_output_dtype() {
        let mut f = new();
        // 1 + 2^-8 is a tie between bfloat16's 1 and 1 + 2^-7: to even, 1.
        let e = f.leaf(&[1.5, -2.0, 1.0 + 1.0 / 256.0], &[3]);
        let ckpt = f.checkpoint();
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        let got = expected(&e, &[3], DType::BF16, inputs).unwrap();
        assert_eq!(got, [0xc0, 0x3f, 0x00, 0xc0, 0x80, 0x3f]);
    }

    #[test]
    fn what_cannot_be_traced_is_an_error_not_a_panic() {
        // A slice past the end of its input.
        let mut f = new();
        let input = Box::new(f.leaf(&[0.0, 1.0, 2.0, 3.0], &[4]));
        let e = Expr::Slice {
            dim: 0,
            start: 3,
            len: 2,
            input,
        };
        let err = eval(f, &e, &[2]).unwrap_err().to_string();
        assert!(
            err.contains("element 1 traces outside the tensor it comes from"),
            "{err}"
        );
        // A concatenation along a dimension the parts lack.
        let mut f = new();
        let parts = vec![f.leaf(&[0.0], &[1]), f.leaf(&[1.0], &[1])];
        let e = Expr::Concat { dim: 1, parts };
        let err = eval(f, &e, &[1, 2]).unwrap_err().to_string();
        assert!(
            err.contains("a concatenation along a missing dimension"),
            "{err}"
        );
        // A fused adapter inside another node.
        let mut f = new();
        let fuse = Expr::Fuse {
            base: Box::new(f.leaf(&[0.0; 4], &[2, 2])),
            a: Box::new(f.leaf(&[0.0; 2], &[1, 2])),
            b: Box::new(f.leaf(&[0.0; 2], &[2, 1])),
            magnitude: None,
            scale: 1.0,
            layout: Layout::Linear,
        };
        let e = Expr::Slice {
            dim: 0,
            start: 0,
            len: 1,
            input: Box::new(fuse),
        };
        let err = eval(f, &e, &[1, 2]).unwrap_err().to_string();
        assert!(
            err.contains("fused adapter only as a whole tensor"),
            "{err}"
        );
    }

    /// `reference` of `W + scale * update`, the values and their allowances.
    fn fused(
        layout: Layout,
        w: (&[f32], [u64; 2]),
        a: (&[f32], [u64; 2]),
        b: (&[f32], [u64; 2]),
    ) -> (Vec<f64>, Vec<f64>) {
        let mut f = new();
        let e = Expr::Fuse {
            base: Box::new(f.leaf(w.0, &w.1)),
            a: Box::new(f.leaf(a.0, &a.1)),
            b: Box::new(f.leaf(b.0, &b.1)),
            magnitude: None,
            scale: 0.5,
            layout,
        };
        let ckpt = f.checkpoint();
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        match reference(&e, &w.1, DType::F32, inputs).unwrap() {
            Reference::Within { values, allowed } => (values, allowed),
            Reference::Exact(_) => panic!("a fused adapter is compared within bounds"),
        }
    }

    #[test]
    fn a_fused_adapter_is_the_weight_plus_the_scaled_update_in_each_layout() {
        // A = [[1, 0, 1], [0, 1, 0]] (rank 2, 3 inputs), B = [[1, 2], [3, 4]]
        // (2 outputs): B @ A = [[1, 2, 1], [3, 4, 3]], scaled by 0.5.
        let a: &[f32] = &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let b: &[f32] = &[1.0, 2.0, 3.0, 4.0];
        // Linear: the weight is [outputs, inputs], all ones.
        let (values, allowed) = fused(
            Layout::Linear,
            (&[1.0; 6], [2, 3]),
            (a, [2, 3]),
            (b, [2, 2]),
        );
        assert_eq!(values, [1.5, 2.0, 1.5, 2.5, 3.0, 2.5]);
        assert_eq!(allowed.len(), 6);
        assert!(allowed.iter().all(|&x| x > 0.0 && x < 1e-3), "{allowed:?}");
        // Conv1D (fan_in_fan_out): the weight is [inputs, outputs], the update
        // transposed: [[0.5, 1.5], [1, 2], [0.5, 1.5]] over [[0, 0], [1, 1], [2, 2]].
        let w: &[f32] = &[0.0, 0.0, 1.0, 1.0, 2.0, 2.0];
        let (values, _) = fused(Layout::FanInFanOut, (w, [3, 2]), (a, [2, 3]), (b, [2, 2]));
        assert_eq!(values, [0.5, 1.5, 2.0, 3.0, 2.5, 3.5]);
    }

    #[test]
    fn any_other_expression_is_compared_exactly() {
        let mut f = new();
        let e = f.leaf(&[1.0, 2.0], &[2]);
        let ckpt = f.checkpoint();
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        match reference(&e, &[2], DType::F32, inputs).unwrap() {
            Reference::Exact(bytes) => assert_eq!(f32s(&bytes), [1.0, 2.0]),
            Reference::Within { .. } => panic!("a leaf is exact"),
        }
    }
}
