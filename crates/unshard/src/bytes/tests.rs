#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::coalesce::Run;
use super::pooled::budget_for;
use super::*;

/// Deterministic bytes: byte `i` is a hash of `i`, so a misplaced copy shows.
fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
        .collect()
}

/// An in-memory source that counts the reads made on it (the default
/// `read_ranges`, so coalescing is what is measured).
#[derive(Debug)]
struct Counting {
    inner: MemBytes,
    reads: AtomicUsize,
}

impl Counting {
    fn new(data: Vec<u8>) -> Counting {
        Counting {
            inner: MemBytes::new(PathBuf::from("counted.bin"), data),
            reads: AtomicUsize::new(0),
        }
    }
}

impl ByteSource for Counting {
    fn name(&self) -> &Path {
        self.inner.name()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read_at(offset, buf)
    }
}

/// Reads `(offset, len)` ranges through `read_ranges` and checks each against `data`.
fn check_ranges(src: &dyn ByteSource, data: &[u8], spans: &[(u64, usize)]) {
    let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(_, n)| vec![0xAA; n]).collect();
    let mut ranges: Vec<(u64, &mut [u8])> = spans
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(o, _), b)| (o, &mut b[..]))
        .collect();
    src.read_ranges(&mut ranges).unwrap();
    for (&(o, n), b) in spans.iter().zip(&bufs) {
        assert_eq!(&b[..], &data[o as usize..o as usize + n], "range {o}+{n}");
    }
}

#[test]
fn coalesce_groups_near_ranges_and_keeps_far_ones_apart() {
    // Unsorted; 0..10 and 5..15 overlap, 15..20 touches, 100..110 is 80 bytes away,
    // 10_000.. is far; the empty request joins nothing.
    let req = [(100, 10), (0, 10), (10_000, 4), (5, 10), (15, 5), (50, 0)];
    let runs = coalesce(&req, 100, 1 << 20);
    assert_eq!(
        runs,
        vec![
            Run {
                start: 0,
                end: 110,
                members: vec![1, 3, 4, 0],
            },
            Run {
                start: 10_000,
                end: 10_004,
                members: vec![2],
            },
        ]
    );
    // With no gap allowed, only overlapping and touching ranges share a read.
    let runs = coalesce(&req, 0, 1 << 20);
    let spans: Vec<(u64, u64)> = runs.iter().map(|r| (r.start, r.end)).collect();
    assert_eq!(spans, [(0, 20), (100, 110), (10_000, 10_004)]);
    // A run stops growing at the size cap (a lone long range is still one run).
    let runs = coalesce(&[(0, 10), (10, 10), (20, 10), (30, 100)], 0, 20);
    let spans: Vec<(u64, u64)> = runs.iter().map(|r| (r.start, r.end)).collect();
    assert_eq!(spans, [(0, 20), (20, 30), (30, 130)]);
}

#[test]
fn every_request_lands_in_exactly_one_run_that_covers_it() {
    let mut seed = 7u64;
    let mut next = |m: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) % m
    };
    for _ in 0..200 {
        let n = 1 + next(20) as usize;
        let req: Vec<(u64, u64)> = (0..n).map(|_| (next(5000), next(300))).collect();
        let runs = coalesce(&req, next(200), 64 + next(2000));
        let mut seen = vec![0; n];
        for r in &runs {
            for &m in &r.members {
                seen[m] += 1;
                let (o, l) = req[m];
                assert!(r.start <= o && o + l <= r.end, "{req:?} -> {runs:?}");
            }
        }
        for (i, &(_, l)) in req.iter().enumerate() {
            assert_eq!(seen[i], usize::from(l > 0), "{req:?} -> {runs:?}");
        }
        assert!(runs.windows(2).all(|w| w[0].start <= w[1].start));
    }
}

