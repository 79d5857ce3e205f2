//! Any bytes as a file: detection and the reader it picks (torch zip, legacy,
//! safetensors) describe tensors that lie inside the file, or fail with an error.
//! The bytes are read from memory (the same readers as for a local file, through the
//! byte-source seam), which keeps runs fast.
#![no_main]

#[path = "common.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use unshard::source::{self, Blob, OpenOptions};

fuzz_target!(|data: &[u8]| {
    let blob = Arc::new(Blob::owned(PathBuf::from("input.pt"), data.to_vec()));
    if let Ok(c) = source::open_blob(blob, &OpenOptions::default()) {
        common::read_all(&c);
    }
});
