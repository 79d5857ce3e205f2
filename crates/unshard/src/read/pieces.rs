//! A tensor's elements gathered from its pieces: positioned reads of each piece's
//! runs, byte-swapped and converted on the way, a chunk at a time. The engine fills
//! its blocks with these, and [`super::read_tensor`] reads values into memory with
//! them.

use std::path::Path;
use std::sync::Arc;

use super::geometry::PieceRuns;
use crate::bytes::Blob;
use crate::dtype::{self, ConvertStats, DType};
use crate::error::{Error, Result};
use crate::source::{Piece, TensorSource};

/// Input bytes read and converted at a time: small enough to stay in a core's cache
/// between the read and the conversion.
pub(crate) const CHUNK_BYTES: usize = 1 << 20;

/// A tensor the engine copies: the pieces of one input's tensor, converted to
/// `dtype`.
pub(crate) struct Copied<'a> {
    /// The output name, for errors.
    pub(crate) name: &'a str,
    pub(crate) source: &'a TensorSource,
    pub(crate) dtype: DType,
}

/// Fills `out` with bytes `[byte0, byte1)` of tensor `t`'s output data. An element
/// cut by the range's edges (possible only if a tensor's offset in its file were not
/// a multiple of its element size, which the canonical layout never produces) is
/// converted whole and the part inside copied; it is counted in the stats of the
/// range that holds its last byte.
pub(crate) fn fill_bytes(
    t: &Copied<'_>,
    files: &[Arc<Blob>],
    byte0: u64,
    byte1: u64,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<ConvertStats> {
    let size = t.dtype.size() as u64;
    let (e0, e1) = (byte0.div_ceil(size), byte1 / size);
    let mut stats = ConvertStats::default();
    if e0 < e1 {
        let dst = &mut out[(e0 * size - byte0) as usize..(e1 * size - byte0) as usize];
        stats = fill_window(t, files, e0, e1, dst, scratch)?;
    }
    let mut cut = |e: u64| -> Result<()> {
        let mut elem = [0u8; 8];
        let elem = &mut elem[..size as usize];
        let s = fill_window(t, files, e, e + 1, elem, scratch)?;
        let (from, to) = (byte0.max(e * size), byte1.min((e + 1) * size));
        out[(from - byte0) as usize..(to - byte0) as usize]
            .copy_from_slice(&elem[(from - e * size) as usize..(to - e * size) as usize]);
        if (e + 1) * size <= byte1 {
            stats.add(s);
        }
        Ok(())
    };
    let head_cut = byte0 % size != 0;
    if head_cut {
        cut(byte0 / size)?;
    }
    // The last element, unless the range lies inside the one just done.
    if byte1 % size != 0 && !(head_cut && byte1 / size == byte0 / size) {
        cut(byte1 / size)?;
    }
    Ok(stats)
}

/// Fills output elements `[e0, e1)` of tensor `t` into `out`, reading the inputs
/// with positioned reads: straight into `out` when no conversion is needed, else a
/// chunk of `scratch` at a time.
pub(crate) fn fill_window(
    t: &Copied<'_>,
    files: &[Arc<Blob>],
    e0: u64,
    e1: u64,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<ConvertStats> {
    if scratch.len() < CHUNK_BYTES {
        scratch.resize(CHUNK_BYTES, 0);
    }
    let mut stats = ConvertStats::default();
    let osz = t.dtype.size() as u64;
    for p in &t.source.pieces {
        let blob = files.get(p.file).ok_or_else(|| {
            Error::bad_tensor(Path::new("?"), t.name, "piece refers to a missing file")
        })?;
        let isz = p.dtype.size() as u64;
        let chunk = CHUNK_BYTES as u64 / isz;
        let runs = PieceRuns::new(p, &t.source.shape);
        let stride = runs.stride;
        prefetch(blob, p, &runs, e0, e1);
        // Bytes a strided gather touched (a local file gathers from a map), released
        // when the piece is done.
        let mut touched: Option<(u64, u64)> = None;
        for (r, a, b) in runs.within(e0, e1) {
            let first_src = r.src + (a - r.out) * stride;
            let start = p.byte_offset + first_src * isz;
            let dst = &mut out[((a - e0) * osz) as usize..((b - e0) * osz) as usize];
            if stride == 1 && p.dtype == t.dtype && !p.big_endian {
                // Stored as written: one positioned read straight into the output.
                blob.read_at(start, dst)?;
                if t.dtype.is_float() {
                    stats.add(dtype::scan(dst, t.dtype));
                }
                continue;
            }
            let mut done = 0;
            while done < b - a {
                let n = chunk.min(b - a - done);
                let src = &mut scratch[..(n * isz) as usize];
                let at = start + done * stride * isz;
                if stride == 1 {
                    blob.read_at(at, src)?;
                } else {
                    // Strided (a transposed or expanded view, rare in checkpoints).
                    blob.read_strided(at, stride * isz, isz as usize, src)?;
                    let end = at + ((n - 1) * stride + 1) * isz;
                    touched = Some(touched.map_or((at, end), |(lo, hi)| (lo.min(at), hi.max(end))));
                }
                if p.big_endian {
                    dtype::byteswap(src, isz as usize);
                }
                let d = &mut dst[(done * osz) as usize..((done + n) * osz) as usize];
                stats.add(convert_run(src, p.dtype, d, t.dtype));
                done += n;
            }
        }
        if let Some((lo, hi)) = touched {
            blob.release(lo, hi - lo);
        }
    }
    Ok(stats)
}

/// Starts reading the bytes of piece `p` that elements `[e0, e1)` need, all at once,
/// so that the chunked reads that follow do not wait for the disk one after the other
/// (several threads reading different places of one file confuse the kernel's own
/// readahead). Only for contiguous runs whose span is not mostly gaps.
///
/// A span read by a single read (one run of at most [`CHUNK_BYTES`]) is not hinted:
/// that read asks for all of it at once anyway, and a checkpoint of many ranks has
/// hundreds of thousands of such pieces, where the hint would be one more system
/// call each.
pub(crate) fn prefetch(blob: &Blob, p: &Piece, runs: &PieceRuns<'_>, e0: u64, e1: u64) {
    if let Some((offset, len)) = piece_span(p, runs, e0, e1) {
        let j = runs.first_ending_after(e0);
        let one_run = j + 1 >= runs.count || runs.run(j + 1).out >= e1;
        if !(one_run && len <= CHUNK_BYTES as u64) {
            blob.will_need(offset, len);
        }
    }
}

/// The `(offset, len)` of the input bytes of piece `p` that elements `[e0, e1)` read,
/// when they form one contiguous span that is not mostly gaps (what [`prefetch`]
/// hints, and what a block announces to its sources).
pub(crate) fn piece_span(p: &Piece, runs: &PieceRuns<'_>, e0: u64, e1: u64) -> Option<(u64, u64)> {
    let isz = p.dtype.size() as u64;
    let j0 = runs.first_ending_after(e0);
    if runs.stride != 1 || j0 >= runs.count || e1 == 0 {
        return None;
    }
    let mut j1 = runs.first_ending_after(e1 - 1).min(runs.count - 1);
    if runs.run(j1).out >= e1 && j1 > j0 {
        j1 -= 1;
    }
    let (first, last) = (runs.run(j0), runs.run(j1));
    let a = first.out.max(e0);
    let b = (last.out + last.len).min(e1);
    if a >= b || first.out >= e1 {
        return None;
    }
    let start = first.src + (a - first.out);
    let end = last.src + (b - last.out);
    if end <= start || (end - start) > 2 * (b - a) {
        return None;
    }
    Some((p.byte_offset + start * isz, (end - start) * isz))
}

/// Converts one run of elements (see [`dtype::convert`]).
pub(crate) fn convert_run(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> ConvertStats {
    dtype::convert(src, from, dst, to)
}
