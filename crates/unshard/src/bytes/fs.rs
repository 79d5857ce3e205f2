//! Files by path, wherever they are: the local file system, or object storage when
//! the path is a URL (the `remote` feature). Readers ask these few questions (what
//! is this path, what is in this directory, read this small file, open this input)
//! instead of calling `std::fs`, so that every format opens from a bucket as from a
//! disk. Local paths go straight to `std::fs`, as before.

use std::io;
use std::path::{Path, PathBuf};

use super::Blob;
use crate::error::{Error, Result};

/// One entry of a directory listing.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Its name inside the directory.
    pub name: String,
    /// The directory's path joined with the name.
    pub path: PathBuf,
    /// A directory (or key prefix) rather than a file.
    pub is_dir: bool,
    /// A file's length in bytes (0 for a directory).
    pub len: u64,
}

/// Whether `path` names object storage (a URL) rather than a local path.
pub fn is_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| {
        let scheme = s.split_once("://").map(|(sch, _)| sch);
        scheme.is_some_and(|sch| {
            !sch.is_empty() && sch.chars().all(|c| c.is_ascii_alphanumeric() || c == '+')
        })
    })
}

/// A path or URL as given on the command line, made safe to print, log and record:
/// a URL's user info (`user:password@`) and query (`?X-Amz-Signature=...`) are
/// removed, after the store's client is made from the whole URL (it keeps the user
/// info for its requests). Every message and `unshard.json` then name the URL
/// without them; the crate-internal `secrets_removed` tells which URLs lost something.
pub fn location(given: &Path) -> PathBuf {
    let Some(clean) = given.to_str().and_then(crate::text::redact_url) else {
        return given.to_path_buf();
    };
    remote::prepare(given);
    let clean = PathBuf::from(clean);
    let mut set = WITHHELD.lock().unwrap_or_else(|e| e.into_inner());
    set.insert(clean.clone());
    clean
}

/// URLs given with user info or a query, as [`location`] returned them.
static WITHHELD: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Whether `path` (as [`location`] returned it) was given with user info or a
/// query that it no longer shows; also true for a URL that still holds them.
pub fn secrets_removed(path: &Path) -> bool {
    if path.to_str().and_then(crate::text::redact_url).is_some() {
        return true;
    }
    let set = WITHHELD.lock().unwrap_or_else(|e| e.into_inner());
    set.iter()
        .any(|w| path.starts_with(w) || w.starts_with(path))
}

/// Whether `path` is a directory (locally) or a key prefix with objects below it.
pub fn is_dir(path: &Path) -> bool {
    if is_url(path) {
        return remote::is_dir(path);
    }
    path.is_dir()
}

/// Whether `path` is a file (locally) or an object.
pub fn is_file(path: &Path) -> bool {
    if is_url(path) {
        return remote::is_file(path);
    }
    path.is_file()
}

/// Whether `path` exists: a file, a directory, an object or a non-empty prefix.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn exists(path: &Path) -> bool {
    is_file(path) || is_dir(path)
}

/// The entries of a directory, sorted by name.
pub fn list(dir: &Path) -> Result<Vec<Entry>> {
    if is_url(dir) {
        return remote::list(dir);
    }
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let path = entry.path();
        // Symbolic links are followed, as `Path::is_dir` does; a dangling one is skipped.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        out.push(Entry {
            name: entry.file_name().to_string_lossy().into_owned(),
            path,
            is_dir: meta.is_dir(),
            len: if meta.is_dir() { 0 } else { meta.len() },
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Reads a whole (small) file: a `.metadata`, a config, an index.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    read_optional(path)?.ok_or_else(|| {
        Error::io(
            "read",
            path,
            io::Error::new(io::ErrorKind::NotFound, "no such file"),
        )
    })
}

/// [`read`], or `None` when there is no such file.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    if is_url(path) {
        return remote::read_optional(path);
    }
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

/// Opens an input for reading: a local file, or an object.
pub fn open(path: &Path) -> Result<Blob> {
    if is_url(path) {
        return remote::open(path);
    }
    Blob::open(path)
}

#[cfg(feature = "remote")]
mod remote {
    use std::path::Path;
    use std::sync::Arc;

    use super::Entry;
    use crate::bytes::remote::{locate, store, ObjectSource};
    use crate::bytes::Blob;
    use crate::error::Result;

    /// The size of `path` from its parent's listing, when that was already made.
    fn listed_size(path: &Path) -> Option<Option<u64>> {
        let (parent, name) = (path.parent()?, path.file_name()?.to_str()?);
        let l = store::cached_listing(parent)?;
        Some(l.files.get(name).copied())
    }

    pub fn is_file(path: &Path) -> bool {
        if let Some(size) = listed_size(path) {
            return size.is_some();
        }
        locate(path)
            .and_then(|l| store::head(&l))
            .is_ok_and(|s| s.is_some())
    }

    pub fn is_dir(path: &Path) -> bool {
        locate(path)
            .and_then(|l| store::list(&l))
            .is_ok_and(|l| !l.files.is_empty() || !l.dirs.is_empty())
    }

    pub fn list(dir: &Path) -> Result<Vec<Entry>> {
        let loc = locate(dir)?;
        let l = store::list(&loc)?;
        let mut out: Vec<Entry> = l
            .files
            .iter()
            .map(|(name, &len)| Entry {
                name: name.clone(),
                path: loc.url.join(name),
                is_dir: false,
                len,
            })
            .chain(l.dirs.iter().map(|name| Entry {
                name: name.clone(),
                path: loc.url.join(name),
                is_dir: true,
                len: 0,
            }))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
        let loc = locate(path)?;
        store::get_whole(&loc)
    }

    /// Makes the client of a URL given with user info, so that the same URL
    /// without it finds that client.
    pub fn prepare(given: &Path) {
        let _ = locate(given);
    }

    pub fn open(path: &Path) -> Result<Blob> {
        let size = listed_size(path).flatten();
        let loc = locate(path)?;
        Ok(Blob::new(Arc::new(ObjectSource::open(loc, size)?)))
    }
}

#[cfg(not(feature = "remote"))]
mod remote {
    use std::path::Path;

    use super::Entry;
    use crate::bytes::Blob;
    use crate::error::{Error, Result};

    fn unsupported(path: &Path) -> Error {
        Error::Unsupported {
            path: path.to_path_buf(),
            what: "reading object storage in this build".into(),
            hint: Some(
                "build unshard with the `remote` feature (the default for the command-line tool)"
                    .into(),
            ),
        }
    }

    pub fn is_file(_: &Path) -> bool {
        false
    }

    pub fn prepare(_: &Path) {}

    pub fn is_dir(_: &Path) -> bool {
        false
    }

    pub fn list(dir: &Path) -> Result<Vec<Entry>> {
        Err(unsupported(dir))
    }

    pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
        Err(unsupported(path))
    }

    pub fn open(path: &Path) -> Result<Blob> {
        Err(unsupported(path))
    }
}
