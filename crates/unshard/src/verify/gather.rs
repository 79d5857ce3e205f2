//! The expected values of a tensor, gathered with a deliberately plain algorithm
//! (output row by output row, asking each piece for the columns it holds) rather
//! than with the writer's run merging, so that a placement bug in the engine shows
//! up as a mismatch instead of being reproduced.

use std::path::Path;
use std::sync::Arc;

use crate::dtype;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::{Blob, TensorSource};
use crate::write::WINDOW_BYTES;

/// A piece seen with at least one dimension, so that a 0-d tensor is a single row
/// of one column.
pub(crate) struct PieceBox<'a> {
    pub(crate) blob: &'a Blob,
    pub(crate) byte_offset: u64,
    pub(crate) dtype: DType,
    pub(crate) big_endian: bool,
    pub(crate) shape: Vec<u64>,
    pub(crate) strides: Vec<u64>,
    pub(crate) offset: Vec<u64>,
}

/// Fills `out` with elements `[e0, e1)` (C order) of `t`, converted to `to`.
///
/// Walks the output rows (the last dimension) that the window touches; for each,
/// every piece whose box contains the row's leading index contributes the columns
/// it holds. Each element is placed by its own coordinates, independently of the
/// writer's run merging. An element no piece holds is an error.
pub(crate) fn gather(
    t: &TensorSource,
    files: &[Arc<Blob>],
    to: DType,
    e0: u64,
    e1: u64,
    out: &mut [u8],
    bufs: &mut GatherBufs,
) -> Result<()> {
    if e0 >= e1 {
        return Ok(());
    }
    let one = [1u64];
    let shape: &[u64] = if t.shape.is_empty() { &one } else { &t.shape };
    let nd = shape.len();
    let cols = shape[nd - 1];
    let lead = &shape[..nd - 1];
    let bad = |path: &Path, msg: String| Error::bad_tensor(path, &t.name, msg);
    let mut boxes = Vec::with_capacity(t.pieces.len());
    for p in &t.pieces {
        let blob = files
            .get(p.file)
            .ok_or_else(|| bad(Path::new("?"), "a piece refers to a missing file".into()))?;
        let (pshape, pstrides, poff) = if p.shape.is_empty() && t.shape.is_empty() {
            (vec![1], vec![1], vec![0])
        } else {
            (p.shape.clone(), p.strides.clone(), p.global_offset.clone())
        };
        if pshape.len() != nd || pstrides.len() != nd || poff.len() != nd {
            return Err(bad(
                &blob.path,
                format!(
                    "a piece of shape {:?} at {:?} does not fit a tensor of shape {:?}",
                    p.shape, p.global_offset, t.shape
                ),
            ));
        }
        if pshape.contains(&0) {
            continue;
        }
        boxes.push(PieceBox {
            blob,
            byte_offset: p.byte_offset,
            dtype: p.dtype,
            big_endian: p.big_endian,
            shape: pshape,
            strides: pstrides,
            offset: poff,
        });
    }
    // Read ahead a share of a window per piece: few reads, bounded memory.
    bufs.ahead.resize_with(boxes.len(), ReadAhead::default);
    let chunk = (2 * WINDOW_BYTES / boxes.len().max(1) as u64).clamp(64 << 10, 4 << 20);
    let osize = to.size() as u64;
    let first_row = e0 / cols;
    let last_row = (e1 - 1) / cols;
    // Leading index of the first row, then counted up row by row.
    let mut idx = vec![0u64; lead.len()];
    let mut r = first_row;
    for d in (0..lead.len()).rev() {
        idx[d] = r % lead[d].max(1);
        r /= lead[d].max(1);
    }
    let mut covered = 0u64;
    for row in first_row..=last_row {
        let row_start = row * cols;
        let c0 = e0.max(row_start) - row_start;
        let c1 = e1.min(row_start + cols) - row_start;
        for (bi, b) in boxes.iter().enumerate() {
            let holds_row =
                (0..nd - 1).all(|d| idx[d] >= b.offset[d] && idx[d] - b.offset[d] < b.shape[d]);
            if !holds_row {
                continue;
            }
            let (lo, hi) = (
                b.offset[nd - 1],
                b.offset[nd - 1].saturating_add(b.shape[nd - 1]),
            );
            let (a, z) = (c0.max(lo), c1.min(hi));
            if a >= z {
                continue;
            }
            // `idx` has the leading dimensions only; zip stops there.
            let src = (a - lo) * b.strides[nd - 1]
                + idx
                    .iter()
                    .zip(&b.offset)
                    .zip(&b.strides)
                    .map(|((i, o), s)| (i - o) * s)
                    .sum::<u64>();
            let count = z - a;
            let dst_at = (row_start + a - e0) * osize;
            let dst = &mut out[dst_at as usize..(dst_at + count * osize) as usize];
            let bytes = source_bytes(
                b,
                src,
                b.strides[nd - 1],
                count,
                chunk,
                &mut bufs.ahead[bi],
                &mut bufs.scratch,
            )
            .map_err(|msg| bad(&b.blob.path, msg))?;
            // By definition, not with the writer's kernels (see `convert`).
            super::convert::convert(bytes, b.dtype, dst, to);
            covered += count;
        }
        for d in (0..lead.len()).rev() {
            idx[d] += 1;
            if idx[d] < lead[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    if covered < e1 - e0 {
        return Err(Error::bad_tensor(
            t.pieces
                .first()
                .and_then(|p| files.get(p.file))
                .map(|b| b.path.clone())
                .unwrap_or_default(),
            &t.name,
            format!(
                "its pieces leave {} of elements [{e0}, {e1}) uncovered",
                e1 - e0 - covered
            ),
        ));
    }
    Ok(())
}

/// Source bytes read ahead for one piece, so that gathering row by row costs one
/// positioned read per chunk rather than one per row.
#[derive(Default)]
pub(crate) struct ReadAhead {
    /// Which file the bytes are from (the blob's address; 0 = nothing yet).
    pub(crate) blob: usize,
    pub(crate) start: u64,
    pub(crate) data: Vec<u8>,
}

/// Buffers reused across the windows a thread gathers.
#[derive(Default)]
pub(crate) struct GatherBufs {
    pub(crate) scratch: Vec<u8>,
    pub(crate) ahead: Vec<ReadAhead>,
}

/// The little-endian bytes of `count` elements of a piece, `stride` apart,
/// starting `first` elements in: a slice of the read-ahead buffer when they are
/// contiguous, else gathered into `scratch`.
pub(crate) fn source_bytes<'a>(
    b: &PieceBox<'_>,
    first: u64,
    stride: u64,
    count: u64,
    chunk: u64,
    ahead: &'a mut ReadAhead,
    scratch: &'a mut Vec<u8>,
) -> std::result::Result<&'a [u8], String> {
    let size = b.dtype.size() as u64;
    let past_end = || "its data lies past the end of the file".to_string();
    let start = first
        .checked_mul(size)
        .and_then(|x| x.checked_add(b.byte_offset))
        .ok_or_else(past_end)?;
    let len = count.checked_mul(size).ok_or_else(past_end)?;
    let end = start.checked_add(len).ok_or_else(past_end)?;
    if stride == 1 && !b.big_endian {
        let key = b.blob as *const Blob as usize;
        let held = ahead.blob == key
            && start >= ahead.start
            && end <= ahead.start + ahead.data.len() as u64;
        if !held {
            let until = start
                .saturating_add(chunk.max(len))
                .min(b.blob.len())
                .max(end);
            let n = usize::try_from(until - start).map_err(|_| past_end())?;
            ahead.blob = 0;
            ahead.data.resize(n, 0);
            b.blob
                .read_at(start, &mut ahead.data)
                .map_err(|e| e.to_string())?;
            (ahead.blob, ahead.start) = (key, start);
        }
        let at = (start - ahead.start) as usize;
        return Ok(&ahead.data[at..at + len as usize]);
    }
    scratch.resize(usize::try_from(len).map_err(|_| past_end())?, 0);
    if stride == 1 {
        b.blob.read_at(start, scratch).map_err(|e| e.to_string())?;
    } else {
        let step = stride.checked_mul(size).ok_or_else(past_end)?;
        b.blob
            .read_strided(start, step, size as usize, scratch)
            .map_err(|e| e.to_string())?;
    }
    if b.big_endian {
        dtype::byteswap(scratch, size as usize);
    }
    Ok(scratch)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::Piece;
    use std::path::PathBuf;

    pub(crate) fn f32_blob(values: &[f32]) -> Arc<Blob> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Arc::new(Blob::owned(PathBuf::from("mem"), bytes))
    }

    pub(crate) fn piece(shape: &[u64], strides: &[u64], off: &[u64], byte_offset: u64) -> Piece {
        Piece {
            file: 0,
            byte_offset,
            dtype: DType::F32,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            global_offset: off.to_vec(),
            big_endian: false,
        }
    }

    pub(crate) fn tensor(shape: &[u64], pieces: Vec<Piece>) -> TensorSource {
        TensorSource {
            name: "t".into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces: pieces.into(),
            storage: None,
            layout: None,
        }
    }

    pub(crate) fn gathered(
        t: &TensorSource,
        files: &[Arc<Blob>],
        e0: u64,
        e1: u64,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0u8; ((e1 - e0) * 4) as usize];
        gather(
            t,
            files,
            DType::F32,
            e0,
            e1,
            &mut out,
            &mut GatherBufs::default(),
        )?;
        Ok(out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    #[test]
    pub(crate) fn gathers_column_shards_and_transposed_views_by_coordinates() {
        // A 2x3 tensor [[0,1,2],[3,4,5]] as two column shards: cols 0..1 and 1..3,
        // the second stored transposed (3x... strides (1, 2)).
        let files = vec![f32_blob(&[0.0, 3.0, 1.0, 4.0, 2.0, 5.0])];
        let t = tensor(
            &[2, 3],
            vec![
                piece(&[2, 1], &[1, 1], &[0, 0], 0),
                piece(&[2, 2], &[1, 2], &[0, 1], 8),
            ],
        );
        assert_eq!(
            gathered(&t, &files, 0, 6).unwrap(),
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
        // A window that starts and ends mid-row.
        assert_eq!(gathered(&t, &files, 2, 5).unwrap(), [2.0, 3.0, 4.0]);
    }

    #[test]
    pub(crate) fn an_element_no_piece_holds_is_an_error_naming_the_tensor() {
        let files = vec![f32_blob(&[0.0, 1.0])];
        let t = tensor(&[4], vec![piece(&[2], &[1], &[0], 0)]);
        let e = gathered(&t, &files, 0, 4).unwrap_err().to_string();
        assert!(e.contains("'t'") && e.contains("uncovered"), "{e}");
    }

    #[test]
    pub(crate) fn narrow_rows_share_one_read_and_big_endian_pieces_are_swapped() {
        // [1000, 3], rows 0..600 in one piece, rows 600..1000 in another stored
        // big-endian; read as windows that cut rows.
        let values: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        let mut bytes: Vec<u8> = values[..1800]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        bytes.extend(values[1800..].iter().flat_map(|v| v.to_be_bytes()));
        let files = vec![Arc::new(Blob::owned(PathBuf::from("mem"), bytes))];
        let mut big = piece(&[400, 3], &[3, 1], &[600, 0], 1800 * 4);
        big.big_endian = true;
        let t = tensor(&[1000, 3], vec![piece(&[600, 3], &[3, 1], &[0, 0], 0), big]);
        let mut bufs = GatherBufs::default();
        for (e0, e1) in [(0, 1000), (1000, 2001), (2001, 3000)] {
            let mut out = vec![0u8; ((e1 - e0) * 4) as usize];
            gather(&t, &files, DType::F32, e0, e1, &mut out, &mut bufs).unwrap();
            let got: Vec<f32> = out
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got, values[e0 as usize..e1 as usize]);
        }
    }

    #[test]
    pub(crate) fn a_scalar_is_one_element() {
        let files = vec![f32_blob(&[7.0])];
        let t = tensor(&[], vec![piece(&[], &[], &[], 0)]);
        assert_eq!(gathered(&t, &files, 0, 1).unwrap(), [7.0]);
    }

    fn as_f32(out: &[u8]) -> Vec<f32> {
        out.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn gathered_with(
        t: &TensorSource,
        files: &[Arc<Blob>],
        e0: u64,
        e1: u64,
        bufs: &mut GatherBufs,
    ) -> Vec<f32> {
        let mut out = vec![0u8; ((e1 - e0) * 4) as usize];
        gather(t, files, DType::F32, e0, e1, &mut out, bufs).unwrap();
        as_f32(&out)
    }

    /// Writes the elements of a [3, 3, 2] tensor whose value is its own C-order
    /// index (`6 g0 + 2 g1 + g2`) that a piece of `shape` at global `off` holds,
    /// each at `byte_offset + 4 * (its local coordinates · strides)`.
    fn place(file: &mut Vec<u8>, p: &Piece) {
        let (sh, st, off) = (&p.shape, &p.strides, &p.global_offset);
        for i in 0..sh[0] {
            for j in 0..sh[1] {
                for k in 0..sh[2] {
                    let value = (6 * (i + off[0]) + 2 * (j + off[1]) + k + off[2]) as f32;
                    let at = (p.byte_offset + 4 * (i * st[0] + j * st[1] + k * st[2])) as usize;
                    if file.len() < at + 4 {
                        file.resize(at + 4, 0);
                    }
                    let bytes = if p.big_endian {
                        value.to_be_bytes()
                    } else {
                        value.to_le_bytes()
                    };
                    file[at..at + 4].copy_from_slice(&bytes);
                }
            }
        }
    }

    #[test]
    fn every_window_of_a_3d_tensor_cut_along_each_dimension_holds_each_elements_value() {
        // [3, 3, 2]: dim 0 = 0 in one C-order piece; dims 0 = 1..3, 1 = 0..2 in one
        // piece stored with its first dimension fastest; the rest cut along the
        // last dimension into two pieces, the second big-endian.
        let mut c2 = piece(&[2, 1, 1], &[1, 1, 1], &[1, 2, 1], 64);
        c2.big_endian = true;
        let pieces = vec![
            piece(&[1, 3, 2], &[6, 2, 1], &[0, 0, 0], 0),
            piece(&[2, 2, 2], &[1, 2, 4], &[1, 0, 0], 24),
            piece(&[2, 1, 1], &[1, 1, 1], &[1, 2, 0], 56),
            c2,
        ];
        let mut file = Vec::new();
        for p in &pieces {
            place(&mut file, p);
        }
        assert_eq!(file.len(), 72);
        let files = vec![Arc::new(Blob::owned(PathBuf::from("mem"), file))];
        let t = tensor(&[3, 3, 2], pieces);
        let want = |e0: u64, e1: u64| (e0..e1).map(|e| e as f32).collect::<Vec<_>>();
        for e0 in 0..18 {
            for e1 in e0 + 1..=18 {
                let got = gathered_with(&t, &files, e0, e1, &mut GatherBufs::default());
                assert_eq!(got, want(e0, e1), "[{e0}, {e1})");
            }
        }
        // The same windows backwards with one set of buffers: each read starts
        // before what the previous one read ahead.
        let mut bufs = GatherBufs::default();
        for e0 in (0..18).rev() {
            for e1 in (e0 + 1..=18).rev() {
                let got = gathered_with(&t, &files, e0, e1, &mut bufs);
                assert_eq!(got, want(e0, e1), "[{e0}, {e1}) backwards");
            }
        }
    }

    #[test]
    fn buffers_reused_for_another_file_or_past_the_read_ahead_read_that_data() {
        // Two tensors at the same byte offset of two files, gathered with one set
        // of buffers: the second must not be served the first file's bytes.
        let files = vec![f32_blob(&[1.0, 2.0]), f32_blob(&[3.0, 4.0])];
        let mut second = piece(&[2], &[1], &[0], 0);
        second.file = 1;
        let (t1, t2) = (
            tensor(&[2], vec![piece(&[2], &[1], &[0], 0)]),
            tensor(&[2], vec![second]),
        );
        let mut bufs = GatherBufs::default();
        assert_eq!(gathered_with(&t1, &files, 0, 2, &mut bufs), [1.0, 2.0]);
        assert_eq!(gathered_with(&t2, &files, 0, 2, &mut bufs), [3.0, 4.0]);
        // Two tensors of one file more than a read-ahead (4 MiB) apart: the second
        // lies past what the first one read.
        let far = (4 << 20) + (256 << 10);
        let mut bytes = vec![0u8; far as usize + 8];
        bytes[8..12].copy_from_slice(&5.0f32.to_le_bytes());
        bytes[far as usize..far as usize + 4].copy_from_slice(&6.0f32.to_le_bytes());
        bytes[far as usize + 4..].copy_from_slice(&7.0f32.to_le_bytes());
        let files = vec![Arc::new(Blob::owned(PathBuf::from("mem"), bytes))];
        let (t1, t2) = (
            tensor(&[1], vec![piece(&[1], &[1], &[0], 8)]),
            tensor(&[2], vec![piece(&[2], &[1], &[0], far)]),
        );
        let mut bufs = GatherBufs::default();
        assert_eq!(gathered_with(&t1, &files, 0, 1, &mut bufs), [5.0]);
        assert_eq!(gathered_with(&t2, &files, 0, 2, &mut bufs), [6.0, 7.0]);
    }

    #[test]
    fn a_piece_whose_rank_differs_from_the_tensors_is_an_error() {
        let files = vec![f32_blob(&[1.0, 2.0])];
        for p in [
            // A 0-d piece of a 1-d tensor.
            piece(&[], &[], &[], 0),
            // The right shape with strides or an offset of another rank.
            piece(&[1], &[1, 1], &[0], 0),
            piece(&[1], &[1], &[0, 0], 0),
        ] {
            let t = tensor(&[1], vec![p]);
            let e = gathered(&t, &files, 0, 1).unwrap_err().to_string();
            assert!(e.contains("'t'") && e.contains("does not fit"), "{e}");
        }
    }

    /// An in-memory source that counts the reads made on it.
    #[derive(Debug)]
    struct Counting {
        inner: crate::source::MemBytes,
        reads: std::sync::atomic::AtomicUsize,
    }

    impl crate::source::ByteSource for Counting {
        fn name(&self) -> &Path {
            self.inner.name()
        }
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.read_at(offset, buf)
        }
    }

    #[test]
    fn the_narrow_rows_of_a_piece_under_4_mib_cost_one_read() {
        // [131072, 3] f32: 1.5 MiB in one piece, gathered row by row (12 bytes a
        // row); one read ahead of up to 4 MiB serves every row.
        let rows = 131_072u64;
        let values: Vec<f32> = (0..rows * 3).map(|i| i as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let counting = Arc::new(Counting {
            inner: crate::source::MemBytes::new(PathBuf::from("mem"), bytes),
            reads: Default::default(),
        });
        let files = vec![Arc::new(Blob::new(counting.clone()))];
        let t = tensor(&[rows, 3], vec![piece(&[rows, 3], &[3, 1], &[0, 0], 0)]);
        let got = gathered_with(&t, &files, 0, rows * 3, &mut GatherBufs::default());
        assert!(got == values, "the values differ");
        assert_eq!(counting.reads.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn a_piece_gives_no_row_past_its_extent() {
        // [2, 2] as two one-row pieces, row 1's listed first and stored first; row
        // 0's piece is followed in the file by other bytes (99), which a piece that
        // also claimed the row after its last would write over row 1.
        let files = vec![f32_blob(&[2.0, 3.0, 0.0, 1.0, 99.0, 99.0])];
        let t = tensor(
            &[2, 2],
            vec![
                piece(&[1, 2], &[2, 1], &[1, 0], 0),
                piece(&[1, 2], &[2, 1], &[0, 0], 8),
            ],
        );
        assert_eq!(gathered(&t, &files, 0, 4).unwrap(), [0.0, 1.0, 2.0, 3.0]);
    }
}
