//! Geometry: where a piece's elements go inside its tensor, as runs that are
//! contiguous in the output and uniformly strided in the source.

use crate::source::{contiguous_strides, Piece};

/// A run of elements: contiguous in the output, uniformly strided in the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) out: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
}

/// The runs of a piece inside a tensor of `global` shape, in output order, with
/// their common source stride. Trailing dims are merged while the piece covers them
/// fully and the source stays uniformly strided, so a full or row-sharded tensor is
/// a single run; a column shard is one run per row. Runs are computed on demand, so
/// a window finds its first run by binary search instead of walking all before it.
pub(crate) struct PieceRuns<'a> {
    /// Shape of the dims that are not merged into a run.
    pub(crate) outer: &'a [u64],
    /// Their element strides in the source and in the full tensor.
    pub(crate) src_strides: &'a [u64],
    pub(crate) out_strides: Vec<u64>,
    /// Output position of the piece's first element.
    pub(crate) base_out: u64,
    pub(crate) len: u64,
    pub(crate) stride: u64,
    pub(crate) count: u64,
}

impl<'a> PieceRuns<'a> {
    pub(crate) fn new(p: &'a Piece, global: &[u64]) -> PieceRuns<'a> {
        let n = p.shape.len();
        let mut runs = PieceRuns {
            outer: &[],
            src_strides: &[],
            out_strides: Vec::new(),
            base_out: 0,
            len: 1,
            stride: 1,
            count: 1,
        };
        if p.shape.contains(&0) {
            runs.count = 0;
            return runs;
        }
        if n == 0 {
            return runs;
        }
        let gs = contiguous_strides(global);
        let mut k = n - 1; // dims k.. form the run
        let mut len = p.shape[n - 1];
        let stride = p.strides[n - 1];
        let mut covered = p.shape[n - 1] == global[n - 1];
        while k > 0 {
            let d = k - 1;
            if covered && (p.shape[d] == 1 || p.strides[d] == stride * len) {
                len *= p.shape[d];
                covered = covered && p.shape[d] == global[d];
                k = d;
            } else {
                break;
            }
        }
        runs.base_out = (0..n).map(|d| p.global_offset[d] * gs[d]).sum();
        runs.outer = &p.shape[..k];
        runs.src_strides = &p.strides[..k];
        runs.out_strides = gs[..k].to_vec();
        runs.len = len;
        runs.stride = stride;
        runs.count = runs.outer.iter().product();
        runs
    }

    /// Run `j` (`j < count`), counting in C order over the outer dims.
    pub(crate) fn run(&self, mut j: u64) -> Run {
        let (mut out, mut src) = (self.base_out, 0);
        for d in (0..self.outer.len()).rev() {
            let i = j % self.outer[d];
            j /= self.outer[d];
            out += i * self.out_strides[d];
            src += i * self.src_strides[d];
        }
        Run {
            out,
            src,
            len: self.len,
        }
    }

    /// The runs that hold output elements of `[e0, e1)`, in order, each with the
    /// part of it inside: `(run, a, b)` for its elements `[a, b)`, never empty.
    pub(crate) fn within(&self, e0: u64, e1: u64) -> impl Iterator<Item = (Run, u64, u64)> + '_ {
        (self.first_ending_after(e0)..self.count)
            .map(|j| self.run(j))
            .take_while(move |r| r.out < e1)
            .filter_map(move |r| {
                let (a, b) = (r.out.max(e0), (r.out + r.len).min(e1));
                (a < b).then_some((r, a, b))
            })
    }

    /// The first run that ends after output element `e` (`count` if none does).
    pub(crate) fn first_ending_after(&self, e: u64) -> u64 {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let r = self.run(mid);
            if r.out + r.len <= e {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    pub(crate) fn piece(shape: &[u64], strides: &[u64], off: &[u64]) -> Piece {
        Piece {
            file: 0,
            byte_offset: 0,
            dtype: DType::F32,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            global_offset: off.to_vec(),
            big_endian: false,
        }
    }

    /// All runs of a piece, and their source stride.
    pub(crate) fn piece_runs(p: &Piece, global: &[u64]) -> (Vec<Run>, u64) {
        let runs = PieceRuns::new(p, global);
        ((0..runs.count).map(|j| runs.run(j)).collect(), runs.stride)
    }

    #[test]
    pub(crate) fn a_row_shard_is_one_run() {
        let (runs, stride) = piece_runs(&piece(&[2, 3], &[3, 1], &[4, 0]), &[6, 3]);
        assert_eq!(
            runs,
            vec![Run {
                out: 12,
                src: 0,
                len: 6
            }]
        );
        assert_eq!(stride, 1);
    }

    #[test]
    pub(crate) fn a_column_shard_is_one_run_per_row() {
        let (runs, _) = piece_runs(&piece(&[2, 2], &[2, 1], &[0, 1]), &[2, 3]);
        assert_eq!(
            runs,
            vec![
                Run {
                    out: 1,
                    src: 0,
                    len: 2
                },
                Run {
                    out: 4,
                    src: 2,
                    len: 2
                }
            ]
        );
    }

    #[test]
    pub(crate) fn a_transposed_view_is_strided() {
        // w.t() of a 2x3 storage: shape (3, 2), strides (1, 3).
        let (runs, stride) = piece_runs(&piece(&[3, 2], &[1, 3], &[0, 0]), &[3, 2]);
        assert_eq!(stride, 3);
        assert_eq!(
            runs,
            vec![
                Run {
                    out: 0,
                    src: 0,
                    len: 2
                },
                Run {
                    out: 2,
                    src: 1,
                    len: 2
                },
                Run {
                    out: 4,
                    src: 2,
                    len: 2
                }
            ]
        );
    }

    #[test]
    pub(crate) fn a_window_finds_its_first_run_by_search() {
        // Columns 1..3 of a 5x3 tensor: one run of 2 per row, at outputs 1, 4, 7, 10, 13.
        let p = piece(&[5, 2], &[2, 1], &[0, 1]);
        let runs = PieceRuns::new(&p, &[5, 3]);
        assert_eq!(runs.count, 5);
        assert_eq!(runs.first_ending_after(0), 0);
        assert_eq!(runs.first_ending_after(3), 1);
        assert_eq!(runs.first_ending_after(6), 2);
        assert_eq!(runs.first_ending_after(14), 4);
        assert_eq!(runs.first_ending_after(15), 5);
        assert_eq!(
            runs.run(3),
            Run {
                out: 10,
                src: 6,
                len: 2
            }
        );
    }
}
