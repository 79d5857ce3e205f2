//! Where input bytes come from: the [`ByteSource`] seam and the [`Blob`] readers hold.
//!
//! Readers and the engine ask a source for byte ranges; nothing assumes a whole-file
//! map. Metadata (pickles, zip records, safetensors headers) is read into small
//! buffers; tensor data is read by the engine, window by window. A local file
//! ([`LocalFile`]) answers with positioned reads; decoded bytes and tests use memory
//! ([`MemBytes`]); an object store would answer with ranged GETs, and
//! [`ByteSource::read_ranges`] is where it would keep many of them in flight.
//!
//! Every source is `Send + Sync` (the engine reads from many threads) and usable as
//! `dyn ByteSource`, so a [`Blob`] holds any of them behind one type.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};

mod coalesce;
pub mod fs;
mod local;
mod memory;
mod pooled;
#[cfg(feature = "remote")]
pub mod remote;
#[cfg(test)]
mod tests;

#[cfg(feature = "remote")]
pub use coalesce::Run;
pub use coalesce::{coalesce, read_runs};
pub(crate) use local::advise_will_need;
pub use local::LocalFile;
pub use memory::MemBytes;
pub use pooled::{open_file_budget, FilePool, PooledFile};

/// Random-access bytes of one input: a local file, bytes in memory, or an object in
/// a bucket (`remote`).
///
/// Reads are positioned and take `&self`, so one source serves many threads at once.
/// A read that would end past [`len`](ByteSource::len) is an error naming the source
/// (the length is fixed when the source is opened: a file that shrinks afterwards
/// gives a short read, which is reported as such, never a crash).
pub trait ByteSource: Send + Sync + fmt::Debug {
    /// What error messages call this source: a file's path, or an object's URL.
    fn name(&self) -> &Path;

    /// Its length in bytes, as of when it was opened.
    fn len(&self) -> u64;

    /// Whether it holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `buf` with the bytes at `offset`, all of them or an error.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Fills every `(offset, buffer)` pair, in any order. Ranges may be unsorted,
    /// adjacent or overlapping; nearby ones are served by one read (see the `coalesce` module),
    /// so a caller asks for all the small records it needs at once rather than one
    /// read each. Sources with a high cost per request (an object store) override it
    /// to issue the coalesced runs concurrently.
    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        let runs = coalesce(&spans(self.name(), ranges)?, GAP, MAX_RUN);
        read_runs(self, ranges, &runs)
    }

    /// A hint: `len` bytes at `offset` will be read soon, so start fetching them. The
    /// default does nothing.
    fn will_need(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }

    /// A hint: `len` bytes at `offset` will not be read again, so any copy the source
    /// keeps of them (a cache, a map) can go. The default does nothing.
    fn release(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }

    /// A hint: every `(offset, len)` range here is read by one unit of work (an output
    /// block of the engine), soon, in any order. A source whose cost is per request
    /// (an object store) fetches them with as few requests as it can, and keeps what
    /// it fetched until [`ByteSource::done_with`] is called with the same ranges. A
    /// source that bounds the bytes it holds ahead may wait here until they fit
    /// (the unit takes its own memory after this call). The default does nothing: a
    /// local file gets [`ByteSource::will_need`] per piece.
    fn will_need_together(&self, ranges: &[(u64, u64)]) {
        let _ = ranges;
    }

    /// The unit of work that announced `ranges` with
    /// [`ByteSource::will_need_together`] is over: what was fetched for it can go.
    fn done_with(&self, ranges: &[(u64, u64)]) {
        let _ = ranges;
    }

    /// How many reads of this source should be in flight at once to get its bandwidth:
    /// 0 (the default) for a local file, whose readers the engine sizes by cores; an
    /// object store, where each request waits for the network, asks for more.
    fn readers(&self) -> usize {
        0
    }

    /// Fills `out` with elements of `elem` bytes, the first at `offset` and each
    /// `stride` bytes after the previous: a strided view (a transposed or expanded
    /// tensor), rare in checkpoints. Its elements are scattered, and neighbouring
    /// output windows read neighbouring bytes, so how to gather them well depends on
    /// the source: the default reads spans ([`read_strided_by_spans`]), a local file
    /// gathers from a map of the file, memory from itself.
    fn read_strided(&self, offset: u64, stride: u64, elem: usize, out: &mut [u8]) -> Result<()> {
        read_strided_by_spans(self, offset, stride, elem, out)
    }

    /// All the bytes, when the source already holds them in memory (no copy needed).
    fn as_bytes(&self) -> Option<&[u8]> {
        None
    }
}

