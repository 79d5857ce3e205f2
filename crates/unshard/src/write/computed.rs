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
//! (`lora::math::fuse_rows`, which gives each element exactly what fusing the whole
//! tensor gives). The one exception, DoRA over a transposed layout (Conv1D,
//! embeddings), rescales columns by norms over every row: those are computed once
//! per tensor, streaming its rows a batch at a time, and kept (one float per column)
//! until the pass ends.
//!
//! So computed tensors are evaluated in parallel, block by block, on the engine's
//! workers, overlapping with the copies, and no tensor is ever held whole. Memory
//! per worker: a batch of at most [`BATCH_ELEMS`] float32 values (or one row, if a
//! row is longer) for each level of the expression being evaluated (a fuse: the
//! rows and their update), plus a fuse's factors A and B (and DoRA's magnitude)
//! whole in float32, which are rank-sized. With the default 8 MiB blocks and up to
//! 16 workers, that is 16 × (2 × 4 MiB + the factors) at most, whatever the model.
//!
//! A tensor that spans several blocks reads its factors once per block (small), and
//! rows cut by a block's edge are computed by both blocks; the cost is a few rows
//! per block.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::dtype::{self, ConvertStats};
use crate::lora::math::{self, Factors};
use crate::plan::{Expr, PlannedTensor};
use crate::prepare::Inputs;
use crate::{DType, Error, Result};

use super::read::{read_tensor_range, windows};

/// Float32 values a block evaluates at a time (4 MiB).
pub(crate) const BATCH_ELEMS: u64 = 1 << 20;

/// What the blocks of one write share about computed tensors: the inputs, and the
/// column factors of transposed DoRA fuses, computed once each.
pub(crate) struct Computed<'a> {
    inputs: Inputs<'a>,
    /// By the address of the `Fuse` node (the plan is borrowed for the whole pass).
    columns: Mutex<HashMap<usize, ColumnSlot>>,
}

/// One transposed DoRA fuse's column factors, once the first block computed them.
type ColumnSlot = Arc<Mutex<Option<Arc<Vec<f32>>>>>;

