//! The ends of many chunk archives of one file read with a few large reads.
//!
//! A checkpoint of many ranks holds hundreds of thousands of small chunk archives,
//! each file holding one chunk of every tensor, back to back. Reading each
//! archive's ends with its own positioned read costs a system call per archive and,
//! from a cold cache, a small disk request per archive in an order that jumps
//! between files. Here the archives of one file are taken in the order they lie in
//! it and their ends are read in runs ([`coalesce`]): requests closer than
//! [`GAP`] share one read of at most `window` bytes, so a file of small archives is
//! read front to back in a few large reads, and a file of large archives in one
//! read per gap between two of them (the end of one and the start of the next).

use crate::bytes::{coalesce, GAP};
use crate::error::Result;
use crate::source::Blob;

/// The longest read made to serve several archives: the one buffer the scan holds.
pub(super) const WINDOW: u64 = 4 << 20;

/// Heads of large archives kept while waiting for their tail's read: a bound on
/// memory for offsets that interleave archives (never the case in files DCP writes,
/// where at most one is pending). Archives beyond it are left out.
const MAX_PENDING: usize = 64;

/// The ends of one archive, as [`super::super::zip::Archive::read_ends`] reads them.
pub(super) struct Ends<'b> {
    /// Bytes `0..head.len()` of the archive (all of it when it is short).
    pub(super) head: &'b [u8],
    /// Where `tail` starts in the archive (the length when the head holds it all).
    pub(super) tail_at: u64,
    pub(super) tail: &'b [u8],
}

/// Which part of an archive a request reads.
#[derive(Clone, Copy)]
enum Part {
    Whole,
    Head,
    Tail,
}

