//! Bytes held in memory: decompressed DCP items, and inputs built by tests.

use std::path::{Path, PathBuf};

use super::{short_read, ByteSource};
use crate::error::Result;

/// A [`ByteSource`] over a buffer in memory.
pub struct MemBytes {
    name: PathBuf,
    data: Vec<u8>,
}

/// Names the buffer and gives its length, not its bytes (they may be megabytes).
impl std::fmt::Debug for MemBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemBytes")
            .field("name", &self.name)
            .field("len", &self.data.len())
            .finish()
    }
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

    fn read_strided(&self, offset: u64, stride: u64, elem: usize, out: &mut [u8]) -> Result<()> {
        super::gather(&self.data, &self.name, offset, stride, elem, out)
    }

    fn as_bytes(&self) -> Option<&[u8]> {
        Some(&self.data)
    }
}
