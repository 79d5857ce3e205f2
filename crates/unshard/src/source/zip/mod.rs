//! A read-only index of a zip archive, read through a byte source.
//!
//! torch writes its archives with stored (uncompressed) entries whose data is aligned
//! to 64 bytes, always with ZIP64 records (docs/formats.md, "torch.save archives").
//! What a checkpoint reader needs from a zip is the position of each entry's bytes,
//! so that tensors can be read in place; general-purpose zip crates hide that behind
//! a reader. An [`Archive`] is a byte range of a [`Blob`], so the same code reads a
//! whole `.pt` file and the archives embedded inside a DCP `.distcp` file.
//!
//! Only records are read, never entry data: the end-of-central-directory records at
//! the tail, the central directory (streamed in blocks), and each entry's 30-byte
//! local header (all at once, with [`Blob::read_ranges`]), whose extra field (torch's
//! alignment padding) gives the data offset. Sizes and offsets come from the central
//! directory. Every offset is checked against the archive with overflow-safe
//! arithmetic.

use std::borrow::Cow;
use std::fmt;
use std::path::PathBuf;

use super::Blob;
use crate::error::{Error, Result};

mod archive;
#[cfg(test)]
mod tests;

pub use archive::Archive;

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;

/// Compression method of a stored entry.
pub const METHOD_STORED: u16 = 0;
/// Compression method of a deflated entry: torch writes none, but reads them (an
/// archive repacked by `zip` has them), so they are read too.
pub const METHOD_DEFLATED: u16 = 8;
/// Most that deflate can expand: 1032 output bytes per input byte.
const DEFLATE_MAX_RATIO: u64 = 1032;
/// Most bytes a deflated record read by [`ZipIndex::stored`] (a pickle, a small
/// record) may inflate to.
pub const MAX_INFLATED_RECORD: u64 = 1 << 30;

/// Bytes of the tail read first: torch's archives carry no comment, so their
/// end-of-central-directory records are in the last 98 bytes, and the central
/// directory of a small archive right before them.
const TAIL: u64 = 4 << 10;

/// The most a comment can push the end-of-central-directory record from the end.
const MAX_TAIL: u64 = 22 + 0xffff;

/// Blocks in which the central directory is read (it grows with the entry count).
const CD_BLOCK: u64 = 1 << 20;

/// One entry of the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipEntry {
    /// Its name, e.g. `archive/data.pkl`.
    pub name: String,
    /// Offset of the entry's data from the start of the archive.
    pub data_offset: u64,
    /// Bytes of data as stored in the archive.
    pub compressed_size: u64,
    /// Bytes of data once decompressed.
    pub size: u64,
    /// Compression method ([`METHOD_STORED`] for torch's entries).
    pub method: u16,
    /// CRC-32 of the data, as recorded.
    pub crc32: u32,
    /// Offset of the entry's local header from the start of the archive.
    pub header_offset: u64,
    /// Offset of the entry's central directory record from the start of the archive.
    pub central_offset: u64,
}

/// The entries of an archive, in central-directory order.
#[derive(Clone, Debug, Default)]
pub struct ZipIndex {
    /// Every entry.
    pub entries: Vec<ZipEntry>,
}

/// Why bytes are not a readable zip archive.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub struct ZipError(pub String);

impl fmt::Display for ZipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How parsing stops: the archive is malformed, or reading it failed.
enum Fail {
    Bad(String),
    Read(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail::Read(e)
    }
}

