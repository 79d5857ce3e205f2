//! From runs of flattened elements to pieces.
//!
//! ZeRO flattens parameters and cuts the flat buffer into equal per-rank
//! partitions, so a rank holds each parameter (or its part of it) as one contiguous
//! run of the parameter's row-major elements. A run `[a, b)` of a C-order tensor is
//! a union of at most `2 * (ndim - 1) + 1` boxes: the tail of the first row it
//! starts in, whole rows, the head of the row it ends in, each recursively in the
//! lower dimensions. Every box is contiguous in the file with the full tensor's
//! strides, so it is an ordinary [`Piece`] and the engine needs nothing new.

use super::super::{contiguous_strides, Piece};

/// The boxes `(global_offset, shape)` that make up the run `[a, b)` of the flattened
/// elements of a C-order tensor of `shape`, in element order.
pub fn boxes(shape: &[u64], a: u64, b: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut out = Vec::new();
    if a < b {
        split(shape, a, b, &mut Vec::new(), &mut out);
    }
    out
}

fn split(
    shape: &[u64],
    a: u64,
    b: u64,
    prefix: &mut Vec<u64>,
    out: &mut Vec<(Vec<u64>, Vec<u64>)>,
) {
    let Some((&rows, rest)) = shape.split_first() else {
        // One element (of a 0-d tensor, or the last dimension's single element).
        out.push((prefix.clone(), vec![1; prefix.len()]));
        return;
    };
    let inner: u64 = rest.iter().product();
    if inner == 0 || rows == 0 {
        return;
    }
    let with = |prefix: &[u64], row: u64, len: u64, out: &mut Vec<(Vec<u64>, Vec<u64>)>| {
        let mut o = prefix.to_vec();
        o.push(row);
        o.extend(std::iter::repeat_n(0, rest.len()));
        // Dimensions above this one are single rows of the box.
        let mut s = vec![1; prefix.len()];
        s.push(len);
        s.extend_from_slice(rest);
        out.push((o, s));
    };
    let (r0, r1) = (a / inner, b / inner);
    if r0 == r1 {
        // Inside one row.
        prefix.push(r0);
        split(rest, a - r0 * inner, b - r0 * inner, prefix, out);
        prefix.pop();
        return;
    }
    let mut first_full = r0;
    if a % inner != 0 {
        prefix.push(r0);
        split(rest, a % inner, inner, prefix, out);
        prefix.pop();
        first_full += 1;
    }
    if r1 > first_full {
        with(prefix, first_full, r1 - first_full, out);
    }
    if b % inner != 0 {
        prefix.push(r1);
        split(rest, 0, b % inner, prefix, out);
        prefix.pop();
    }
}

/// The pieces for a run: elements `[a, b)` of a tensor of `shape`, stored
/// contiguously in the file starting where `at` (a 1-D flat piece) puts its element
/// `local`.
pub fn pieces(shape: &[u64], a: u64, b: u64, at: &Piece, local: u64) -> Vec<Piece> {
    let strides = contiguous_strides(shape);
    let elem = at.dtype.size() as u64;
    boxes(shape, a, b)
        .into_iter()
        .map(|(offset, box_shape)| {
            let flat: u64 = offset.iter().zip(&strides).map(|(o, s)| o * s).sum();
            Piece {
                file: at.file,
                byte_offset: at.byte_offset + (local + flat - a) * elem,
                dtype: at.dtype,
                shape: box_shape,
                strides: strides.clone(),
                global_offset: offset,
                big_endian: at.big_endian,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of `[a, b)` is in exactly one box, and nothing else is.
    fn check(shape: &[u64], a: u64, b: u64) {
        let strides = contiguous_strides(shape);
        let numel: u64 = shape.iter().product();
        let mut hit = vec![0u32; numel as usize];
        let bx = boxes(shape, a, b);
        assert!(
            bx.len() < 2 * shape.len().max(1),
            "{shape:?} {a} {b}: {bx:?}"
        );
        for (o, s) in &bx {
            let n: u64 = s.iter().product();
            assert!(n > 0, "{shape:?} {a} {b}: an empty box in {bx:?}");
            for i in 0..n {
                let mut rem = i;
                let mut flat = 0;
                for d in (0..s.len()).rev() {
                    flat += (o[d] + rem % s[d]) * strides[d];
                    rem /= s[d];
                }
                hit[flat as usize] += 1;
            }
        }
        for (i, h) in hit.iter().enumerate() {
            let want = u32::from((a..b).contains(&(i as u64)));
            assert_eq!(*h, want, "{shape:?} [{a}, {b}) element {i}");
        }
    }

    #[test]
    fn runs_tile_exactly() {
        for shape in [vec![7], vec![3, 5], vec![2, 3, 4], vec![4, 1, 3], vec![]] {
            let n: u64 = shape.iter().product();
            for a in 0..=n {
                for b in a..=n {
                    check(&shape, a, b);
                }
            }
        }
    }

    #[test]
    fn a_run_of_whole_rows_is_one_box() {
        assert_eq!(boxes(&[4, 3], 3, 9), vec![(vec![1, 0], vec![2, 3])]);
        // The tail of row 0 and the head of row 1: no whole row between them.
        assert_eq!(
            boxes(&[4, 3], 2, 4),
            vec![(vec![0, 2], vec![1, 1]), (vec![1, 0], vec![1, 1])]
        );
        assert_eq!(
            boxes(&[4, 3], 2, 7),
            vec![
                (vec![0, 2], vec![1, 1]),
                (vec![1, 0], vec![1, 3]),
                (vec![2, 0], vec![1, 1])
            ]
        );
    }
}
