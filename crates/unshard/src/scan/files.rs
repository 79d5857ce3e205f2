//! Finding the pickles in one file, whatever holds them: the records of a zip
//! archive (any `.pkl` record, deflated or stored), the five pickles of a legacy
//! `torch.save` stream, back-to-back bare pickles, and the archives a DCP `.distcp`
//! file embeds. Every pickle of a file is parsed under one budget
//! ([`Limits::remaining_after`]), so a file of many pickles is bounded as a whole.
//!
//! Files are read through a [`Blob`], never mapped or copied whole: a zip archive's
//! records and its `.pkl` entries; the start of a stream of pickles (in a prefix that
//! doubles until they fit, as the legacy reader does); the records of the archives
//! in a `.distcp` file, found from its end.

use std::path::Path;

use unshard_pickle::{parse_partial, ErrorKind, Limits};

use super::{audit_pickle, FileScan};
use crate::source::zip::{le32, le64, Archive, ZipIndex};
use crate::source::{legacy, safetensors, Blob};

/// Pickles read back to back from a bare pickle file.
const MAX_BARE_PICKLES: usize = 64;
/// The first prefix read for a stream of pickles; it doubles while one runs past it.
const FIRST_READ: u64 = 64 << 10;
/// Blocks in which a `.distcp` file is searched for archive end records, where its
/// archives cannot be found from its end.
const SEARCH_BLOCK: u64 = 1 << 20;
/// Extensions of files that may be a protocol 0 or 1 pickle (which has no magic).
const PICKLE_EXTENSIONS: &[&str] = &[
    "pkl", "pickle", "pt", "pth", "bin", "ckpt", "joblib", "dat", "data", "metadata",
];

/// Scans one file (see the module docs). Never fails: what cannot be read is a
/// problem of the result.
pub fn scan_file(path: &Path) -> FileScan {
    let mut scan = scan_file_with(path, FIRST_READ);
    let (recognised, calls) = std::mem::take(&mut scan.unsafe_calls)
        .into_iter()
        .partition(super::trainer::is_trainer_arguments);
    scan.recognised = recognised;
    scan.unsafe_calls = calls;
    scan
}

/// [`scan_file`], reading a stream of pickles from a first prefix of `first_read`
/// bytes.
fn scan_file_with(path: &Path, first_read: u64) -> FileScan {
    let mut scan = FileScan {
        path: path.to_path_buf(),
        ..FileScan::default()
    };
    let blob = match Blob::open(path) {
        Ok(b) => b,
        Err(e) => {
            scan.kind = "unreadable".into();
            scan.problems.push(format!("cannot open it: {e}"));
            return scan;
        }
    };
    if blob.is_empty() {
        scan.kind = "empty file".into();
        return scan;
    }
    let head = match blob.head(64) {
        Ok(h) => h,
        Err(e) => {
            scan.kind = "unreadable".into();
            scan.problems.push(format!("cannot read it: {e}"));
            return scan;
        }
    };
    let len = usize::try_from(blob.len()).unwrap_or(usize::MAX);
    let mut reader = Reader {
        scan: &mut scan,
        blob: &blob,
        limits: Limits::default().scaled_to(len),
        first_read,
    };
    if path.extension().is_some_and(|e| e == "distcp") {
        // Items torch.save'd back to back, tensor bytes between them: the file may
        // start like a zip archive but is not one.
        reader.scan.kind = "torch.distributed.checkpoint data file".into();
        reader.embedded_archives();
    } else if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        reader.scan.kind = "zip archive".into();
        reader.zip(&mut Archive::whole(&blob), "");
    } else if legacy::is_legacy(&head) {
        reader.scan.kind = "legacy torch.save stream".into();
        reader.stream(Stream::Legacy);
    } else if safetensors::looks_like_safetensors(&head, blob.len()) {
        scan.kind = "safetensors file (holds no pickle)".into();
    } else if head.first() == Some(&0x80) || has_pickle_extension(path) {
        reader.scan.kind = "pickle".into();
        reader.stream(Stream::Bare);
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

/// Pickles that follow one another from the start of a file.
#[derive(Clone, Copy)]
enum Stream {
    /// The five of a legacy `torch.save` stream (storages follow them).
    Legacy,
    /// Up to [`MAX_BARE_PICKLES`] bare pickles.
    Bare,
}

/// A pickle ran past the prefix read: read more and start again.
struct Cut;

struct Reader<'a> {
    scan: &'a mut FileScan,
    blob: &'a Blob,
    /// What is left of the file's budget.
    limits: Limits,
    /// The first prefix read for a stream of pickles ([`FIRST_READ`]).
    first_read: u64,
}

