//! Computed tensors ([`Content::Computed`]) inside the block engine.
//!
//! A block that overlaps a computed tensor fills those bytes itself, as it fills a
//! copied tensor's: it evaluates, in float32, only the rows (indices along dimension
//! 0) that its byte range covers, converts them once to the output dtype with the
//! same kernels as a copy, and the block is written like any other (direct I/O, a
//! part of a multipart upload, the shard of one `--part`). Every expression node is
//! row-local: a leaf's rows are a range of its elements (read and widened by the
//! copy path's reader and kernels), a concatenation, permutation or narrowing takes
//! rows of its inputs, and a LoRA fuse adds the update of just those rows
//! (`dtype::fuse::fuse_rows`, which gives each element exactly what fusing the whole
//! tensor gives). The one exception, DoRA over a transposed layout (Conv1D,
//! embeddings), rescales columns by norms over every row: those are computed once
//! per tensor, streaming its rows a batch at a time, and kept (one float per column)
//! until the pass ends.
//!
//! So computed tensors are evaluated in parallel, block by block, on the engine's
//! workers, overlapping with the copies, and no tensor is ever held whole. Memory
//! per worker: a batch of at most [`BATCH_ELEMS`] float32 values (256 KiB; one row,
//! if a row is longer) for each level of the expression being evaluated, one tile
//! of a fuse's update (256 KiB), and the factors A and B (and DoRA's magnitude) of
//! the fuse it evaluated last, whole in float32 (rank-sized); the buffers are kept
//! for reuse (`buffers`, at most 8 per worker). With up to 16 workers that is a few
//! MiB each plus the factors, whatever the model: the TinyLlama-1.1B fuse of the
//! README peaks at 61 MB of RSS, against 43 MB for a plain merge.
//!
//! The factors are read once per worker and tensor (a thread keeps the last
//! fuse's), and rows cut by a block's edge are computed by both blocks; the cost is
//! a few rows per block.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::dtype::fuse::{self as math, Factors};
use crate::dtype::DType;
use crate::dtype::{self, ConvertStats};
use crate::error::{Error, Result};
use crate::plan::Inputs;
use crate::plan::{Expr, PlannedTensor};

use crate::read::{read_tensor_range, windows};
use buffers::{bytes_mut, from_le, le_bytes, rows_of, Buf};

mod buffers;

/// A fuse's factors: A, B and DoRA's magnitude.
type FuseFactors = (Buf, Buf, Option<Buf>);

/// The factors a thread read last, by (write, node).
type LastFactors = Option<((u64, usize), Rc<FuseFactors>)>;

thread_local! {
    /// The update of the rows being fused, grown once per worker.
    static DELTA: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The factors of the fuse this thread evaluated last, by (write, node).
    static LAST_FACTORS: RefCell<LastFactors> = const { RefCell::new(None) };
}

/// Tells one write's [`Computed`] from another's (node addresses may repeat).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Float32 values a block evaluates at a time (256 KiB: the rows, their update and
/// their output bytes stay in a core's cache from the read to the conversion).
pub(crate) const BATCH_ELEMS: u64 = 1 << 16;

/// What the blocks of one write share about computed tensors: the inputs, and the
/// column factors of transposed DoRA fuses, computed once each.
pub(crate) struct Computed<'a> {
    id: u64,
    inputs: Inputs<'a>,
    /// By the address of the `Fuse` node (the plan is borrowed for the whole pass).
    columns: Mutex<HashMap<usize, ColumnSlot>>,
}

/// One transposed DoRA fuse's column factors, once the first block computed them.
type ColumnSlot = Arc<Mutex<Option<Arc<Vec<f32>>>>>;