/// Calls `f(i, ends)` for every archive `archives[i] = (offset, len)` of `blob`, with
/// its first and last `ends` bytes (the whole archive when `2 * ends >= len`), in
/// the order the archives lie in the file. Archives must lie inside the blob.
/// Archives whose head could not be kept (see [`MAX_PENDING`]) are not passed to
/// `f`. Returns how many reads were made. `buf` is the read buffer, kept by the
/// caller from one file to the next: a fresh one per file would cost the kernel a
/// zeroed page for every page of every file read.
pub(super) fn for_each_ends(
    blob: &Blob,
    archives: &[(u64, u64)],
    ends: u64,
    window: u64,
    buf: &mut Vec<u8>,
    mut f: impl FnMut(usize, Ends<'_>) -> Result<()>,
) -> Result<usize> {
    let mut requests = Vec::with_capacity(archives.len());
    let mut parts = Vec::with_capacity(archives.len());
    for (i, &(offset, len)) in archives.iter().enumerate() {
        if ends.saturating_mul(2) >= len {
            requests.push((offset, len));
            parts.push((i, Part::Whole));
        } else {
            requests.push((offset, ends));
            parts.push((i, Part::Head));
            requests.push((offset + len - ends, ends));
            parts.push((i, Part::Tail));
        }
    }
    let runs = coalesce(&requests, GAP, window);
    let mut pending: Vec<(usize, Vec<u8>)> = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        // The next run is asked for while this one is parsed.
        if let Some(next) = runs.get(r + 1) {
            blob.will_need(next.start, next.end - next.start);
        }
        let n = usize::try_from(run.end - run.start).unwrap_or(usize::MAX);
        if buf.len() < n {
            buf.resize(n, 0);
        }
        let buf = &mut buf[..n];
        blob.read_at(run.start, buf)?;
        for &m in &run.members {
            let (offset, len) = requests[m];
            let at = (offset - run.start) as usize;
            let bytes = &buf[at..at + len as usize];
            let (i, part) = parts[m];
            match part {
                Part::Whole => f(
                    i,
                    Ends {
                        head: bytes,
                        tail_at: len,
                        tail: &[],
                    },
                )?,
                Part::Head => {
                    if pending.len() < MAX_PENDING {
                        pending.push((i, bytes.to_vec()));
                    }
                }
                Part::Tail => {
                    let Some(k) = pending.iter().position(|(j, _)| *j == i) else {
                        continue;
                    };
                    let (_, head) = pending.swap_remove(k);
                    f(
                        i,
                        Ends {
                            head: &head,
                            tail_at: archives[i].1 - ends,
                            tail: bytes,
                        },
                    )?;
                }
            }
        }
    }
    Ok(runs.len())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A byte that tells its position apart from its neighbours'.
    fn byte_at(i: u64) -> u8 {
        (i.wrapping_mul(2_654_435_761) >> 13) as u8
    }

    /// Every archive gets the bytes at its own ends, as a read of each would give,
    /// small archives back to back, large ones, gaps and a last one at the file's
    /// end alike, and the archives of a file are served by far fewer reads than
    /// one each.
    #[test]
    fn batched_ends_are_the_bytes_of_each_archive() {
        let mut archives = Vec::new();
        let mut at = 0u64;
        for k in 0..3000u64 {
            let len = match k % 7 {
                0 => 20_000,        // large: head and tail read apart
                1 => 9,             // shorter than the ends
                _ => 500 + k % 300, // small: read whole
            };
            archives.push((at, len));
            at += len + if k % 11 == 0 { 40_000 } else { 0 };
        }
        let data: Vec<u8> = (0..at).map(byte_at).collect();
        let blob = Blob::owned(PathBuf::from("rank0.distcp"), data.clone());
        let ends = 1000;
        let mut seen = vec![false; archives.len()];
        let reads = for_each_ends(&blob, &archives, ends, 1 << 20, &mut Vec::new(), |i, e| {
            let (offset, len) = archives[i];
            let archive = &data[offset as usize..(offset + len) as usize];
            if 2 * ends >= len {
                assert_eq!(e.head, archive, "archive {i}");
                assert!(e.tail.is_empty());
                assert_eq!(e.tail_at, len);
            } else {
                assert_eq!(e.head, &archive[..ends as usize], "archive {i}");
                assert_eq!(e.tail_at, len - ends);
                assert_eq!(e.tail, &archive[(len - ends) as usize..], "archive {i}");
            }
            assert!(!seen[i], "archive {i} twice");
            seen[i] = true;
            Ok(())
        })
        .unwrap();
        assert!(seen.iter().all(|&s| s), "every archive is passed");
        assert!(reads < archives.len() / 5, "{reads} reads");
    }

    /// `e` holds the first and last bytes of the archive at `(offset, len)` in `data`.
    fn assert_ends(data: &[u8], (offset, len): (u64, u64), e: &Ends<'_>, what: &str) {
        let a = &data[offset as usize..(offset + len) as usize];
        assert_eq!(e.head, &a[..e.head.len()], "{what}");
        assert_eq!(e.tail, &a[e.tail_at as usize..], "{what}");
    }

    /// One buffer serves file after file: a later file with shorter runs than the
    /// one before gets its own bytes, never what the buffer held before.
    #[test]
    fn a_buffer_kept_from_file_to_file_holds_only_the_current_file() {
        let mut buf = Vec::new();
        for (k, (n, len)) in [(200_000u64, 30_000u64), (9_000, 700), (50_000, 2_500)]
            .into_iter()
            .enumerate()
        {
            let data: Vec<u8> = (0..n).map(|i| byte_at(i + 7919 * k as u64)).collect();
            let blob = Blob::owned(PathBuf::from(format!("rank{k}.distcp")), data.clone());
            let archives: Vec<(u64, u64)> = (0..n / len).map(|i| (i * len, len)).collect();
            let mut n_seen = 0;
            for_each_ends(&blob, &archives, 1000, 64 << 10, &mut buf, |i, e| {
                assert_ends(&data, archives[i], &e, &format!("file {k}, archive {i}"));
                n_seen += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(n_seen, archives.len(), "file {k}");
        }
    }

    /// Archives listed out of order (and one inside another) still get their own bytes.
    #[test]
    fn unsorted_and_overlapping_archives_get_their_own_bytes() {
        let data: Vec<u8> = (0..100_000).map(byte_at).collect();
        let blob = Blob::owned(PathBuf::from("rank1.distcp"), data.clone());
        let archives = [(50_000, 3000), (0, 40_000), (100, 500), (60_000, 40_000)];
        let mut n = 0;
        for_each_ends(&blob, &archives, 2000, 1 << 20, &mut Vec::new(), |i, e| {
            assert_ends(&data, archives[i], &e, &format!("archive {i}"));
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(n, archives.len());
    }
}
