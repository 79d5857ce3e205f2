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
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> crate::Result<()> {
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
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/ckpt/llama_policy.pt");
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
