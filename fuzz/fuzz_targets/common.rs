//! Shared by the directory and file targets: a scratch directory in memory and a bounded
//! read of every tensor a reader describes.

use std::path::PathBuf;

use unshard::source::Checkpoint;
use unshard::write::read_tensor;

/// A per-process scratch directory, on tmpfs when available (targets that read
/// from memory do not need it).
#[allow(dead_code)]
pub fn scratch() -> PathBuf {
    let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    let dir = PathBuf::from(base).join(format!("unshard-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// Reads every described tensor (up to 16 MiB each): pieces must lie inside files.
pub fn read_all(c: &Checkpoint) {
    for t in &c.tensors {
        if t.nbytes() <= 16 << 20 {
            let _ = read_tensor(&c.files, t, t.dtype);
        }
    }
}
