//! Checksums of the output, taken while it is written: the SHA-256 of each
//! [`WINDOW_BYTES`] block of each file (file offsets `k × WINDOW_BYTES`, the last
//! block shorter), hashed from the buffer handed to the write.
//!
//! Blocks are written in any order and by many threads, so a streaming SHA-256 of
//! a whole file would need the blocks in file order, which only a second read (or
//! buffering most of the file) gives. Per-block digests cost nothing of the sort:
//! each worker hashes its own block. A file's checksum is then the SHA-256 of its
//! block digests in order ([`FileDigest::tree`]), which anyone can recompute from
//! the file (the README shows how); `verify` recomputes the block digests from the
//! one read it makes of the output.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::WINDOW_BYTES;
use crate::{Error, Result};

/// A SHA-256 digest.
pub type Sha = [u8; 32];

/// The SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> Sha {
    Sha256::digest(bytes).into()
}

/// Lowercase hexadecimal.
pub fn hex(d: &Sha) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The block digests of one output file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileDigest {
    /// The file's size in bytes.
    pub size: u64,
    /// The SHA-256 of each block, in file order; `None` until known.
    pub blocks: Vec<Option<Sha>>,
}

impl FileDigest {
    /// A file of `size` bytes whose blocks are not hashed yet.
    pub fn new(size: u64) -> FileDigest {
        FileDigest {
            size,
            blocks: vec![None; size.div_ceil(WINDOW_BYTES) as usize],
        }
    }

    /// The digests of a file held whole in memory (the index, the config).
    pub fn of_bytes(bytes: &[u8]) -> FileDigest {
        FileDigest {
            size: bytes.len() as u64,
            blocks: bytes
                .chunks(WINDOW_BYTES as usize)
                .map(|c| Some(sha256(c)))
                .collect(),
        }
    }

    /// The digests of a local file, read once.
    pub fn of_file(path: &Path) -> Result<FileDigest> {
        let f = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let size = f
            .metadata()
            .map_err(|e| Error::io("inspect", path, e))?
            .len();
        let mut buf = Vec::new();
        let blocks = (0..size.div_ceil(WINDOW_BYTES))
            .map(|k| {
                let start = k * WINDOW_BYTES;
                buf.resize(WINDOW_BYTES.min(size - start) as usize, 0);
                f.read_exact_at(&mut buf, start)
                    .map_err(|e| Error::io("read back", path, e))?;
                Ok(Some(sha256(&buf)))
            })
            .collect::<Result<_>>()?;
        Ok(FileDigest { size, blocks })
    }

    /// The file's checksum: the SHA-256 of its block digests, concatenated in
    /// order; `None` while a block is not hashed.
    pub fn tree(&self) -> Option<Sha> {
        let mut h = Sha256::new();
        for b in &self.blocks {
            h.update(b.as_ref()?);
        }
        Some(h.finalize().into())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The definition the README gives, spelled out with a plain SHA-256 of each
    /// slice: a file of two and a half blocks has three block digests.
    #[test]
    fn a_files_checksum_is_the_sha256_of_its_block_digests() {
        let w = WINDOW_BYTES as usize;
        let bytes: Vec<u8> = (0..2 * w + w / 2).map(|i| (i * 7 % 251) as u8).collect();
        let d = FileDigest::of_bytes(&bytes);
        assert_eq!(d.blocks.len(), 3);
        let mut cat = Vec::new();
        for c in [&bytes[..w], &bytes[w..2 * w], &bytes[2 * w..]] {
            cat.extend_from_slice(&Sha256::digest(c));
        }
        assert_eq!(d.tree().unwrap(), <Sha>::from(Sha256::digest(&cat)));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(FileDigest::of_file(&p).unwrap(), d);
        // Known value: SHA-256 of "abc".
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
