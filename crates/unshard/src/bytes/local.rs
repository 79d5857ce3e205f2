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
use crate::error::{Error, Result};

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

/// Linux only: they read the page table in `/proc/self/pagemap`.
#[cfg(all(test, target_os = "linux"))]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io::Write;

    use super::*;

    const PAGE: usize = 4096;

    /// Whether the page of this process at `addr` is mapped in its page table (bit 63
    /// of its `/proc/self/pagemap` entry, readable without privileges).
    fn present(addr: usize) -> bool {
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        let mut entry = [0u8; 8];
        pagemap
            .read_exact_at(&mut entry, (addr / PAGE * 8) as u64)
            .unwrap();
        u64::from_le_bytes(entry) >> 63 == 1
    }

    /// A local file of `pages` pages after one strided read, which maps it.
    fn mapped_file(pages: usize) -> (tempfile::NamedTempFile, LocalFile) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![1u8; pages * PAGE]).unwrap();
        let local = LocalFile::open(f.path()).unwrap();
        let mut out = [0u8; 2];
        local.read_strided(0, PAGE as u64, 1, &mut out).unwrap();
        (f, local)
    }

    #[test]
    fn a_strided_read_of_a_non_empty_file_maps_it_once_and_an_empty_one_is_not_mapped() {
        let (_f, local) = mapped_file(4);
        let first = local.map.get().unwrap().as_ref().unwrap().as_ptr();
        let mut out = [0u8; 4];
        local.read_strided(1, PAGE as u64, 1, &mut out).unwrap();
        assert_eq!(out, [1; 4]);
        assert_eq!(local.map.get().unwrap().as_ref().unwrap().as_ptr(), first);
        let empty = tempfile::NamedTempFile::new().unwrap();
        let local = LocalFile::open(empty.path()).unwrap();
        local.read_strided(0, 4, 4, &mut []).unwrap();
        assert!(matches!(local.map.get(), Some(None)));
    }

    #[test]
    fn a_release_unmaps_exactly_the_whole_pages_inside_the_range() {
        let (_f, local) = mapped_file(16);
        let base = local.map.get().unwrap().as_ref().unwrap().as_ptr() as usize;
        // The pages of the map that are in the page table now.
        let resident = || -> Vec<usize> { (0..16).filter(|&p| present(base + p * PAGE)).collect() };
        let touch = |local: &LocalFile| {
            let mut out = [0u8; 16];
            local.read_strided(0, PAGE as u64, 1, &mut out).unwrap();
            assert_eq!(out, [1; 16]);
        };
        // Bytes 100 .. 100 + 3 pages: only pages 1 and 2 lie wholly inside.
        touch(&local);
        assert_eq!(resident(), (0..16).collect::<Vec<_>>());
        local.release(100, 3 * PAGE as u64);
        assert_eq!(resident(), [0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
        // Page-aligned, from page 5 to past the end of the map.
        touch(&local);
        local.release(5 * PAGE as u64, u64::MAX);
        assert_eq!(resident(), [0, 1, 2, 3, 4]);
        // Ranges inside one page release nothing.
        touch(&local);
        local.release(PAGE as u64 + 1, PAGE as u64 - 2);
        local.release(0, PAGE as u64 - 1);
        assert_eq!(resident(), (0..16).collect::<Vec<_>>());
    }
}
