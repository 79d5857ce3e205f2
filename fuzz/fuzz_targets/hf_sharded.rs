//! Any bytes as rank 2's file of torch's HF storage writer (saving distributed),
//! beside a real rank 1 file: the folder is opened and every tensor it describes is
//! read. Refusals are fine; a panic or a piece outside its file is not.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use unshard::source::hf_sharded;

const RANK1: &[u8] = include_bytes!(
    "../../fixtures/torchtitan/hf_sharded/qwen3_bf16_1file/sharded/shard-00001-model-00001-of-00001.safetensors"
);

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch().join("hf_sharded");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("shard-00001-model-00001-of-00001.safetensors"), RANK1);
    let _ = std::fs::write(dir.join("shard-00002-model-00001-of-00001.safetensors"), data);
    if let Ok(c) = hf_sharded::open(&dir) {
        common::read_all(&c);
    }
});
