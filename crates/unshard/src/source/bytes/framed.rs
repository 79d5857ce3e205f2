//! A byte source that checks the records around the bytes it serves.
//!
//! A reader that plans many small records from one it parsed (the chunk archives of
//! a DCP checkpoint, planned from the first archive of each structure) need not read
//! each record twice, once at open to check it and once more to copy its payload.
//! It wraps the file in a [`Framed`] source instead, listing each record it did not
//! read (a *frame*: a byte range of the file) and the [`Pattern`] the frame must
//! match. A read that touches a frame checks the whole frame against its pattern,
//! from the read's own buffer when the frame lies inside it ([`ByteSource::extent`]
//! tells a caller how far to widen a read for that), else with one read of the
//! frame; each frame is checked once. A frame unlike its pattern fails the read with
//! [`Error::Replan`]: the plan made from the pattern may put the payload in the
//! wrong place, so the caller opens the input again with every record checked up
//! front. [`ByteSource::check_unread`] checks the frames no read has touched.

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{coalesce, read_strided_by_spans, ByteSource, GAP, MAX_RUN};
use crate::{Error, Result};

/// The longest read [`Framed`] widens to the frames it holds part of (longer ones
/// read those frames apart).
const WIDEN_MAX: usize = 1 << 20;

/// What every frame planned from one parsed record holds: the record's bytes but
/// for ranges free to differ (its payload, an id, their checksums).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// Bytes `0..head.len()` of the frame.
    pub head: Vec<u8>,
    /// Where `tail` starts in the frame (the frame's length when the head holds it all).
    pub tail_at: u64,
    /// Bytes `tail_at..` of the frame. Bytes between the head and the tail are free.
    pub tail: Vec<u8>,
    /// Frame byte ranges free to differ, sorted by start.
    pub free: Vec<(u64, u64)>,
}

impl Pattern {
    /// The length of a frame of this pattern.
    pub fn len(&self) -> u64 {
        if self.tail.is_empty() {
            self.head.len() as u64
        } else {
            self.tail_at + self.tail.len() as u64
        }
    }

    /// Whether the pattern is of empty frames.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a frame whose first `head.len()` bytes are `head` and whose bytes from
    /// `tail_at` on are `tail` matches the pattern.
    pub fn matches_ends(&self, head: &[u8], tail_at: u64, tail: &[u8]) -> bool {
        tail_at == self.tail_at
            && same(0, head, &self.head, &self.free)
            && same(tail_at, tail, &self.tail, &self.free)
    }

    /// Whether `frame`, all of a frame's bytes, matches the pattern.
    pub fn matches(&self, frame: &[u8]) -> bool {
        if frame.len() as u64 != self.len() {
            return false;
        }
        let head = &frame[..self.head.len()];
        let tail_at = if self.tail.is_empty() {
            frame.len() as u64
        } else {
            self.tail_at
        };
        self.matches_ends(head, tail_at, &frame[tail_at as usize..])
    }
}

/// Whether `bytes` (frame bytes from `at`) equal `want` outside the `free` ranges.
pub fn same(at: u64, bytes: &[u8], want: &[u8], free: &[(u64, u64)]) -> bool {
    if bytes.len() != want.len() {
        return false;
    }
    let end = at + bytes.len() as u64;
    let mut pos = at;
    for &(s, e) in free.iter().chain(std::iter::once(&(end, end))) {
        let (s, e) = (s.clamp(at, end), e.clamp(at, end));
        if s > pos {
            let (i, j) = ((pos - at) as usize, (s - at) as usize);
            if bytes[i..j] != want[i..j] {
                return false;
            }
        }
        pos = pos.max(e);
    }
    true
}

/// The look-up table of [`Framed::index`] for `frames` (sorted, not overlapping):
/// about one bucket per frame, each at least 64 bytes wide.
fn index(frames: &[Frame]) -> (Vec<u32>, u64, u32) {
    let (Some(first), Some(last)) = (frames.first(), frames.last()) else {
        return (Vec::new(), 0, 0);
    };
    let base = first.offset;
    let span = last.offset + u64::from(last.len) - base;
    let per = (span / frames.len() as u64).max(64);
    let shift = 63 - per.leading_zeros();
    let buckets = (span >> shift) + 1;
    let mut index = Vec::with_capacity(buckets as usize);
    let mut k = 0;
    for b in 0..buckets {
        let at = base + (b << shift);
        while frames
            .get(k)
            .is_some_and(|f| f.offset + u64::from(f.len) <= at)
        {
            k += 1;
        }
        index.push(k as u32);
    }
    (index, base, shift)
}

