//! The block engine: fills aligned blocks of output files from the pieces of the
//! tensors they overlap, reading with positioned reads, byte-swapping and
//! converting on the way (computed tensors: the rows a block covers are evaluated
//! there, see `computed`), and writes each block with one positioned write.

use rayon::prelude::*;

use super::computed::Computed;
use super::direct::BufferPool;
use super::fetch;
use super::sink::ShardFile;
#[cfg(test)]
use super::NoProgress;
use super::{Inputs, Progress};
use crate::cancel::Cancel;
use crate::digest::{self, Sha};
use crate::dtype::ConvertStats;
use crate::error::Result;
use crate::plan::{Content, Origin, Plan};
use crate::read::batched::Batch;
use crate::read::geometry::PieceRuns;
use crate::read::pieces::{fill_bytes, Copied, CHUNK_BYTES};
use crate::source::FileId;

/// Fills and writes every block of every shard, in parallel; returns what conversion
/// saw per planned tensor, and per shard the digest of each block as written (see
/// `digest`) when `checksums`, else `None` for every block. `block_bytes` is a
/// multiple of [`DIRECT_ALIGN`].
pub(crate) fn write_blocks(
    plan: &Plan,
    inputs: Inputs<'_>,
    files: &[Box<dyn ShardFile>],
    block_bytes: u64,
    checksums: bool,
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<(Vec<ConvertStats>, BlockDigests)> {
    let mut blocks = Vec::new();
    for (shard, s) in plan.shards.iter().enumerate() {
        let mut start = 0;
        while start < s.file_size {
            let len = block_bytes.min(s.file_size - start);
            blocks.push(Block { shard, start, len });
            start += len;
        }
    }
    // What the readers read while parsing is not needed again: sources that keep a
    // copy (a cache) can drop it.
    for blob in inputs.all().flat_map(|c| &c.files) {
        blob.release_all();
    }
    // Blocks are written in any order, so take them in the order their input lies
    // on the disk: the threads then read a few streams front to back instead of
    // jumping about (a DCP file holds its chunks largest first, not by name).
    blocks.sort_by_cached_key(|b| input_position(plan, b));
    let pool = BufferPool::new(block_bytes as usize);
    let computed = Computed::new(inputs);
    // Inputs that wait on the network (object storage) want more reads in flight.
    let readers = inputs
        .all()
        .flat_map(|c| &c.files)
        .map(|b| b.source().readers())
        .max()
        .unwrap_or(0);
    let together = readers > 0;
    // Each block is hashed by the worker that filled it, just before its write,
    // while it is still in the core's cache: hashing (about 1-2 GB/s a core with
    // the SHA extensions) then runs on every worker at once. One hashing thread fed
    // the written buffers capped a merge at that one core's rate (2.2x slower than
    // without checksums on a 2-core machine, 1.1B model).
    let run = || {
        blocks
            .par_iter()
            .map(|b| {
                cancel.check()?;
                // Sources that pay per request fetch the block's input in one go.
                let _fetch = together.then(|| fetch::announce(plan, inputs, b));
                let mut bufs = pool.take();
                let out = bufs.block.slice_mut(b.len as usize);
                let (stats, tensor_bytes) =
                    fill_block(plan, inputs, &computed, b, out, &mut bufs.scratch)?;
                let size = plan.shards[b.shard].file_size;
                let digest = checksums
                    .then(|| digest::block(out, b.start, size))
                    .flatten();
                files[b.shard].write_block(out, b.start)?;
                pool.give(bufs);
                progress.advance(tensor_bytes);
                Ok((stats, digest))
            })
            .collect::<Result<Vec<(Vec<(usize, ConvertStats)>, Option<Sha>)>>>()
    };
    let workers = rayon::ThreadPoolBuilder::new()
        .num_threads(worker_threads().max(readers))
        .thread_name(|i| format!("unshard-write-{i}"))
        .build();
    let per_block = match workers {
        Ok(workers) => workers.install(run)?,
        // No threads to spare: the global pool does the work.
        Err(_) => run()?,
    };
    let mut stats = vec![ConvertStats::default(); plan.tensors.len()];
    let mut digests: BlockDigests = plan
        .shards
        .iter()
        .map(|s| vec![None; s.file_size.div_ceil(block_bytes) as usize])
        .collect();
    for (b, (per_tensor, digest)) in blocks.iter().zip(per_block) {
        for (ti, s) in per_tensor {
            stats[ti].add(s);
        }
        digests[b.shard][(b.start / block_bytes) as usize] = digest;
    }
    Ok((stats, digests))
}

/// Per shard, the digest of each block as written (`None`: not hashed).
pub(crate) type BlockDigests = Vec<Vec<Option<Sha>>>;

/// Where a block starts reading: the input (checkpoint before base), file and byte
/// offset of the first element of the first tensor it holds. `None` (sorted first)
/// for a block of header only.
pub(crate) fn input_position(plan: &Plan, b: &Block) -> Option<(bool, FileId, u64)> {
    let shard = &plan.shards[b.shard];
    let first = shard
        .entries
        .partition_point(|&(ti, off)| off + plan.tensors[ti].nbytes() <= b.start);
    let &(ti, off) = shard.entries[first..]
        .iter()
        .find(|&&(ti, _)| plan.tensors[ti].nbytes() > 0)?;
    let t = &plan.tensors[ti];
    let e = (b.start.max(off) - off) / t.dtype.size() as u64;
    // A computed tensor: where its first leaf (a fuse's base weight) lies.
    let (source, origin) = match &t.content {
        Content::Copy(s) => (s, t.origin),
        Content::Computed(expr) => {
            let leaf = *expr.leaves().first()?;
            (&leaf.source, leaf.input)
        }
    };
    source.pieces.iter().find_map(|p| {
        let runs = PieceRuns::new(p, &source.shape);
        let j = runs.first_ending_after(e);
        if j >= runs.count {
            return None;
        }
        let r = runs.run(j);
        (r.out <= e).then(|| {
            let src = r.src + (e - r.out) * runs.stride;
            (
                origin == Origin::Base,
                p.file,
                p.byte_offset + src * p.dtype.size() as u64,
            )
        })
    })
}

/// Threads that fill and write blocks. One per core keeps the cores busy while data
/// is in the page cache; twice that keeps them busy while some threads wait for the
/// disk (a direct write returns when the data is on the device). Each holds a block
/// and a chunk (9 MiB); 16 of them convert far faster than any disk delivers, so more
/// would only add memory.
pub(crate) fn worker_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cores).min(16)
}

