//! Any bytes: the zip index either describes entries that lie inside the slice or
//! refuses; reading any stored entry never goes out of bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use unshard::source::zip::ZipIndex;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = ZipIndex::parse(data) {
        for e in &index.entries {
            if let Ok(bytes) = index.stored_bytes(data, e) {
                assert_eq!(bytes.len() as u64, e.size);
            }
        }
    }
});
