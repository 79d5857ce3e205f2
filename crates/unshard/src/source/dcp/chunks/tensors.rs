//! Building the tensors: each chunk becomes a piece, from what [`Reader::scan`]
//! resolved or by reading and parsing the chunk's archive, and each tensor's pieces
//! are checked to tile it.
//!
//! A checkpoint of many ranks has hundreds of thousands of chunks, so the building
//! is split over threads where it can be. The tensors whose chunks were all resolved need nothing of the reader but what the scan found, so
//! they are built first, split by chunk count into contiguous parts, one part per
//! thread (up to [`BUILD_THREADS`]); each entry's chunks are dropped as soon as its
//! tensor is built. The others read, parse, learn templates and ask for archives
//! ahead, all of which holds the reader: they are built after, on this thread, in
//! order. The tensors come out in their order either way, and the error is that of
//! the first tensor in order that fails.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use super::super::super::torch::{self, Leaf};
use super::super::super::zip::Archive;
use super::super::super::{check_coverage, FileId, Piece, TensorSource};
use super::super::metadata::{Chunks, Entry, EntryKind, Metadata};
use super::{plain, Reader, Resolved};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Threads that build the resolved tensors at most: the work is a few hundred
/// milliseconds at the largest, split once.
pub(in crate::source::dcp) const BUILD_THREADS: usize = 2;

