#![allow(clippy::unwrap_used)]

use super::*;
use std::path::PathBuf;

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
    let blob = Blob::owned(PathBuf::from("a.zip"), a.clone());
    let archive = Archive::whole(&blob);
    assert_eq!(&idx.stored(&archive, e).expect("bytes")[..], b"hello");
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

/// Counts the positioned reads made on a file, and the bytes they read.
#[derive(Debug)]
struct Counting(
    crate::source::LocalFile,
    std::sync::atomic::AtomicUsize,
    std::sync::atomic::AtomicUsize,
);

impl crate::source::ByteSource for Counting {
    fn name(&self) -> &std::path::Path {
        self.0.name()
    }
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> crate::error::Result<()> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.2
            .fetch_add(buf.len(), std::sync::atomic::Ordering::Relaxed);
        self.0.read_at(offset, buf)
    }
}

#[test]
fn a_torch_archive_is_indexed_in_a_few_reads_that_skip_the_data() {
    use crate::source::ByteSource;
    use std::sync::atomic::Ordering::Relaxed;
    let path = crate::fixtures().join("ckpt/llama_policy.pt");
    let file = crate::source::LocalFile::open(&path).expect("fixture");
    let len = file.len();
    let counting = std::sync::Arc::new(Counting(file, Default::default(), Default::default()));
    let blob = Blob::new(counting.clone());
    let idx = ZipIndex::read(&mut Archive::whole(&blob)).expect("index");
    let (reads, bytes) = (counting.1.load(Relaxed), counting.2.load(Relaxed));
    // The tail, then the local headers in one request: fewer reads than entries,
    // and a small part of the file (the tensors between the headers are skipped).
    assert!(idx.entries.len() > 20, "{}", idx.entries.len());
    assert!(
        reads < idx.entries.len() / 2,
        "{reads} reads for {} entries",
        idx.entries.len()
    );
    assert!((bytes as u64) < len / 4, "{bytes} of {len} bytes read");
    // The same index as from the whole file in memory.
    let data = std::fs::read(&path).expect("fixture");
    assert_eq!(idx.entries, ZipIndex::parse(&data).expect("index").entries);
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

/// One entry of `raw` bytes (stored or deflated), declaring `size` and `crc`, then a
/// directory claiming `count` entries and a `comment` of that many bytes.
fn archive_with(raw: &[u8], method: u16, size: u32, crc: u32, count: u16, comment: u16) -> Vec<u8> {
    let name = b"x/e";
    let mut v = Vec::new();
    v.extend_from_slice(&LOCAL_SIG.to_le_bytes());
    v.extend_from_slice(&[0u8; 22]);
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(&5u16.to_le_bytes()); // a local extra field, as torch pads
    v.extend_from_slice(name);
    v.extend_from_slice(&[0u8; 5]);
    v.extend_from_slice(raw);
    let cd = v.len() as u32;
    v.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
    v.extend_from_slice(&[0u8; 6]);
    v.extend_from_slice(&method.to_le_bytes());
    v.extend_from_slice(&[0u8; 4]);
    v.extend_from_slice(&crc.to_le_bytes());
    v.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(&[0u8; 12]);
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(name);
    let cd_size = v.len() as u32 - cd;
    v.extend_from_slice(&EOCD_SIG.to_le_bytes());
    v.extend_from_slice(&[0u8; 4]);
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(&cd_size.to_le_bytes());
    v.extend_from_slice(&cd.to_le_bytes());
    v.extend_from_slice(&comment.to_le_bytes());
    v.extend(std::iter::repeat_n(b'c', comment as usize));
    v
}

fn stored_archive(body: &[u8], count: u16, comment: u16) -> Vec<u8> {
    archive_with(
        body,
        METHOD_STORED,
        body.len() as u32,
        crc32fast::hash(body),
        count,
        comment,
    )
}

#[test]
fn data_starts_after_the_local_name_and_extra_field() {
    let a = stored_archive(b"payload", 1, 0);
    let idx = ZipIndex::parse(&a).unwrap();
    let e = idx.find("x/e").unwrap();
    assert_eq!((e.data_offset, e.size, e.compressed_size), (38, 7, 7));
    assert_eq!(&a[38..45], b"payload");
    assert!(idx.find("x/f").is_none());
    assert!(idx.duplicate().is_none());
}

#[test]
fn the_end_record_is_found_behind_a_comment_of_any_length() {
    for comment in [0u16, 1, 100, 5000, 0xffff] {
        let a = stored_archive(b"payload", 1, comment);
        let idx = ZipIndex::parse(&a).unwrap_or_else(|e| panic!("comment {comment}: {e}"));
        assert_eq!(idx.entries.len(), 1, "comment {comment}");
    }
    let e = ZipIndex::parse(&[0u8; 21]).unwrap_err();
    assert!(e.0.contains("21 bytes is too short"), "{e}");
    let e = ZipIndex::parse(&[0u8; 22]).unwrap_err();
    assert!(e.0.contains("no end-of-central-directory record"), "{e}");
    // An end record 22 bytes from the end is found; one 21 bytes from it is not.
    let mut a = stored_archive(b"payload", 1, 0);
    ZipIndex::parse(&a).unwrap();
    a.pop();
    assert!(ZipIndex::parse(&a).is_err());
}

#[test]
fn an_entry_count_beyond_the_directory_is_refused_before_reading() {
    // The directory holds one 49-byte entry: room for 49 / 46 = 1, and one more is
    // let through (then read, and found past the end); two more are refused unread.
    let e = ZipIndex::parse(&stored_archive(b"p", 2, 0)).unwrap_err();
    assert!(
        e.0.contains("central directory entry at byte 88 (+46) lies past the end"),
        "{e}"
    );
    let e = ZipIndex::parse(&stored_archive(b"p", 3, 0)).unwrap_err();
    assert!(e.0.contains("claims 3 entries"), "{e}");
    assert!(e.0.contains("room for at most 1"), "{e}");
}

#[test]
fn a_directory_past_the_end_is_refused() {
    let mut a = stored_archive(b"p", 1, 0);
    let n = a.len();
    // The directory's offset (EOCD + 16) moved one byte later: it ends past the end.
    let cd = u32::from_le_bytes(a[n - 6..n - 2].try_into().unwrap());
    a[n - 6..n - 2].copy_from_slice(&(cd + 23).to_le_bytes());
    let e = ZipIndex::parse(&a).unwrap_err();
    assert!(e.0.contains("lies past the end"), "{e}");
}

fn inflate(a: &[u8], max: u64) -> Result<Vec<u8>> {
    let idx = ZipIndex::parse(a).unwrap();
    let blob = Blob::owned(PathBuf::from("a.zip"), a.to_vec());
    let archive = Archive::whole(&blob);
    idx.inflate(&archive, &idx.entries[0], max)
}

#[test]
fn a_deflated_entry_is_inflated_within_its_declared_size_and_crc() {
    let body: Vec<u8> = (0..4000u32).map(|i| (i % 7) as u8).collect();
    let raw = miniz_oxide::deflate::compress_to_vec(&body, 6);
    let crc = crc32fast::hash(&body);
    let n = body.len() as u32;
    let good = archive_with(&raw, METHOD_DEFLATED, n, crc, 1, 0);
    assert_eq!(inflate(&good, n as u64).unwrap(), body);
    // Through stored(): the record cap applies, the bytes are the same.
    let idx = ZipIndex::parse(&good).unwrap();
    let blob = Blob::owned(PathBuf::from("a.zip"), good.clone());
    let archive = Archive::whole(&blob);
    assert_eq!(
        &idx.stored(&archive, &idx.entries[0]).unwrap()[..],
        &body[..]
    );

    let e = inflate(&good, n as u64 - 1).unwrap_err().to_string();
    assert!(e.contains("at most 3999 are read"), "{e}");
    let e = inflate(
        &archive_with(&raw, METHOD_DEFLATED, n, crc ^ 1, 1, 0),
        1 << 20,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fails its CRC-32 check"), "{e}");
    let e = inflate(
        &archive_with(&raw, METHOD_DEFLATED, n - 1, crc, 1, 0),
        1 << 20,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("does not inflate") || e.contains("inflates to"),
        "{e}"
    );
    let e = inflate(
        &archive_with(&raw, METHOD_DEFLATED, n + 1, crc, 1, 0),
        1 << 20,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("inflates to 4000 bytes, not the 4001"), "{e}");
    // More than deflate can expand the compressed bytes to: refused unread.
    let tiny = archive_with(&raw[..3], METHOD_DEFLATED, 3 * 1032 + 1, crc, 1, 0);
    let e = inflate(&tiny, 1 << 20).unwrap_err().to_string();
    assert!(
        e.contains("claims 3097 bytes from 3 compressed bytes"),
        "{e}"
    );
    let ok = archive_with(&raw[..3], METHOD_DEFLATED, 3 * 1032, crc, 1, 0);
    let e = inflate(&ok, 1 << 20).unwrap_err().to_string();
    assert!(!e.contains("compressed bytes (at most"), "{e}");
}

#[test]
fn another_compression_method_is_named() {
    let a = archive_with(b"abc", 12, 3, crc32fast::hash(b"abc"), 1, 0);
    let idx = ZipIndex::parse(&a).unwrap();
    let blob = Blob::owned(PathBuf::from("a.zip"), a.clone());
    let e = idx
        .stored(&Archive::whole(&blob), &idx.entries[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("zip method 12"), "{e}");
}

/// A stored archive of `n` one-byte entries named `archive/data/I`.
fn many(n: usize) -> Vec<u8> {
    let mut v = Vec::new();
    let mut locals = Vec::new();
    for i in 0..n {
        let name = format!("archive/data/{i}");
        locals.push(v.len() as u32);
        v.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        v.extend_from_slice(&[0u8; 22]);
        v.extend_from_slice(&(name.len() as u16).to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(name.as_bytes());
        v.push(i as u8);
    }
    let cd = v.len() as u32;
    for (i, local) in locals.iter().enumerate() {
        let name = format!("archive/data/{i}");
        v.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
        v.extend_from_slice(&[0u8; 12]);
        v.extend_from_slice(&crc32fast::hash(&[i as u8]).to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&(name.len() as u16).to_le_bytes());
        v.extend_from_slice(&[0u8; 12]);
        v.extend_from_slice(&local.to_le_bytes());
        v.extend_from_slice(name.as_bytes());
    }
    let cd_size = v.len() as u32 - cd;
    v.extend_from_slice(&EOCD_SIG.to_le_bytes());
    v.extend_from_slice(&[0u8; 4]);
    v.extend_from_slice(&(n as u16).to_le_bytes());
    v.extend_from_slice(&(n as u16).to_le_bytes());
    v.extend_from_slice(&cd_size.to_le_bytes());
    v.extend_from_slice(&cd.to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    v
}

#[test]
fn a_directory_larger_than_the_tail_is_read_in_one_block() {
    use std::sync::atomic::Ordering::Relaxed;
    // 2000 entries: a 124 KB directory, far more than the 4 KiB tail read first.
    let data = many(2000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.zip");
    std::fs::write(&path, &data).unwrap();
    let file = crate::source::LocalFile::open(&path).unwrap();
    let counting = std::sync::Arc::new(Counting(file, Default::default(), Default::default()));
    let blob = Blob::new(counting.clone());
    let idx = ZipIndex::read(&mut Archive::whole(&blob)).unwrap();
    assert_eq!(idx.entries.len(), 2000);
    for (i, e) in idx.entries.iter().enumerate() {
        assert_eq!(e.name, format!("archive/data/{i}"));
        assert_eq!(data[e.data_offset as usize], i as u8, "{}", e.name);
    }
    // The tail, the directory in one block, the local headers in one request
    // (which a file source may split into a few reads).
    let reads = counting.1.load(Relaxed);
    assert!(reads < 50, "{reads} reads");
}

#[test]
fn a_stored_record_is_read_up_to_the_end_and_not_past_it() {
    let mut a = stored_archive(b"payload", 1, 0);
    let n = a.len() as u32;
    // The declared size (central directory + 24) set to reach the archive's last
    // byte, then one byte further: the record is read, then refused unread.
    let cd = a.len() - 22 - 46 - 3;
    a[cd + 24..cd + 28].copy_from_slice(&(n - 38).to_le_bytes());
    let idx = ZipIndex::parse(&a).unwrap();
    let blob = Blob::owned(PathBuf::from("a.zip"), a.clone());
    let archive = Archive::whole(&blob);
    assert_eq!(
        idx.stored(&archive, &idx.entries[0]).unwrap().len() as u32,
        n - 38
    );
    a[cd + 24..cd + 28].copy_from_slice(&(n - 37).to_le_bytes());
    let idx = ZipIndex::parse(&a).unwrap();
    let blob = Blob::owned(PathBuf::from("a.zip"), a.clone());
    let e = idx
        .stored(&Archive::whole(&blob), &idx.entries[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("entry 'x/e' at byte 38"), "{e}");
    assert!(e.contains("lies past the end of the archive"), "{e}");
}

#[test]
fn two_entries_of_one_name_are_found() {
    let idx = ZipIndex::parse(&stored_archive(b"p", 1, 0)).unwrap();
    assert!(idx.duplicate().is_none());
    let twice = ZipIndex {
        entries: vec![idx.entries[0].clone(), idx.entries[0].clone()],
    };
    assert_eq!(twice.duplicate().map(|e| e.name.as_str()), Some("x/e"));
    // The error type prints its message.
    let e = ZipIndex::parse(&[0u8; 21]).unwrap_err();
    assert_eq!(e.to_string(), e.0);
}