impl<'a> Computed<'a> {
    pub(crate) fn new(inputs: Inputs<'a>) -> Computed<'a> {
        Computed {
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
    fn rows(&self, name: &str, e: &Expr, ra: u64, rb: u64) -> Result<Vec<f32>> {
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
                let mut v = vec![0f32; ((rb - ra) * row_len) as usize];
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
                let mut out = Vec::with_capacity(((rb - ra) * row_len) as usize);
                let mut at = 0;
                for p in parts {
                    let n = rows_of(&p.shape(name)?).0;
                    let (a, b) = (ra.max(at), rb.min(at + n));
                    if a < b {
                        out.extend(self.rows(name, p, a - at, b - at)?);
                    }
                    at += n;
                }
                Ok(out)
            }
            Expr::Concat { dim, parts } => {
                let outer = ((rb - ra) * shape[1..*dim].iter().product::<u64>()) as usize;
                let out_row = shape[*dim..].iter().product::<u64>() as usize;
                let mut out = vec![0f32; outer * out_row];
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
                let mut out = Vec::with_capacity(((rb - ra) * row_len) as usize);
                let mut i = ra as usize;
                while i < rb as usize {
                    // A run of rows that follow each other in the input: one read.
                    let start = order[i];
                    let mut j = i + 1;
                    while j < rb as usize && order[j] == start + (j - i) as u64 {
                        j += 1;
                    }
                    out.extend(self.rows(name, input, start, start + (j - i) as u64)?);
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
                let mut out = vec![0f32; outer * out_row];
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
                let whole = |x: &Expr| -> Result<Vec<f32>> {
                    let n = rows_of(&x.shape(name)?).0;
                    self.rows(name, x, 0, n)
                };
                let (a, b) = (whole(a)?, whole(b)?);
                let m = magnitude.as_deref().map(whole).transpose()?;
                let f = Factors {
                    layout: *layout,
                    a: &a,
                    b: &b,
                    rank: (a.len())
                        .checked_div(if layout.transposed() { rows } else { cols })
                        .unwrap_or(0),
                    scale: *scale,
                    magnitude: m.as_deref(),
                };
                let columns = match (&m, layout.transposed()) {
                    (Some(m), true) => Some(self.column_factors(name, e, base, &f, m)?),
                    _ => None,
                };
                let mut w = self.rows(name, base, ra, rb)?;
                let mut delta = Vec::new();
                math::fuse_rows(
                    &mut w,
                    rows,
                    cols,
                    ra as usize,
                    &f,
                    columns.as_deref().map(|c| &c[..]),
                    &mut delta,
                );
                Ok(w)
            }
        }
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

/// `(rows, elements per row)` of a value of `shape`: a scalar is one row of one.
fn rows_of(shape: &[u64]) -> (u64, u64) {
    match shape.split_first() {
        None => (1, 1),
        Some((&rows, rest)) => (rows, rest.iter().product()),
    }
}

/// The values as little-endian bytes (the kernels' input), without a copy on a
/// little-endian machine.
fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: an f32 is 4 bytes without padding and any byte may be read as a
        // u8; the slice borrows `v` for its whole life and covers exactly its bytes.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        })
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The bytes of `v`, for a reader to fill with little-endian float32s (then
/// [`from_le`]).
fn bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: an f32 is 4 bytes without padding and every bit pattern is a valid
    // f32, so any bytes written through the slice leave valid values; the slice
    // borrows `v` mutably for its whole life and covers exactly its bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Values filled as little-endian bytes, in the machine's order.
fn from_le(v: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in v {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use super::super::direct::OutFile;
    use super::super::engine::write_blocks;
    use super::super::{NoProgress, ShardFile, WINDOW_BYTES};
    use crate::cancel::Cancel;
    use crate::lora::math::{self, Factors, Layout};
    use crate::options::MergeOptions;
    use crate::plan::{Candidate, Expr, Origin, Plan, PlannedTensor, ShardPlan};
    use crate::prepare::{prepare, Inputs};
    use crate::source::{contiguous_strides, Blob, Checkpoint, Format, Piece, TensorSource};
    use crate::{dtype, DType};

    /// Writes `plan` with blocks of `block` bytes; the shards' bytes.
    fn write(plan: &Plan, inputs: Inputs<'_>, block: u64) -> Vec<Vec<u8>> {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<Box<dyn ShardFile>> = plan
            .shards
            .iter()
            .map(|s| {
                let f = OutFile::create(&dir.path().join(&s.file_name), s.file_size).unwrap();
                Box::new(f) as Box<dyn ShardFile>
            })
            .collect();
        write_blocks(plan, inputs, &files, block, &NoProgress, &Cancel::new()).unwrap();
        drop(files);
        let read = |s: &ShardPlan| std::fs::read(dir.path().join(&s.file_name)).unwrap();
        plan.shards.iter().map(read).collect()
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Fused weights far larger than a block, of odd widths (rows cut by block
    /// edges), in every layout, with and without DoRA: the bytes written a block at
    /// a time are the whole-tensor fuse (`math::fuse`) converted once.
    #[test]
    fn fused_rows_cut_by_blocks_equal_the_whole_tensor_fuse() {
        let (rows, cols, r) = (301usize, 77usize, 5usize);
        let mut bytes = Vec::new();
        let mut leaf = |name: &str, values: &[f32], shape: &[u64]| {
            let at = bytes.len() as u64;
            bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            Expr::leaf(
                Origin::Checkpoint,
                TensorSource {
                    name: name.into(),
                    dtype: DType::F32,
                    shape: shape.to_vec(),
                    pieces: vec![Piece {
                        file: 0,
                        byte_offset: at,
                        dtype: DType::F32,
                        shape: shape.to_vec(),
                        strides: contiguous_strides(shape),
                        global_offset: vec![0; shape.len()],
                        big_endian: false,
                    }],
                    storage: None,
                    layout: None,
                },
            )
        };
        let w = random(rows * cols, 1);
        let mut tensors = Vec::new();
        let mut want = Vec::new();
        for (i, layout) in [Layout::Linear, Layout::FanInFanOut, Layout::Embedding]
            .into_iter()
            .enumerate()
        {
            for dora in [false, true] {
                let seed = 10 * i as u64 + dora as u64;
                let (sa, sb) = layout.factor_shapes(rows as u64, cols as u64, r as u64);
                let a = random(r * (sa[1] as usize), seed + 2);
                let b = random(r * (sb[0] as usize), seed + 3);
                let channels = layout.out_channels(rows as u64, cols as u64) as usize;
                let m = dora.then(|| random(channels, seed + 4));
                let name = format!("w{i}{dora}");
                let expr = Expr::Fuse {
                    base: Box::new(leaf("w", &w, &[rows as u64, cols as u64])),
                    a: Box::new(leaf("a", &a, &sa)),
                    b: Box::new(leaf("b", &b, &sb)),
                    magnitude: m
                        .as_ref()
                        .map(|m| Box::new(leaf("m", m, &[channels as u64]))),
                    scale: 0.37,
                    layout,
                };
                let mut whole = w.clone();
                math::fuse(
                    &mut whole,
                    rows,
                    cols,
                    &Factors {
                        layout,
                        a: &a,
                        b: &b,
                        rank: r,
                        scale: 0.37,
                        magnitude: m.as_deref(),
                    },
                );
                let src: Vec<u8> = whole.iter().flat_map(|v| v.to_le_bytes()).collect();
                let mut bf16 = vec![0u8; rows * cols * 2];
                dtype::convert(&src, DType::F32, &mut bf16, DType::BF16);
                want.extend(bf16);
                let c = Candidate::computed(&name, "w", Origin::Checkpoint, expr).unwrap();
                tensors.push(PlannedTensor {
                    dtype: DType::BF16,
                    ..PlannedTensor::from_candidate(c)
                });
            }
        }
        // Laid out back to back after a header that puts the first row off a block edge.
        let header = vec![b' '; 1000];
        let each = (rows * cols * 2) as u64;
        let entries = (0..tensors.len())
            .map(|i| (i, 1000 + i as u64 * each))
            .collect();
        let file_size = 1000 + tensors.len() as u64 * each;
        let plan = Plan {
            tensors,
            shards: vec![ShardPlan {
                file_name: "x.safetensors".into(),
                header: header.clone(),
                entries,
                file_size,
            }],
            dtype: None,
            config: None,
            index: None,
            total_size: file_size - 1000,
            report: Default::default(),
        };
        let ckpt = Checkpoint {
            format: Format::TorchZip,
            path: PathBuf::from("input"),
            files: vec![Arc::new(Blob::owned(PathBuf::from("input"), bytes))],
            key: None,
            tensors: Vec::new(),
            extras: Vec::new(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        };
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        let mut expected = header;
        expected.extend(want);
        for block in [4096, 3 * 4096, WINDOW_BYTES] {
            let got = write(&plan, inputs, block);
            assert!(
                got[0] == expected,
                "{block}-byte blocks: first difference at byte {:?}",
                got[0].iter().zip(&expected).position(|(a, b)| a != b)
            );
        }
    }

    /// Every LoRA fixture case merged with 4 KiB blocks (tensors cut across many
    /// blocks, evaluated by many workers in any order) gives the bytes of 8 MiB
    /// blocks (each tensor whole in one block).
    #[test]
    fn lora_fixtures_give_the_same_bytes_whatever_the_blocks() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
        let text = std::fs::read_to_string(fixtures.join("lora/cases.json")).unwrap();
        let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut checked = 0;
        for case in cases["cases"].as_array().unwrap() {
            let args: Vec<&str> = case["extra_args"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            let arg = |f: &str| args.iter().position(|a| *a == f).map(|i| args[i + 1]);
            let mut opts = MergeOptions {
                checkpoint: fixtures.join(case["adapter"].as_str().unwrap()),
                base: Some(fixtures.join(case["base"].as_str().unwrap())),
                ..MergeOptions::default()
            };
            opts.adapter.name = arg("--adapter").map(str::to_string);
            opts.adapter.config = arg("--adapter-config").map(|p| fixtures.join(p));
            let p = prepare(&opts).unwrap();
            let fused = p
                .plan
                .tensors
                .iter()
                .filter(|t| matches!(&t.content, crate::plan::Content::Computed(_)))
                .count();
            assert!(fused > 0, "{}", case["name"]);
            assert_eq!(
                write(&p.plan, p.inputs(), 4096),
                write(&p.plan, p.inputs(), WINDOW_BYTES),
                "{}",
                case["name"]
            );
            checked += 1;
        }
        assert!(checked >= 8, "only {checked} cases");
    }
}
