//! Finding the pickles in one file, whatever holds them: the records of a zip
//! archive (any `.pkl` record, deflated or stored), the five pickles of a legacy
//! `torch.save` stream, back-to-back bare pickles, and the archives a DCP `.distcp`
//! file embeds. Every pickle of a file is parsed under one budget
//! ([`Limits::remaining_after`]), so a file of many pickles is bounded as a whole.

use std::path::Path;

use unshard_pickle::{parse_partial, Limits};

use super::{audit_pickle, FileScan};
use crate::source::{legacy, safetensors, zip};

/// Largest pickle record inflated from a deflated zip entry.
const MAX_INFLATED: u64 = 1 << 30;
/// Pickles read back to back from a bare pickle file.
const MAX_BARE_PICKLES: usize = 64;
/// Extensions of files that may be a protocol 0 or 1 pickle (which has no magic).
const PICKLE_EXTENSIONS: &[&str] = &[
    "pkl", "pickle", "pt", "pth", "bin", "ckpt", "joblib", "dat", "data", "metadata",
];

/// Scans one file (see the module docs). Never fails: what cannot be read is a
/// problem of the result.
pub fn scan_file(path: &Path) -> FileScan {
    let mut scan = FileScan {
        path: path.to_path_buf(),
        ..FileScan::default()
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            scan.kind = "unreadable".into();
            scan.problems.push(format!("cannot open it: {e}"));
            return scan;
        }
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if len == 0 {
        scan.kind = "empty file".into();
        return scan;
    }
    // SAFETY: read-only map of a file, read once; see `source::Blob::open`.
    let map = match unsafe { memmap2::Mmap::map(&file) } {
        Ok(m) => m,
        Err(e) => {
            scan.kind = "unreadable".into();
            scan.problems.push(format!("cannot map it: {e}"));
            return scan;
        }
    };
    let data: &[u8] = &map;
    let mut reader = Reader {
        scan: &mut scan,
        path,
        limits: Limits::default().scaled_to(data.len()),
    };
    if path.extension().is_some_and(|e| e == "distcp") {
        // Items torch.save'd back to back, tensor bytes between them: the file may
        // start like a zip archive but is not one.
        reader.scan.kind = "torch.distributed.checkpoint data file".into();
        reader.embedded_archives(data);
    } else if data.starts_with(b"PK\x03\x04") || data.starts_with(b"PK\x05\x06") {
        reader.scan.kind = "zip archive".into();
        reader.zip(data);
    } else if legacy::is_legacy(data) {
        reader.scan.kind = "legacy torch.save stream".into();
        reader.legacy(data);
    } else if safetensors::looks_like_safetensors(data) {
        scan.kind = "safetensors file (holds no pickle)".into();
    } else if data.first() == Some(&0x80) || has_pickle_extension(path) {
        reader.scan.kind = "pickle".into();
        reader.bare(data);
    } else {
        scan.kind = "not a pickle".into();
    }
    scan
}

fn has_pickle_extension(path: &Path) -> bool {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    ext.is_some_and(|e| PICKLE_EXTENSIONS.contains(&e.as_str()))
        || path.file_name().is_some_and(|n| n == ".metadata")
}

struct Reader<'a> {
    scan: &'a mut FileScan,
    path: &'a Path,
    /// What is left of the file's budget.
    limits: Limits,
}

