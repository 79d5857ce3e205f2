//! `--no-fuse`: the adapter written back as a standard peft adapter directory
//! (`adapter_config.json` + `adapter_model.safetensors`), for servers that load
//! adapters separately (vLLM `--lora-modules`, TGI, `PeftModel.from_pretrained`).
//!
//! Names are those peft's `save_pretrained` writes: `base_model.model.<module>.lora_A.weight`,
//! `.lora_B.weight`, `.lora_magnitude_vector`, `.lora_embedding_A` / `_B`, and a saved
//! module's tensors as `base_model.model.<name>`. The config is the one the adapter
//! was resolved with, unchanged: the real `lora_alpha`, rank patterns and all.
//! Tensors keep their stored dtype. Memory: one tensor at a time.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::config::CONFIG_FILE;
use super::resolve::Resolved;
use crate::error::{Error, Result};
use crate::read::read_tensor;
use crate::source::{Blob, TensorSource};

/// The weight file written.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// peft's prefix for the wrapped model's names.
const PREFIX: &str = "base_model.model.";

/// `(name in the adapter file, tensor)` for every tensor the adapter owns.
pub fn adapter_tensors(resolved: &Resolved) -> Vec<(String, &TensorSource)> {
    let mut out = Vec::new();
    for f in &resolved.fuses {
        let (a, b) = if f.embedding {
            ("lora_embedding_A", "lora_embedding_B")
        } else {
            ("lora_A.weight", "lora_B.weight")
        };
        out.push((format!("{PREFIX}{}.{a}", f.module), &f.a));
        out.push((format!("{PREFIX}{}.{b}", f.module), &f.b));
        if let Some(m) = &f.magnitude {
            out.push((format!("{PREFIX}{}.lora_magnitude_vector", f.module), m));
        }
    }
    for t in resolved.tensors.iter().filter(|t| resolved.owns(&t.name)) {
        out.push((format!("{PREFIX}{}", t.name), t));
    }
    out.sort_by(|x, y| x.0.cmp(&y.0));
    out
}

/// Writes the adapter directory into `dir` (created if absent); `files` are the
/// files of the input the adapter was resolved from.
pub fn write_adapter_dir(dir: &Path, resolved: &Resolved, files: &[Arc<Blob>]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let config_path = dir.join(CONFIG_FILE);
    let text =
        serde_json::to_string_pretty(&Value::Object(resolved.config.raw.clone())).map_err(|e| {
            Error::corrupt(
                &config_path,
                format!("cannot serialise the adapter config: {e}"),
            )
        })?;
    std::fs::write(&config_path, text + "\n").map_err(|e| Error::io("write", &config_path, e))?;
    write_safetensors(&dir.join(WEIGHTS_FILE), &adapter_tensors(resolved), files)
}

/// A safetensors file of `tensors`, in the order given, each in its stored dtype.
fn write_safetensors(
    path: &Path,
    tensors: &[(String, &TensorSource)],
    files: &[Arc<Blob>],
) -> Result<()> {
    let mut header = Map::new();
    let mut meta = Map::new();
    meta.insert("format".into(), Value::String("pt".into()));
    header.insert("__metadata__".into(), Value::Object(meta));
    let mut offset = 0u64;
    for (name, t) in tensors {
        let end = offset + t.nbytes();
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": t.dtype.safetensors_name(),
                "shape": t.shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut head = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| Error::corrupt(path, format!("cannot serialise the header: {e}")))?;
    // The data starts 8-byte aligned, padded with spaces as the safetensors package does.
    while (head.len() + 8) % 8 != 0 {
        head.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io("create", path, e))?;
    let mut out = std::io::BufWriter::new(file);
    let io = |e| Error::io("write", path, e);
    out.write_all(&(head.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&head).map_err(io)?;
    for (_, t) in tensors {
        let (bytes, _) = read_tensor(files, t, t.dtype)?;
        out.write_all(&bytes).map_err(io)?;
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::source::test_input::MemInput;

    /// Every length of header, whatever its remainder by 8, is padded with spaces so
    /// that the data starts 8-byte aligned (what the safetensors package writes and
    /// what a reader that maps the file expects), and the data follows unchanged.
    #[test]
    fn the_data_starts_8_byte_aligned_for_every_header_length() {
        let dir = tempfile::tempdir().unwrap();
        let mut remainders = std::collections::BTreeSet::new();
        for len in 1..=8 {
            let name = "w".repeat(len);
            let mut input = MemInput::default();
            let t = input.tensor(&name, &[1.5, -2.0], &[2]);
            let files = input.checkpoint().files;
            let path = dir.path().join(format!("{len}.safetensors"));
            write_safetensors(&path, &[(name.clone(), &t)], &files).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!((8 + n) % 8, 0, "header of {n} bytes for '{name}'");
            let head = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
            let json = head.trim_end_matches(' ');
            remainders.insert(json.len() % 8);
            let parsed: Value = serde_json::from_str(json).unwrap();
            assert_eq!(parsed[&name]["data_offsets"], serde_json::json!([0, 8]));
            let data: Vec<u8> = [1.5f32, -2.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(bytes[8 + n..], data[..]);
        }
        // The names above give headers of every remainder, padded or not.
        assert_eq!(remainders.len(), 8);
    }
}
