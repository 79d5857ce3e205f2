//! Checksums of the output, taken while it is written: a file's checksum is its
//! BLAKE3 hash, the same value `b3sum FILE` prints, computed from the output's
//! [`WINDOW_BYTES`] blocks (file offsets `k × WINDOW_BYTES`, the last shorter),
//! each hashed from the buffer handed to the write.
//!
//! Blocks are written in any order and by many threads, so a streaming hash of a
//! whole file would need the blocks in file order, which only a second read (or
//! buffering most of the file) gives. BLAKE3 is a tree hash: each block is a
//! complete subtree of the file's tree (the window is a power of two times
//! BLAKE3's 1 KiB chunk, and every block starts at a multiple of it), so each
//! worker hashes its own block to the subtree's chaining value ([`block`]) and
//! the file's hash is those values merged up the tree ([`FileDigest::tree`]).
//! A file of one block is hashed whole: its block digest is the file's hash.
//! `verify` recomputes the block digests from the one read it makes of the
//! output; the tests hold every combination to `blake3::hash` of the whole file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use blake3::hazmat::{
    left_subtree_len, max_subtree_len, merge_subtrees_non_root, merge_subtrees_root, HasherExt,
    Mode,
};

use crate::error::{Error, Result};

/// Output bytes assembled per unit of work (a multiple of the direct I/O
/// alignment): the writer hashes each such block of a file, a complete subtree of
/// the file's BLAKE3 tree.
pub const WINDOW_BYTES: u64 = 8 << 20;

/// A 32-byte digest: a block's chaining value, or a file's BLAKE3 hash.
pub type Sha = [u8; 32];

/// The digest of the block `bytes` of a file of `file_size` bytes, starting at
/// `offset`: the file's BLAKE3 hash when the block is the whole file, else the
/// block's subtree chaining value. `None` when the block is not a complete
/// subtree of the file's tree (blocks must be a power of two of at least 1 KiB,
/// at a multiple of their size, the last one possibly shorter).
pub fn block(bytes: &[u8], offset: u64, file_size: u64) -> Option<Sha> {
    let len = bytes.len() as u64;
    if offset == 0 && len == file_size {
        return Some(blake3::hash(bytes).into());
    }
    let whole = offset % blake3::CHUNK_LEN as u64 == 0
        && max_subtree_len(offset).is_none_or(|max| len <= max)
        && (offset + len == file_size || len.is_power_of_two())
        && len > 0;
    whole.then(|| {
        blake3::Hasher::new()
            .set_input_offset(offset)
            .update(bytes)
            .finalize_non_root()
    })
}

/// The BLAKE3 hash of `bytes`.
pub fn hash(bytes: &[u8]) -> Sha {
    blake3::hash(bytes).into()
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
    /// Each block's digest ([`block`]), in file order; `None` until known.
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
        let size = bytes.len() as u64;
        FileDigest {
            size,
            blocks: bytes
                .chunks(WINDOW_BYTES as usize)
                .enumerate()
                .map(|(k, c)| block(c, k as u64 * WINDOW_BYTES, size))
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
                Ok(block(&buf, start, size))
            })
            .collect::<Result<_>>()?;
        Ok(FileDigest { size, blocks })
    }

    /// The file's checksum, its BLAKE3 hash: the block digests merged up the
    /// tree. `None` while a block is not hashed, or when the digests do not
    /// cover the size (one per block).
    pub fn tree(&self) -> Option<Sha> {
        self.tree_in(WINDOW_BYTES)
    }

    /// [`tree`](Self::tree) for blocks of `window` bytes (a power of two of at
    /// least 1 KiB).
    pub(crate) fn tree_in(&self, window: u64) -> Option<Sha> {
        let cvs = self.blocks.iter().copied().collect::<Option<Vec<Sha>>>()?;
        if !window.is_power_of_two()
            || window < blake3::CHUNK_LEN as u64
            || cvs.len() as u64 != self.size.div_ceil(window)
        {
            return None;
        }
        if self.size <= window {
            // One block is the whole file, hashed as such; no block at all is
            // the empty file.
            return Some(cvs.first().copied().unwrap_or_else(|| hash(b"")));
        }
        let ((l, ll), (r, rl)) = split(&cvs, self.size, window);
        let (l, r) = (subtree(l, ll, window), subtree(r, rl, window));
        Some(merge_subtrees_root(&l, &r, Mode::Hash).into())
    }
}

/// Digests of a subtree's blocks, and its length in bytes.
type Part<'a> = (&'a [Sha], u64);

/// A subtree of `len` bytes (more than one block) cut where BLAKE3 cuts it: the
/// left part is the largest power of two of chunks that leaves some for the
/// right, a whole number of blocks since the block is a power of two of chunks.
fn split(cvs: &[Sha], len: u64, window: u64) -> (Part<'_>, Part<'_>) {
    let left = left_subtree_len(len);
    let n = (left / window) as usize;
    ((&cvs[..n], left), (&cvs[n..], len - left))
}

/// The chaining value of the subtree of `len` bytes whose blocks have digests `cvs`.
fn subtree(cvs: &[Sha], len: u64, window: u64) -> Sha {
    if len <= window {
        return cvs[0];
    }
    let ((l, ll), (r, rl)) = split(cvs, len, window);
    merge_subtrees_non_root(&subtree(l, ll, window), &subtree(r, rl, window), Mode::Hash)
}