impl Reader<'_> {
    /// Parses and audits the pickle at the start of `data`; returns where it ended,
    /// or `None` if it broke (the break is a problem of the scan).
    fn pickle(&mut self, data: &[u8], entry: &str) -> Option<usize> {
        let partial = parse_partial(data, &self.limits);
        self.limits = self.limits.remaining_after(&partial.pickle);
        self.scan.pickles += 1;
        let (calls, omitted) = audit_pickle(self.path, entry, &partial.pickle);
        self.scan.unsafe_calls.extend(calls);
        self.scan.omitted += omitted;
        match partial.error {
            Some(e) => {
                self.scan.problems.push(format!("{entry}: {e}"));
                None
            }
            None => Some(partial.end),
        }
    }

    fn zip(&mut self, data: &[u8]) {
        let index = match zip::ZipIndex::parse(data) {
            Ok(i) => i,
            Err(e) => {
                self.scan.problems.push(e.0);
                return;
            }
        };
        let mut names = std::collections::HashSet::new();
        for e in &index.entries {
            if !names.insert(e.name.as_str()) {
                self.scan.problems.push(format!(
                    "the archive holds two records named '{}': readers disagree on which one counts (torch reads the first)",
                    e.name
                ));
            }
        }
        for e in &index.entries {
            if !e.name.ends_with(".pkl") {
                continue;
            }
            match zip_record(data, e) {
                Ok(bytes) => {
                    self.pickle(&bytes, &e.name);
                }
                Err(m) => self.scan.problems.push(m),
            }
        }
    }

    fn legacy(&mut self, data: &[u8]) {
        const NAMES: [&str; 5] = [
            "magic-number",
            "protocol-version",
            "system-info",
            "object",
            "storage-keys",
        ];
        let mut at = 0usize;
        for (i, name) in NAMES.iter().enumerate() {
            let rest = data.get(at..).unwrap_or_default();
            let entry = format!("legacy pickle {} of 5 ({name}) at byte {at}", i + 1);
            match self.pickle(rest, &entry) {
                Some(used) => at += used,
                None => return,
            }
        }
    }

    fn bare(&mut self, data: &[u8]) {
        let mut at = 0usize;
        for i in 0..MAX_BARE_PICKLES {
            let rest = data.get(at..).unwrap_or_default();
            if rest.is_empty() || (i > 0 && rest.iter().all(u8::is_ascii_whitespace)) {
                return;
            }
            let entry = if i == 0 {
                "pickle".to_string()
            } else {
                format!("pickle {} at byte {at}", i + 1)
            };
            match self.pickle(rest, &entry) {
                Some(used) if used > 0 => at += used,
                _ => return,
            }
        }
    }

    /// The `.pkl` records of the zip archives a `.distcp` file embeds (torch.save'd
    /// items). Their local headers carry no sizes (torch streams them), so each
    /// archive is found from its end record: the central directory's size and offset
    /// say where the archive starts.
    fn embedded_archives(&mut self, data: &[u8]) {
        let mut at = 0usize;
        while let Some(eocd) = find(data, at, b"PK\x05\x06") {
            at = eocd + 4;
            let Some(start) = archive_start(data, eocd) else {
                continue;
            };
            let comment = read_u16(data, eocd + 20).unwrap_or(0);
            let Some(archive) = data.get(start..eocd + 22 + comment) else {
                continue;
            };
            let index = match zip::ZipIndex::parse(archive) {
                Ok(i) => i,
                Err(e) => {
                    self.scan
                        .problems
                        .push(format!("archive ending at byte {eocd}: {}", e.0));
                    continue;
                }
            };
            for e in &index.entries {
                if !e.name.ends_with(".pkl") {
                    continue;
                }
                match zip_record(archive, e) {
                    Ok(bytes) => {
                        self.pickle(&bytes, &format!("{} (archive at byte {start})", e.name));
                    }
                    Err(m) => self.scan.problems.push(m),
                }
            }
        }
    }
}

/// Where the zip archive whose end record is at `eocd` starts: the central directory
/// ends where the end records begin, and its offset in the archive is known. torch
/// writes ZIP64 end records (a 56-byte record and a 20-byte locator) before the end
/// record; their sizes and offsets take precedence.
fn archive_start(data: &[u8], eocd: usize) -> Option<usize> {
    let mut cd_size = u64::from(read_u32(data, eocd + 12)?);
    let mut cd_offset = u64::from(read_u32(data, eocd + 16)?);
    let mut cd_end = eocd;
    if let Some(locator) = eocd.checked_sub(20) {
        if read_u32(data, locator) == Some(0x0706_4b50) {
            let record = locator.checked_sub(56)?;
            if read_u32(data, record)? != 0x0606_4b50 {
                return None;
            }
            cd_end = record;
            cd_size = read_u64(data, record + 40)?;
            cd_offset = read_u64(data, record + 48)?;
        }
    }
    let cd_start = cd_end.checked_sub(usize::try_from(cd_size).ok()?)?;
    cd_start.checked_sub(usize::try_from(cd_offset).ok()?)
}

fn read_u16(data: &[u8], at: usize) -> Option<usize> {
    let b = data.get(at..at + 2)?;
    Some(u16::from_le_bytes([b[0], b[1]]) as usize)
}

fn read_u32(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at + 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn read_u64(data: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = data.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

/// The bytes of a zip record: borrowed when stored, inflated (up to its declared
/// size, at most [`MAX_INFLATED`]) when deflated.
fn zip_record<'a>(data: &'a [u8], e: &zip::ZipEntry) -> Result<std::borrow::Cow<'a, [u8]>, String> {
    match e.method {
        zip::METHOD_STORED => {
            let index = zip::ZipIndex {
                entries: Vec::new(),
            };
            index
                .stored_bytes(data, e)
                .map(std::borrow::Cow::Borrowed)
                .map_err(|err| err.0)
        }
        zip::METHOD_DEFLATED => zip::inflate(data, e, MAX_INFLATED)
            .map(std::borrow::Cow::Owned)
            .map_err(|err| err.0),
        other => Err(format!(
            "record '{}' uses zip compression method {other}, which torch does not read",
            e.name
        )),
    }
}

/// Offset of the first `needle` in `data` at or after `from`.
fn find(data: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    let hay = data.get(from..)?;
    let first = *needle.first()?;
    let mut i = 0;
    while let Some(p) = hay.get(i..)?.iter().position(|&b| b == first) {
        let at = i + p;
        if hay.get(at..at + needle.len()) == Some(needle) {
            return Some(from + at);
        }
        i = at + 1;
    }
    None
}
