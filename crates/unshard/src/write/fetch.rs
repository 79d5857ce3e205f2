//! One request per output block, for inputs whose cost is per request (object
//! storage). Before a block is filled, the input spans of every piece it reads are
//! gathered per input file and announced together
//! ([`ByteSource::will_need_together`](crate::source::ByteSource::will_need_together)):
//! neighbouring tensors of a file lie a few bytes of headers apart, so the source
//! serves the whole block with one ranged GET per file instead of one per piece.
//! An object store may wait there until the block's bytes fit in its read-ahead
//! budget; the worker takes its output buffer after. What was fetched is let go
//! when the block is done (also on error). Local files ignore both calls and keep
//! their per-piece hints.

use std::sync::Arc;

use super::engine::{Block, Overlap};
use super::Inputs;
use crate::plan::Plan;
use crate::read::geometry::PieceRuns;
use crate::read::pieces::piece_span;
use crate::source::Blob;

/// An input file and the `(offset, len)` ranges a block reads from it.
type FileRanges<'a> = (&'a Arc<Blob>, Vec<(u64, u64)>);

/// The ranges a block announced, per input file; dropping it tells the files the
/// block is done.
pub(crate) struct BlockFetch<'a> {
    files: Vec<FileRanges<'a>>,
}

impl Drop for BlockFetch<'_> {
    fn drop(&mut self) {
        for (blob, ranges) in &self.files {
            blob.source().done_with(ranges);
        }
    }
}

/// Announces to each input file the byte ranges block `b` will read from it.
pub(crate) fn announce<'a>(plan: &Plan, inputs: Inputs<'a>, b: &Block) -> BlockFetch<'a> {
    let mut files: Vec<FileRanges<'a>> = Vec::new();
    for Overlap { ti, off, lo, hi } in b.overlaps(plan) {
        let t = &plan.tensors[ti];
        let Some(source) = t.copied() else {
            continue;
        };
        // Whole elements: a cut one is read whole (see `engine::fill_bytes`).
        let size = t.dtype.size() as u64;
        let (e0, e1) = ((lo - off) / size, (hi - off).div_ceil(size));
        let inputs = inputs.files(t.origin);
        for p in &source.pieces {
            let Some(blob) = inputs.get(p.file) else {
                continue;
            };
            let Some(span) = piece_span(p, &PieceRuns::new(p, &source.shape), e0, e1) else {
                continue;
            };
            match files.iter_mut().find(|(f, _)| Arc::ptr_eq(f, blob)) {
                Some((_, ranges)) => ranges.push(span),
                None => files.push((blob, vec![span])),
            }
        }
    }
    for (blob, ranges) in &files {
        blob.source().will_need_together(ranges);
    }
    BlockFetch { files }
}
