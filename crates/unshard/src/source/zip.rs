//! A read-only index of a zip archive held in a byte slice.
//!
//! torch writes its archives with stored (uncompressed) entries aligned to 64 bytes,
//! always with ZIP64 records (formats.md §1.2). What a checkpoint reader needs from a
//! zip is the position of each entry's bytes, so that tensors can be read in place;
//! general-purpose zip crates hide that behind a reader. This index works on any
//! byte slice, so the same code reads a whole `.pt` file and the archives embedded
//! inside a DCP `.distcp` file. Sizes and offsets come from the central directory;
//! the data offset comes from each entry's local header, whose extra field (torch's
//! alignment padding) differs from the central one. Every offset is checked against
//! the slice with overflow-safe arithmetic.

use std::fmt;

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

/// One entry of the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipEntry {
    pub name: String,
    /// Offset of the entry's data from the start of the slice.
    pub data_offset: u64,
    /// Bytes of data as stored in the archive.
    pub compressed_size: u64,
    /// Bytes of data once decompressed.
    pub size: u64,
    pub method: u16,
    pub crc32: u32,
}

/// The entries of an archive, in central-directory order.
#[derive(Clone, Debug, Default)]
pub struct ZipIndex {
    pub entries: Vec<ZipEntry>,
}

/// Why a slice is not a readable zip archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipError(pub String);

impl fmt::Display for ZipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads the bytes at an offset of the archive into a buffer.
pub type ReadAt<'a> = &'a dyn Fn(u64, &mut [u8]) -> Result<(), ZipError>;

fn err<T>(msg: impl Into<String>) -> Result<T, ZipError> {
    Err(ZipError(msg.into()))
}