#[test]
fn read_ranges_serves_unsorted_overlapping_and_adjacent_ranges() {
    let data = pattern(200_000);
    let src = MemBytes::new(PathBuf::from("mem.bin"), data.clone());
    check_ranges(
        &src,
        &data,
        &[
            (150_000, 100),
            (0, 30),
            (10, 30),
            (40, 1),
            (41, 0),
            (41, 7),
            (100_000, 50_000),
            (199_990, 10),
            (120, 64),
        ],
    );
    // Many random ranges, compared byte for byte.
    let mut seed = 11u64;
    let mut next = |m: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) % m
    };
    for _ in 0..50 {
        let spans: Vec<(u64, usize)> = (0..1 + next(40))
            .map(|_| {
                let o = next(199_000);
                (o, next(1000) as usize)
            })
            .collect();
        check_ranges(&src, &data, &spans);
    }
}

#[test]
fn nearby_ranges_take_one_read_and_far_ones_their_own() {
    let data = pattern(1 << 20);
    let src = Counting::new(data.clone());
    // Thirty headers 1 KiB apart: one read.
    let spans: Vec<(u64, usize)> = (0..30).rev().map(|i| (i * 1024, 30)).collect();
    check_ranges(&src, &data, &spans);
    assert_eq!(src.reads.swap(0, Ordering::Relaxed), 1);
    // Three ranges far apart: three reads.
    check_ranges(&src, &data, &[(0, 8), (500_000, 8), (1_000_000, 8)]);
    assert_eq!(src.reads.swap(0, Ordering::Relaxed), 3);
}

#[test]
fn a_range_past_the_end_is_an_error_naming_the_source() {
    let data = pattern(1000);
    let src = MemBytes::new(PathBuf::from("short.bin"), data.clone());
    let mut a = [0u8; 10];
    let mut b = [0u8; 10];
    let mut ranges = [(0u64, &mut a[..]), (995u64, &mut b[..])];
    let e = src.read_ranges(&mut ranges).unwrap_err().to_string();
    assert!(e.contains("short.bin") && e.contains("at byte 995"), "{e}");
    let mut c = [0u8; 4];
    let mut over = [(u64::MAX - 1, &mut c[..])];
    assert!(src.read_ranges(&mut over).is_err());
}

#[test]
fn a_local_file_reads_like_memory_and_reports_truncation() {
    let data = pattern(300_000);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    let local = LocalFile::open(f.path()).unwrap();
    assert_eq!(local.len(), data.len() as u64);
    let spans: Vec<(u64, usize)> = (0..64).map(|i| (i * 4099 % 290_000, 700)).collect();
    check_ranges(&local, &data, &spans);
    local.will_need(0, 1 << 30);
    // The file shrinks after it was opened: a read past the new end is an error that
    // names the file, not a crash and not stale bytes.
    f.as_file().set_len(1000).unwrap();
    let mut buf = [0u8; 100];
    let e = local.read_at(2000, &mut buf).unwrap_err().to_string();
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    assert!(e.contains("shorter than when it was opened"), "{e}");
    let mut ranges = [(10u64, &mut buf[..])];
    local.read_ranges(&mut ranges).unwrap();
    assert_eq!(&buf[..], &data[10..110]);
}

#[test]
fn sources_are_shareable_trait_objects() {
    fn shareable<T: Send + Sync + ?Sized>() {}
    shareable::<dyn ByteSource>();
    let blob = Blob::new(Arc::new(MemBytes::new(PathBuf::from("m"), pattern(10))));
    assert_eq!(blob.path, Path::new("m"));
    assert_eq!(blob.read_vec(2, 3).unwrap(), pattern(10)[2..5]);
    assert_eq!(blob.head(100).unwrap().len(), 10);
    assert!(blob.read_vec(8, 3).is_err());
}

/// One way of reading a strided view: `(offset, stride, elem, out)`.
type StridedRead<'a> = &'a dyn Fn(u64, u64, usize, &mut [u8]) -> Result<()>;