const _: () = assert!(WINDOW_BYTES.is_power_of_two() && WINDOW_BYTES >= blake3::CHUNK_LEN as u64);

/// What a file of the output should hash to.
#[derive(Clone, Debug)]
pub struct Expected {
    /// The file, relative to the output directory.
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// What is known of its content.
    pub digest: ExpectedDigest,
}

/// The checksums a file is held to.
#[derive(Clone, Debug)]
pub enum ExpectedDigest {
    /// Each block's digest as the writer hashed it (`None`: not hashed).
    Written(Vec<Option<Sha>>),
    /// The file checksum recorded in `unshard.json`
    /// (the BLAKE3 of the whole file, as `b3sum` prints it).
    Recorded(Sha),
}

/// The expectations of a merge just written.
pub fn written(names: &[String], digests: &[FileDigest]) -> Vec<Expected> {
    names
        .iter()
        .zip(digests)
        .map(|(n, d)| Expected {
            name: n.clone(),
            size: d.size,
            digest: ExpectedDigest::Written(d.blocks.clone()),
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Every shape of tree a file can have — empty, one block, exactly k blocks,
    /// a partial last block, sizes where BLAKE3's left subtree is 1, 2 or 4
    /// blocks — merges to `blake3::hash` of the whole file, the value `b3sum`
    /// prints.
    #[test]
    fn a_files_checksum_is_its_blake3_hash() {
        let w = WINDOW_BYTES as usize;
        let all: Vec<u8> = (0..5 * w + 3).map(|i| (i * 7 % 251) as u8).collect();
        for len in [
            0,
            1,
            1024,
            w - 1,
            w,
            w + 1,
            w + 1024,
            2 * w,
            2 * w + 5,
            3 * w,
            3 * w + w / 2,
            4 * w,
            4 * w + 1,
            5 * w + 3,
        ] {
            let bytes = &all[..len];
            let d = FileDigest::of_bytes(bytes);
            assert_eq!(d.blocks.len(), len.div_ceil(w), "{len}");
            assert_eq!(
                d.tree().unwrap(),
                <Sha>::from(blake3::hash(bytes)),
                "a file of {len} bytes"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, &all).unwrap();
        assert_eq!(FileDigest::of_file(&p).unwrap(), FileDigest::of_bytes(&all));
        // Known value (the BLAKE3 test vectors): the hash of "abc".
        assert_eq!(
            hex(&hash(b"abc")),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
    }

    /// A missing block, or digests that do not match the size, give no checksum
    /// rather than a wrong one (or a panic on a malformed record).
    #[test]
    fn incomplete_digests_give_no_checksum() {
        let w = WINDOW_BYTES as usize;
        let bytes = vec![1u8; 2 * w + 1];
        let mut d = FileDigest::of_bytes(&bytes);
        d.blocks[1] = None;
        assert_eq!(d.tree(), None);
        let mut d = FileDigest::of_bytes(&bytes);
        d.blocks.pop();
        assert_eq!(d.tree(), None);
        d.size = 0;
        assert_eq!(d.tree(), None);
    }

    /// Blocks of any power of two of at least 1 KiB merge to the file's hash; digests
    /// said to be of blocks of another size (which cannot be subtrees of a BLAKE3
    /// tree) give no checksum rather than a wrong one or a panic.
    #[test]
    fn a_window_that_is_no_subtree_size_gives_no_checksum() {
        let bytes: Vec<u8> = (0..3 * 1024 + 5).map(|i| (i % 251) as u8).collect();
        let size = bytes.len() as u64;
        let d = FileDigest {
            size,
            blocks: bytes
                .chunks(1024)
                .enumerate()
                .map(|(k, c)| block(c, k as u64 * 1024, size))
                .collect(),
        };
        assert_eq!(d.tree_in(1024), Some(<Sha>::from(blake3::hash(&bytes))));
        let fake = |size: u64, n: usize| FileDigest {
            size,
            blocks: vec![Some([0; 32]); n],
        };
        assert_eq!(fake(2048, 4).tree_in(512), None, "under a chunk");
        assert_eq!(fake(6144, 2).tree_in(3072), None, "not a power of two");
    }

    /// A block that is not a complete subtree of the file's tree (not a power of
    /// two, or not at a multiple of its size) has no digest, rather than a wrong
    /// one or a panic inside the hash; a shorter last block has one.
    #[test]
    fn only_whole_subtrees_are_hashed() {
        let b = vec![5u8; 12288];
        assert_eq!(block(&b, 12288, 100_000), None, "not a power of two");
        assert_eq!(block(&b[..4096], 1000, 100_000), None, "not chunk-aligned");
        assert_eq!(block(&b[..8192], 4096, 100_000), None, "past its subtree");
        assert!(block(&b[..4096], 4096, 100_000).is_some());
        assert!(block(&b, 16384, 16384 + 12288).is_some(), "the last block");
        assert_eq!(block(&[], 4096, 100_000), None);
        // Nor is an empty block at the end of the file (BLAKE3 has no empty
        // subtree but the empty file's root).
        assert_eq!(block(&[], 4096, 4096), None, "an empty last block");
    }
}