impl Reader<'_> {
    /// The tensors `tensors` (each a name and an index in `md.entries`, in the order
    /// [`Reader::scan`] was given them), the resolved ones on up to `threads`
    /// threads (see the module's doc). Each entry's chunks are cleared once its
    /// tensor is built: its pieces now say all the chunks said, and a checkpoint of
    /// many chunks holds one or the other, not both.
    pub(in crate::source::dcp) fn build(
        &mut self,
        md: &mut Metadata,
        tensors: &[(String, usize)],
        threads: usize,
    ) -> Result<Vec<TensorSource>> {
        let mut built: Vec<Option<Result<TensorSource>>> = Vec::new();
        built.resize_with(tensors.len(), || None);
        {
            let mut entries: Vec<Option<&mut Entry>> = md.entries.iter_mut().map(Some).collect();
            let mut jobs = Vec::new();
            for (at, (name, i)) in tensors.iter().enumerate() {
                let Some(first) = self.all_resolved(at) else {
                    continue;
                };
                if let Some(entry) = entries.get_mut(*i).and_then(Option::take) {
                    jobs.push(Job {
                        at,
                        name,
                        entry,
                        first,
                    });
                }
            }
            let found = Found {
                dir: self.dir,
                resolved: &self.resolved,
                layouts: &self.layouts,
            };
            let (done, parts) = found.build_on_threads(jobs, threads);
            self.built_parts = parts;
            for (at, source) in done {
                built[at] = source;
            }
        }
        let mut out = Vec::with_capacity(tensors.len());
        for (at, ((name, i), done)) in tensors.iter().zip(built).enumerate() {
            if let Some(source) = done {
                out.push(source?);
                continue;
            }
            // The tensors built on threads went through their part of `resolved`.
            if let Some(&(first, _)) = self.firsts.get(at) {
                self.next = first;
            }
            let Some(entry) = md.entries.get(*i) else {
                return Err(Error::bad_tensor(self.dir, name, "not in the metadata"));
            };
            out.push(self.tensor(md, name, entry)?);
            if let Some(Entry {
                kind: EntryKind::Tensor { chunks, .. },
                ..
            }) = md.entries.get_mut(*i)
            {
                chunks.clear();
            }
        }
        Ok(out)
    }

    /// The index in `resolved` of the first chunk of tensor `at` of the scan's
    /// list when every chunk of it is plain and was resolved, so that building it
    /// needs no read.
    fn all_resolved(&self, at: usize) -> Option<usize> {
        let &(first, all_plain) = self.firsts.get(at)?;
        let end = self.firsts.get(at + 1).map_or(self.resolved.len(), |f| f.0);
        let resolved = self.resolved.get(first..end)?;
        (all_plain && resolved.iter().all(Option::is_some)).then_some(first)
    }

    /// The tensor of `entry`, named `name`: its chunks resolved by the scan are
    /// placed as it found them; the others are located, decompressed if they went
    /// through a transform, and read and parsed (or checked against a template),
    /// their ends asked for ahead.
    pub(super) fn tensor(
        &mut self,
        md: &Metadata,
        name: &str,
        entry: &Entry,
    ) -> Result<TensorSource> {
        let EntryKind::Tensor {
            dtype,
            shape,
            chunks,
            ..
        } = &entry.kind
        else {
            return Err(Error::bad_tensor(self.dir, name, "not a tensor entry"));
        };
        let mut pieces = Vec::with_capacity(chunks.list.len());
        let mut files_used = FileSet::new();
        let mut compressed = false;
        let elem = dtype.size() as u64;
        for chunk in &chunks.list {
            let (offsets, sizes) = (chunks.offsets(chunk), chunks.sizes(chunk));
            let numel = chunk_bytes(self.dir, name, sizes, elem)?;
            if numel == 0 {
                continue;
            }
            if plain(md, chunks, chunk) {
                let idx = self.next;
                self.next += 1;
                if let Some(r) = self.resolved.get(idx).copied().flatten() {
                    files_used.insert(chunk.item.map_or(0, |i| i.file_index()));
                    pieces.push(piece_of(&self.layouts, r, *dtype, sizes, offsets));
                    continue;
                }
            }
            let what = format!("tensor '{}' chunk at {offsets:?}", entry.fqn);
            let item = chunk.item.ok_or_else(|| {
                Error::corrupt(
                    self.dir.join(".metadata"),
                    format!("{what} has no storage entry"),
                )
            })?;
            // A chunk archive is the tensor's bytes plus a small pickle and zip records.
            let max_decoded = numel.saturating_add(16 << 20);
            let (file, offset, length) = self.archive(md, &item, &what, max_decoded)?;
            let plain = md.transforms(&item).is_empty();
            files_used.insert(item.file_index());
            compressed |= !plain;
            let blob = self.files[file].clone();
            // Both ends of the archive in one request: they hold the zip records and
            // the pickle, so the parse that follows reads nothing more (tensor bytes,
            // in the middle, are left for the engine).
            let mut archive = Archive::new(&blob, offset, length)?;
            archive.read_ends(self.ends, self.ends)?;
            let mut magic = [0u8; 2];
            if length < 2 || archive.read(0, &mut magic).is_err() || &magic != b"PK" {
                return Err(Error::Unsupported {
                    path: blob.path.clone(),
                    what: format!("{what}: a DCP item that is not a torch.save archive (safetensors-format DCP)"),
                    hint: Some("save with the default FileSystemWriter, or convert with torch.distributed.checkpoint.format_utils.dcp_to_torch_save".into()),
                });
            }
            if let (true, Some(templates)) = (plain, &mut self.templates) {
                let piece = templates.piece(&archive, self.ends, *dtype, sizes, file, offsets)?;
                if let Some(piece) = piece {
                    self.parsed += 1;
                    self.prefetch_more();
                    pieces.push(piece);
                    continue;
                }
            }
            let mut payload = torch::read_zip_payload(&mut archive)?;
            let clean = payload.unsafe_calls.is_empty() && payload.inflated.is_empty();
            self.unsafe_calls.append(&mut payload.unsafe_calls);
            if plain {
                self.parsed += 1;
                self.prefetch_more();
            }
            let t = match torch::leaf(&payload.pickle, payload.pickle.root()) {
                Ok(Some(Leaf::Tensor(t))) => t,
                Ok(_) => {
                    return Err(Error::corrupt(
                        &blob.path,
                        format!("{what}: the archive does not hold a plain tensor"),
                    ))
                }
                Err(m) => return Err(Error::bad_tensor(&blob.path, name, m)),
            };
            if t.shape != sizes || t.dtype != *dtype {
                return Err(Error::bad_tensor(
                    &blob.path,
                    name,
                    format!(
                        "the chunk at {:?} holds a {} {:?} tensor where the metadata says {} {:?}",
                        offsets,
                        t.dtype.safetensors_name(),
                        t.shape,
                        dtype.safetensors_name(),
                        sizes
                    ),
                ));
            }
            let piece = payload.piece(file, name, &t, offsets.to_vec())?;
            if let (true, true, Some(templates)) = (plain, clean, &mut self.templates) {
                templates.learn(&mut archive, self.ends, &piece)?;
            }
            drop(archive);
            pieces.push(piece);
        }
        let files = files_used.len();
        let tensor = (name, *dtype, shape.as_slice(), chunks);
        finish(self.dir, tensor, pieces, files, compressed)
    }
}