/// Holes up to this size between two requested ranges are read rather than skipped
/// by the default [`ByteSource::read_ranges`]: one larger read costs less than two.
pub const GAP: u64 = 32 << 10;

/// The longest read the default [`ByteSource::read_ranges`] makes to serve several
/// ranges at once (a single range longer than this is still read in one piece).
pub const MAX_RUN: u64 = 8 << 20;

/// The `(offset, len)` of each range, after checking that none overflows.
pub fn spans(name: &Path, ranges: &[(u64, &mut [u8])]) -> Result<Vec<(u64, u64)>> {
    ranges
        .iter()
        .map(|(offset, buf)| {
            let len = buf.len() as u64;
            match offset.checked_add(len) {
                Some(_) => Ok((*offset, len)),
                None => Err(Error::corrupt(
                    name,
                    format!("a read of {len} bytes at byte {offset} overflows"),
                )),
            }
        })
        .collect()
}

/// The error for a read that ends past the end of a source.
pub fn short_read(name: &Path, offset: u64, len: u64) -> Error {
    Error::corrupt(
        name,
        format!(
            "cannot read {len} bytes at byte {offset}: the file is shorter than when it was opened (it changed while being read)"
        ),
    )
}

/// One input as readers and the engine hold it: a [`ByteSource`] and the path that
/// names it in messages. Cheap to share (`Arc<Blob>` in `Checkpoint::files`).
pub struct Blob {
    /// The path (or URL) error messages name.
    pub path: PathBuf,
    source: Arc<dyn ByteSource>,
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blob")
            .field("path", &self.path)
            .field("source", &self.source)
            .finish()
    }
}

impl Blob {
    /// Wraps any byte source; messages name it by [`ByteSource::name`].
    pub fn new(source: Arc<dyn ByteSource>) -> Blob {
        Blob {
            path: source.name().to_path_buf(),
            source,
        }
    }

    /// Opens a local file for positioned reads.
    pub fn open(path: &Path) -> Result<Blob> {
        Ok(Blob::new(Arc::new(LocalFile::open(path)?)))
    }

    /// Wraps bytes held in memory (a decompressed DCP item, a test input), named `path`.
    pub fn owned(path: PathBuf, bytes: Vec<u8>) -> Blob {
        Blob::new(Arc::new(MemBytes::new(path, bytes)))
    }

    /// The source behind this blob.
    pub fn source(&self) -> &Arc<dyn ByteSource> {
        &self.source
    }

    /// Its length in bytes, as of when it was opened.
    pub fn len(&self) -> u64 {
        self.source.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.source.is_empty()
    }

