//! The scan of [`Reader::scan`]: files taken from a shared queue by up to
//! [`SCAN_THREADS`] threads, each file's archive ends read a window at a time
//! ([`for_each_ends`]) and checked against the templates (the first archive of each
//! structure parsed and kept as one).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::super::super::torch::{self, Leaf};
use super::super::super::zip::Archive;
use super::super::super::{Blob, FileId, Piece};
use super::super::batch::{for_each_ends, WINDOW};
use super::super::metadata::{Entry, EntryKind};
use super::super::template::Templates;
use super::{Reader, Resolved};

impl Reader<'_> {
    /// [`Reader::scan`] of `jobs` (sorted by file and offset) on up to one thread per
    /// core ([`SCAN_THREADS`] at most), each with its own templates and window,
    /// taking the next file from a shared queue when done with one (a fixed split
    /// left one thread scanning alone while the other had finished early); returns
    /// the first thread's templates, with the hits of all.
    pub(super) fn scan_jobs(
        &mut self,
        tensors: &[(String, &Entry)],
        jobs: &[Job],
        first: Templates,
    ) -> Templates {
        let groups: Vec<&[Job]> = jobs.chunk_by(|a, b| a.0 == b.0).collect();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, SCAN_THREADS)
            .min(groups.len().max(1));
        let next = AtomicUsize::new(0);
        let take = || groups.get(next.fetch_add(1, Ordering::Relaxed)).copied();
        let mut templates = vec![first];
        templates.resize_with(threads, Templates::default);
        let (files, ends) = (&self.files, self.ends);
        let outs: Vec<Scanned> = {
            let (head, tail) = templates.split_at_mut(1);
            std::thread::scope(|scope| {
                let handles: Vec<_> = tail
                    .iter_mut()
                    .map(|t| {
                        std::thread::Builder::new()
                            .name("unshard-scan".into())
                            .spawn_scoped(scope, || scan_part(files, tensors, take, t, ends))
                    })
                    .collect();
                // This thread drains the queue too, so files a thread that cannot
                // start would have taken are scanned here. (Files taken by a thread
                // that stops are left unresolved: read when their tensors are built.)
                let mut outs = vec![scan_part(files, tensors, take, &mut head[0], ends)];
                outs.extend(
                    handles
                        .into_iter()
                        .filter_map(|h| h.ok().and_then(|h| h.join().ok())),
                );
                outs
            })
        };
        for out in outs {
            self.scan_reads += out.reads;
            let ids: Vec<Option<u32>> = out
                .layouts
                .into_iter()
                .map(|(strides, big_endian)| self.layout_id(strides, big_endian))
                .collect();
            for (idx, file, byte_offset, layout) in out.resolved {
                if let Some(Some(layout)) = ids.get(layout as usize) {
                    self.resolved[idx as usize] = Some(Resolved {
                        file,
                        layout: *layout,
                        byte_offset,
                    });
                }
            }
        }
        let mut templates = templates.into_iter();
        let mut first = templates.next().unwrap_or_default();
        first.hits += templates.map(|t| t.hits).sum::<u64>();
        first
    }
}

/// A chunk archive for [`Reader::scan`]: file, offset, length, index in
/// `resolved`, and the tensor (in the list being built) and chunk it holds.
pub(super) type Job = (u32, u64, u64, u32, u32, u32);

/// Threads [`Reader::scan`] uses at most.
const SCAN_THREADS: usize = 4;

/// What one thread of [`Reader::scan`] resolved.
#[derive(Default)]
struct Scanned {
    /// `(index in resolved, file, byte offset, index in layouts)`.
    resolved: Vec<(u32, u32, u64, u32)>,
    layouts: Vec<(Vec<u64>, bool)>,
    reads: usize,
}

/// Resolves the archives of the files `next` hands out (each file's jobs, sorted by
/// offset) against `templates`, a file at a time (see [`for_each_ends`]), until it
/// hands out no more.
fn scan_part<'j>(
    files: &[Arc<Blob>],
    tensors: &[(String, &Entry)],
    next: impl Fn() -> Option<&'j [Job]>,
    templates: &mut Templates,
    ends_len: u64,
) -> Scanned {
    let mut out = Scanned::default();
    let Scanned {
        resolved,
        layouts,
        reads,
    } = &mut out;
    let mut layout_of = |strides: &[u64], big_endian: bool| -> Option<u32> {
        let i = match layouts
            .iter()
            .position(|(s, b)| s == strides && *b == big_endian)
        {
            Some(i) => i,
            None => {
                layouts.push((strides.to_vec(), big_endian));
                layouts.len() - 1
            }
        };
        u32::try_from(i).ok()
    };
    let mut buf = Vec::new();
    while let Some(group) = next() {
        let Some(blob) = group.first().and_then(|j| files.get(j.0 as usize)) else {
            continue;
        };
        let archives: Vec<(u64, u64)> = group.iter().map(|j| (j.1, j.2)).collect();
        let n = for_each_ends(blob, &archives, ends_len, WINDOW, &mut buf, |i, ends| {
            let (id, offset, length, idx, t, c) = group[i];
            let entry = tensors[t as usize].1;
            let EntryKind::Tensor { dtype, chunks, .. } = &entry.kind else {
                return Ok(());
            };
            let sizes = chunks.sizes(&chunks.list[c as usize]);
            let found = match templates.layout(length, *dtype, sizes, &ends) {
                Some(l) => layout_of(l.strides, l.big_endian).map(|k| (l.rel_offset, k)),
                None => {
                    // Parsed here only if it is clean and says what the metadata
                    // says; anything else is parsed again when its tensor is built,
                    // which reports it.
                    let Ok(mut archive) = Archive::new(blob, offset, length) else {
                        return Ok(());
                    };
                    archive.hold(0, ends.head.to_vec());
                    if !ends.tail.is_empty() {
                        archive.hold(ends.tail_at, ends.tail.to_vec());
                    }
                    let file = id as FileId;
                    learn_from(templates, &mut archive, ends_len, *dtype, sizes, file).and_then(
                        |p| {
                            let rel = p.byte_offset.checked_sub(offset)?;
                            Some((rel, layout_of(&p.strides, p.big_endian)?))
                        },
                    )
                }
            };
            if let Some((rel, layout)) = found {
                resolved.push((idx, id, offset + rel, layout));
            }
            Ok(())
        });
        // A read that fails leaves the rest of the file to be read (and the failure
        // reported) when its tensors are built.
        *reads += n.unwrap_or(0);
    }
    out
}

/// Parses archive `a` (its ends held) and, when it is clean and holds the `dtype`
/// tensor of `sizes` the metadata says, keeps it as the template of its structure
/// and returns its piece (in file `file`, placed at the origin). `None` for anything
/// else, which is parsed again, and reported, when its tensor is built.
pub(super) fn learn_from(
    templates: &mut Templates,
    a: &mut Archive<'_>,
    ends: u64,
    dtype: crate::dtype::DType,
    sizes: &[u64],
    file: FileId,
) -> Option<Piece> {
    let payload = torch::read_zip_payload(a).ok()?;
    if !payload.unsafe_calls.is_empty() || !payload.inflated.is_empty() {
        return None;
    }
    let Ok(Some(Leaf::Tensor(t))) = torch::leaf(&payload.pickle, payload.pickle.root()) else {
        return None;
    };
    if t.shape != sizes || t.dtype != dtype {
        return None;
    }
    let origin = vec![0; sizes.len()];
    let piece = payload.piece(file, "", &t, origin).ok()?;
    if piece.file != file {
        return None;
    }
    templates.learn(a, ends, &piece).ok()?;
    Some(piece)
}