#[test]
fn strided_reads_pick_every_element_at_any_stride() {
    let data = pattern(3 << 20);
    let mem = MemBytes::new(PathBuf::from("strided.bin"), data.clone());
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    let local = LocalFile::open(f.path()).unwrap();
    // In memory, from a local file's map, and by spans (the default).
    let ways: [(&str, StridedRead<'_>); 3] = [
        ("memory", &|o, s, e, out| mem.read_strided(o, s, e, out)),
        ("local", &|o, s, e, out| local.read_strided(o, s, e, out)),
        ("spans", &|o, s, e, out| {
            read_strided_by_spans(&mem, o, s, e, out)
        }),
    ];
    for (way, read) in ways {
        // Dense, transposed-like, one window boundary crossed many times, farther
        // than the coalescing gap, and a broadcast (stride 0).
        for (offset, stride, elem, n) in [
            (0u64, 4u64, 4usize, 1000usize),
            (6, 12, 2, 250_000),
            (1, 40_000, 4, 60),
            (100, 0, 8, 50),
            (3, 1 << 20, 2, 3),
        ] {
            let mut out = vec![0u8; n * elem];
            read(offset, stride, elem, &mut out).unwrap();
            for (i, e) in out.chunks_exact(elem).enumerate() {
                let at = (offset + i as u64 * stride) as usize;
                assert_eq!(
                    e,
                    &data[at..at + elem],
                    "{way}: stride {stride}, element {i}"
                );
            }
        }
        // Past the end: an error, not a panic.
        let mut out = vec![0u8; 8];
        assert!(read(3 << 20, 4, 4, &mut out).is_err(), "{way}");
        assert!(
            read(u64::MAX - 2, u64::MAX / 2, 4, &mut out).is_err(),
            "{way}"
        );
    }
    let mut out = vec![0u8; 8];
    let e = mem.read_strided(3 << 20, 4, 4, &mut out).unwrap_err();
    assert!(e.to_string().contains("strided.bin"), "{e}");
    local.release(0, 3 << 20);
}

#[test]
fn memory_bytes_debug_names_the_buffer_and_gives_its_length_not_its_bytes() {
    let src = MemBytes::new(PathBuf::from("decoded.bin"), vec![7u8; 300]);
    let d = format!("{src:?}");
    assert!(d.contains("decoded.bin") && d.contains("300"), "{d}");
    assert!(!d.contains("7, 7"), "{d}");
    assert_eq!(src.as_bytes(), Some(&[7u8; 300][..]));
    assert_eq!(src.readers(), 0);
    let empty = MemBytes::new(PathBuf::from("e"), Vec::new());
    assert!(empty.is_empty() && !src.is_empty());
}

#[test]
fn a_local_file_with_no_ranges_or_only_empty_ones_reads_nothing() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&pattern(100)).unwrap();
    let local = LocalFile::open(f.path()).unwrap();
    local.read_ranges(&mut []).unwrap();
    let mut a = [0u8; 0];
    local.read_ranges(&mut [(5u64, &mut a[..])]).unwrap();
}

#[test]
fn a_strided_read_after_a_release_still_reads_the_file() {
    let data = pattern(1 << 20);
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&data).unwrap();
    let local = LocalFile::open(f.path()).unwrap();
    let mut out = vec![0u8; 4 * 1000];
    local.read_strided(12, 1000, 4, &mut out).unwrap();
    // Parts of pages, whole pages, past the end: the map's pages come back from the file.
    for (o, l) in [(100, 5000), (4096, 8192), (0, 1 << 21), (700_000, u64::MAX)] {
        local.release(o, l);
        local.read_strided(12, 1000, 4, &mut out).unwrap();
        for (i, e) in out.chunks_exact(4).enumerate() {
            let at = 12 + i * 1000;
            assert_eq!(e, &data[at..at + 4], "after release({o}, {l}), element {i}");
        }
    }
}

/// Three files of different lengths and contents in a directory.
fn pool_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    (0..3)
        .map(|i| {
            let p = dir.join(format!("rank{i}.bin"));
            let data: Vec<u8> = pattern(1000 + 100 * i)
                .iter()
                .map(|b| b ^ i as u8)
                .collect();
            std::fs::write(&p, &data).unwrap();
            (p, data)
        })
        .collect()
}

