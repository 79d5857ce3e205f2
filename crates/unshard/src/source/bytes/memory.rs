//! Bytes held in memory: decompressed DCP items, and inputs built by tests.

use std::path::{Path, PathBuf};

use super::{short_read, ByteSource};
use crate::Result;

/// A [`ByteSource`] over a buffer in memory.
#[derive(Debug)]
pub struct MemBytes {
    name: PathBuf,
    data: Vec<u8>,
}

impl MemBytes {
    /// Holds `data`; messages name it `name` (the file it was decoded from).
    pub fn new(name: PathBuf, data: Vec<u8>) -> MemBytes {
        MemBytes { name, data }
    }
}

impl ByteSource for MemBytes {
    fn name(&self) -> &Path {
        &self.name
    }

    fn len(&self) -> u64 {
        self.data.len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        let src = usize::try_from(offset)
            .ok()
            .and_then(|s| self.data.get(s..s.checked_add(buf.len())?))
            .ok_or_else(|| short_read(&self.name, offset, len))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn as_bytes(&self) -> Option<&[u8]> {
        Some(&self.data)
    }
}
