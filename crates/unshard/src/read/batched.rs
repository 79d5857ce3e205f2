//! Blocks of many small pieces, read with one positioned read per run of
//! neighbouring pieces in a file instead of one read per piece.
//!
//! A checkpoint of many ranks stores every tensor as one small chunk per rank, and
//! each rank's file holds its chunks of all tensors back to back. An output block
//! then needs a few kilobytes from each of hundreds of files for each tensor it
//! holds: at 582 K chunks, one read per chunk spent more time in the kernel's
//! per-call work (the system call, the page-cache look-up) than in copying bytes.
//! Here the small contiguous runs a block needs are gathered first, sorted by file
//! and offset, and read in runs ([`coalesce`]: neighbours less than [`GAP`] apart,
//! at most the scratch buffer's length), then copied or converted from the buffer
//! into the block: the chunks of all the block's tensors from one file come in one read.
//! Pieces that are large, strided or byte-swapped are left to the per-piece path
//! (`engine::fill_bytes`), which reads them straight into the output.

use std::sync::Arc;

use super::geometry::PieceRuns;
use super::pieces::{convert_run, Copied};
use crate::bytes::{coalesce, GAP};
use crate::dtype::ConvertStats;
use crate::dtype::DType;
use crate::error::Result;
use crate::source::Blob;

/// The longest run of a piece taken into a batch: longer ones are read straight
/// into the output, where one read per run costs little.
const SMALL: u64 = 64 << 10;

/// One contiguous run of a piece that the block needs.
struct Op<'a> {
    blob: &'a Blob,
    /// Input bytes `[src, src + len)`.
    src: u64,
    len: u64,
    /// Where its output starts in the block, and how long it is there.
    dst: usize,
    dst_len: usize,
    from: DType,
    to: DType,
    /// Index into [`Batch::stats`].
    slot: usize,
}

/// The small runs of the tensors of one block, gathered before any is read.
#[derive(Default)]
pub(crate) struct Batch<'a> {
    ops: Vec<Op<'a>>,
    /// What conversion saw, per tensor taken (plan index).
    stats: Vec<(usize, ConvertStats)>,
}

impl<'a> Batch<'a> {
    /// Takes elements `[e0, e1)` of tensor `t` (plan index `ti`), bound for the
    /// block's bytes from `at` on, if every run they need is small, contiguous and
    /// stored little-endian; otherwise takes nothing and returns `false`.
    pub(crate) fn add(
        &mut self,
        ti: usize,
        t: &Copied<'_>,
        files: &'a [Arc<Blob>],
        (e0, e1): (u64, u64),
        at: usize,
    ) -> bool {
        let before = self.ops.len();
        let slot = self.stats.len();
        let osz = t.dtype.size() as u64;
        for p in &t.source.pieces {
            let Some(blob) = files.get(p.file) else {
                // The per-piece path reports the missing file.
                self.ops.truncate(before);
                return false;
            };
            let isz = p.dtype.size() as u64;
            let runs = PieceRuns::new(p, &t.source.shape);
            if p.big_endian || (runs.stride != 1 && runs.count > 0) {
                self.ops.truncate(before);
                return false;
            }
            for (r, a, b) in runs.within(e0, e1) {
                let len = (b - a) * isz;
                if len > SMALL {
                    self.ops.truncate(before);
                    return false;
                }
                self.ops.push(Op {
                    blob,
                    src: p.byte_offset + (r.src + (a - r.out)) * isz,
                    len,
                    dst: at + ((a - e0) * osz) as usize,
                    dst_len: ((b - a) * osz) as usize,
                    from: p.dtype,
                    to: t.dtype,
                    slot,
                });
            }
        }
        self.stats.push((ti, ConvertStats::default()));
        true
    }

