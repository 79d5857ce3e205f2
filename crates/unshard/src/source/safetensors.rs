//! Reading `.safetensors` files (base model weights, or a checkpoint to inspect).
//!
//! A file is an 8-byte little-endian header length `n`, `n` bytes of JSON, then the
//! tensor data. Only the header is read (8 + `n` bytes). It is validated as strictly
//! as the reference reader does (docs/formats.md): bounded size, valid JSON, known
//! dtypes, offsets contiguous from 0 with no gap, no overlap and no trailing bytes,
//! and every extent computed with checked arithmetic. A violation names the file and
//! the tensor.

use std::path::Path;

use super::{contiguous_strides, Blob, FileId, Piece, StorageId, TensorSource};
use crate::{DType, Error, Result};

/// The reference reader's cap on the header size.
pub const MAX_HEADER: u64 = 100_000_000;

/// Whether a file of `file_len` bytes starting with `head` plausibly is a
/// safetensors file.
pub fn looks_like_safetensors(head: &[u8], file_len: u64) -> bool {
    if head.len() < 10 {
        return false;
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&head[..8]);
    let n = u64::from_le_bytes(n);
    (2..=MAX_HEADER).contains(&n) && 8 + n <= file_len && head[8] == b'{'
}

/// One parsed header.
#[derive(Debug)]
pub struct Header {
    /// Byte offset of the data buffer in the file (8 + header length).
    pub data_start: u64,
    /// `(name, dtype, shape, begin, end)` in header order, offsets relative to `data_start`.
    pub tensors: Vec<(String, DType, Vec<u64>, u64, u64)>,
    /// `__metadata__` entries, in header order.
    pub metadata: Vec<(String, String)>,
}

/// Parses and validates the header of a safetensors file held whole in `data`.
pub fn read_header(path: &Path, data: &[u8]) -> Result<Header> {
    parse_header(path, data, data.len() as u64)
}

/// Reads and validates the header of a safetensors file, reading only the header.
pub fn read_header_from(blob: &Blob) -> Result<Header> {
    parse_header(&blob.path, &header_bytes(blob)?, blob.len())
}

/// The first 8 + `n` bytes of a safetensors file: the length and the JSON header.
/// A length over [`MAX_HEADER`] or past the end of the file gives what fits, so that
/// [`parse_header`] reports it.
pub fn header_bytes(blob: &Blob) -> Result<Vec<u8>> {
    let len = blob.len();
    if len < 8 {
        return blob.head(8);
    }
    let mut n = [0u8; 8];
    blob.read_at(0, &mut n)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Ok(n.to_le_bytes().to_vec());
    }
    blob.read_vec(0, 8 + n)
}

/// Parses and validates a safetensors header from `prefix`, the first bytes of a
/// file of `len` bytes (at least the length and the JSON header).
pub fn parse_header(path: &Path, prefix: &[u8], len: u64) -> Result<Header> {
    let data = prefix;
    if len < 8 || data.len() < 8 {
        return Err(Error::corrupt(path, "too short for a safetensors header"));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&data[..8]);
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(Error::corrupt(
            path,
            format!("safetensors header of {n} bytes exceeds the {MAX_HEADER}-byte limit"),
        ));
    }
    if 8 + n > len || 8 + n > data.len() as u64 {
        return Err(Error::corrupt(
            path,
            format!(
                "safetensors header claims {n} bytes but the file has {len}; the file is truncated"
            ),
        ));
    }
    let text = std::str::from_utf8(&data[8..(8 + n) as usize])
        .map_err(|_| Error::corrupt(path, "the safetensors header is not UTF-8"))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text.trim_end())
        .map_err(|e| {
            Error::corrupt(
                path,
                format!("the safetensors header is not a JSON object: {e}"),
            )
        })?;
    let mut tensors = Vec::with_capacity(json.len());
    let mut metadata = Vec::new();
    for (name, v) in &json {
        if name == "__metadata__" {
            let m = v
                .as_object()
                .ok_or_else(|| Error::corrupt(path, "__metadata__ is not an object"))?;
            for (k, v) in m {
                let v = v.as_str().ok_or_else(|| {
                    Error::corrupt(path, format!("__metadata__ value '{k}' is not a string"))
                })?;
                metadata.push((k.clone(), v.to_string()));
            }
            continue;
        }
        let bad = |msg: String| Error::bad_tensor(path, name, msg);
        let dtype_s = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("no dtype".into()))?;
        let dtype = DType::from_safetensors_name(dtype_s)
            .ok_or_else(|| bad(format!("unsupported dtype {dtype_s}")))?;
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .ok_or_else(|| bad("shape is not a list of non-negative ints".into()))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| bad("data_offsets is not [begin, end]".into()))?;
        tensors.push((name.clone(), dtype, shape, offs[0], offs[1]));
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].3, tensors[i].4));
    let mut expect = 0u64;
    for &i in &order {
        let (name, dtype, shape, begin, end) = &tensors[i];
        let bad = |msg: String| Error::bad_tensor(path, name, msg);
        if *begin != expect {
            return Err(bad(format!(
                "data starts at {begin} but the previous tensor ends at {expect} (gap or overlap)"
            )));
        }
        let nbytes = shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if end.checked_sub(*begin) != Some(nbytes) {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] do not match {nbytes} bytes of {dtype} {shape:?}"
            )));
        }
        expect = *end;
    }
    if 8 + n + expect != len {
        return Err(Error::corrupt(
            path,
            format!("tensor data ends at byte {} but the file has {len} bytes; the file is truncated or has trailing bytes", 8 + n + expect),
        ));
    }
    Ok(Header {
        data_start: 8 + n,
        tensors,
        metadata,
    })
}

/// Describes every tensor of a safetensors file as a one-piece source.
pub fn sources(file: FileId, header: &Header) -> Vec<TensorSource> {
    header
        .tensors
        .iter()
        .map(|(name, dtype, shape, begin, _)| TensorSource {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            pieces: vec![Piece {
                file,
                byte_offset: header.data_start + begin,
                dtype: *dtype,
                shape: shape.clone(),
                strides: contiguous_strides(shape),
                global_offset: vec![0; shape.len()],
                big_endian: false,
            }]
            .into(),
            storage: Some(StorageId {
                file,
                key: name.clone(),
            }),
            layout: None,
        })
        .collect()
}
