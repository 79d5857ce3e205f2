//! The content pass of `verify`: each shard is read once, in blocks of
//! [`WINDOW_BYTES`] at file offsets `k × WINDOW_BYTES` (the writer's blocks), and
//! each block serves twice: its BLAKE3 digest is taken (compared by `checksums` with
//! what the writer hashed, or with `unshard.json`), and the tensor elements that
//! start in it are compared with the expected values (gathered from the inputs,
//! or a computed tensor's reference). So verifying costs one read of the output.
//!
//! An element cut by a block edge (a tensor whose offset is not a multiple of its
//! element size: never in unshard's or safetensors' layout) is read whole on its
//! own. A computed tensor's reference is evaluated once, kept while the blocks
//! that hold the tensor are compared, and dropped after its last block.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::compare::{compare, compare_within, Diffs};
use super::gather::{gather, GatherBufs};
use super::reference::{self, Reference};
use super::structure::{read_output, Located, Written};
use crate::cancel::Cancel;
use crate::digest::{block, FileDigest};
use crate::error::Result;
use crate::plan::{Content, Plan};
use crate::prepare::Inputs;
use crate::write::{Progress, WINDOW_BYTES};

/// What the pass found: per check, the differences or why its bytes could not be
/// read; per shard, the digests of what was read (`None` where a read failed or
/// the shard could not be opened).
pub(crate) struct Found {
    pub(crate) diffs: Vec<Diffs>,
    pub(crate) unreadable: Vec<Option<String>>,
    pub(crate) digests: Vec<Option<FileDigest>>,
}

/// A tensor to compare, placed in its shard.
#[derive(Clone, Copy)]
struct Span {
    /// Byte range in the shard file.
    begin: u64,
    end: u64,
    /// Index into `checks`.
    ci: usize,
}

/// Computed tensors' references, shared by the blocks that hold each.
struct References {
    slots: Vec<Mutex<Option<Arc<Reference>>>>,
    /// Blocks still to use each reference.
    left: Vec<AtomicUsize>,
}

impl References {
    fn get(&self, ci: usize, make: impl FnOnce() -> Result<Reference>) -> Result<Arc<Reference>> {
        let mut slot = self.slots[ci].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = &*slot {
            return Ok(r.clone());
        }
        let r = Arc::new(make()?);
        *slot = Some(r.clone());
        Ok(r)
    }