/// A byte range of a file that must match a pattern before any of it is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Its first byte in the file.
    pub offset: u64,
    /// Its length: that of its pattern.
    pub len: u32,
    /// Index of its pattern.
    pub pattern: u32,
}

/// A [`ByteSource`] whose reads check the frames they touch (see the module docs).
pub struct Framed {
    inner: Arc<dyn ByteSource>,
    /// Sorted by offset, none overlapping the next.
    frames: Vec<Frame>,
    patterns: Arc<[Pattern]>,
    /// One bit per frame: checked.
    checked: Vec<AtomicU64>,
    /// Where to start looking for the frames at an offset: `index[b]` is the first
    /// frame ending after `base + (b << shift)`. The engine looks up a frame per
    /// read, and a binary search through hundreds of thousands of frames missed the
    /// cache at every step.
    index: Vec<u32>,
    base: u64,
    shift: u32,
}

impl fmt::Debug for Framed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Framed")
            .field("inner", &self.inner)
            .field("frames", &self.frames.len())
            .finish()
    }
}

impl Framed {
    /// `inner` with `frames` to check against `patterns`. Frames that overlap one
    /// before them, name no pattern, are not of their pattern's length or end past
    /// the source are refused (`Err` holds the frames refused): the reader plans
    /// those records another way.
    pub fn new(
        inner: Arc<dyn ByteSource>,
        mut frames: Vec<Frame>,
        patterns: Arc<[Pattern]>,
    ) -> std::result::Result<Framed, Vec<Frame>> {
        frames.sort_unstable_by_key(|f| f.offset);
        let mut refused = Vec::new();
        let mut end = 0u64;
        let len = inner.len();
        frames.retain(|f| {
            let fits = patterns
                .get(f.pattern as usize)
                .is_some_and(|p| p.len() == u64::from(f.len));
            let f_end = f.offset.saturating_add(u64::from(f.len));
            let ok = fits && f.offset >= end && f_end <= len;
            if ok {
                end = f_end;
            } else {
                refused.push(*f);
            }
            ok
        });
        if !refused.is_empty() {
            return Err(refused);
        }
        let words = frames.len().div_ceil(64);
        let (index, base, shift) = index(&frames);
        Ok(Framed {
            inner,
            frames,
            patterns,
            checked: (0..words).map(|_| AtomicU64::new(0)).collect(),
            index,
            base,
            shift,
        })
    }

    /// How many frames have been checked.
    pub fn checked(&self) -> usize {
        self.checked
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }

    fn is_checked(&self, k: usize) -> bool {
        self.checked[k / 64].load(Ordering::Relaxed) & (1 << (k % 64)) != 0
    }

    fn mark(&self, k: usize) {
        self.checked[k / 64].fetch_or(1 << (k % 64), Ordering::Relaxed);
    }

    /// The indices of the frames that overlap `offset..end`.
    fn overlapping(&self, offset: u64, end: u64) -> Range<usize> {
        let b = offset.saturating_sub(self.base) >> self.shift;
        let mut first = usize::try_from(b)
            .ok()
            .and_then(|b| self.index.get(b))
            .map_or(self.frames.len(), |&k| k as usize);
        let ends_before = |f: &Frame| f.offset + u64::from(f.len) <= offset;
        while self.frames.get(first).is_some_and(ends_before) {
            first += 1;
        }
        let mut last = first;
        while self.frames.get(last).is_some_and(|f| f.offset < end) {
            last += 1;
        }
        first..last
    }

    /// `ranges`, each widened to the frames it touches (see [`ByteSource::extent`]).
    fn widened(&self, ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
        ranges.iter().map(|&(o, n)| self.extent(o, n)).collect()
    }

    /// [`ByteSource::extent`] of the `len` bytes at `offset`, given the frames
    /// `near` that they overlap.
    fn extent_near(&self, near: Range<usize>, offset: u64, len: u64) -> (u64, u64) {
        let end = offset.saturating_add(len);
        let (Some(first), Some(last)) = (
            self.frames.get(near.start),
            near.end.checked_sub(1).and_then(|k| self.frames.get(k)),
        ) else {
            return (offset, len);
        };
        let start = offset.min(first.offset);
        let end = end.max(last.offset + u64::from(last.len));
        (start, end - start)
    }