#[test]
fn a_pool_keeps_at_most_its_cap_open_and_closes_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let files = pool_files(dir.path());
    let pool = FilePool::new(2);
    let srcs: Vec<PooledFile> = files
        .iter()
        .map(|(p, _)| PooledFile::open(p, &pool).unwrap())
        .collect();
    // Opening records the length; no descriptor is kept yet.
    assert_eq!((pool.opens(), pool.open_now()), (0, 0));
    for (s, (p, d)) in srcs.iter().zip(&files) {
        assert_eq!(s.name(), p.as_path());
        assert_eq!(s.len(), d.len() as u64);
    }
    let read = |i: usize| {
        let mut buf = [0u8; 50];
        srcs[i].read_at(900, &mut buf).unwrap();
        assert_eq!(&buf[..], &files[i].1[900..950], "file {i}");
    };
    read(0); // open 0
    read(1); // open 1
    read(0); // 0 is open: no open, and 0 is now more recent than 1
    assert_eq!((pool.opens(), pool.open_now()), (2, 2));
    read(2); // full: 1, the least recently used, is closed
    assert_eq!((pool.opens(), pool.open_now()), (3, 2));
    read(0); // still open
    assert_eq!(pool.opens(), 3);
    read(1); // was closed: opened again, closing 2
    assert_eq!((pool.opens(), pool.open_now()), (4, 2));
    read(0);
    assert_eq!(pool.opens(), 4);
    // A hint opens the file it is about (the pool's only descriptor source).
    srcs[2].will_need(0, 100);
    assert_eq!(pool.opens(), 5);
    // A read past the end names the file.
    let mut buf = [0u8; 10];
    let e = srcs[0].read_at(995, &mut buf).unwrap_err().to_string();
    assert!(
        e.contains("rank0.bin") && e.contains("shorter than when it was opened"),
        "{e}"
    );
}

#[test]
fn a_full_pool_closes_exactly_the_least_recently_used_file_whatever_the_order() {
    // Eight files open in a pool of eight; every round re-reads all of them but one,
    // in a shuffled order, then reads a ninth: the one not re-read is the least
    // recently used and the only one that may be closed. A pool picking any other
    // victim reopens a file on the next pass, which the open count shows.
    let dir = tempfile::tempdir().unwrap();
    let n = 9;
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| {
            let p = dir.path().join(format!("f{i}.bin"));
            std::fs::write(&p, pattern(64 + i)).unwrap();
            p
        })
        .collect();
    let pool = FilePool::new(n - 1);
    let srcs: Vec<PooledFile> = paths
        .iter()
        .map(|p| PooledFile::open(p, &pool).unwrap())
        .collect();
    let read = |i: usize| {
        let mut b = [0u8; 4];
        srcs[i].read_at(0, &mut b).unwrap();
    };
    let mut open: Vec<usize> = (0..n - 1).collect();
    for &i in &open {
        read(i);
    }
    let mut outside = n - 1;
    let mut state = 0x9e37_79b9_u32;
    for round in 0..24 {
        // Which open file is left out this round, and the order of the others.
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let lru = open[(state >> 8) as usize % open.len()];
        let mut others: Vec<usize> = open.iter().copied().filter(|&i| i != lru).collect();
        let k = round % others.len();
        others.rotate_left(k);
        if round % 2 == 1 {
            others.reverse();
        }
        for &i in &others {
            read(i);
        }
        let before = pool.opens();
        read(outside); // the pool is full: `lru` must be the one closed
        assert_eq!(pool.opens(), before + 1, "round {round}");
        for &i in &others {
            read(i);
        }
        assert_eq!(
            pool.opens(),
            before + 1,
            "round {round}: a file other than the least recently used ({lru}) was closed"
        );
        assert_eq!(pool.open_now(), n - 1);
        open.retain(|&i| i != lru);
        open.push(outside);
        outside = lru;
    }
}

#[test]
fn the_open_file_budget_follows_the_process_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct passed to it.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let cur = usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX);
    let budget = open_file_budget();
    assert_eq!(budget, budget_for(cur), "limit {cur}");
    assert!(budget >= 1);
}