fn bad<T>(msg: impl Into<String>) -> std::result::Result<T, Fail> {
    Err(Fail::Bad(msg.into()))
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian `u32` at `at` (the caller has checked the length).
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian `u64` at `at` (the caller has checked the length).
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// The central directory, read front to back in blocks of [`CD_BLOCK`].
struct Cursor {
    start: u64,
    buf: Vec<u8>,
}

impl Cursor {
    /// `len` bytes at `at` of the archive, refilling the block when they are not in it.
    fn get<'s>(
        &'s mut self,
        a: &'s Archive<'_>,
        at: u64,
        len: u64,
        what: &str,
    ) -> std::result::Result<&'s [u8], Fail> {
        // Usually the central directory is in the tail already read: no copy.
        if let Some(b) = a.held_bytes(at, len) {
            return Ok(b);
        }
        let inside =
            at >= self.start && at.saturating_add(len) <= self.start + self.buf.len() as u64;
        if !inside {
            if at.checked_add(len).is_none_or(|e| e > a.len) {
                return bad(format!(
                    "{what} at byte {at} (+{len}) lies past the end of the archive ({} bytes); the file is truncated or corrupt",
                    a.len
                ));
            }
            let n = len.max(CD_BLOCK).min(a.len - at);
            self.buf = a.read_vec(at, n)?;
            self.start = at;
        }
        let from = (at - self.start) as usize;
        Ok(&self.buf[from..from + len as usize])
    }
}

impl ZipIndex {
    /// Indexes an archive held in a slice (tests, fuzzing).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn parse(data: &[u8]) -> std::result::Result<ZipIndex, ZipError> {
        let blob = Blob::owned(PathBuf::from("archive"), data.to_vec());
        let mut a = Archive::whole(&blob);
        index(&mut a).map_err(|f| match f {
            Fail::Bad(m) => ZipError(m),
            Fail::Read(e) => ZipError(e.to_string()),
        })
    }

    /// Indexes an archive, reading only its records; errors name the blob's file.
    pub fn read(a: &mut Archive<'_>) -> Result<ZipIndex> {
        let blob = a.blob;
        index(a).map_err(|f| match f {
            Fail::Bad(m) => Error::corrupt(&blob.path, m),
            Fail::Read(e) => e,
        })
    }

    /// The entry with this exact name.
    pub fn find(&self, name: &str) -> Option<&ZipEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Two entries of one name, if any: torch reads the first, other zip readers
    /// the last, so the archive does not say which it holds.
    pub fn duplicate(&self) -> Option<&ZipEntry> {
        let mut names = std::collections::HashSet::new();
        self.entries.iter().find(|e| !names.insert(e.name.as_str()))
    }

    /// The bytes of a record (a pickle, a small record): borrowed from what the
    /// archive holds, else read into memory; a deflated record is inflated (up to
    /// [`MAX_INFLATED_RECORD`] bytes, see [`ZipIndex::inflate`]).
    pub fn stored<'a>(&self, a: &'a Archive<'_>, entry: &ZipEntry) -> Result<Cow<'a, [u8]>> {
        match entry.method {
            METHOD_STORED => {}
            METHOD_DEFLATED => return Ok(Cow::Owned(self.inflate(a, entry, MAX_INFLATED_RECORD)?)),
            method => {
                return Err(Error::corrupt(&a.blob.path, format!(
                    "entry '{}' is compressed with zip method {method}, which torch does not read; torch writes stored entries, so this archive was repacked by another tool. Unzip and re-zip it with `zip -0`, or load and re-save it with torch.save",
                    entry.name
                )))
            }
        }
        if entry
            .data_offset
            .checked_add(entry.size)
            .is_none_or(|e| e > a.len)
        {
            return Err(a.past_end(
                entry.data_offset,
                entry.size,
                &format!("entry '{}'", entry.name),
            ));
        }
        if let Some(b) = a.held_bytes(entry.data_offset, entry.size) {
            return Ok(Cow::Borrowed(b));
        }
        Ok(Cow::Owned(a.read_vec(entry.data_offset, entry.size)?))
    }

    /// Inflates a deflated entry into memory. Its declared size must be at most `max`
    /// and within what deflate can expand its compressed bytes to (so neither the
    /// compressed read nor the output is larger than `max` allows); the output may
    /// not exceed it, and must match the entry's CRC-32.
    pub fn inflate(&self, a: &Archive<'_>, entry: &ZipEntry, max: u64) -> Result<Vec<u8>> {
        let name = &entry.name;
        let bad = |msg: String| Error::corrupt(&a.blob.path, msg);
        // Deflate never stores more than 5 bytes of framing per 64 KiB block.
        let most_compressed = max.saturating_add(max / 8192).saturating_add(64);
        if entry.size > max
            || entry.compressed_size > most_compressed
            || entry.size > entry.compressed_size.saturating_mul(DEFLATE_MAX_RATIO)
        {
            return Err(bad(format!(
                "deflated entry '{name}' claims {} bytes from {} compressed bytes (at most {max} are read); re-zip it without compression (zip -0), or re-save it with torch.save",
                entry.size, entry.compressed_size
            )));
        }
        let raw = match a.held_bytes(entry.data_offset, entry.compressed_size) {
            Some(b) => Cow::Borrowed(b),
            None => Cow::Owned(a.read_vec(entry.data_offset, entry.compressed_size)?),
        };
        let limit = usize::try_from(entry.size)
            .map_err(|_| bad(format!("deflated entry '{name}' is too large to inflate")))?;
        let out = miniz_oxide::inflate::decompress_to_vec_with_limit(&raw, limit)
            .map_err(|e| bad(format!("deflated entry '{name}' does not inflate: {e}")))?;
        if out.len() as u64 != entry.size {
            return Err(bad(format!(
                "deflated entry '{name}' inflates to {} bytes, not the {} its directory entry declares",
                out.len(),
                entry.size
            )));
        }
        if crc32fast::hash(&out) != entry.crc32 {
            return Err(bad(format!(
                "deflated entry '{name}' fails its CRC-32 check"
            )));
        }
        Ok(out)
    }
}

