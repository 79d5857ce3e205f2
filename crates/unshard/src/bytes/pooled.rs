//! Local files opened on demand, at most so many at once: for checkpoints with more
//! rank files than the process may keep open (16,384 ranks against a hard limit of
//! a few thousand descriptors on many clusters' login nodes).
//!
//! Each [`PooledFile`] knows its path and length (read once, at creation, with the
//! file closed again); a read takes a descriptor from its [`FilePool`], opening the
//! file if it is not open and closing the least recently used one when the pool is
//! full. Descriptors are shared (`Arc<File>`), so one closed by the pool stays valid
//! for a read already using it. A file replaced between two opens would be a
//! different file: its length is checked on every open, and a change is an error
//! naming it. Strided gathers read spans (no map is kept of a file that may close).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::local::advise_will_need;
use super::{short_read, ByteSource};
use crate::error::{Error, Result};

/// The descriptors open for a set of [`PooledFile`]s.
#[derive(Debug)]
pub struct FilePool {
    cap: usize,
    inner: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    /// File number → descriptor and when it was last used.
    files: HashMap<usize, (Arc<File>, u64)>,
    tick: u64,
    next_id: usize,
    /// Opens so far (for tests and reports).
    opens: u64,
}

impl FilePool {
    /// A pool keeping at most `cap` files open (at least one).
    pub fn new(cap: usize) -> Arc<FilePool> {
        Arc::new(FilePool {
            cap: cap.max(1),
            inner: Mutex::new(Open::default()),
        })
    }

    /// How many times a file of the pool has been opened.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn opens(&self) -> u64 {
        self.lock().opens
    }

    /// How many files are open now.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn open_now(&self) -> usize {
        self.lock().files.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // A panic while holding the lock leaves the map consistent (every update is
        // one insert or remove), so a poisoned lock is used as it is.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The open descriptor of file `id` at `path`, opening it (and closing the least
    /// recently used file) if needed.
    fn get(&self, id: usize, path: &Path, len: u64) -> Result<Arc<File>> {
        let mut open = self.lock();
        open.tick += 1;
        let tick = open.tick;
        if let Some((f, used)) = open.files.get_mut(&id) {
            *used = tick;
            return Ok(f.clone());
        }
        if open.files.len() >= self.cap {
            if let Some(oldest) = open
                .files
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
            {
                open.files.remove(&oldest);
            }
        }
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let now = file
            .metadata()
            .map_err(|e| Error::io("read the size of", path, e))?
            .len();
        if now != len {
            return Err(Error::corrupt(
                path,
                format!("the file changed while being read: it had {len} bytes and now has {now}"),
            ));
        }
        let file = Arc::new(file);
        open.files.insert(id, (file.clone(), tick));
        open.opens += 1;
        Ok(file)
    }
}

/// A [`ByteSource`] over a local file whose descriptor comes from a [`FilePool`].
#[derive(Debug)]
pub struct PooledFile {
    path: PathBuf,
    len: u64,
    id: usize,
    pool: Arc<FilePool>,
}

impl PooledFile {
    /// Records the length of the file at `path` (opening it briefly) and puts it in `pool`.
    pub fn open(path: &Path, pool: &Arc<FilePool>) -> Result<PooledFile> {
        let len = std::fs::metadata(path)
            .map_err(|e| Error::io("read the size of", path, e))?
            .len();
        // Opened once now, so that a file that cannot be read is reported here, as
        // for a file kept open.
        File::open(path).map_err(|e| Error::io("open", path, e))?;
        let id = {
            let mut open = pool.lock();
            open.next_id += 1;
            open.next_id
        };
        Ok(PooledFile {
            path: path.to_path_buf(),
            len,
            id,
            pool: pool.clone(),
        })
    }
}

impl ByteSource for PooledFile {
    fn name(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let file = self.pool.get(self.id, &self.path, self.len)?;
        file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                short_read(&self.path, offset, buf.len() as u64)
            } else {
                Error::io("read", &self.path, e)
            }
        })
    }

    fn will_need(&self, offset: u64, len: u64) {
        if let Ok(file) = self.pool.get(self.id, &self.path, self.len) {
            advise_will_need(&file, offset, len.min(self.len.saturating_sub(offset)));
        }
    }
}

/// How many input files a reader may keep open at once: the soft limit on open
/// files (which the command line raises to the hard limit), less a reserve for the
/// output files, the engine and the rest of the process.
pub fn open_file_budget() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct passed to it.
    let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    budget_for(cur)
}

/// The budget for a soft limit of `cur` open files. Below 17 there is nothing to
/// spare: every input stays open, and a limit too low for them fails while opening
/// them (before any output exists), as it would without the pool.
pub(super) fn budget_for(cur: usize) -> usize {
    match cur {
        0..=16 => usize::MAX,
        17..=256 => cur - 16,
        _ => cur - 128,
    }
}