#[test]
fn a_pooled_file_that_changed_length_between_opens_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let files = pool_files(dir.path());
    let pool = FilePool::new(1);
    let a = PooledFile::open(&files[0].0, &pool).unwrap();
    let b = PooledFile::open(&files[1].0, &pool).unwrap();
    let mut buf = [0u8; 10];
    a.read_at(0, &mut buf).unwrap();
    b.read_at(0, &mut buf).unwrap(); // closes a
    std::fs::write(&files[0].0, pattern(10)).unwrap();
    let e = a.read_at(0, &mut buf).unwrap_err().to_string();
    assert!(
        e.contains("rank0.bin") && e.contains("had 1000 bytes and now has 10"),
        "{e}"
    );
    assert!(PooledFile::open(&dir.path().join("missing.bin"), &pool).is_err());
}

#[test]
fn the_open_file_budget_keeps_a_reserve_below_the_limit() {
    assert_eq!(budget_for(0), usize::MAX);
    assert_eq!(budget_for(16), usize::MAX);
    assert_eq!(budget_for(17), 1);
    assert_eq!(budget_for(256), 240);
    assert_eq!(budget_for(257), 129);
    assert_eq!(budget_for(20_000), 19_872);
}

#[test]
fn a_source_with_the_defaults_reads_strided_views_by_spans_and_holds_no_bytes() {
    let data = pattern(5000);
    let src = Counting::new(data.clone());
    let mut out = vec![0u8; 2 * 100];
    src.read_strided(7, 30, 2, &mut out).unwrap();
    for (i, e) in out.chunks_exact(2).enumerate() {
        let at = 7 + i * 30;
        assert_eq!(e, &data[at..at + 2], "element {i}");
    }
    assert_eq!(src.as_bytes(), None);
    assert_eq!(src.readers(), 0);
    assert!(!src.is_empty());
    let blob = Blob::owned(PathBuf::from("blob.bin"), pattern(3));
    let d = format!("{blob:?}");
    assert!(
        d.starts_with("Blob") && d.contains("blob.bin") && d.contains("MemBytes"),
        "{d}"
    );
    assert!(!blob.is_empty());
    assert!(Blob::owned(PathBuf::from("none.bin"), Vec::new()).is_empty());
}

#[test]
fn strided_reads_by_spans_take_one_read_per_span_and_one_per_far_element() {
    let data = pattern(3 << 20);
    let src = Counting::new(data.clone());
    // (offset, stride, elem, n, reads): a span holds at most STRIDED_SPAN bytes, so
    // (2^20 - 2) / 12 + 1 = 87,382 elements of 2 bytes 12 apart fit in one read and
    // one more takes a second; at a stride of GAP elements still share spans (32 of 4
    // bytes in 1 MiB); past GAP each element is read on its own.
    for (offset, stride, elem, n, reads) in [
        (6u64, 12u64, 2usize, 87_382usize, 1usize),
        (6, 12, 2, 87_383, 2),
        (3, GAP, 4, 10, 1),
        (3, GAP, 4, 33, 2),
        (1, GAP + 1, 4, 5, 5),
        // The last element ends where the source does: the span stops there too.
        ((3 << 20) - (999 * 12 + 2), 12, 2, 1000, 1),
    ] {
        let mut out = vec![0u8; n * elem];
        read_strided_by_spans(&src, offset, stride, elem, &mut out).unwrap();
        for (i, e) in out.chunks_exact(elem).enumerate() {
            let at = (offset + i as u64 * stride) as usize;
            assert_eq!(e, &data[at..at + elem], "stride {stride}, element {i}");
        }
        let got = src.reads.swap(0, Ordering::Relaxed);
        assert_eq!(got, reads, "{n} elements {stride} bytes apart: {got} reads");
    }
    // Less than one element's bytes: nothing to read, and no panic.
    let mut out = [0u8; 3];
    read_strided_by_spans(&src, 0, 8, 4, &mut out).unwrap();
    assert_eq!(src.reads.load(Ordering::Relaxed), 0);
}

#[test]
fn a_gather_whose_offsets_overflow_names_the_bytes_it_could_not_read() {
    let mem = MemBytes::new(PathBuf::from("over.bin"), pattern(100));
    // Element 0 is at byte 1; element 1 would be at 1 + u64::MAX.
    let mut out = [0u8; 16];
    let e = mem
        .read_strided(1, u64::MAX, 8, &mut out)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("over.bin") && e.contains("cannot read 8 bytes at byte 1"),
        "{e}"
    );
}
