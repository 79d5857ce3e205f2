//! The output file and its buffers: direct I/O where the filesystem allows it, an
//! aligned buffer pool so that nothing is allocated or zeroed per block, and space
//! reserved up front so that a full disk fails before any work.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::read::pieces::CHUNK_BYTES;

/// Alignment of direct I/O: of file offsets, lengths and buffer addresses.
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// A buffer whose start is aligned for direct I/O.
pub(crate) struct AlignedBuf {
    pub(crate) raw: Vec<u8>,
    pub(crate) start: usize,
}

impl AlignedBuf {
    pub(crate) fn new(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + DIRECT_ALIGN];
        let misalign = raw.as_ptr() as usize % DIRECT_ALIGN;
        let start = (DIRECT_ALIGN - misalign) % DIRECT_ALIGN;
        AlignedBuf { raw, start }
    }

    pub(crate) fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        &mut self.raw[self.start..self.start + len]
    }
}

/// What a worker fills a block with: the block itself and a scratch buffer for
/// input that needs converting.
pub(crate) struct Buffers {
    pub(crate) block: AlignedBuf,
    pub(crate) scratch: Vec<u8>,
}

/// Buffers handed from block to block, so memory is a few buffers per thread and
/// nothing is allocated or zeroed per block.
pub(crate) struct BufferPool {
    pub(crate) block_bytes: usize,
    pub(crate) free: std::sync::Mutex<Vec<Buffers>>,
}

impl BufferPool {
    pub(crate) fn new(block_bytes: usize) -> BufferPool {
        BufferPool {
            block_bytes,
            free: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn take(&self) -> Buffers {
        let reused = self.free.lock().ok().and_then(|mut f| f.pop());
        reused.unwrap_or_else(|| Buffers {
            block: AlignedBuf::new(self.block_bytes),
            scratch: vec![0u8; CHUNK_BYTES],
        })
    }

    pub(crate) fn give(&self, bufs: Buffers) {
        if let Ok(mut f) = self.free.lock() {
            f.push(bufs);
        }
    }
}

/// An output shard file. Blocks go straight to the disk with direct I/O where the
/// filesystem supports it: the output is written once, not copied into the page cache
/// and written back later (which `fsync` would then wait for), and it does not push
/// the inputs out of the cache. Elsewhere, and for a file's unaligned last bytes,
/// writes are buffered.
pub(crate) struct OutFile {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) direct: Option<File>,
    pub(crate) direct_refused: AtomicBool,
}

impl OutFile {
    /// Creates the file with `size` bytes reserved on the disk.
    pub(crate) fn create(path: &Path, size: u64) -> Result<OutFile> {
        let file = File::create(path).map_err(|e| Error::io("create", path, e))?;
        preallocate(&file, size).map_err(|e| Error::io("allocate space for", path, e))?;
        #[cfg(target_os = "linux")]
        let direct = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        };
        #[cfg(not(target_os = "linux"))]
        let direct = None;
        Ok(OutFile {
            path: path.to_path_buf(),
            file,
            direct,
            direct_refused: AtomicBool::new(false),
        })
    }

    /// Writes `buf` at any `offset`, through the page cache.
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| Error::io("write", &self.path, e))
    }

    /// Writes `buf` at `offset`, a multiple of [`DIRECT_ALIGN`] like `buf`'s address.
    pub(crate) fn write_block(&self, buf: &[u8], offset: u64) -> Result<()> {
        let aligned = buf.len() / DIRECT_ALIGN * DIRECT_ALIGN;
        let mut done = 0;
        if let Some(direct) = &self.direct {
            if aligned > 0 && !self.direct_refused.load(Ordering::Relaxed) {
                match direct.write_all_at(&buf[..aligned], offset) {
                    Ok(()) => done = aligned,
                    // The filesystem takes O_DIRECT opens but not these writes: buffer.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        self.direct_refused.store(true, Ordering::Relaxed)
                    }
                    Err(e) => return Err(Error::io("write", &self.path, e)),
                }
            }
        }
        self.file
            .write_all_at(&buf[done..], offset + done as u64)
            .map_err(|e| Error::io("write", &self.path, e))
    }
}

/// Reserves `len` bytes on the disk for `f` (Linux: `posix_fallocate`), so that a
/// full disk fails before any work. Elsewhere the file only gets its length.
#[cfg(target_os = "linux")]
pub(crate) fn preallocate(f: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    let len_i = i64::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: the descriptor is open for writing for the duration of the call.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len_i) };
    match r {
        0 => Ok(()),
        // Filesystems without fallocate: fall back to a sparse length.
        libc::EOPNOTSUPP | libc::EINVAL => f.set_len(len),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// See the Linux version: here the file gets its length, sparse.
#[cfg(not(target_os = "linux"))]
pub(crate) fn preallocate(f: &File, len: u64) -> std::io::Result<()> {
    f.set_len(len)
}

impl super::sink::ShardFile for OutFile {
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<()> {
        OutFile::write_block(self, buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        OutFile::write_at(self, buf, offset)
    }

    fn finish(&self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| Error::io("flush", &self.path, e))
    }

    fn local_path(&self) -> Option<&Path> {
        Some(&self.path)
    }
}