/// Finds the end-of-central-directory record in the tail, scanning back over a
/// possible comment; returns its offset in the archive.
fn find_eocd(a: &mut Archive<'_>) -> std::result::Result<u64, Fail> {
    let len = a.len;
    if len < 22 {
        return bad(format!("{len} bytes is too short to be a zip archive"));
    }
    let mut tail = TAIL.min(len);
    loop {
        let start = len - tail;
        if a.held_bytes(start, tail).is_none() {
            let data = a.read_vec(start, tail)?;
            a.held.push((start, data));
        }
        let data = a.held_bytes(start, tail).unwrap_or(&[]);
        // Candidate positions from `len - 22` down to `start`.
        if let Some(i) = (0..data.len().saturating_sub(21))
            .rev()
            .find(|&i| data[i..i + 4] == EOCD_SIG.to_le_bytes())
        {
            return Ok(start + i as u64);
        }
        if tail >= MAX_TAIL.min(len) {
            return bad(
                "no end-of-central-directory record: the archive is truncated or not a zip file",
            );
        }
        tail = MAX_TAIL.min(len);
    }
}

fn index(a: &mut Archive<'_>) -> std::result::Result<ZipIndex, Fail> {
    let len = a.len;
    let eocd = find_eocd(a)?;
    let a: &Archive<'_> = a;
    let e = a.field::<22>(eocd, "end of central directory")?;
    let mut count = le16(&e, 10) as u64;
    let mut cd_size = le32(&e, 12) as u64;
    let mut cd_offset = le32(&e, 16) as u64;
    if count == 0xffff || cd_size == 0xffff_ffff || cd_offset == 0xffff_ffff {
        let loc = eocd.checked_sub(20).and_then(|l| {
            let b = a.field::<20>(l, "zip64 locator").ok()?;
            (le32(&b, 0) == ZIP64_LOCATOR_SIG).then_some(b)
        });
        let Some(loc) = loc else {
            return bad("the archive needs ZIP64 records but has no ZIP64 locator");
        };
        let rec = le64(&loc, 8);
        let r = a.field::<4>(rec, "zip64 end of central directory")?;
        if le32(&r, 0) != ZIP64_EOCD_SIG {
            return bad(format!(
                "no ZIP64 end-of-central-directory record at byte {rec}"
            ));
        }
        let r = a.field::<56>(rec, "zip64 end of central directory")?;
        count = le64(&r, 32);
        cd_size = le64(&r, 40);
        cd_offset = le64(&r, 48);
    }
    if cd_offset.checked_add(cd_size).is_none_or(|e| e > len) {
        return bad(format!(
            "the central directory (byte {cd_offset}, {cd_size} bytes) lies past the end of the archive ({len} bytes); the file is truncated"
        ));
    }
    if count > cd_size / 46 + 1 {
        return bad(format!(
            "the archive claims {count} entries but its central directory has room for at most {}",
            cd_size / 46
        ));
    }
    let mut entries = Vec::with_capacity(count as usize);
    let mut locals = Vec::with_capacity(count as usize);
    let mut cd = Cursor {
        start: 0,
        buf: Vec::new(),
    };
    let mut at = cd_offset;
    for i in 0..count {
        let h = cd.get(a, at, 46, "central directory entry")?;
        if le32(h, 0) != CENTRAL_SIG {
            return bad(format!(
                "central directory entry {i} at byte {at} has a bad signature"
            ));
        }
        let method = le16(h, 10);
        let crc32 = le32(h, 16);
        let mut compressed_size = le32(h, 20) as u64;
        let mut size = le32(h, 24) as u64;
        let name_len = le16(h, 28) as u64;
        let extra_len = le16(h, 30) as u64;
        let comment_len = le16(h, 32) as u64;
        let mut local = le32(h, 42) as u64;
        let name_bytes = cd.get(a, at + 46, name_len, "entry name")?;
        let name = String::from_utf8_lossy(name_bytes).into_owned();
        // ZIP64 extended information: the fields that overflowed, in this order.
        let extra = cd.get(a, at + 46 + name_len, extra_len, "entry extra field")?;
        let mut x = 0usize;
        while x + 4 <= extra.len() {
            let id = le16(extra, x);
            let n = le16(extra, x + 2) as usize;
            let body = extra.get(x + 4..x + 4 + n).unwrap_or(&[]);
            if id == 0x0001 {
                let mut fields = body.chunks_exact(8).map(|c| le64(c, 0));
                if size == 0xffff_ffff {
                    size = fields.next().unwrap_or(size);
                }
                if compressed_size == 0xffff_ffff {
                    compressed_size = fields.next().unwrap_or(compressed_size);
                }
                if local == 0xffff_ffff {
                    local = fields.next().unwrap_or(local);
                }
            }
            x += 4 + n;
        }
        if local.checked_add(30).is_none_or(|e| e > len) {
            return bad(format!(
                "local header of '{name}' at byte {local} (+30) lies past the end of the archive ({len} bytes); the file is truncated or corrupt"
            ));
        }
        locals.push(local);
        entries.push(ZipEntry {
            name,
            data_offset: 0,
            compressed_size,
            size,
            method,
            crc32,
            header_offset: local,
            central_offset: at,
        });
        at = at + 46 + name_len + extra_len + comment_len;
    }
    // Every local header at once: they are spread over the file (one before each
    // entry's data), so one request lets the source read them together.
    let mut headers = vec![[0u8; 30]; locals.len()];
    let mut reqs: Vec<(u64, &mut [u8])> = locals
        .iter()
        .zip(headers.iter_mut())
        .map(|(&l, h)| (l, &mut h[..]))
        .collect();
    a.read_many(&mut reqs)?;
    for ((entry, &local), header) in entries.iter_mut().zip(&locals).zip(&headers) {
        if le32(header, 0) != LOCAL_SIG {
            return bad(format!(
                "entry '{}': no local header at byte {local}",
                entry.name
            ));
        }
        let lname = le16(header, 26) as u64;
        let lextra = le16(header, 28) as u64;
        let data_offset = local + 30 + lname + lextra;
        if data_offset
            .checked_add(entry.compressed_size)
            .is_none_or(|e| e > len)
        {
            return bad(format!(
                "entry '{}' ({} bytes at byte {data_offset}) lies past the end of the archive ({len} bytes); the file is truncated",
                entry.name, entry.compressed_size
            ));
        }
        entry.data_offset = data_offset;
    }
    Ok(ZipIndex { entries })
}
