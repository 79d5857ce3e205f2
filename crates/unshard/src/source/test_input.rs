//! An in-memory checkpoint for unit tests: tensors laid out back to back in one
//! file, each one contiguous piece.

use std::path::PathBuf;
use std::sync::Arc;

use super::{contiguous_strides, Blob, Checkpoint, Format, Piece, TensorSource};
use crate::dtype::DType;

/// The file being built, and the tensors added to it.
#[derive(Default)]
pub(crate) struct MemInput {
    bytes: Vec<u8>,
    tensors: Vec<TensorSource>,
}

impl MemInput {
    /// The file's length so far: where the next tensor starts.
    pub(crate) fn bytes_len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// A float32 tensor of `values`, appended to the file.
    pub(crate) fn tensor(&mut self, name: &str, values: &[f32], shape: &[u64]) -> TensorSource {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.raw(name, &bytes, DType::F32, shape)
    }

    /// A tensor of `dtype` stored as `bytes`, appended to the file.
    pub(crate) fn raw(
        &mut self,
        name: &str,
        bytes: &[u8],
        dtype: DType,
        shape: &[u64],
    ) -> TensorSource {
        let at = self.bytes.len() as u64;
        self.bytes.extend(bytes);
        let t = TensorSource {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces: vec![Piece {
                file: 0,
                byte_offset: at,
                dtype,
                shape: shape.to_vec(),
                strides: contiguous_strides(shape),
                global_offset: vec![0; shape.len()],
                big_endian: false,
            }]
            .into(),
            storage: None,
            layout: None,
        };
        self.tensors.push(t.clone());
        t
    }

    /// The checkpoint of one file, `input`, listing every tensor added.
    pub(crate) fn checkpoint(self) -> Checkpoint {
        Checkpoint {
            format: Format::TorchZip,
            path: PathBuf::from("input"),
            files: vec![Arc::new(Blob::owned(PathBuf::from("input"), self.bytes))],
            key: None,
            tensors: self.tensors,
            extras: Vec::new(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        }
    }
}