/// A tensor whose chunks were all resolved, for a thread to build: its place in
/// the list, its name and entry, and the index in `resolved` of its first chunk.
struct Job<'e> {
    at: usize,
    name: &'e str,
    entry: &'e mut Entry,
    first: usize,
}

/// What the scan found, all that building a tensor of resolved chunks reads.
#[derive(Clone, Copy)]
struct Found<'r> {
    dir: &'r Path,
    resolved: &'r [Option<Resolved>],
    layouts: &'r [(Vec<u64>, bool)],
}

/// The tensors built by [`Found::build_on_threads`], each with its place in the
/// list (`None`: to be built on the reader's thread).
type Built = Vec<(usize, Option<Result<TensorSource>>)>;

impl Found<'_> {
    /// Builds the tensors of `jobs` in up to `threads` contiguous parts of about as
    /// many chunks each, a part per thread; this thread takes a part too, and the
    /// parts of any thread that could not start. Returns the tensors with their
    /// places and how many tensors each part had.
    fn build_on_threads(self, jobs: Vec<Job<'_>>, threads: usize) -> (Built, Vec<usize>) {
        let weights: Vec<usize> = jobs.iter().map(|j| chunk_count(j.entry)).collect();
        let cuts = split_evenly(&weights, threads.clamp(1, jobs.len().max(1)));
        let mut jobs = jobs.into_iter();
        let parts: Vec<Mutex<Vec<Job>>> = cuts
            .iter()
            .map(|&n| Mutex::new(jobs.by_ref().take(n).collect()))
            .collect();
        let next = AtomicUsize::new(0);
        let work = || {
            let mut out = Vec::new();
            while let Some(part) = parts.get(next.fetch_add(1, Ordering::Relaxed)) {
                let mut part = part.lock().unwrap_or_else(PoisonError::into_inner);
                out.extend(self.build_part(&mut part));
            }
            out
        };
        let done = if parts.len() < 2 {
            work()
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = (1..parts.len())
                    .map(|_| {
                        std::thread::Builder::new()
                            .name("unshard-build".into())
                            .spawn_scoped(scope, work)
                    })
                    .collect();
                let mut done = work();
                for h in handles.into_iter().flatten() {
                    match h.join() {
                        Ok(out) => done.extend(out),
                        // A bug, which one thread would have met too.
                        Err(panic) => std::panic::resume_unwind(panic),
                    }
                }
                done
            })
        };
        (done, cuts)
    }

    /// The tensors of one part, in order, each entry's chunks cleared once its
    /// tensor is built; stops at the first that fails.
    fn build_part(self, part: &mut [Job<'_>]) -> Built {
        let mut files = FileSet::new();
        let mut out = Vec::with_capacity(part.len());
        for job in part {
            let source = self.tensor(job.name, job.entry, job.first, &mut files);
            let failed = matches!(source, Some(Err(_)));
            if let (Some(Ok(_)), EntryKind::Tensor { chunks, .. }) = (&source, &mut job.entry.kind)
            {
                chunks.clear();
            }
            out.push((job.at, source));
            if failed {
                break;
            }
        }
        out
    }

    /// The tensor of `entry`, named `name`, whose chunks (all plain) are resolved
    /// from index `first` of `resolved` on, as [`Reader::tensor`] builds it; `None`
    /// if one is not resolved after all (the reader builds it then). `files` counts
    /// the files it is in.
    fn tensor(
        self,
        name: &str,
        entry: &Entry,
        first: usize,
        files: &mut FileSet,
    ) -> Option<Result<TensorSource>> {
        let EntryKind::Tensor {
            dtype,
            shape,
            chunks,
            ..
        } = &entry.kind
        else {
            return None;
        };
        let mut pieces = Vec::with_capacity(chunks.list.len());
        files.clear();
        let elem = dtype.size() as u64;
        let mut next = first;
        for chunk in &chunks.list {
            let (offsets, sizes) = (chunks.offsets(chunk), chunks.sizes(chunk));
            match chunk_bytes(self.dir, name, sizes, elem) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
            let r = self.resolved.get(next).copied().flatten()?;
            next += 1;
            files.insert(chunk.item?.file_index());
            pieces.push(piece_of(self.layouts, r, *dtype, sizes, offsets));
        }
        let tensor = (name, *dtype, shape.as_slice(), chunks);
        Some(finish(self.dir, tensor, pieces, files.len(), false))
    }
}

