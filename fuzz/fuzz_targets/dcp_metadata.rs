//! Any bytes as a DCP `.metadata` beside a real `__0_0.distcp`: the DCP reader
//! describes chunks inside the data file with full coverage, or fails with an error.
#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use unshard::source::{self, OpenOptions};

const DISTCP: &[u8] = include_bytes!("../../fixtures/sharded/llama_w2_dcp/__0_0.distcp");
const DISTCP1: &[u8] = include_bytes!("../../fixtures/sharded/llama_w2_dcp/__1_0.distcp");

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch().join("dcp");
    let _ = std::fs::create_dir_all(&dir);
    if !dir.join("__0_0.distcp").exists() {
        let _ = std::fs::write(dir.join("__0_0.distcp"), DISTCP);
        let _ = std::fs::write(dir.join("__1_0.distcp"), DISTCP1);
    }
    if std::fs::write(dir.join(".metadata"), data).is_err() {
        return;
    }
    if let Ok(c) = source::open(&dir, &OpenOptions::default()) {
        common::read_all(&c);
    }
});
