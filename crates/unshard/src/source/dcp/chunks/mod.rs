//! Chunk archives: each chunk listed in `.metadata` is a complete `torch.save` archive
//! of one tensor at a byte range of a `.distcp` file. This module opens the files,
//! checks each range lies inside its file, decodes `stream.zstd/1` items, reads each
//! archive's records (both ends, in one request) and turns the chunk into a piece.
//!
//! A checkpoint of many ranks has hundreds of thousands of chunks, so reading their
//! records one read (and one wait) at a time would take longer than merging. Before
//! the tensors are built, [`Reader::scan`] takes the archives file by file, in the
//! order they lie in each file, reads their ends with a few large reads (`batch`)
//! and checks each against the template of its structure (parsing the first of
//! each): what it resolves needs no read when the tensor is built. Archives it
//! leaves (compressed, unusual, broken) are read and parsed one by one as before,
//! their ends asked for a thousand ahead, and report what is wrong with them.
//!
//! By job: this file opens and locates; `resolve` resolves archives before the
//! tensors are built; `tensors` builds the tensors, those of resolved archives on
//! two threads.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::super::torch;
use super::super::zip::Archive;
use super::super::{Blob, FileId};
use super::metadata::{Chunk, Chunks, Entry, EntryKind, Item, Metadata};
use crate::bytes::{FilePool, PooledFile};

mod resolve;
mod tensors;
pub(super) use tensors::BUILD_THREADS;

use super::template::Templates;
use crate::error::{Error, Result};

/// The transform DCP's `ZStandard` extension records on each item it compressed.
const ZSTD: &str = "stream.zstd/1";

/// Opens `.distcp` files once each and turns chunks into pieces.
pub(super) struct Reader<'a> {
    dir: &'a Path,
    /// The files opened so far, then in-memory files of decompressed items.
    pub(super) files: Vec<Arc<Blob>>,
    by_name: HashMap<String, FileId>,
    /// The file of each of `.metadata`'s file indexes, once opened: a chunk's file
    /// is found without hashing its name (hundreds of thousands of chunks).
    by_index: Vec<Option<FileId>>,
    /// Every chunk archive to be parsed, in parsing order: file, offset, length.
    ahead: Vec<(FileId, u64, u64)>,
    /// How many of `ahead` have been asked for.
    asked: usize,
    /// How many of `ahead` have been parsed.
    parsed: usize,
    /// Bytes read at each end of a chunk archive before parsing it (see [`ENDS`]).
    ends: u64,
    /// What the chunk archives' pickles would run under `torch.load`.
    pub(super) unsafe_calls: Vec<crate::source::audit::UnsafeCall>,
    /// When the checkpoint has more files than may be open at once: the pool that
    /// opens them on demand.
    pub(super) pool: Option<Arc<FilePool>>,
    /// Parsed archives that others of the same structure are checked against
    /// (`None`: every archive is parsed).
    pub(super) templates: Option<Templates>,
    /// Per chunk archive that is read in place (see [`plain`]), in the order the
    /// tensors are built: what [`Reader::scan`] found, if it resolved it.
    resolved: Vec<Option<Resolved>>,
    /// How many of `resolved` the tensors built so far went through.
    next: usize,
    /// Per tensor given to [`Reader::scan`], in order: the index in `resolved` of
    /// its first plain chunk, and whether all its chunks are plain.
    firsts: Vec<(usize, bool)>,
    /// How many tensors of resolved chunks each thread's part had (for tests).
    pub(super) built_parts: Vec<usize>,
    /// The strides and byte order of the resolved pieces, each once.
    layouts: Vec<(Vec<u64>, bool)>,
    /// Reads the scan made (for tests).
    pub(super) scan_reads: usize,
}

/// Where the tensor of a chunk archive resolved by [`Reader::scan`] is.
#[derive(Clone, Copy, Debug)]
struct Resolved {
    file: u32,
    /// Index in [`Reader::layouts`].
    layout: u32,
    byte_offset: u64,
}

