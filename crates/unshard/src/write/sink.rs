//! The output-sink seam: where a merge's files go, so that they appear complete or
//! not at all.
//!
//! The engine writes each shard through a [`ShardFile`] (blocks at any offset, from
//! many threads, in any order), then the small files (index, config, the base's
//! tokenizer files), and the merge calls [`Sink::commit`] once everything
//! succeeded (and verified, when asked). Dropping a sink without committing it
//! removes what it wrote.
//!
//! [`StagingDir`] is the local implementation: a staging directory beside the
//! destination, fsynced and renamed into place. An object-store sink would upload
//! shards as multipart uploads (a block is a part), write the index and config
//! last, and abort the uploads on failure.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::direct::OutFile;
use super::staging::{commit, create_staging, write_file, Staging};
use crate::error::Result;

/// An output being written.
pub trait Sink: Send + Sync {
    /// Creates shard file `name`, exactly `size` bytes, with the space reserved
    /// where the store allows (a full disk fails here, before any work).
    fn create_shard(&self, name: &str, size: u64) -> Result<Box<dyn ShardFile>>;

    /// Writes a small file whole (the index, the config).
    fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()>;

    /// Copies a local file in under `name`, unless a file of that name was
    /// written already; returns whether it copied.
    fn copy_file(&self, name: &str, from: &Path) -> Result<bool>;

    /// A local directory holding the files written so far, for reading them back
    /// before the commit (`verify`); `None` for a store that has none.
    fn staged_dir(&self) -> Option<&Path>;

    /// Makes the output visible, complete, at its destination.
    fn commit(self: Box<Self>) -> Result<()>;
}

/// One shard file of a [`Sink`].
pub trait ShardFile: Send + Sync {
    /// Writes `buf` at `offset`. The engine's blocks start at multiples of 4096
    /// bytes, from buffers aligned to 4096 bytes, and are 4096-byte multiples long
    /// except a file's last one.
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<()>;

    /// Writes `buf` at any `offset`, for writers outside the block engine (the
    /// engine writes every byte, computed tensors included, as blocks).
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;

    /// Makes what was written durable.
    fn finish(&self) -> Result<()>;

    /// Where the file can be read back locally, if anywhere (to hash the blocks
    /// that computed tensors finished after the block pass).
    fn local_path(&self) -> Option<&Path> {
        None
    }
}

/// The local sink: a staging directory beside `output`, fsynced and renamed into
/// place by [`Sink::commit`], removed if dropped before.
pub struct StagingDir {
    staging: Staging,
    output: PathBuf,
}

impl StagingDir {
    /// Creates the staging directory for `output` (replacing one this process left).
    pub fn create(output: &Path) -> Result<StagingDir> {
        Ok(StagingDir {
            staging: create_staging(output)?,
            output: output.to_path_buf(),
        })
    }

    /// The staging directory.
    pub fn path(&self) -> &Path {
        &self.staging.path
    }
}

impl Sink for StagingDir {
    fn create_shard(&self, name: &str, size: u64) -> Result<Box<dyn ShardFile>> {
        Ok(Box::new(OutFile::create(
            &self.staging.path.join(name),
            size,
        )?))
    }

    fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_file(&self.staging.path.join(name), bytes)
    }

    fn copy_file(&self, name: &str, from: &Path) -> Result<bool> {
        let dst = self.staging.path.join(name);
        if dst.exists() {
            return Ok(false);
        }
        if crate::bytes::fs::is_url(from) {
            // A base in object storage: extra files are small (`MAX_EXTRA_FILE`).
            write_file(&dst, &crate::bytes::fs::read(from)?)?;
        } else {
            std::fs::copy(from, &dst).map_err(|e| crate::error::Error::io("copy", from, e))?;
        }
        File::open(&dst)
            .and_then(|f| f.sync_all())
            .map_err(|e| crate::error::Error::io("flush", &dst, e))?;
        Ok(true)
    }

    fn staged_dir(&self) -> Option<&Path> {
        Some(&self.staging.path)
    }

    fn commit(self: Box<Self>) -> Result<()> {
        let StagingDir { staging, output } = *self;
        commit(staging, &output)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_staging_dir_holds_what_is_written_until_the_commit_moves_it_into_place() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("merged");
        let extra = tmp.path().join("tokenizer.json");
        std::fs::write(&extra, b"{\"version\": 1}").unwrap();
        let sink: Box<dyn Sink> = Box::new(StagingDir::create(&out).unwrap());
        let staged = sink.staged_dir().unwrap().to_path_buf();
        assert!(staged.is_dir() && staged != out);

        sink.write_file("config.json", b"{}").unwrap();
        assert!(sink.copy_file("tokenizer.json", &extra).unwrap());
        // A file of that name written already is kept, not copied over.
        sink.write_file("special_tokens_map.json", b"mine").unwrap();
        assert!(!sink.copy_file("special_tokens_map.json", &extra).unwrap());
        let shard = sink.create_shard("model.safetensors", 4).unwrap();
        shard.write_at(b"abcd", 0).unwrap();
        shard.finish().unwrap();
        drop(shard);

        // Before the commit the files are in the staging directory only.
        assert_eq!(std::fs::read(staged.join("config.json")).unwrap(), b"{}");
        assert!(!out.exists());
        sink.commit().unwrap();
        assert!(!staged.exists());
        let read = |name: &str| std::fs::read(out.join(name)).unwrap();
        assert_eq!(read("config.json"), b"{}");
        assert_eq!(read("tokenizer.json"), b"{\"version\": 1}");
        assert_eq!(read("special_tokens_map.json"), b"mine");
        assert_eq!(read("model.safetensors"), b"abcd");
    }
}