/// One unit of work: bytes `[start, start + len)` of shard `shard`'s file.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    pub(super) shard: usize,
    pub(super) start: u64,
    pub(super) len: u64,
}

/// A tensor a block overlaps.
pub(crate) struct Overlap {
    /// The tensor, by index in the plan.
    pub(crate) ti: usize,
    /// Where it starts in the shard file.
    pub(crate) off: u64,
    /// The bytes of the shard file `[lo, hi)` it has in the block (never empty).
    pub(crate) lo: u64,
    pub(crate) hi: u64,
}

impl Block {
    /// The tensors with bytes in the block, in file order.
    pub(crate) fn overlaps<'p>(&self, plan: &'p Plan) -> impl Iterator<Item = Overlap> + 'p {
        let entries = &plan.shards[self.shard].entries;
        let (b0, b1) = (self.start, self.start + self.len);
        let first = entries.partition_point(|&(ti, off)| off + plan.tensors[ti].nbytes() <= b0);
        entries[first..]
            .iter()
            .take_while(move |&&(_, off)| off < b1)
            .map(move |&(ti, off)| Overlap {
                ti,
                off,
                lo: off.max(b0),
                hi: (off + plan.tensors[ti].nbytes()).min(b1),
            })
            .filter(|o| o.lo < o.hi)
    }
}

