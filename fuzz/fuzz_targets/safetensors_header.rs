//! Any bytes: a safetensors header is validated (offsets contiguous, in bounds, no
//! overflow) or refused; what it accepts describes tensors inside the file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use unshard::source::safetensors;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = safetensors::read_header(Path::new("fuzz.safetensors"), data) {
        for (_, dtype, shape, begin, end) in &header.tensors {
            assert!(begin <= end);
            assert!(header.data_start + end <= data.len() as u64);
            let n: u64 = shape.iter().product();
            assert_eq!(n * dtype.size() as u64, end - begin);
        }
        let _ = safetensors::sources(0, header.data_start, header.tensors);
    }
});