/// How many chunks an entry has (none if it is not a tensor).
fn chunk_count(entry: &Entry) -> usize {
    match &entry.kind {
        EntryKind::Tensor { chunks, .. } => chunks.list.len(),
        EntryKind::Bytes { .. } => 0,
    }
}

/// How many of `weights`, taken in order, go in each of `parts` contiguous parts so
/// that the parts' sums are about equal: an item goes in the part its middle falls in.
fn split_evenly(weights: &[usize], parts: usize) -> Vec<usize> {
    let parts = parts.max(1);
    let total: u128 = weights.iter().map(|&w| w as u128).sum::<u128>().max(1);
    let mut counts = vec![0; parts];
    let mut sum: u128 = 0;
    for &w in weights {
        let middle = 2 * sum + w as u128;
        let part = (middle * parts as u128 / (2 * total)).min(parts as u128 - 1) as usize;
        counts[part] += 1;
        sum += w as u128;
    }
    counts
}

/// The bytes of a chunk of `sizes` elements of `elem` bytes, of tensor `name`.
fn chunk_bytes(dir: &Path, name: &str, sizes: &[u64], elem: u64) -> Result<u64> {
    sizes
        .iter()
        .try_fold(1u64, |a, &n| a.checked_mul(n))
        .and_then(|n| n.checked_mul(elem))
        .ok_or_else(|| Error::bad_tensor(dir, name, format!("chunk sizes {sizes:?} overflow")))
}

/// The piece of a chunk the scan resolved to `r` (its layout one of `layouts`).
fn piece_of(
    layouts: &[(Vec<u64>, bool)],
    r: Resolved,
    dtype: DType,
    sizes: &[u64],
    offsets: &[u64],
) -> Piece {
    let (strides, big_endian) = layouts
        .get(r.layout as usize)
        .map_or((&[][..], false), |(s, b)| (s.as_slice(), *b));
    Piece {
        file: r.file as FileId,
        byte_offset: r.byte_offset,
        dtype,
        shape: sizes.to_vec(),
        strides: strides.to_vec(),
        global_offset: offsets.to_vec(),
        big_endian,
    }
}