/// Fills `out` with the bytes of `block`: the header and the tensors it overlaps.
pub(crate) fn fill_block(
    plan: &Plan,
    inputs: Inputs<'_>,
    computed: &Computed<'_>,
    block: &Block,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<(Vec<(usize, ConvertStats)>, u64)> {
    let shard = &plan.shards[block.shard];
    let (b0, b1) = (block.start, block.start + block.len);
    let header = shard.header.len() as u64;
    // Bytes of `out` filled so far; gaps (a plan leaves none) are zeroed.
    let mut filled = 0u64;
    if b0 < header {
        let n = header.min(b1) - b0;
        out[..n as usize].copy_from_slice(&shard.header[b0 as usize..(b0 + n) as usize]);
        filled = n;
    }
    let mut stats = Vec::new();
    // Tensors whose pieces are all small are read together, file by file, after
    // the others (see `batched`).
    let mut batch = Batch::default();
    for Overlap { ti, off, lo, hi } in block.overlaps(plan) {
        let t = &plan.tensors[ti];
        if lo - b0 > filled {
            out[filled as usize..(lo - b0) as usize].fill(0);
        }
        let dst = &mut out[(lo - b0) as usize..(hi - b0) as usize];
        let source = match &t.content {
            Content::Copy(source) => source,
            Content::Computed(expr) => {
                stats.push((ti, computed.fill(t, expr, lo - off, hi - off, dst)?));
                filled = hi - b0;
                continue;
            }
        };
        let copy = Copied {
            name: &t.name,
            source,
            dtype: t.dtype,
        };
        let size = t.dtype.size() as u64;
        let whole = (lo - off) % size == 0 && (hi - off) % size == 0;
        let window = ((lo - off) / size, (hi - off) / size);
        let files = inputs.files(t.origin);
        if whole && batch.add(ti, &copy, files, window, (lo - b0) as usize) {
            filled = hi - b0;
            continue;
        }
        let s = fill_bytes(&copy, files, lo - off, hi - off, dst, scratch)?;
        stats.push((ti, s));
        filled = hi - b0;
    }
    out[filled as usize..].fill(0);
    if scratch.len() < CHUNK_BYTES {
        scratch.resize(CHUNK_BYTES, 0);
    }
    stats.extend(batch.fill(out, scratch)?);
    Ok((stats, block.len - header.saturating_sub(b0).min(block.len)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::bytes::Blob;
    use crate::dtype::{self, DType};
    use crate::plan::{Candidate, PlannedTensor};
    use crate::source::{contiguous_strides, Checkpoint, Format};
    use crate::source::{Piece, TensorSource};
    use std::path::PathBuf;
    use std::sync::Arc;

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn source(name: &str, dtype: DType, shape: &[u64], pieces: Vec<Piece>) -> TensorSource {
        TensorSource {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces: pieces.into(),
            storage: None,
            layout: None,
        }
    }

    fn stored(dtype: DType, byte_offset: u64, shape: &[u64], global_offset: &[u64]) -> Piece {
        Piece {
            file: 0,
            byte_offset,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            global_offset: global_offset.to_vec(),
            big_endian: false,
        }
    }

    /// A shard laid out by hand so that elements straddle block edges (a 14-byte
    /// header, then 3 bytes, then 2- and 4-byte elements at odd offsets), written in
    /// 4 KiB blocks: the file must equal the tensors converted whole, and a value
    /// cut by a block edge must be counted once.
    #[test]
    fn blocks_fill_elements_cut_by_their_edges() {
        let a: Vec<f32> = (0..3000)
            .map(|i| {
                if i == 2039 {
                    f32::NAN
                } else {
                    i as f32 * 0.37 - 5.0
                }
            })
            .collect();
        let c: Vec<f32> = (0..4000)
            .map(|i| {
                if i == 543 {
                    f32::INFINITY
                } else {
                    1.0 / (i as f32 + 0.5)
                }
            })
            .collect();
        // Input file: A, then B's 3 bytes, then C as two column shards of a 4x1000.
        let mut input = le_bytes(&a);
        input.extend_from_slice(&[7, 8, 9]);
        let c_at = input.len() as u64;
        for half in 0..2 {
            for row in 0..4 {
                input.extend(le_bytes(
                    &c[row * 1000 + half * 500..row * 1000 + half * 500 + 500],
                ));
            }
        }
        let blob = Arc::new(Blob::owned(PathBuf::from("input"), input));
        let ckpt = Checkpoint {
            format: Format::TorchZip,
            path: PathBuf::from("input"),
            files: vec![blob],
            key: None,
            tensors: Vec::new(),
            extras: Vec::new(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        };
        let planned = |name: &str, dtype: DType, source: TensorSource| PlannedTensor {
            name: name.into(),
            dtype,
            ..PlannedTensor::from_candidate(Candidate::copy(Origin::Checkpoint, &source))
        };
        let tensors = vec![
            planned(
                "a",
                DType::BF16,
                source(
                    "a",
                    DType::F32,
                    &[3000],
                    vec![stored(DType::F32, 0, &[3000], &[0])],
                ),
            ),
            planned(
                "b",
                DType::U8,
                source(
                    "b",
                    DType::U8,
                    &[3],
                    vec![stored(DType::U8, 12_000, &[3], &[0])],
                ),
            ),
            planned(
                "c",
                DType::F32,
                source(
                    "c",
                    DType::F32,
                    &[4, 1000],
                    vec![
                        stored(DType::F32, c_at, &[4, 500], &[0, 0]),
                        stored(DType::F32, c_at + 8000, &[4, 500], &[0, 500]),
                    ],
                ),
            ),
        ];
        let header = b"fourteen bytes".to_vec();
        let entries = vec![(1, 14), (0, 17), (2, 6017)];
        let file_size = 6017 + 16_000;
        let plan = Plan {
            tensors,
            shards: vec![crate::plan::ShardPlan {
                file_name: "x.safetensors".into(),
                header: header.clone(),
                entries,
                file_size,
            }],
            dtype: None,
            config: None,
            index: None,
            total_size: file_size - 14,
            report: Default::default(),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let files: Vec<Box<dyn ShardFile>> = vec![Box::new(
            super::super::direct::OutFile::create(&path, file_size).unwrap(),
        )];
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
            extra: &[],
        };
        let (stats, digests) = write_blocks(
            &plan,
            inputs,
            &files,
            4096,
            true,
            &NoProgress,
            &Cancel::new(),
        )
        .unwrap();
        drop(files);

        let mut want = header;
        want.extend_from_slice(&[7, 8, 9]);
        let mut a_bf16 = vec![0u8; 6000];
        dtype::convert(&le_bytes(&a), DType::F32, &mut a_bf16, DType::BF16);
        want.extend(a_bf16);
        want.extend(le_bytes(&c));
        assert_eq!(std::fs::read(&path).unwrap(), want);
        // The blocks' digests merge to the file's BLAKE3 hash.
        let d = digest::FileDigest {
            size: want.len() as u64,
            blocks: digests[0].clone(),
        };
        assert_eq!(d.blocks.len(), want.len().div_ceil(4096));
        assert_eq!(d.tree_in(4096), Some(<Sha>::from(blake3::hash(&want))));
        assert_eq!(stats[0].nan, 1, "a NaN cut by a block edge is counted once");
        assert_eq!(
            stats[2].inf, 1,
            "an inf cut by a block edge is counted once"
        );
    }
}