impl<'a> Computed<'a> {
    pub(crate) fn new(inputs: Inputs<'a>) -> Computed<'a> {
        Computed {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            inputs,
            columns: Mutex::new(HashMap::new()),
        }
    }

    /// Fills bytes `[byte0, byte1)` of computed tensor `t`'s output data into `out`.
    /// An element cut by the range's edges is converted whole and the part inside
    /// copied; it is counted in the stats of the range that holds its last byte (as
    /// copies are).
    pub(crate) fn fill(
        &self,
        t: &PlannedTensor,
        expr: &Expr,
        byte0: u64,
        byte1: u64,
        out: &mut [u8],
    ) -> Result<ConvertStats> {
        let size = t.dtype.size() as u64;
        let mut stats = ConvertStats::default();
        let (_, row_len) = rows_of(&t.shape);
        if byte0 >= byte1 || row_len == 0 {
            return Ok(stats);
        }
        let (e_first, e_end, counted_end) = (byte0 / size, byte1.div_ceil(size), byte1 / size);
        let per = (BATCH_ELEMS / row_len).max(1);
        let mut cut = Vec::new();
        let head_cut = byte0 % size != 0;
        let cuts = [
            head_cut.then_some(byte0 / size),
            (byte1 % size != 0 && !(head_cut && byte1 / size == byte0 / size))
                .then_some(byte1 / size),
        ];
        for (ra, rb) in windows(e_first / row_len, e_end.div_ceil(row_len), per) {
            let values = self.rows(&t.name, expr, ra, rb)?;
            let base = ra * row_len;
            let (a, b) = (base.max(e_first), (rb * row_len).min(e_end));
            let src = le_bytes(&values[(a - base) as usize..(b - base) as usize]);
            // Whole elements inside the range convert straight into `out`.
            let (wa, wb) = (a.max(byte0.div_ceil(size)), b.min(counted_end));
            if wa < wb {
                let dst = &mut out[(wa * size - byte0) as usize..(wb * size - byte0) as usize];
                stats.add(dtype::convert(
                    &src[((wa - a) * 4) as usize..((wb - a) * 4) as usize],
                    DType::F32,
                    dst,
                    t.dtype,
                ));
            }
            // Elements cut by an edge (never, in the canonical layout).
            for e in cuts
                .iter()
                .flatten()
                .copied()
                .filter(|e| (a..b).contains(e))
            {
                cut.resize(size as usize, 0);
                let i = ((e - a) * 4) as usize;
                let s = dtype::convert(&src[i..i + 4], DType::F32, &mut cut, t.dtype);
                let (from, to) = (byte0.max(e * size), byte1.min((e + 1) * size));
                out[(from - byte0) as usize..(to - byte0) as usize]
                    .copy_from_slice(&cut[(from - e * size) as usize..(to - e * size) as usize]);
                if (e + 1) * size <= byte1 {
                    stats.add(s);
                }
            }
        }
        Ok(stats)
    }

    /// Rows `[ra, rb)` (along dimension 0) of `e`'s value, float32, C order.
    fn rows(&self, name: &str, e: &Expr, ra: u64, rb: u64) -> Result<Buf> {
        let shape = e.shape(name)?;
        let (rows, row_len) = rows_of(&shape);
        if ra > rb || rb > rows {
            return Err(Error::plan(
                format!("computed tensor '{name}': rows {ra}..{rb} of a {shape:?} value"),
                None,
            ));
        }
        match e {
            Expr::Leaf(l) => {
                let mut v = Buf::new(((rb - ra) * row_len) as usize);
                let files = self.inputs.files(l.input);
                read_tensor_range(
                    files,
                    &l.source,
                    DType::F32,
                    ra * row_len,
                    rb * row_len,
                    bytes_mut(&mut v),
                )?;
                from_le(&mut v);
                Ok(v)
            }
            Expr::Concat { dim: 0, parts } => {
                let mut out = Buf::new(((rb - ra) * row_len) as usize);
                let (mut at, mut filled) = (0, 0);
                for p in parts {
                    let n = rows_of(&p.shape(name)?).0;
                    let (a, b) = (ra.max(at), rb.min(at + n));
                    if a < b {
                        let v = self.rows(name, p, a - at, b - at)?;
                        out[filled..filled + v.len()].copy_from_slice(&v);
                        filled += v.len();
                    }
                    at += n;
                }
                Ok(out)
            }
            Expr::Concat { dim, parts } => {
                let outer = ((rb - ra) * shape[1..*dim].iter().product::<u64>()) as usize;
                let out_row = shape[*dim..].iter().product::<u64>() as usize;
                let mut out = Buf::new(outer * out_row);
                let mut at = 0;
                for p in parts {
                    let part_row = p.shape(name)?[*dim..].iter().product::<u64>() as usize;
                    let v = self.rows(name, p, ra, rb)?;
                    for o in 0..outer {
                        out[o * out_row + at..o * out_row + at + part_row]
                            .copy_from_slice(&v[o * part_row..(o + 1) * part_row]);
                    }
                    at += part_row;
                }
                Ok(out)
            }
            Expr::PermuteRows { rows: order, input } => {
                let mut out = Buf::new(((rb - ra) * row_len) as usize);
                let mut filled = 0;
                let mut i = ra as usize;
                while i < rb as usize {
                    // A run of rows that follow each other in the input: one read.
                    let start = order[i];
                    let mut j = i + 1;
                    while j < rb as usize && order[j] == start + (j - i) as u64 {
                        j += 1;
                    }
                    let v = self.rows(name, input, start, start + (j - i) as u64)?;
                    out[filled..filled + v.len()].copy_from_slice(&v);
                    filled += v.len();
                    i = j;
                }
                Ok(out)
            }
            Expr::Slice {
                dim: 0,
                start,
                input,
                ..
            } => self.rows(name, input, start + ra, start + rb),
            Expr::Slice {
                dim,
                start,
                len,
                input,
            } => {
                let in_shape = input.shape(name)?;
                let outer = ((rb - ra) * in_shape[1..*dim].iter().product::<u64>()) as usize;
                let inner = in_shape[dim + 1..].iter().product::<u64>() as usize;
                let (in_row, out_row) = (in_shape[*dim] as usize * inner, *len as usize * inner);
                let from = *start as usize * inner;
                let v = self.rows(name, input, ra, rb)?;
                let mut out = Buf::new(outer * out_row);
                for o in 0..outer {
                    out[o * out_row..(o + 1) * out_row]
                        .copy_from_slice(&v[o * in_row + from..o * in_row + from + out_row]);
                }
                Ok(out)
            }
            Expr::Fuse {
                base,
                a,
                b,
                magnitude,
                scale,
                layout,
            } => {
                let (rows, cols) = (shape[0] as usize, shape[1] as usize);
                let factors = self.factors(name, e, a, b, magnitude.as_deref())?;
                let (a, b, m) = (&factors.0, &factors.1, factors.2.as_deref());
                let f = Factors {
                    layout: *layout,
                    a,
                    b,
                    rank: (a.len())
                        .checked_div(if layout.transposed() { rows } else { cols })
                        .unwrap_or(0),
                    scale: *scale,
                    magnitude: m,
                };
                let columns = match (m, layout.transposed()) {
                    (Some(m), true) => Some(self.column_factors(name, e, base, &f, m)?),
                    _ => None,
                };
                let mut w = self.rows(name, base, ra, rb)?;
                DELTA.with_borrow_mut(|delta| {
                    math::fuse_rows(
                        &mut w,
                        rows,
                        cols,
                        ra as usize,
                        &f,
                        columns.as_deref().map(|c| &c[..]),
                        delta,
                    )
                });
                Ok(w)
            }
        }
    }

    /// A fuse's factors A, B (and DoRA's magnitude) in float32, read whole. A block
    /// evaluates a tensor in several batches, so the thread keeps the last fuse's
    /// factors (keyed by this write and the node) instead of reading them again.
    fn factors(
        &self,
        name: &str,
        node: &Expr,
        a: &Expr,
        b: &Expr,
        m: Option<&Expr>,
    ) -> Result<Rc<FuseFactors>> {
        let key = (self.id, node as *const Expr as usize);
        let hit =
            LAST_FACTORS.with_borrow(|c| c.as_ref().filter(|c| c.0 == key).map(|c| c.1.clone()));
        if let Some(f) = hit {
            return Ok(f);
        }
        let whole = |x: &Expr| -> Result<Buf> {
            let n = rows_of(&x.shape(name)?).0;
            self.rows(name, x, 0, n)
        };
        let f = Rc::new((whole(a)?, whole(b)?, m.map(whole).transpose()?));
        LAST_FACTORS.with_borrow_mut(|c| *c = Some((key, f.clone())));
        Ok(f)
    }

    /// The column factors `m / ||column||` of a transposed DoRA fuse `node`: every
    /// row of `base + update` is streamed once, a batch at a time, the first time a
    /// block asks; the blocks that ask meanwhile wait for that one.
    fn column_factors(
        &self,
        name: &str,
        node: &Expr,
        base: &Expr,
        f: &Factors<'_>,
        m: &[f32],
    ) -> Result<Arc<Vec<f32>>> {
        let slot = {
            let mut map = self.columns.lock().unwrap_or_else(PoisonError::into_inner);
            map.entry(node as *const Expr as usize).or_default().clone()
        };
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = &*slot {
            return Ok(c.clone());
        }
        let shape = base.shape(name)?;
        let (rows, cols) = (shape[0], shape[1] as usize);
        let plain = Factors {
            magnitude: None,
            ..*f
        };
        let mut sums = vec![0f64; cols];
        let mut delta = Vec::new();
        // (Its own scratch: the caller holds the thread's.)
        for (ra, rb) in windows(0, rows, (BATCH_ELEMS / cols.max(1) as u64).max(1)) {
            let mut w = self.rows(name, base, ra, rb)?;
            math::fuse_rows(
                &mut w,
                rows as usize,
                cols,
                ra as usize,
                &plain,
                None,
                &mut delta,
            );
            math::dora_column_sums(&mut sums, &w);
        }
        let c = Arc::new(math::dora_column_factors(&sums, m));
        *slot = Some(c.clone());
        Ok(c)
    }
}

#[cfg(test)]
mod tests;