    /// Fills `buf` with the bytes at `offset`. A short read means the file shrank
    /// since it was opened (readers validated extents then) and is an error.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.source.read_at(offset, buf)
    }

    /// Fills every `(offset, buffer)` pair, coalescing nearby ranges (see
    /// [`ByteSource::read_ranges`]).
    pub fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.source.read_ranges(ranges)
    }

    /// `len` bytes at `offset`, read into a new buffer: for metadata (a pickle, a
    /// header), never for tensor data. The range must lie inside the source.
    pub fn read_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::corrupt(
                &self.path,
                format!(
                    "{len} bytes at byte {offset} lie past the end of the file ({} bytes); it is truncated",
                    self.len()
                ),
            ));
        }
        let n = usize::try_from(len).map_err(|_| short_read(&self.path, offset, len))?;
        let mut buf = vec![0; n];
        self.read_at(offset, &mut buf)?;
        Ok(buf)
    }

    /// The first `max` bytes (fewer for a shorter file): what format detection looks at.
    pub fn head(&self, max: u64) -> Result<Vec<u8>> {
        self.read_vec(0, max.min(self.len()))
    }

    /// A hint that a byte range will be read soon (see [`ByteSource::will_need`]).
    pub fn will_need(&self, offset: u64, len: u64) {
        self.source.will_need(offset, len);
    }

    /// A hint that a byte range will not be read again (see [`ByteSource::release`]).
    pub fn release(&self, offset: u64, len: u64) {
        self.source.release(offset, len);
    }

    /// [`Blob::release`] of the whole source.
    pub fn release_all(&self) {
        self.release(0, self.len());
    }

    /// Fills `out` with elements of `elem` bytes, the first at `offset` and each
    /// `stride` bytes after the previous: the bytes of a strided view (a transposed or
    /// expanded tensor). See [`ByteSource::read_strided`].
    pub fn read_strided(
        &self,
        offset: u64,
        stride: u64,
        elem: usize,
        out: &mut [u8],
    ) -> Result<()> {
        self.source.read_strided(offset, stride, elem, out)
    }
}

/// [`ByteSource::read_strided`] by positioned reads: elements closer than [`GAP`]
/// are read as spans of up to [`STRIDED_SPAN`] bytes and picked out, farther ones
/// one by one.
pub fn read_strided_by_spans<S: ByteSource + ?Sized>(
    src: &S,
    offset: u64,
    stride: u64,
    elem: usize,
    out: &mut [u8],
) -> Result<()> {
    let n = out.len() / elem.max(1);
    if n == 0 {
        return Ok(());
    }
    let e = elem as u64;
    let per = if stride > GAP {
        1
    } else {
        usize::try_from(STRIDED_SPAN.saturating_sub(e) / stride.max(1) + 1).unwrap_or(n)
    };
    let overflow = || {
        Error::corrupt(
            src.name(),
            format!(
                "a strided read of {n} elements {stride} bytes apart at byte {offset} overflows"
            ),
        )
    };
    let mut span = Vec::new();
    for (w, chunk) in out.chunks_mut(per.saturating_mul(elem)).enumerate() {
        let first = (w as u64)
            .checked_mul(per as u64)
            .and_then(|i| i.checked_mul(stride))
            .and_then(|x| x.checked_add(offset))
            .ok_or_else(overflow)?;
        let k = (chunk.len() / elem) as u64;
        if k == 1 {
            src.read_at(first, chunk)?;
            continue;
        }
        // k - 1 strides and one element: at most STRIDED_SPAN bytes, by `per`.
        let len = (k - 1) * stride + e;
        span.resize(len as usize, 0);
        src.read_at(first, &mut span)?;
        for (i, dst) in chunk.chunks_exact_mut(elem).enumerate() {
            let at = i * stride as usize;
            dst.copy_from_slice(&span[at..at + elem]);
        }
    }
    Ok(())
}

/// Gathers a strided view from bytes in memory (a buffer, or a map of a file);
/// elements past the end are an error naming the source.
pub(crate) fn gather(
    data: &[u8],
    name: &Path,
    offset: u64,
    stride: u64,
    elem: usize,
    out: &mut [u8],
) -> Result<()> {
    for (i, dst) in out.chunks_exact_mut(elem.max(1)).enumerate() {
        let at = (i as u64)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(offset))
            .ok_or_else(|| short_read(name, offset, out_len(i, elem)))?;
        let src = usize::try_from(at)
            .ok()
            .and_then(|a| data.get(a..a.checked_add(elem)?))
            .ok_or_else(|| short_read(name, at, elem as u64))?;
        dst.copy_from_slice(src);
    }
    Ok(())
}

fn out_len(i: usize, elem: usize) -> u64 {
    (i as u64).saturating_mul(elem as u64)
}

/// The longest span [`read_strided_by_spans`] reads at once.
pub const STRIDED_SPAN: u64 = 1 << 20;