/// Little-endian field reads that fail instead of panicking.
struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn bytes(&self, at: u64, len: u64, what: &str) -> Result<&'a [u8], ZipError> {
        let start = usize::try_from(at).ok();
        let end = at.checked_add(len).and_then(|e| usize::try_from(e).ok());
        match (start, end) {
            (Some(s), Some(e)) if e <= self.data.len() => Ok(&self.data[s..e]),
            _ => err(format!(
                "{what} at byte {at} (+{len}) lies past the end of the archive ({} bytes); the file is truncated or corrupt",
                self.data.len()
            )),
        }
    }
    fn u16(&self, at: u64, what: &str) -> Result<u16, ZipError> {
        let b = self.bytes(at, 2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&self, at: u64, what: &str) -> Result<u32, ZipError> {
        let b = self.bytes(at, 4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&self, at: u64, what: &str) -> Result<u64, ZipError> {
        let b = self.bytes(at, 8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl ZipIndex {
    /// Indexes the archive occupying all of `data`.
    pub fn parse(data: &[u8]) -> Result<ZipIndex, ZipError> {
        let from_data = |at: u64, buf: &mut [u8]| {
            let b = Reader { data }.bytes(at, buf.len() as u64, "local header")?;
            buf.copy_from_slice(b);
            Ok(())
        };
        ZipIndex::parse_with(data, &from_data)
    }

    /// Like [`ZipIndex::parse`], but each entry's local header is read by
    /// `read_local(offset, buf)` instead of from `data`. Readers of a mapped file pass
    /// a positioned read: touching one header in the map can map the whole page-cache
    /// folio around it (up to 2 MiB on recent kernels) into the resident set, once per
    /// tensor, when only the central directory at the end needs to be mapped.
    pub fn parse_with(data: &[u8], read_local: ReadAt<'_>) -> Result<ZipIndex, ZipError> {
        let r = Reader { data };
        let len = data.len() as u64;
        let eocd = find_eocd(data)?;
        let mut count = r.u16(eocd + 10, "end of central directory")? as u64;
        let mut cd_size = r.u32(eocd + 12, "end of central directory")? as u64;
        let mut cd_offset = r.u32(eocd + 16, "end of central directory")? as u64;
        if count == 0xffff || cd_size == 0xffff_ffff || cd_offset == 0xffff_ffff {
            let loc = eocd
                .checked_sub(20)
                .filter(|&l| r.u32(l, "zip64 locator").ok() == Some(ZIP64_LOCATOR_SIG));
            let Some(loc) = loc else {
                return err("the archive needs ZIP64 records but has no ZIP64 locator");
            };
            let rec = r.u64(loc + 8, "zip64 locator")?;
            if r.u32(rec, "zip64 end of central directory")? != ZIP64_EOCD_SIG {
                return err(format!(
                    "no ZIP64 end-of-central-directory record at byte {rec}"
                ));
            }
            count = r.u64(rec + 32, "zip64 end of central directory")?;
            cd_size = r.u64(rec + 40, "zip64 end of central directory")?;
            cd_offset = r.u64(rec + 48, "zip64 end of central directory")?;
        }
        if cd_offset.checked_add(cd_size).is_none_or(|e| e > len) {
            return err(format!(
                "the central directory (byte {cd_offset}, {cd_size} bytes) lies past the end of the archive ({len} bytes); the file is truncated"
            ));
        }
        if count > cd_size / 46 + 1 {
            return err(format!(
                "the archive claims {count} entries but its central directory has room for at most {}",
                cd_size / 46
            ));
        }
        let mut entries = Vec::with_capacity(count as usize);
        let mut at = cd_offset;
        for i in 0..count {
            if r.u32(at, "central directory entry")? != CENTRAL_SIG {
                return err(format!(
                    "central directory entry {i} at byte {at} has a bad signature"
                ));
            }
            let method = r.u16(at + 10, "central directory entry")?;
            let crc32 = r.u32(at + 16, "central directory entry")?;
            let mut compressed_size = r.u32(at + 20, "central directory entry")? as u64;
            let mut size = r.u32(at + 24, "central directory entry")? as u64;
            let name_len = r.u16(at + 28, "central directory entry")? as u64;
            let extra_len = r.u16(at + 30, "central directory entry")? as u64;
            let comment_len = r.u16(at + 32, "central directory entry")? as u64;
            let mut local = r.u32(at + 42, "central directory entry")? as u64;
            let name_bytes = r.bytes(at + 46, name_len, "entry name")?;
            let name = String::from_utf8_lossy(name_bytes).into_owned();
            // ZIP64 extended information: the fields that overflowed, in this order.
            let extra = r.bytes(at + 46 + name_len, extra_len, "entry extra field")?;
            let mut x = 0usize;
            while x + 4 <= extra.len() {
                let id = u16::from_le_bytes([extra[x], extra[x + 1]]);
                let n = u16::from_le_bytes([extra[x + 2], extra[x + 3]]) as usize;
                let body = extra.get(x + 4..x + 4 + n).unwrap_or(&[]);
                if id == 0x0001 {
                    let mut fields = body.chunks_exact(8).map(|c| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(c);
                        u64::from_le_bytes(a)
                    });
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
            let mut header = [0u8; 30];
            if local.checked_add(30).is_none_or(|e| e > len) {
                return err(format!(
                    "local header of '{name}' at byte {local} (+30) lies past the end of the archive ({len} bytes); the file is truncated or corrupt"
                ));
            }
            read_local(local, &mut header)?;
            if header[..4] != LOCAL_SIG.to_le_bytes() {
                return err(format!("entry '{name}': no local header at byte {local}"));
            }
            let lname = u16::from_le_bytes([header[26], header[27]]) as u64;
            let lextra = u16::from_le_bytes([header[28], header[29]]) as u64;
            let data_offset = local + 30 + lname + lextra;
            if data_offset
                .checked_add(compressed_size)
                .is_none_or(|e| e > len)
            {
                return err(format!(
                    "entry '{name}' ({compressed_size} bytes at byte {data_offset}) lies past the end of the archive ({len} bytes); the file is truncated"
                ));
            }
            entries.push(ZipEntry {
                name,
                data_offset,
                compressed_size,
                size,
                method,
                crc32,
            });
            at = at + 46 + name_len + extra_len + comment_len;
        }
        Ok(ZipIndex { entries })
    }

    /// The entry with this exact name.
    pub fn find(&self, name: &str) -> Option<&ZipEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The bytes of a stored entry, borrowed from the archive slice.
    pub fn stored_bytes<'a>(&self, data: &'a [u8], entry: &ZipEntry) -> Result<&'a [u8], ZipError> {
        if entry.method != METHOD_STORED {
            return err(format!(
                "entry '{}' is compressed (zip method {}); torch writes stored entries only, so this archive was repacked by another tool. Unzip and re-zip it with `zip -0`, or load and re-save it with torch.save",
                entry.name, entry.method
            ));
        }
        Reader { data }.bytes(
            entry.data_offset,
            entry.size,
            &format!("entry '{}'", entry.name),
        )
    }
}

/// Inflates a deflated entry into memory. Its declared size must be at most `max`
/// and within what deflate can expand its compressed bytes to; the output may not
/// exceed it, and must match the entry's CRC-32.
pub fn inflate(data: &[u8], entry: &ZipEntry, max: u64) -> Result<Vec<u8>, ZipError> {
    let name = &entry.name;
    if entry.size > max || entry.size > entry.compressed_size.saturating_mul(DEFLATE_MAX_RATIO) {
        return err(format!(
            "deflated entry '{name}' claims {} bytes from {} compressed bytes (at most {max} are read)",
            entry.size, entry.compressed_size
        ));
    }
    let raw = Reader { data }.bytes(
        entry.data_offset,
        entry.compressed_size,
        &format!("entry '{name}'"),
    )?;
    let limit = usize::try_from(entry.size)
        .map_err(|_| ZipError(format!("entry '{name}' is too large")))?;
    let out = miniz_oxide::inflate::decompress_to_vec_with_limit(raw, limit)
        .map_err(|e| ZipError(format!("deflated entry '{name}' does not inflate: {e}")))?;
    if out.len() as u64 != entry.size {
        return err(format!(
            "deflated entry '{name}' inflates to {} bytes, not the {} its directory entry declares",
            out.len(),
            entry.size
        ));
    }
    if crc32fast::hash(&out) != entry.crc32 {
        return err(format!("deflated entry '{name}' fails its CRC-32 check"));
    }
    Ok(out)
}

/// Finds the end-of-central-directory record, scanning back over a possible comment.
fn find_eocd(data: &[u8]) -> Result<u64, ZipError> {
    if data.len() < 22 {
        return err(format!(
            "{} bytes is too short to be a zip archive",
            data.len()
        ));
    }
    let lowest = data.len().saturating_sub(22 + 0xffff);
    let mut i = data.len() - 22;
    loop {
        if data[i..i + 4] == EOCD_SIG.to_le_bytes() {
            return Ok(i as u64);
        }
        if i == lowest {
            return err(
                "no end-of-central-directory record: the archive is truncated or not a zip file",
            );
        }
        i -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal stored archive with one entry, built by hand.
    fn archive(name: &str, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        v.extend_from_slice(&[0u8; 22]);
        v.extend_from_slice(&(name.len() as u16).to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(name.as_bytes());
        v.extend_from_slice(body);
        let cd = v.len() as u32;
        v.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
        v.extend_from_slice(&[0u8; 6]);
        v.extend_from_slice(&0u16.to_le_bytes()); // method
        v.extend_from_slice(&[0u8; 4]);
        v.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(&(name.len() as u16).to_le_bytes());
        v.extend_from_slice(&[0u8; 12]);
        v.extend_from_slice(&0u32.to_le_bytes()); // local header offset
        v.extend_from_slice(name.as_bytes());
        let cd_size = v.len() as u32 - cd;
        v.extend_from_slice(&EOCD_SIG.to_le_bytes());
        v.extend_from_slice(&[0u8; 4]);
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&cd_size.to_le_bytes());
        v.extend_from_slice(&cd.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v
    }

    #[test]
    fn reads_a_stored_entry() {
        let a = archive("x/data.pkl", b"hello");
        let idx = ZipIndex::parse(&a).expect("valid archive");
        let e = idx.find("x/data.pkl").expect("entry");
        assert_eq!(idx.stored_bytes(&a, e).expect("bytes"), b"hello");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let a = archive("x/data.pkl", b"hello world");
        for n in 0..a.len() {
            assert!(
                ZipIndex::parse(&a[..n]).is_err(),
                "prefix of {n} bytes parsed"
            );
        }
    }

    #[test]
    fn entry_past_the_end_is_an_error() {
        let mut a = archive("x/y", b"abc");
        // Claim a huge size in the central directory.
        let cd = a.len() - 22 - 46 - 3;
        a[cd + 20..cd + 24].copy_from_slice(&1000u32.to_le_bytes());
        let e = ZipIndex::parse(&a).expect_err("must fail");
        assert!(e.0.contains("past the end"), "{e}");
    }
}