    /// A block is done with `ci`'s reference: the last one drops it.
    fn done(&self, ci: usize) {
        if self.left[ci].fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.slots[ci].lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}

/// Reads every shard of `written` once and compares the tensors of `checks`
/// (planned index, where it is) with what `plan` says they hold.
pub(crate) fn check_blocks(
    plan: &Plan,
    inputs: Inputs<'_>,
    written: &Written,
    checks: &[(usize, &Located)],
    progress: &dyn Progress,
    cancel: &Cancel,
) -> Result<Found> {
    let w = WINDOW_BYTES;
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); written.shards.len()];
    for (ci, &(ti, loc)) in checks.iter().enumerate() {
        let end = loc.offset + plan.tensors[ti].nbytes();
        spans[loc.shard].push(Span {
            begin: loc.offset,
            end,
            ci,
        });
    }
    for s in &mut spans {
        s.sort_by_key(|s| s.begin);
    }
    let refs = References {
        slots: (0..checks.len()).map(|_| Mutex::new(None)).collect(),
        left: checks
            .iter()
            .map(|&(ti, loc)| {
                let end = loc.offset + plan.tensors[ti].nbytes();
                let blocks = if end > loc.offset {
                    (end - 1) / w - loc.offset / w + 1
                } else {
                    0
                };
                AtomicUsize::new(blocks as usize)
            })
            .collect(),
    };
    let mut blocks: Vec<(usize, u64)> = Vec::new();
    let mut total = 0;
    for (si, s) in written.shards.iter().enumerate() {
        if let Some(f) = &s.file {
            blocks.extend((0..f.len().div_ceil(w)).map(|k| (si, k)));
            total += f.len();
        }
    }
    progress.start(total);

    let per_block = blocks
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new(), GatherBufs::default()),
            |(buf, expected, bufs), &(si, k)| -> Result<BlockFound> {
                cancel.check()?;
                let Some(file) = &written.shards[si].file else {
                    return Ok(BlockFound {
                        shard: si,
                        block: k,
                        ..BlockFound::default()
                    });
                };
                let start = k * w;
                let len = w.min(file.len() - start);
                buf.resize(len as usize, 0);
                let read = read_output(file, start, buf);
                let mut found = BlockFound {
                    shard: si,
                    block: k,
                    ..BlockFound::default()
                };
                let here = &spans[si];
                let first = here.partition_point(|s| s.end <= start);
                for s in here[first..].iter().take_while(|s| s.begin < start + len) {
                    if s.end == s.begin {
                        continue;
                    }
                    let (ti, _) = checks[s.ci];
                    let t = &plan.tensors[ti];
                    if let Err(e) = &read {
                        found.unreadable.push((
                            s.ci,
                            format!(
                                "cannot read its data (the file changed during the check?): {e}"
                            ),
                        ));
                        continue;
                    }
                    let size = t.dtype.size() as u64;
                    let numel = t.numel();
                    // Elements that start in this block; the last may run past it.
                    let a = (start.max(s.begin) - s.begin).div_ceil(size);
                    let b = (((start + len).min(s.end) - s.begin).div_ceil(size)).min(numel);
                    let whole = (((start + len).min(s.end) - s.begin) / size).min(numel);
                    let mut compare_at = |e0: u64, e1: u64, bytes: &[u8]| -> Result<Diffs> {
                        match &t.content {
                            Content::Copy(source) => {
                                expected.resize(bytes.len(), 0);
                                gather(
                                    source,
                                    inputs.files(t.origin),
                                    t.dtype,
                                    e0,
                                    e1,
                                    expected,
                                    bufs,
                                )?;
                                Ok(compare(expected, bytes, t.dtype, e0))
                            }
                            Content::Computed(e) => {
                                let r = refs.get(s.ci, || {
                                    reference::reference(e, &t.shape, t.dtype, inputs)
                                })?;
                                let (i0, i1) = (e0 as usize, e1 as usize);
                                Ok(match &*r {
                                    Reference::Exact(x) => compare(
                                        &x[i0 * size as usize..i1 * size as usize],
                                        bytes,
                                        t.dtype,
                                        e0,
                                    ),
                                    Reference::Within { values, allowed } => compare_within(
                                        &values[i0..i1],
                                        &allowed[i0..i1],
                                        bytes,
                                        t.dtype,
                                        e0,
                                    ),
                                })
                            }
                        }
                    };
                    let mut d = Diffs::default();
                    if a < whole {
                        let lo = (s.begin + a * size - start) as usize;
                        let hi = (s.begin + whole * size - start) as usize;
                        d.add(compare_at(a, whole, &buf[lo..hi])?);
                    }
                    if whole < b {
                        // Cut by the block's end: read whole, on its own.
                        let mut elem = vec![0u8; size as usize];
                        match read_output(file, s.begin + whole * size, &mut elem) {
                            Ok(()) => d.add(compare_at(whole, whole + 1, &elem)?),
                            Err(e) => found.unreadable.push((s.ci, e.to_string())),
                        }
                    }
                    found.diffs.push((s.ci, d));
                    if t.copied().is_none() {
                        refs.done(s.ci);
                    }
                }
                found.digest = read
                    .is_ok()
                    .then(|| block(buf, start, file.len()))
                    .flatten();
                progress.advance(len);
                Ok(found)
            },
        )
        .collect::<Result<Vec<BlockFound>>>()?;
    progress.finish();

    let mut out = Found {
        diffs: vec![Diffs::default(); checks.len()],
        unreadable: vec![None; checks.len()],
        digests: written
            .shards
            .iter()
            .map(|s| s.file.as_ref().map(|f| FileDigest::new(f.len())))
            .collect(),
    };
    let mut failed = vec![false; written.shards.len()];
    for b in per_block {
        for (ci, d) in b.diffs {
            out.diffs[ci].add(d);
        }
        for (ci, e) in b.unreadable {
            out.unreadable[ci] = Some(e);
        }
        if let Some(fd) = &mut out.digests[b.shard] {
            match b.digest {
                Some(d) => fd.blocks[b.block as usize] = Some(d),
                None => failed[b.shard] = true,
            }
        }
    }
    for (d, failed) in out.digests.iter_mut().zip(failed) {
        if failed {
            *d = None;
        }
    }
    Ok(out)
}

/// What one block showed.
#[derive(Default)]
struct BlockFound {
    shard: usize,
    block: u64,
    digest: Option<crate::digest::Sha>,
    diffs: Vec<(usize, Diffs)>,
    unreadable: Vec<(usize, String)>,
}
