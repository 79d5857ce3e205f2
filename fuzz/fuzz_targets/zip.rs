//! Any bytes: the zip index either describes entries that lie inside the archive or
//! refuses; reading any stored entry never goes out of bounds.
#![no_main]

use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use unshard::source::zip::{Archive, ZipIndex};
use unshard::source::Blob;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = ZipIndex::parse(data) {
        let blob = Blob::owned(PathBuf::from("fuzz.zip"), data.to_vec());
        let archive = Archive::whole(&blob);
        for e in &index.entries {
            assert!(e.data_offset + e.compressed_size <= data.len() as u64);
            if let Ok(bytes) = index.stored(&archive, e) {
                assert_eq!(bytes.len() as u64, e.size);
            }
        }
    }
});
