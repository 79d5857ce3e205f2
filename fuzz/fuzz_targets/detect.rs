//! Any bytes as a file: detection and the reader it picks (torch zip, legacy,
//! safetensors) describe tensors that lie inside the file, or fail with an error.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use unshard::source::{self, OpenOptions};

fuzz_target!(|data: &[u8]| {
    let path = common::scratch().join("input.pt");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(c) = source::open(&path, &OpenOptions::default()) {
        common::read_all(&c);
    }
});