    /// Checks frame `k`, whose bytes are `bytes`.
    fn check_frame(&self, k: usize, bytes: &[u8]) -> Result<()> {
        let f = self.frames[k];
        if self.patterns[f.pattern as usize].matches(bytes) {
            self.mark(k);
            return Ok(());
        }
        let end = f.offset + u64::from(f.len);
        Err(Error::Replan {
            path: self.inner.name().to_path_buf(),
            msg: format!(
                "the record at bytes {}..{end} is not laid out like the one it was planned from",
                f.offset
            ),
        })
    }

    /// Checks every frame not yet checked that overlaps the `buf.len()` bytes at
    /// `offset`, which `buf` holds.
    fn check(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.check_near(
            self.overlapping(offset, offset + buf.len() as u64),
            offset,
            buf,
        )
    }

    /// [`Framed::check`], given the frames `near` that the bytes overlap.
    fn check_near(&self, near: Range<usize>, offset: u64, buf: &[u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let mut frame = Vec::new();
        for k in near {
            if self.is_checked(k) {
                continue;
            }
            let f = self.frames[k];
            let f_end = f.offset + u64::from(f.len);
            if f.offset >= offset && f_end <= end {
                let at = (f.offset - offset) as usize;
                self.check_frame(k, &buf[at..at + f.len as usize])?;
            } else {
                frame.resize(f.len as usize, 0);
                self.inner.read_at(f.offset, &mut frame)?;
                self.check_frame(k, &frame)?;
            }
        }
        Ok(())
    }
}

impl ByteSource for Framed {
    fn name(&self) -> &Path {
        self.inner.name()
    }

    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.saturating_add(buf.len() as u64);
        let near = self.overlapping(offset, end);
        // A short read that holds part of a frame not yet checked is widened to the
        // whole frame: one read instead of two (one request, for an object store).
        let partial = near.clone().any(|k| {
            let f = self.frames[k];
            !self.is_checked(k) && (f.offset < offset || f.offset + u64::from(f.len) > end)
        });
        if partial && buf.len() <= WIDEN_MAX {
            // The widened bytes overlap the same frames: they end where those do.
            let (start, len) = self.extent_near(near.clone(), offset, buf.len() as u64);
            let mut wide = vec![0; len as usize];
            self.inner.read_at(start, &mut wide)?;
            self.check_near(near, start, &wide)?;
            let at = (offset - start) as usize;
            buf.copy_from_slice(&wide[at..at + buf.len()]);
            return Ok(());
        }
        self.inner.read_at(offset, buf)?;
        self.check_near(near, offset, buf)
    }

    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.inner.read_ranges(ranges)?;
        ranges.iter().try_for_each(|(o, b)| self.check(*o, b))
    }

    // Hints name the frames around the bytes too: reads are widened to them (see
    // `extent`), and a source that fetches what it is told (an object store) would
    // otherwise make a request of its own for each frame's ends.
    fn will_need(&self, offset: u64, len: u64) {
        let (offset, len) = self.extent(offset, len);
        self.inner.will_need(offset, len);
    }

    fn release(&self, offset: u64, len: u64) {
        self.inner.release(offset, len);
    }

    fn will_need_together(&self, ranges: &[(u64, u64)]) {
        self.inner.will_need_together(&self.widened(ranges));
    }

    fn done_with(&self, ranges: &[(u64, u64)]) {
        self.inner.done_with(&self.widened(ranges));
    }

    fn readers(&self) -> usize {
        self.inner.readers()
    }

    fn read_strided(&self, offset: u64, stride: u64, elem: usize, out: &mut [u8]) -> Result<()> {
        let n = (out.len() / elem.max(1)) as u64;
        let span = n
            .saturating_sub(1)
            .saturating_mul(stride)
            .saturating_add(elem as u64);
        if self
            .overlapping(offset, offset.saturating_add(span))
            .is_empty()
        {
            self.inner.read_strided(offset, stride, elem, out)
        } else {
            read_strided_by_spans(self, offset, stride, elem, out)
        }
    }

    fn extent(&self, offset: u64, len: u64) -> (u64, u64) {
        self.extent_near(
            self.overlapping(offset, offset.saturating_add(len)),
            offset,
            len,
        )
    }

    fn check_unread(&self) -> Result<()> {
        let unread: Vec<(u64, u64)> = (0..self.frames.len())
            .filter(|&k| !self.is_checked(k))
            .map(|k| (self.frames[k].offset, u64::from(self.frames[k].len)))
            .collect();
        let mut buf = Vec::new();
        for run in coalesce(&unread, GAP, MAX_RUN) {
            buf.resize((run.end - run.start) as usize, 0);
            self.read_at(run.start, &mut buf)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::bytes::MemBytes;
    use std::path::PathBuf;

    #[test]
    fn bytes_are_compared_outside_the_free_ranges_only() {
        let want = b"abcdefgh";
        assert!(same(10, b"abXXefgh", want, &[(12, 14)]));
        assert!(!same(10, b"abXXefgX", want, &[(12, 14)]));
        assert!(!same(10, b"Xbcdefgh", want, &[(12, 14)]));
        // Ranges outside the bytes, or overlapping their ends.
        assert!(same(10, b"Xbcdefgh", want, &[(0, 11), (30, 40)]));
        assert!(!same(10, b"abcdefgh", b"abcdefg", &[]));
    }

    /// A record of 40 bytes: "HEAD", a 4-byte id, 24 payload bytes, "TAIL", a
    /// 4-byte id; the ids and the payload are free.
    fn record(id: u8, payload: u8) -> Vec<u8> {
        let mut r = b"HEAD".to_vec();
        r.extend([id; 4]);
        r.extend([payload; 24]);
        r.extend(b"TAIL");
        r.extend([id; 4]);
        r
    }

    fn patterns(split: bool) -> Arc<[Pattern]> {
        let r = record(0, 0);
        let free = vec![(4, 8), (8, 32), (36, 40)];
        let p = if split {
            // Head and tail apart: the payload in between is not compared.
            Pattern {
                head: r[..10].to_vec(),
                tail_at: 30,
                tail: r[30..].to_vec(),
                free,
            }
        } else {
            Pattern {
                head: r,
                tail_at: 40,
                tail: Vec::new(),
                free,
            }
        };
        Arc::new([p])
    }

    /// Ten records after 7 bytes of preamble, the fifth with a byte changed at `bad`
    /// (if any), framed.
    fn framed(bad: Option<usize>, split: bool) -> (Framed, Vec<u8>) {
        let mut data = b"PREFACE".to_vec();
        for k in 0..10u8 {
            let mut r = record(k, 100 + k);
            if let (4, Some(i)) = (k, bad) {
                r[i] ^= 1;
            }
            data.extend(r);
        }
        let frames: Vec<Frame> = (0..10)
            .map(|k| Frame {
                offset: 7 + 40 * k,
                len: 40,
                pattern: 0,
            })
            .collect();
        let src = Arc::new(MemBytes::new(PathBuf::from("rank.distcp"), data.clone()));
        (Framed::new(src, frames, patterns(split)).unwrap(), data)
    }

    /// Reads serve the file's bytes and check each frame they touch once, from the
    /// read's buffer or with a read of the frame when the read holds part of it.
    #[test]
    fn reads_check_the_frames_they_touch() {
        for split in [false, true] {
            let (f, data) = framed(None, split);
            let mut buf = vec![0; 20];
            // Inside the payload of record 2 only.
            f.read_at(7 + 80 + 10, &mut buf).unwrap();
            assert_eq!(buf, data[97..117]);
            assert_eq!(f.checked(), 1);
            // Records 0..=3 whole: three more, the preamble touches none.
            let mut buf = vec![0; 7 + 160];
            f.read_at(0, &mut buf).unwrap();
            assert_eq!(buf, data[..167]);
            assert_eq!(f.checked(), 4);
            assert_eq!(f.extent(7 + 40 * 5 + 9, 3), (207, 40));
            assert_eq!(f.extent(0, 8), (0, 47));
            assert_eq!(f.extent(3, 2), (3, 2));
            f.check_unread().unwrap();
            assert_eq!(f.checked(), 10);
            let (g, _) = framed(None, split);
            let (mut a, mut b) = ([0u8; 3], [0u8; 50]);
            let mut ranges = [(2, &mut a[..]), (7 + 40 * 6 + 30, &mut b[..])];
            g.read_ranges(&mut ranges).unwrap();
            assert_eq!((&a[..], &b[..]), (&data[2..5], &data[277..327]));
            assert_eq!(g.checked(), 2);
            // Past the end, or overflowing: an error, never a panic.
            let mut four = [0u8; 4];
            assert!(f.read_at(u64::MAX - 1, &mut four).is_err());
            assert!(f.read_at(data.len() as u64 - 2, &mut four).is_err());
        }
    }

    /// A byte changed outside the free ranges fails whichever read touches the
    /// record, naming the file and the record; one in a free range does not.
    #[test]
    fn a_frame_unlike_its_pattern_fails_the_read() {
        for split in [false, true] {
            for bad in [0, 3, 32, 35] {
                let (f, data) = framed(Some(bad), split);
                let rec = 7 + 4 * 40;
                let mut buf = vec![0; 2];
                // A read of the neighbours passes; of any byte of record 4 fails.
                f.read_at(rec - 2, &mut buf).unwrap();
                f.read_at(rec + 40, &mut buf).unwrap();
                let e = f.read_at(rec + 12, &mut buf).unwrap_err();
                assert!(matches!(e, Error::Replan { .. }), "{e}");
                let m = e.to_string();
                assert!(
                    m.contains("rank.distcp") && m.contains("bytes 167..207"),
                    "{m}"
                );
                let mut all = vec![0; data.len()];
                assert!(f.read_at(0, &mut all).is_err());
                assert!(f.check_unread().is_err());
                // Strided reads too, also one whose first element is before the
                // frames and whose fifth is in record 4.
                let mut out = vec![0; 4];
                assert!(f.read_strided(rec + 8, 4, 2, &mut out).is_err());
                let mut out = vec![0; 20];
                assert!(f.read_strided(1, 40, 2, &mut out).is_err());
                // And reads of several ranges at once.
                let (mut a, mut b) = ([0u8; 3], [0u8; 3]);
                let mut ranges = [(0, &mut a[..]), (rec + 20, &mut b[..])];
                let e = f.read_ranges(&mut ranges).unwrap_err();
                assert!(matches!(e, Error::Replan { .. }), "{e}");
            }
            for free in [5, 8, 20, 31, 38] {
                let (f, _) = framed(Some(free), split);
                f.check_unread().unwrap();
                assert_eq!(f.checked(), 10);
            }
        }
        // In the middle of a split pattern (payload, never compared).
        let (f, _) = framed(Some(12), true);
        f.check_unread().unwrap();
    }

    /// The frames a range overlaps, found through the look-up table, are those a
    /// search of every frame finds: frames of mixed lengths, with gaps small and
    /// large between them, ranges anywhere (before, between, after the frames).
    #[test]
    fn the_index_finds_the_frames_a_range_overlaps() {
        let mut frames = Vec::new();
        let mut at = 100u64;
        for k in 0..300u64 {
            let len = [40u32, 3, 200, 64, 1000][k as usize % 5];
            frames.push(Frame {
                offset: at,
                len,
                pattern: 0,
            });
            at += u64::from(len) + [0, 0, 7, 5000, 1][k as usize % 5];
        }
        let patterns: Vec<Pattern> = [40u64, 3, 200, 64, 1000]
            .iter()
            .map(|&n| Pattern {
                head: vec![0; n as usize],
                tail_at: n,
                tail: Vec::new(),
                free: Vec::new(),
            })
            .collect();
        for f in &mut frames {
            f.pattern = [40, 3, 200, 64, 1000]
                .iter()
                .position(|&n| n == f.len)
                .unwrap() as u32;
        }
        let src = Arc::new(MemBytes::new(
            PathBuf::from("f"),
            vec![0; at as usize + 500],
        ));
        let f = Framed::new(src, frames.clone(), patterns.into()).unwrap();
        // Every byte: the frame holding it, if any.
        let mut owner = vec![None; at as usize + 400];
        for (k, fr) in frames.iter().enumerate() {
            for o in fr.offset..fr.offset + u64::from(fr.len) {
                owner[o as usize] = Some(k);
            }
        }
        for (o, &k) in owner.iter().enumerate() {
            let got: Vec<usize> = f.overlapping(o as u64, o as u64 + 1).collect();
            assert_eq!(got, k.into_iter().collect::<Vec<_>>(), "byte {o}");
        }
        let mut x = 12345u64;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let offset = (x >> 20) % (at + 400);
            let len = 1 + (x >> 50) % [1, 50, 3000][(x % 3) as usize];
            let end = offset + len;
            let want: Vec<usize> = (0..frames.len())
                .filter(|&k| {
                    frames[k].offset < end && frames[k].offset + u64::from(frames[k].len) > offset
                })
                .collect();
            let got: Vec<usize> = f.overlapping(offset, end).collect();
            assert_eq!(got, want, "{offset}..{end}");
        }
    }

    /// What a [`Framed`] asks of the source under it.
    #[derive(Debug)]
    struct Recorded {
        inner: MemBytes,
        calls: std::sync::Mutex<Vec<(&'static str, u64, u64)>>,
    }

    impl Recorded {
        fn take(&self) -> Vec<(&'static str, u64, u64)> {
            std::mem::take(&mut *self.calls.lock().unwrap())
        }
        fn note(&self, what: &'static str, ranges: &[(u64, u64)]) {
            let mut calls = self.calls.lock().unwrap();
            calls.extend(ranges.iter().map(|&(o, n)| (what, o, n)));
        }
    }

    impl ByteSource for Recorded {
        fn name(&self) -> &Path {
            self.inner.name()
        }
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            self.note("read", &[(offset, buf.len() as u64)]);
            self.inner.read_at(offset, buf)
        }
        fn will_need(&self, offset: u64, len: u64) {
            self.note("will_need", &[(offset, len)]);
        }
        fn will_need_together(&self, ranges: &[(u64, u64)]) {
            self.note("together", ranges);
        }
        fn done_with(&self, ranges: &[(u64, u64)]) {
            self.note("done_with", ranges);
        }
        fn release(&self, offset: u64, len: u64) {
            self.note("release", &[(offset, len)]);
        }
        fn readers(&self) -> usize {
            7
        }
    }

    /// A short read that holds part of a frame not yet checked is widened to the
    /// whole frame (one read of the source, not the read and then the frame's); a
    /// read of a checked frame, or one longer than [`WIDEN_MAX`], is not; hints are
    /// widened to the frames they touch.
    #[test]
    fn short_reads_and_hints_are_widened_to_whole_frames() {
        let (framed_mem, mut data) = framed(None, false);
        let frames = framed_mem.frames.clone();
        data.resize(7 + 400 + WIDEN_MAX + 100, 7);
        let rec = Arc::new(Recorded {
            inner: MemBytes::new(PathBuf::from("rank.distcp"), data.clone()),
            calls: Default::default(),
        });
        let fresh = || Framed::new(rec.clone(), frames.clone(), patterns(false)).unwrap();
        let f = fresh();
        let frame = |k: u64| (7 + 40 * k, 40);
        let mut two = [0u8; 2];
        // Two bytes inside record 2: one read, of the whole record.
        f.read_at(7 + 80 + 10, &mut two).unwrap();
        assert_eq!(two, data[97..99]);
        assert_eq!(rec.take(), vec![("read", 87, 40)]);
        // Again, now checked: the two bytes alone.
        f.read_at(7 + 80 + 10, &mut two).unwrap();
        assert_eq!(rec.take(), vec![("read", 97, 2)]);
        // Across records 3 and 4: both whole, in one read.
        let mut ten = [0u8; 10];
        f.read_at(7 + 160 - 5, &mut ten).unwrap();
        assert_eq!(ten, data[162..172]);
        assert_eq!(rec.take(), vec![("read", 127, 80)]);
        // Hints.
        f.will_need(7 + 200 + 3, 2);
        f.will_need_together(&[(7 + 240 + 1, 1), (0, 3)]);
        f.done_with(&[(7 + 280 + 39, 2)]);
        let (a, b, c, d) = (frame(5), frame(6), frame(7), frame(8));
        assert_eq!(
            rec.take(),
            vec![
                ("will_need", a.0, a.1),
                ("together", b.0, b.1),
                ("together", 0, 3),
                ("done_with", c.0, d.0 + d.1 - c.0),
            ]
        );
        // From the first byte of record 5, ending inside it: widened too.
        f.read_at(7 + 200, &mut two).unwrap();
        assert_eq!(two, data[207..209]);
        assert_eq!(rec.take(), vec![("read", 207, 40)]);
        // Released bytes are the caller's range; the source's figures are its own.
        f.release(3, 9);
        assert_eq!(rec.take(), vec![("release", 3, 9)]);
        assert_eq!((f.readers(), f.len()), (7, data.len() as u64));
        // The longest read widened, from inside record 9, and one byte longer.
        let mut long = vec![0u8; WIDEN_MAX];
        f.read_at(7 + 360 + 1, &mut long).unwrap();
        assert_eq!(long, data[368..368 + WIDEN_MAX]);
        assert_eq!(rec.take(), vec![("read", 367, WIDEN_MAX as u64 + 1)]);
        // Record 9 not yet checked: the read, then the record apart.
        let g = fresh();
        let mut longer = vec![0u8; WIDEN_MAX + 1];
        g.read_at(7 + 360 + 1, &mut longer).unwrap();
        assert_eq!(longer, data[368..369 + WIDEN_MAX]);
        assert_eq!(
            rec.take(),
            vec![("read", 368, WIDEN_MAX as u64 + 1), ("read", 367, 40)]
        );
    }

    /// The look-up table itself: `index[b]` is exactly the first frame ending after
    /// bucket `b`'s start (a table that only errs early would find the same frames,
    /// walking further), and there are about as many buckets as frames, each at
    /// least 64 bytes wide.
    #[test]
    fn the_index_has_a_bucket_per_frame_pointing_at_the_first_frame_it_holds() {
        for (count, len, gap) in [
            (1u64, 40u32, 0u64),
            (10, 40, 0),
            (300, 3, 1),
            (257, 1000, 4000),
        ] {
            let frames: Vec<Frame> = (0..count)
                .map(|k| Frame {
                    offset: 50 + k * (u64::from(len) + gap),
                    len,
                    pattern: 0,
                })
                .collect();
            let (index, base, shift) = index(&frames);
            assert_eq!(base, 50);
            let last = frames.last().unwrap();
            let span = last.offset + u64::from(last.len) - base;
            let per = (span / count).max(64);
            let width = 1u64 << shift;
            assert!(
                width >= 64 && width <= per && 2 * width > per,
                "{count} frames: width {width}, per {per}"
            );
            assert_eq!(index.len() as u64, (span >> shift) + 1, "{count} frames");
            for (b, &k) in index.iter().enumerate() {
                let at = base + (b as u64) * width;
                let want = frames
                    .iter()
                    .take_while(|f| f.offset + u64::from(f.len) <= at)
                    .count();
                assert_eq!(k as usize, want, "{count} frames, bucket {b}");
            }
        }
        assert_eq!(index(&[]), (Vec::new(), 0, 0));
    }

    #[test]
    fn a_framed_source_shows_its_source_and_frame_count() {
        let (f, _) = framed(None, false);
        let shown = format!("{f:?}");
        assert!(
            shown.starts_with("Framed")
                && shown.contains("rank.distcp")
                && shown.contains("frames: 10"),
            "{shown}"
        );
    }

    #[test]
    fn a_pattern_is_empty_only_when_its_frames_are() {
        assert!(!patterns(false)[0].is_empty());
        assert!(!patterns(true)[0].is_empty());
        let none = Pattern {
            head: Vec::new(),
            tail_at: 0,
            tail: Vec::new(),
            free: Vec::new(),
        };
        assert!(none.is_empty());
        assert!(none.matches(&[]));
    }

    /// Frames that overlap, end past the source or are not of their pattern's length
    /// are refused, with the frames named.
    #[test]
    fn frames_that_cannot_be_checked_are_refused() {
        let src = Arc::new(MemBytes::new(PathBuf::from("f"), vec![0; 100]));
        let frame = |offset, len, pattern| Frame {
            offset,
            len,
            pattern,
        };
        let ok = [frame(0, 40, 0), frame(40, 40, 0)];
        assert!(Framed::new(src.clone(), ok.to_vec(), patterns(false)).is_ok());
        for bad in [
            frame(39, 40, 0),
            frame(80, 40, 0),
            frame(50, 39, 0),
            frame(50, 40, 1),
        ] {
            let frames = vec![ok[0], ok[1], bad];
            let refused = Framed::new(src.clone(), frames, patterns(false)).unwrap_err();
            assert_eq!(refused, vec![bad]);
        }
    }
}