    /// Reads every run taken and fills its part of `out` (the block), using
    /// `scratch` (at least [`SMALL`] bytes) as the read buffer: each file's runs are
    /// read in [`coalesce`]d runs of neighbours. Returns what conversion saw per
    /// tensor.
    pub(crate) fn fill(
        self,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<Vec<(usize, ConvertStats)>> {
        let Batch { mut ops, mut stats } = self;
        ops.sort_unstable_by_key(|o| (o.blob as *const Blob as usize, o.src));
        for file in ops.chunk_by(|a, b| std::ptr::eq(a.blob, b.blob)) {
            let ranges: Vec<(u64, u64)> = file.iter().map(|o| (o.src, o.len)).collect();
            for run in coalesce(&ranges, GAP, scratch.len() as u64) {
                let blob = file[0].blob;
                let buf = &mut scratch[..(run.end - run.start) as usize];
                blob.read_at(run.start, buf)?;
                for o in run.members.iter().map(|&m| &file[m]) {
                    let at = (o.src - run.start) as usize;
                    let dst = &mut out[o.dst..o.dst + o.dst_len];
                    stats[o.slot].1.add(convert_run(
                        &buf[at..at + o.len as usize],
                        o.from,
                        dst,
                        o.to,
                    ));
                }
            }
        }
        Ok(stats)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::pieces::fill_window;
    use super::*;
    use crate::source::{contiguous_strides, Piece, TensorSource};
    use std::path::PathBuf;

    /// Three files laid out as a checkpoint of three ranks lays them out: each holds
    /// its rows of every tensor, back to back, with headers between them (and, in
    /// the second file, a hole wider than [`GAP`]); one tensor is split by columns
    /// (one run per row), one is stored as bf16.
    fn checkpoint() -> (Vec<Arc<Blob>>, Vec<TensorSource>) {
        let mut files = vec![Vec::new(), Vec::new(), Vec::new()];
        let mut tensors = Vec::new();
        let shapes: [(u64, u64, DType); 7] = [
            (6, 40, DType::F32),
            (9, 33, DType::F32),
            (3, 1000, DType::BF16),
            (12, 17, DType::F32),
            (6, 24, DType::F32),
            (3, 2000, DType::F32),
            (4, 90, DType::F32), // split by columns
        ];
        let mut value = 0u32;
        for (k, &(rows, cols, dtype)) in shapes.iter().enumerate() {
            let mut pieces = Vec::new();
            for (r, f) in files.iter_mut().enumerate() {
                f.extend(std::iter::repeat_n(0xAB, 100 + r * 7));
                if r == 1 && k == 3 {
                    f.extend(std::iter::repeat_n(0xCD, (GAP + 5000) as usize));
                }
                let (shape, global_offset) = if k == 6 {
                    (vec![rows, cols / 3], vec![0, r as u64 * cols / 3])
                } else {
                    (vec![rows / 3, cols], vec![r as u64 * rows / 3, 0])
                };
                let at = f.len() as u64;
                for _ in 0..shape[0] * shape[1] {
                    value += 1;
                    let x = if value % 97 == 0 {
                        f32::NAN
                    } else {
                        value as f32 * 0.25 - 300.0
                    };
                    match dtype {
                        DType::BF16 => f.extend(&x.to_bits().to_le_bytes()[2..]),
                        _ => f.extend(x.to_le_bytes()),
                    }
                }
                pieces.push(Piece {
                    file: r,
                    byte_offset: at,
                    dtype,
                    strides: contiguous_strides(&shape),
                    shape,
                    global_offset,
                    big_endian: false,
                });
            }
            tensors.push(TensorSource {
                name: format!("t{k}"),
                dtype,
                shape: vec![rows, cols],
                pieces: pieces.into(),
                storage: None,
                layout: None,
            });
        }
        let files = files
            .into_iter()
            .enumerate()
            .map(|(i, b)| Arc::new(Blob::owned(PathBuf::from(format!("f{i}")), b)))
            .collect();
        (files, tensors)
    }

    /// Fills windows of every tensor, converted to `to`, once through a batch (with
    /// a read buffer of `cap` bytes) and once piece by piece; returns whether every
    /// tensor was taken.
    fn both_ways(to: DType, cap: usize, trim: u64) -> bool {
        let (files, tensors) = checkpoint();
        let osz = to.size() as u64;
        let mut windows = Vec::new();
        let mut at = 0usize;
        for t in &tensors {
            let n: u64 = t.shape.iter().product();
            let (e0, e1) = (trim.min(n), n.saturating_sub(trim));
            windows.push((e0, e1, at));
            at += ((e1 - e0) * osz) as usize + 3;
        }
        let mut batched = vec![0x55u8; at];
        let mut by_piece = vec![0x55u8; at];
        let mut batch = Batch::default();
        let mut taken = true;
        let mut want = Vec::new();
        let mut scratch = Vec::new();
        for (ti, (t, &(e0, e1, at))) in tensors.iter().zip(&windows).enumerate() {
            let copy = Copied {
                name: &t.name,
                source: t,
                dtype: to,
            };
            taken &= batch.add(ti, &copy, &files, (e0, e1), at);
            let dst = &mut by_piece[at..at + ((e1 - e0) * osz) as usize];
            want.push((
                ti,
                fill_window(&copy, &files, e0, e1, dst, &mut scratch).unwrap(),
            ));
        }
        let got = batch.fill(&mut batched, &mut vec![0u8; cap]).unwrap();
        assert_eq!(batched, by_piece, "to {to:?}, cap {cap}, trim {trim}");
        assert_eq!(got, want);
        taken
    }

    #[test]
    fn a_batch_fills_what_piece_by_piece_reads_fill() {
        for to in [DType::F32, DType::BF16, DType::F16] {
            // A buffer just over the largest run (8,000 bytes) forces a read per
            // run or two; a large one takes each file's part in one read (two for
            // the second file: the hole splits it).
            for cap in [8192, 1 << 20] {
                for trim in [0, 5, 31] {
                    assert!(both_ways(to, cap, trim));
                }
            }
        }
    }

    #[test]
    fn large_strided_or_big_endian_pieces_are_left_to_the_piece_path() {
        let (files, mut tensors) = checkpoint();
        let mut batch = Batch::default();
        fn copy(t: &TensorSource) -> Copied<'_> {
            Copied {
                name: "t",
                source: t,
                dtype: DType::F32,
            }
        }
        // A 3 x 2000 f32 tensor split by rows: runs of 8,000 bytes, small.
        assert!(batch.add(0, &copy(&tensors[5]), &files, (0, 6000), 0));
        // Its whole first row and more: one run of 9 * 2000 * 4 bytes > SMALL.
        let mut long = tensors[5].clone();
        long.shape = vec![27, 2000];
        long.pieces[0].shape = vec![9, 2000];
        long.pieces[0].strides = contiguous_strides(&[9, 2000]);
        assert!(!batch.add(1, &copy(&long), &files, (0, 18_000), 0));
        tensors[1].pieces[2].big_endian = true;
        assert!(!batch.add(2, &copy(&tensors[1]), &files, (0, 297), 0));
        tensors[0].pieces[1].strides = vec![1, 2];
        assert!(!batch.add(3, &copy(&tensors[0]), &files, (0, 240), 0));
        // A piece in a file the checkpoint does not have, after one it has.
        let mut missing = tensors[4].clone();
        missing.pieces[2].file = 3;
        assert!(!batch.add(4, &copy(&missing), &files, (0, 144), 0));
        // What was refused left nothing behind: only the first tensor's runs.
        assert_eq!(batch.stats.len(), 1);
        assert_eq!(batch.ops.len(), 3);
    }
}
