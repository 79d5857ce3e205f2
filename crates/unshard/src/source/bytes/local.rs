//! Local files: positioned reads (`pread`), page-cache hints (`posix_fadvise`).
//!
//! Reads go through `pread`: a file truncated by another process while it is read
//! gives a short read, reported as an error naming the file, never SIGBUS. The one
//! exception is the gather of a strided view (a transposed tensor, rare in
//! checkpoints), which reads from a read-only map made on first use: its elements
//! are scattered over the whole storage and every output window needs bytes from all
//! of it, so reading spans would read the storage again for each window (a
//! transposed 2048 x 4096 tensor took 30 times longer that way), while mapped pages
//! are read once. The engine releases the pages a gather touched.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{
    coalesce, gather, read_runs, read_strided_by_spans, short_read, spans, ByteSource, GAP, MAX_RUN,
};
use crate::{Error, Result};

/// A [`ByteSource`] over a file on a local file system.
#[derive(Debug)]
pub struct LocalFile {
    path: PathBuf,
    file: File,
    len: u64,
    /// A read-only map for strided gathers, made on the first one (`None` if the
    /// map cannot be made: gathers then read spans).
    map: OnceLock<Option<memmap2::Mmap>>,
}

impl LocalFile {
    /// Opens `path` for reading and records its length.
    pub fn open(path: &Path) -> Result<LocalFile> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("read the size of", path, e))?
            .len();
        Ok(LocalFile {
            path: path.to_path_buf(),
            file,
            len,
            map: OnceLock::new(),
        })
    }
}

/// Runs from which [`LocalFile::read_ranges`] first tells the kernel about all of them.
const HINT_RUNS: usize = 4;

impl ByteSource for LocalFile {
    fn name(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                short_read(&self.path, offset, buf.len() as u64)
            } else {
                Error::io("read", &self.path, e)
            }
        })
    }

    /// Coalesces the ranges; when there are several runs (the local headers of a zip
    /// spread over a file), asks the kernel for all of them before reading the first,
    /// so that from a cold cache the disk serves them together rather than one wait
    /// per read.
    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        let runs = coalesce(&spans(&self.path, ranges)?, GAP, MAX_RUN);
        if runs.len() >= HINT_RUNS {
            for r in &runs[1..] {
                self.will_need(r.start, r.end - r.start);
            }
        }
        read_runs(self, ranges, &runs)
    }

    fn will_need(&self, offset: u64, len: u64) {
        advise_will_need(&self.file, offset, len.min(self.len.saturating_sub(offset)));
    }

    fn read_strided(&self, offset: u64, stride: u64, elem: usize, out: &mut [u8]) -> Result<()> {
        let map = self.map.get_or_init(|| {
            if self.len == 0 {
                return None;
            }
            // SAFETY: a read-only map of a file opened read-only, used only for
            // strided gathers, whose offsets were checked against the file's length
            // when it was opened (a file truncated under a gather can fault: the one
            // place a map is still used, see the module header).
            let map = unsafe { memmap2::Mmap::map(&self.file) }.ok()?;
            let _ = map.advise(memmap2::Advice::Random);
            Some(map)
        });
        match map {
            Some(m) => gather(m, &self.path, offset, stride, elem, out),
            None => read_strided_by_spans(self, offset, stride, elem, out),
        }
    }

    /// Unmaps the pages of the strided-gather map in the range, if there is a map:
    /// they stop counting toward the resident set. Pages read with `pread` belong to
    /// the kernel's cache, not to this process, and are left alone.
    fn release(&self, offset: u64, len: u64) {
        if let Some(Some(m)) = self.map.get() {
            release_map(m, offset, len);
        }
    }
}

/// Unmaps the whole pages of a map inside a byte range.
fn release_map(m: &memmap2::Mmap, offset: u64, len: u64) {
    const PAGE: u64 = 4096;
    let start = offset.div_ceil(PAGE) * PAGE;
    let end = (offset.saturating_add(len) / PAGE * PAGE).min(m.len() as u64);
    if end > start {
        // SAFETY: DONTNEED on a private read-only file mapping only drops clean
        // pages; later reads fault them back in from the file.
        let _ = unsafe {
            m.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                start as usize,
                (end - start) as usize,
            )
        };
    }
}

/// `posix_fadvise(WILLNEED)` in steps: one request reads at most the device's
/// readahead size (128 KiB by default), so a long range is asked for piece by piece.
#[cfg(target_os = "linux")]
pub(crate) fn advise_will_need(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    const STEP: u64 = 1 << 20;
    let end = offset.saturating_add(len);
    let mut at = offset;
    while at < end {
        let n = STEP.min(end - at);
        // SAFETY: posix_fadvise only reads its arguments; the descriptor is open.
        let _ = unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                at as libc::off_t,
                n as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        at += n;
    }
}

/// Without `posix_fadvise` (macOS), the hint is dropped: reads just wait for the disk.
#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_will_need(_file: &File, _offset: u64, _len: u64) {}