/// Whether a chunk's archive is read in place from its file, and so goes through the
/// scan and the prefetch: it has bytes, a storage entry and no transform.
fn plain(md: &Metadata, chunks: &Chunks, chunk: &Chunk) -> bool {
    chunk
        .item
        .is_some_and(|item| md.transforms(&item).is_empty())
        && !chunks.sizes(chunk).contains(&0)
}

/// Chunk archives whose ends are asked for ahead of the parse.
const PREFETCH_CHUNKS: usize = 1024;

/// Bytes asked for, then read, at each end of a chunk archive: its zip records and
/// pickle take about 2 KiB at the start and 1 KiB at the end, so that one request
/// (one read for an archive under 40 KiB) holds everything parsing needs.
pub(super) const ENDS: u64 = 4 << 10;

impl<'a> Reader<'a> {
    /// A reader of the chunks of the DCP directory `dir`.
    /// `max_open` bounds the files kept open at once (`None`: every file stays open).
    pub(super) fn new(
        dir: &'a Path,
        ends: u64,
        max_open: Option<usize>,
        templates: bool,
    ) -> Reader<'a> {
        Reader {
            templates: templates.then(Templates::default),
            pool: max_open.map(FilePool::new),
            dir,
            files: Vec::new(),
            by_name: HashMap::new(),
            by_index: Vec::new(),
            ahead: Vec::new(),
            asked: 0,
            parsed: 0,
            ends,
            unsafe_calls: Vec::new(),
            resolved: Vec::new(),
            next: 0,
            firsts: Vec::new(),
            built_parts: Vec::new(),
            layouts: Vec::new(),
            scan_reads: 0,
        }
    }

    /// Resolves the chunk archives of `tensors` (the entries about to be built, in
    /// that order) from their template where it can: file by file, each file's
    /// archives in the order they lie in it, their ends read a window of up to
    /// [`WINDOW`] bytes at a time. The first archive of each structure is parsed
    /// (and kept as a template) if it is clean; anything unexpected is left for
    /// [`Reader::tensor`] to read, parse and report as before. Then asks for the
    /// ends of the first archives left: parsing touches each archive's two ends one
    /// after the other, and from a cold cache each touch would wait for its own disk
    /// read; asking the kernel for the ends of the next thousand keeps the disk busy
    /// with many small reads at once, no more than a few MB of them ahead of the
    /// parse. Files that do not open are left for the parse to report.
    pub(super) fn scan(&mut self, md: &Metadata, tensors: &[(String, &Entry)]) {
        // (file, offset, length, index in `resolved`, tensor, chunk)
        let mut jobs: Vec<(u32, u64, u64, u32, u32, u32)> = Vec::new();
        self.firsts = Vec::with_capacity(tensors.len());
        for (t, (_, entry)) in tensors.iter().enumerate() {
            let first = self.resolved.len();
            let EntryKind::Tensor { chunks, .. } = &entry.kind else {
                self.firsts.push((first, false));
                continue;
            };
            let mut all_plain = true;
            for (c, chunk) in chunks.list.iter().enumerate() {
                let Some(item) = chunk.item.filter(|_| plain(md, chunks, chunk)) else {
                    all_plain = false;
                    continue;
                };
                let idx = self.resolved.len();
                self.resolved.push(None);
                let Ok(id) = self.file_of(md, &item, &entry.fqn) else {
                    continue;
                };
                let inside = item
                    .offset
                    .checked_add(item.length)
                    .is_some_and(|end| end <= self.files[id].len());
                let fits = u32::try_from(idx).is_ok() && u32::try_from(id).is_ok();
                if inside && fits {
                    jobs.push((
                        id as u32,
                        item.offset,
                        item.length,
                        idx as u32,
                        t as u32,
                        c as u32,
                    ));
                }
            }
            self.firsts.push((first, all_plain));
        }
        if self.ends > 0 {
            if let Some(templates) = self.templates.take() {
                jobs.sort_unstable_by_key(|j| (j.0, j.1));
                self.templates = Some(self.scan_jobs(tensors, &jobs, templates));
            }
        }
        let left: Vec<(FileId, u64, u64)> = {
            let mut left: Vec<_> = jobs
                .iter()
                .filter(|j| self.resolved[j.3 as usize].is_none())
                .map(|j| (j.3, j.0 as FileId, j.1, j.2))
                .collect();
            left.sort_unstable_by_key(|j| j.0);
            left.into_iter().map(|(_, f, o, l)| (f, o, l)).collect()
        };
        drop(jobs);
        self.ahead = left;
        self.prefetch_more();
    }

    /// The index of a layout in [`Reader::layouts`], added if new.
    fn layout_id(&mut self, strides: Vec<u64>, big_endian: bool) -> Option<u32> {
        let i = match self
            .layouts
            .iter()
            .position(|(s, b)| *s == strides && *b == big_endian)
        {
            Some(i) => i,
            None => {
                self.layouts.push((strides, big_endian));
                self.layouts.len() - 1
            }
        };
        u32::try_from(i).ok()
    }

    /// Notes that one more chunk archive has been parsed and asks for the next.
    fn prefetch_more(&mut self) {
        let until = (self.parsed + PREFETCH_CHUNKS).min(self.ahead.len());
        while self.asked < until {
            let (id, offset, length) = self.ahead[self.asked];
            let blob = &self.files[id];
            let end = self.ends.max(1);
            if length <= end.saturating_mul(2) {
                blob.will_need(offset, length);
            } else {
                blob.will_need(offset, end);
                blob.will_need(offset.saturating_add(length - end), end);
            }
            self.asked += 1;
        }
    }

    /// The file `item` is stored in, opened if it was not yet (see [`Reader::file`]).
    fn file_of(&mut self, md: &Metadata, item: &Item, tensor: &str) -> Result<FileId> {
        let i = item.file_index() as usize;
        if let Some(Some(id)) = self.by_index.get(i) {
            return Ok(*id);
        }
        let id = self.file(md.file(item), tensor)?;
        if self.by_index.len() <= i {
            self.by_index.resize(i + 1, None);
        }
        self.by_index[i] = Some(id);
        Ok(id)
    }

    fn file(&mut self, name: &str, tensor: &str) -> Result<FileId> {
        if let Some(&id) = self.by_name.get(name) {
            return Ok(id);
        }
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains('/')
            && !name.contains('\\');
        if !plain {
            return Err(Error::corrupt(
                self.dir.join(".metadata"),
                format!("tensor '{tensor}' is stored in '{name}', which is not a file of the checkpoint directory"),
            ));
        }
        let path = self.dir.join(name);
        let blob = match &self.pool {
            Some(pool) if !crate::bytes::fs::is_url(&path) => {
                Blob::new(Arc::new(PooledFile::open(&path, pool)?))
            }
            _ => crate::bytes::fs::open(&path)?,
        };
        let id = self.files.len();
        self.files.push(Arc::new(blob));
        self.by_name.insert(name.to_string(), id);
        Ok(id)
    }

    /// The bytes of an item as stored: `(file, offset, length)` after checking the
    /// range lies inside its file.
    fn locate(&mut self, md: &Metadata, item: &Item, what: &str) -> Result<(FileId, u64, u64)> {
        let id = self.file_of(md, item, what)?;
        let blob = &self.files[id];
        let end = item.offset.checked_add(item.length);
        match end {
            Some(end) if end <= blob.len() => Ok((id, item.offset, item.length)),
            _ => Err(Error::corrupt(
                &blob.path,
                format!(
                    "{what} is stored at bytes {}..{} but the file has {} bytes; it is truncated or incomplete",
                    item.offset,
                    item.offset.saturating_add(item.length),
                    blob.len()
                ),
            )),
        }
    }

    /// The item's bytes as a torch.save archive: the range of its file, or a
    /// decompressed copy (then a new in-memory file). Returns the file holding them,
    /// the archive's offset in it and its length.
    fn archive(
        &mut self,
        md: &Metadata,
        item: &Item,
        what: &str,
        max_decoded: u64,
    ) -> Result<(FileId, u64, u64)> {
        let (id, offset, length) = self.locate(md, item, what)?;
        let transforms = md.transforms(item);
        if transforms.is_empty() {
            return Ok((id, offset, length));
        }
        let path = self.files[id].path.clone();
        if let Some(t) = transforms.iter().find(|t| t.as_str() != ZSTD) {
            return Err(Error::Unsupported {
                path,
                what: format!("{what}: the DCP stream transform '{t}'"),
                hint: Some(format!(
                    "unshard decodes only '{ZSTD}' (torch's ZStandard extension); load the checkpoint in Python and save it again without the extension"
                )),
            });
        }
        let mut data = self.files[id].read_vec(offset, length)?;
        for _ in transforms {
            data = unzstd(&data, max_decoded)
                .map_err(|m| Error::corrupt(&path, format!("{what}: {m}")))?;
        }
        let len = data.len() as u64;
        let new = self.files.len();
        self.files.push(Arc::new(Blob::owned(path, data)));
        Ok((new, 0, len))
    }

    /// The bytes of a byte entry's item, decoded, when they are at most `limit`
    /// bytes; and the file they are in.
    pub(super) fn read_item(
        &mut self,
        md: &Metadata,
        item: &Item,
        what: &str,
        limit: u64,
    ) -> Result<(PathBuf, Vec<u8>)> {
        let (id, offset, length) = self.archive(md, item, what, limit)?;
        let blob = self.files[id].clone();
        if length > limit {
            return Err(Error::corrupt(
                &blob.path,
                format!("{what} takes {length} bytes, more than the {limit} it may"),
            ));
        }
        Ok((blob.path.clone(), blob.read_vec(offset, length)?))
    }

    /// What a byte entry holds, for `inspect`: small items are unpickled (inertly);
    /// anything unreadable is just described by its size.
    pub(super) fn describe_bytes(&mut self, md: &Metadata, entry: &Entry) -> String {
        let EntryKind::Bytes { item: Some(item) } = entry.kind else {
            return "non-tensor entry (no storage entry)".into();
        };
        let fqn = entry.fqn.as_str();
        let fallback = format!("non-tensor entry ({} bytes)", item.length);
        if item.length > 1 << 20 {
            return fallback;
        }
        let Ok((file, offset, length)) = self.locate(md, &item, fqn) else {
            return fallback;
        };
        let blob = self.files[file].clone();
        let Ok(mut data) = blob.read_vec(offset, length) else {
            return fallback;
        };
        for t in md.transforms(&item) {
            match (t.as_str(), unzstd(&data, 1 << 20)) {
                (ZSTD, Ok(d)) => data = d,
                _ => return fallback,
            }
        }
        let held = Blob::owned(blob.path.clone(), data);
        match torch::read_zip_payload(&mut Archive::whole(&held)) {
            Ok(mut payload) => {
                self.unsafe_calls.append(&mut payload.unsafe_calls);
                torch::describe(&payload.pickle, payload.pickle.root())
            }
            Err(_) => fallback,
        }
    }
}

/// Decompresses a zstd stream, refusing to produce more than `limit` bytes.
fn unzstd(data: &[u8], limit: u64) -> std::result::Result<Vec<u8>, String> {
    let decoder = zstd::stream::read::Decoder::new(data)
        .map_err(|e| format!("cannot start zstd decompression: {e}"))?;
    let mut out = Vec::new();
    decoder
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| format!("the zstd stream is corrupt: {e}"))?;
    if out.len() as u64 > limit {
        return Err(format!(
            "the zstd stream decompresses to more than the {limit} bytes the chunk can hold"
        ));
    }
    Ok(out)
}
