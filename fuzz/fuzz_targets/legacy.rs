//! Any bytes after the legacy magic: the legacy reader parses its five pickles and
//! locates storages inside the input, or refuses; tensors it then describes fit.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use unshard::source::{legacy, torch, Blob};

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.pt");
    let blob = Blob::owned(path.to_path_buf(), data.to_vec());
    if let Ok(payload) = legacy::read_legacy_payload(&blob) {
        for loc in payload.storages.values() {
            assert!(loc.offset + loc.len <= data.len() as u64);
        }
        if let Ok(found) = torch::find_tensors(&payload.pickle, path, None) {
            let _ = torch::plain_sources(&payload, 0, &found);
        }
    }
});
