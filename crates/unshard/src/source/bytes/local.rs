//! Local files: positioned reads (`pread`), page-cache hints (`posix_fadvise`).
//!
//! Nothing is mapped: a file truncated by another process while it is read gives a
//! short read, reported as an error naming the file, never SIGBUS.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{coalesce, read_runs, short_read, spans, ByteSource, GAP, MAX_RUN};
use crate::{Error, Result};

/// A [`ByteSource`] over a file on a local file system.
#[derive(Debug)]
pub struct LocalFile {
    path: PathBuf,
    file: File,
    len: u64,
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

    /// Nothing to drop: the file's pages belong to the kernel's cache, not to this
    /// process, and other readers may want them.
    fn release(&self, _offset: u64, _len: u64) {}
}

/// `posix_fadvise(WILLNEED)` in steps: one request reads at most the device's
/// readahead size (128 KiB by default), so a long range is asked for piece by piece.
#[cfg(target_os = "linux")]
fn advise_will_need(file: &File, offset: u64, len: u64) {
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
fn advise_will_need(_file: &File, _offset: u64, _len: u64) {}