/// The tensor `(name, dtype, shape, chunks)` of `pieces`, in `files` files, with
/// its layout described, after checking its pieces tile it.
fn finish(
    dir: &Path,
    (name, dtype, shape, chunks): (&str, DType, &[u64], &Chunks),
    pieces: Vec<Piece>,
    files: usize,
    compressed: bool,
) -> Result<TensorSource> {
    let split: Vec<String> = (0..shape.len())
        .filter(|&d| {
            chunks
                .list
                .iter()
                .any(|c| chunks.sizes(c).get(d) != shape.get(d))
        })
        .map(|d| d.to_string())
        .collect();
    let kind = if compressed { "DCP (zstd)" } else { "DCP" };
    let layout = match (pieces.len(), split.is_empty()) {
        (1, true) => format!("{kind}, 1 chunk"),
        (n, _) => format!(
            "{kind}, {n} chunks{} in {files} file(s)",
            if split.is_empty() {
                String::new()
            } else {
                format!(" split on dim {}", split.join(" and "))
            },
        ),
    };
    let source = TensorSource {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        pieces: pieces.into(),
        storage: None,
        layout: Some(layout),
    };
    check_coverage(dir, &source)?;
    Ok(source)
}

/// The distinct files of a tensor's chunks, counted without hashing: hundreds of
/// thousands of chunks, in a few files each. A file is counted when its stamp is
/// not the current one; a new tensor takes a new stamp.
struct FileSet {
    /// Per file index, the stamp of the last tensor it was counted for.
    stamps: Vec<u32>,
    stamp: u32,
    count: usize,
}

impl FileSet {
    fn new() -> FileSet {
        FileSet {
            stamps: Vec::new(),
            stamp: 1,
            count: 0,
        }
    }

    /// Starts counting again, from no file.
    fn clear(&mut self) {
        self.count = 0;
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            // Every stamp might now be taken for current: start them all again.
            self.stamps.fill(0);
            self.stamp = 1;
        }
    }

    /// Counts file `file` unless it was counted since [`FileSet::clear`].
    fn insert(&mut self, file: u32) {
        let i = file as usize;
        if i >= self.stamps.len() {
            self.stamps.resize(i + 1, 0);
        }
        if self.stamps[i] != self.stamp {
            self.stamps[i] = self.stamp;
            self.count += 1;
        }
    }

    /// How many files were counted.
    fn len(&self) -> usize {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file is counted once per tensor however many of its chunks are in it, and
    /// again for the next tensor, also when the stamps wrap around.
    #[test]
    fn files_of_a_tensor_are_counted_once_each() {
        let mut files = FileSet::new();
        for f in [3, 1, 3, 3, 0, 1, 3] {
            files.insert(f);
        }
        assert_eq!(files.len(), 3);
        files.clear();
        assert_eq!(files.len(), 0);
        files.insert(1);
        files.insert(1);
        files.insert(7);
        assert_eq!(files.len(), 2);
        files.stamp = u32::MAX;
        files.clear();
        for f in [7, 1, 7] {
            files.insert(f);
        }
        assert_eq!(files.len(), 2);
        files.clear();
        files.insert(0);
        assert_eq!(files.len(), 1);
    }

    /// Parts are contiguous, every item is in one, and their chunk counts are close.
    #[test]
    fn tensors_are_split_by_chunk_count() {
        assert_eq!(split_evenly(&[8, 8, 8, 8], 2), vec![2, 2]);
        assert_eq!(split_evenly(&[100, 1, 1, 1, 1], 2), vec![1, 4]);
        assert_eq!(split_evenly(&[1, 1, 1, 100], 2), vec![3, 1]);
        assert_eq!(split_evenly(&[5, 5, 5], 1), vec![3]);
        assert_eq!(split_evenly(&[], 2), vec![0, 0]);
        assert_eq!(split_evenly(&[0, 0, 0], 2), vec![3, 0]);
        // A tensor of no chunks after all the others goes in the last part.
        assert_eq!(split_evenly(&[5, 0], 2), vec![0, 2]);
    }
}
