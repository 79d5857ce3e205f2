//! An archive as a byte range of a blob, with the parts already read held in memory.

use super::{bad, Fail};
use crate::error::{Error, Result};
use crate::source::Blob;

/// An archive occupying `len` bytes at `base` of a blob, with the parts of it
/// already read (its ends, for a DCP chunk) held so that parsing reads them once.
#[derive(Debug)]
pub struct Archive<'a> {
    pub(super) blob: &'a Blob,
    base: u64,
    pub(super) len: u64,
    /// `(offset in the archive, bytes)`.
    pub(super) held: Vec<(u64, Vec<u8>)>,
}

impl<'a> Archive<'a> {
    /// The archive at `base..base + len` of `blob`; the range must lie inside it.
    pub fn new(blob: &'a Blob, base: u64, len: u64) -> Result<Archive<'a>> {
        if base.checked_add(len).is_none_or(|e| e > blob.len()) {
            return Err(Error::corrupt(
                &blob.path,
                format!(
                    "an archive of {len} bytes at byte {base} lies past the end of the file ({} bytes); it is truncated",
                    blob.len()
                ),
            ));
        }
        Ok(Archive {
            blob,
            base,
            len,
            held: Vec::with_capacity(3),
        })
    }

    /// The archive that is the whole of `blob`.
    pub fn whole(blob: &'a Blob) -> Archive<'a> {
        Archive {
            blob,
            base: 0,
            len: blob.len(),
            held: Vec::with_capacity(3),
        }
    }

    /// The blob holding the archive.
    pub fn blob(&self) -> &'a Blob {
        self.blob
    }

    /// Where the archive starts in its blob.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads the first `head` and the last `tail` bytes in one request (one read when
    /// they are close) and holds them: an archive whose records and pickle sit at its
    /// ends, as torch writes them, then parses without further reads.
    pub fn read_ends(&mut self, head: u64, tail: u64) -> Result<()> {
        if head.saturating_add(tail) >= self.len {
            let all = self.blob.read_vec(self.base, self.len)?;
            self.held.push((0, all));
            return Ok(());
        }
        let mut a = vec![0; head as usize];
        let mut b = vec![0; tail as usize];
        let mut ranges = [
            (self.base, &mut a[..]),
            (self.base + self.len - tail, &mut b[..]),
        ];
        self.blob.read_ranges(&mut ranges)?;
        self.held.push((0, a));
        self.held.push((self.len - tail, b));
        Ok(())
    }

    /// Holds `bytes` as the archive's bytes from `at` on, read by the caller (the
    /// ends of many archives read at once): reads they cover are served from them.
    /// They must be the archive's bytes and lie inside it.
    pub fn hold(&mut self, at: u64, bytes: Vec<u8>) {
        if at
            .checked_add(bytes.len() as u64)
            .is_some_and(|end| end <= self.len)
        {
            self.held.push((at, bytes));
        }
    }

    /// Fills `buf` with the bytes at `at` of the archive.
    pub fn read(&self, at: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        if at.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(self.past_end(at, len, "a read"));
        }
        if let Some(b) = self.held_bytes(at, len) {
            buf.copy_from_slice(b);
            return Ok(());
        }
        self.blob.read_at(self.base + at, buf)
    }

    /// `len` bytes at `at` of the archive, in a new buffer.
    pub fn read_vec(&self, at: u64, len: u64) -> Result<Vec<u8>> {
        if at.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(self.past_end(at, len, "a read"));
        }
        let mut buf = vec![0; len as usize];
        self.read(at, &mut buf)?;
        Ok(buf)
    }

    /// Fills every `(offset in the archive, buffer)`: from what is held, the rest with
    /// one [`Blob::read_ranges`]. Offsets must have been checked against the length.
    pub(super) fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> Result<()> {
        let mut rest: Vec<(u64, &mut [u8])> = Vec::new();
        for (at, buf) in reqs.iter_mut() {
            match self.held_bytes(*at, buf.len() as u64) {
                Some(b) => buf.copy_from_slice(b),
                None => rest.push((self.base + *at, &mut buf[..])),
            }
        }
        self.blob.read_ranges(&mut rest)
    }

    pub(super) fn held_bytes(&self, at: u64, len: u64) -> Option<&[u8]> {
        self.held.iter().find_map(|(start, data)| {
            let from = usize::try_from(at.checked_sub(*start)?).ok()?;
            data.get(from..from.checked_add(usize::try_from(len).ok()?)?)
        })
    }

    pub(super) fn past_end(&self, at: u64, len: u64, what: &str) -> Error {
        Error::corrupt(
            &self.blob.path,
            format!(
                "{what} at byte {at} (+{len}) lies past the end of the archive ({} bytes); the file is truncated or corrupt",
                self.len
            ),
        )
    }

    /// Reads a record of `N` bytes after checking it lies inside the archive.
    pub(super) fn field<const N: usize>(
        &self,
        at: u64,
        what: &str,
    ) -> std::result::Result<[u8; N], Fail> {
        let len = N as u64;
        if at.checked_add(len).is_none_or(|e| e > self.len) {
            return bad(format!(
                "{what} at byte {at} (+{len}) lies past the end of the archive ({} bytes); the file is truncated or corrupt",
                self.len
            ));
        }
        let mut buf = [0u8; N];
        self.read(at, &mut buf)?;
        Ok(buf)
    }
}