impl Reader<'_> {
    /// Parses and audits the pickle at the start of `data`; returns where it ended,
    /// `Ok(None)` if it broke (the break is a problem of the scan), or [`Cut`] if it
    /// runs past `data` and `data` is not the rest of the file (`whole`).
    fn pickle(&mut self, data: &[u8], entry: &str, whole: bool) -> Result<Option<usize>, Cut> {
        let partial = parse_partial(data, &self.limits);
        if let Some(e) = &partial.error {
            if !whole && matches!(e.kind, ErrorKind::Truncated | ErrorKind::NoStop) {
                return Err(Cut);
            }
        }
        self.limits = self.limits.remaining_after(&partial.pickle);
        self.scan.pickles += 1;
        let (calls, omitted) = audit_pickle(&self.blob.path, entry, &partial.pickle);
        self.scan.unsafe_calls.extend(calls);
        self.scan.omitted += omitted;
        match partial.error {
            Some(e) => {
                self.scan.problems.push(format!("{entry}: {e}"));
                Ok(None)
            }
            None => Ok(Some(partial.end)),
        }
    }

    /// The `.pkl` records of the archive `a`, and its duplicate records (an
    /// ambiguity, not a choice: readers disagree on which one counts). `at` says
    /// where an archive inside a larger file is.
    fn zip(&mut self, a: &mut Archive<'_>, at: &str) {
        let index = match ZipIndex::read(a) {
            Ok(i) => i,
            Err(e) => {
                self.scan.problems.push(format!("{at}{e}"));
                return;
            }
        };
        let mut names = std::collections::HashSet::new();
        for e in &index.entries {
            if !names.insert(e.name.as_str()) {
                self.scan.problems.push(format!(
                    "the archive{at} holds two records named '{}': readers disagree on which one counts (torch reads the first)",
                    e.name
                ));
            }
        }
        for e in &index.entries {
            if !e.name.ends_with(".pkl") {
                continue;
            }
            match index.stored(a, e) {
                Ok(bytes) => {
                    // The record is all of the pickle: it cannot be cut.
                    let _ = self.pickle(&bytes, &format!("{}{at}", e.name), true);
                }
                Err(err) => self.scan.problems.push(err.to_string()),
            }
        }
    }

    /// The pickles at the start of the file, read in a prefix that doubles while a
    /// pickle runs past it (each try starts afresh, under a fresh budget).
    fn stream(&mut self, kind: Stream) {
        let len = self.blob.len();
        let fresh = (self.limits.clone(), self.scan.clone());
        let mut want = self.first_read.clamp(1, len);
        loop {
            let data = match self.blob.read_vec(0, want) {
                Ok(d) => d,
                Err(e) => {
                    self.scan.problems.push(format!("cannot read it: {e}"));
                    return;
                }
            };
            let whole = want == len;
            let done = match kind {
                Stream::Legacy => self.legacy(&data, whole),
                Stream::Bare => self.bare(&data, whole),
            };
            if done.is_ok() {
                return;
            }
            (self.limits, *self.scan) = fresh.clone();
            want = want.saturating_mul(2).min(len);
        }
    }

    fn legacy(&mut self, data: &[u8], whole: bool) -> Result<(), Cut> {
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
            match self.pickle(rest, &entry, whole)? {
                Some(used) => at += used,
                None => return Ok(()),
            }
        }
        Ok(())
    }

    fn bare(&mut self, data: &[u8], whole: bool) -> Result<(), Cut> {
        let mut at = 0usize;
        for i in 0..MAX_BARE_PICKLES {
            let rest = data.get(at..).unwrap_or_default();
            if rest.is_empty() && !whole {
                return Err(Cut);
            }
            if rest.is_empty() || (i > 0 && rest.iter().all(u8::is_ascii_whitespace)) {
                return Ok(());
            }
            let entry = if i == 0 {
                "pickle".to_string()
            } else {
                format!("pickle {} at byte {at}", i + 1)
            };
            match self.pickle(rest, &entry, whole)? {
                Some(used) if used > 0 => at += used,
                _ => return Ok(()),
            }
        }
        Ok(())
    }

    /// The `.pkl` records of the zip archives a `.distcp` file embeds (torch.save'd
    /// items, back to back). Each archive is found from its end record (the central
    /// directory's size and offset say where the archive starts), walking back from
    /// the end of the file: only records are read. Where the walk stops (an item
    /// that is not a zip archive: a compressed one), the rest is searched for end
    /// records block by block.
    fn embedded_archives(&mut self) {
        let mut end = self.blob.len();
        while let Some(eocd) = end.checked_sub(22) {
            let Some(start) = self.archive_at(eocd, end) else {
                break;
            };
            end = start;
        }
        if end < 22 {
            return;
        }
        // Search [0, end) for end records, in blocks overlapping by 3 bytes so that
        // a signature across two blocks is seen.
        let mut from = 0u64;
        let mut found = Vec::new();
        while from + 4 <= end {
            let n = SEARCH_BLOCK.min(end - from);
            let block = match self.blob.read_vec(from, n) {
                Ok(b) => b,
                Err(e) => {
                    self.scan.problems.push(format!("cannot read it: {e}"));
                    return;
                }
            };
            found.extend(
                block
                    .windows(4)
                    .enumerate()
                    .filter(|(_, w)| *w == b"PK\x05\x06")
                    .map(|(i, _)| from + i as u64),
            );
            if from + n >= end {
                break;
            }
            from += n - 3;
        }
        for eocd in found {
            let comment = self.read::<2>(eocd + 20).map_or(0, u16::from_le_bytes);
            let _ = self.archive_at(eocd, eocd + 22 + u64::from(comment));
        }
    }

    /// Scans the archive whose end record is at `eocd` and which ends at `end`;
    /// returns where it starts, or `None` if there is no end record there.
    fn archive_at(&mut self, eocd: u64, end: u64) -> Option<u64> {
        if self.read::<4>(eocd)? != *b"PK\x05\x06" || end > self.blob.len() {
            return None;
        }
        let start = self.archive_start(eocd)?;
        let at = format!(" (archive at byte {start})");
        match Archive::new(self.blob, start, end - start) {
            Ok(mut a) => self.zip(&mut a, &at),
            Err(e) => self.scan.problems.push(format!("{e}")),
        }
        Some(start)
    }

    /// Where the zip archive whose end record is at `eocd` starts: the central
    /// directory ends where the end records begin, and its offset in the archive
    /// is known. torch writes ZIP64 end records (a 56-byte record and a 20-byte
    /// locator) before the end record; their sizes and offsets take precedence.
    fn archive_start(&self, eocd: u64) -> Option<u64> {
        let e = self.read::<22>(eocd)?;
        let mut cd_size = u64::from(le32(&e, 12));
        let mut cd_offset = u64::from(le32(&e, 16));
        let mut cd_end = eocd;
        if let Some(locator) = eocd.checked_sub(20) {
            let l = self.read::<4>(locator)?;
            if u32::from_le_bytes(l) == 0x0706_4b50 {
                let record = locator.checked_sub(56)?;
                let r = self.read::<56>(record)?;
                if le32(&r, 0) != 0x0606_4b50 {
                    return None;
                }
                cd_end = record;
                cd_size = le64(&r, 40);
                cd_offset = le64(&r, 48);
            }
        }
        cd_end.checked_sub(cd_size)?.checked_sub(cd_offset)
    }

    /// `N` bytes at `at`, if they lie inside the file.
    fn read<const N: usize>(&self, at: u64) -> Option<[u8; N]> {
        if at.checked_add(N as u64)? > self.blob.len() {
            return None;
        }
        let mut buf = [0u8; N];
        self.blob.read_at(at, &mut buf).ok()?;
        Some(buf)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn hostile(name: &str) -> std::path::PathBuf {
        crate::fixtures().join("hostile").join(name)
    }

    /// The archives of a `.distcp` file are found from its end by their records,
    /// and by the block search when the walk back stops at bytes that are not an
    /// archive (a compressed item): both find the same pickles and the payload.
    #[test]
    fn distcp_archives_are_found_from_the_end_and_past_an_item_that_is_not_one() {
        let path = hostile("dcp_payload/__0_0.distcp");
        let walked = scan_file(&path);
        assert_eq!(walked.pickles, 2, "{walked:?}");
        assert!(walked.problems.is_empty(), "{walked:?}");
        let names: Vec<&str> = walked
            .unsafe_calls
            .iter()
            .map(|c| c.callable.as_str())
            .collect();
        assert!(names.contains(&"posix.system"), "{names:?}");

        let dir = tempfile::tempdir().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // A trailing item that is not a zip archive: the walk back stops at once.
        bytes.extend_from_slice(&[0x28; 100]);
        let searched_path = dir.path().join("__0_0.distcp");
        std::fs::write(&searched_path, &bytes).unwrap();
        let searched = scan_file(&searched_path);
        assert_eq!(searched.pickles, walked.pickles, "{searched:?}");
        let strip = |s: &FileScan| {
            s.unsafe_calls
                .iter()
                .map(|c| (c.callable.clone(), c.entry.clone(), c.offset))
                .collect::<Vec<_>>()
        };
        let mut a = strip(&walked);
        let mut b = strip(&searched);
        a.sort();
        b.sort();
        assert_eq!(a, b);
    }

    /// What each file is read as, by its magic and (for a pickle with no magic)
    /// its name: files the generators wrote.
    #[test]
    fn each_file_is_read_as_what_its_bytes_are() {
        let root = crate::fixtures();
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("config.json");
        std::fs::write(&json, b"{\"model_type\": \"llama\"}").unwrap();
        let metadata = dir.path().join("notes.txt");
        std::fs::write(&metadata, b"not a pickle").unwrap();
        for (path, kind) in [
            (
                hostile("dcp_payload/__0_0.distcp"),
                "torch.distributed.checkpoint data file",
            ),
            (hostile("clean.pt"), "zip archive"),
            (
                root.join("ckpt/llama_policy_legacy.pt"),
                "legacy torch.save stream",
            ),
            (hostile("picklescan/ps_os_anything.pkl"), "pickle"),
            (json, "not a pickle"),
            (metadata, "not a pickle"),
        ] {
            assert_eq!(scan_file(&path).kind, kind, "{}", path.display());
        }
    }

    /// Bare pickles back to back are named by their place; whitespace after the
    /// last ends the stream, whitespace alone is no pickle.
    #[test]
    fn bare_pickles_are_named_by_their_place_and_trailing_whitespace_ends_them() {
        let payload = std::fs::read(hostile("picklescan/ps_os_anything.pkl")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let two = dir.path().join("two.pkl");
        let mut bytes = payload.clone();
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(b"\n\n");
        std::fs::write(&two, &bytes).unwrap();
        let s = scan_file(&two);
        assert_eq!(s.pickles, 2, "{s:?}");
        assert!(s.problems.is_empty(), "{s:?}");
        let mut entries: Vec<&str> = s.unsafe_calls.iter().map(|c| c.entry.as_str()).collect();
        entries.dedup();
        let second = format!("pickle 2 at byte {}", payload.len());
        assert_eq!(entries, ["pickle", second.as_str()], "{s:?}");

        let blank = dir.path().join("blank.pkl");
        std::fs::write(&blank, b"\n  \n").unwrap();
        let s = scan_file(&blank);
        assert_eq!(s.pickles, 1, "{s:?}");
        assert!(!s.problems.is_empty(), "{s:?}");
    }

    /// Findings beyond the per-pickle bound (distinct callables) are counted, not
    /// listed.
    #[test]
    fn findings_past_the_bound_are_counted() {
        let n = unshard_pickle::audit::MAX_FINDINGS + 44;
        let mut bytes = b"\x80\x02(".to_vec();
        for i in 0..n {
            bytes.extend_from_slice(format!("cevil{i}\nrun\n(tR").as_bytes());
        }
        bytes.extend_from_slice(b"l.");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.pkl");
        std::fs::write(&path, &bytes).unwrap();
        let s = scan_file(&path);
        assert!(s.problems.is_empty(), "{:?}", s.problems);
        assert_eq!(s.unsafe_calls.len() + s.omitted, n, "{}", s.omitted);
        assert!(s.omitted > 0);
    }

    /// The archives of a `.distcp` file found by the block search, behind a
    /// trailing item of zeros, with the end record of the last archive across the
    /// end of the first search block, or of the second (past two megabytes): what
    /// the walk from the end finds.
    #[test]
    fn archives_are_found_across_search_blocks() {
        let path = hostile("dcp_payload/__0_0.distcp");
        let walked = scan_file(&path);
        let bytes = std::fs::read(&path).unwrap();
        let last = bytes.windows(4).rposition(|w| w == b"PK\x05\x06").unwrap();
        let calls = |s: &FileScan| {
            let mut v: Vec<(String, usize)> = s
                .unsafe_calls
                .iter()
                .map(|c| (c.callable.clone(), c.offset))
                .collect();
            v.sort();
            v
        };
        // Blocks start at 0, B - 3 and 2B - 6: the signature starts one byte before
        // the end of the first block, or two before the end of the second.
        let block = SEARCH_BLOCK as usize;
        for signature_at in [block - 1, 2 * block - 5] {
            let mut padded = vec![0u8; signature_at - last];
            padded.extend_from_slice(&bytes);
            padded.extend_from_slice(&[0u8; 100]);
            let dir = tempfile::tempdir().unwrap();
            let searched_path = dir.path().join("__0_0.distcp");
            std::fs::write(&searched_path, &padded).unwrap();
            let searched = scan_file(&searched_path);
            assert!(searched.problems.is_empty(), "{searched:?}");
            assert_eq!(searched.pickles, walked.pickles, "{searched:?}");
            assert_eq!(calls(&searched), calls(&walked), "at {signature_at}");
        }
    }

    /// Pickles longer than the first prefix read are read in full (the prefix
    /// doubles), and give what one read of the whole file gives.
    #[test]
    fn a_stream_of_pickles_longer_than_the_first_read_is_read_in_full() {
        let src = crate::fixtures().join("ckpt/llama_policy_legacy.pt");
        let whole = scan_file_with(&src, u64::MAX);
        assert_eq!(whole.pickles, 5, "{whole:?}");
        assert!(whole.problems.is_empty(), "{whole:?}");
        for first in [1, 64, 1000] {
            let grown = scan_file_with(&src, first);
            assert_eq!(grown.pickles, 5, "first read {first}: {grown:?}");
            assert!(grown.problems.is_empty(), "first read {first}: {grown:?}");
        }
        // Bare pickles back to back, the second past the first read.
        let dir = tempfile::tempdir().unwrap();
        let bare = dir.path().join("two.pkl");
        let payload = std::fs::read(hostile("picklescan/ps_os_anything.pkl")).unwrap();
        let mut two = payload.clone();
        two.extend_from_slice(&payload);
        std::fs::write(&bare, &two).unwrap();
        let s = scan_file_with(&bare, 8);
        assert_eq!(s.pickles, 2, "{s:?}");
        assert_eq!(
            s.unsafe_calls.len(),
            2 * scan_file(&hostile("picklescan/ps_os_anything.pkl"))
                .unsafe_calls
                .len(),
            "{s:?}"
        );
        // Cut inside the object pickle: a problem, not a hang or a panic.
        let cut = dir.path().join("cut.pt");
        let data = std::fs::read(&src).unwrap();
        std::fs::write(&cut, &data[..200]).unwrap();
        let s = scan_file(&cut);
        assert!(!s.problems.is_empty(), "{s:?}");
    }
}
