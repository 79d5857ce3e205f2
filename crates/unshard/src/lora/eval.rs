//! Evaluating one fused weight from its inputs: read the base weight and the
//! factors as float32, fuse ([`super::math`]). Memory: the weight in float32 plus
//! the factors and one block of the update.

use std::sync::Arc;

use super::math::{self, Factors};
use super::resolve::Fuse;
use crate::dtype::DType;
use crate::error::Result;
use crate::read::read_tensor;
use crate::source::{Blob, TensorSource};

/// Reads a tensor as float32 values.
pub fn read_f32(files: &[Arc<Blob>], t: &TensorSource) -> Result<Vec<f32>> {
    let (bytes, _) = read_tensor(files, t, DType::F32)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The fused weight in float32: `w` (in `w_files`) with `fuse`'s factors (in
/// `adapter_files`).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn fused_f32(
    fuse: &Fuse,
    w_files: &[Arc<Blob>],
    w: &TensorSource,
    adapter_files: &[Arc<Blob>],
) -> Result<Vec<f32>> {
    let layout = fuse.layout_for(&w.shape)?;
    let (rows, cols) = (w.shape[0] as usize, w.shape[1] as usize);
    let mut values = read_f32(w_files, w)?;
    let a = read_f32(adapter_files, &fuse.a)?;
    let b = read_f32(adapter_files, &fuse.b)?;
    let m = fuse
        .magnitude
        .as_ref()
        .map(|m| read_f32(adapter_files, m))
        .transpose()?;
    math::fuse(
        &mut values,
        rows,
        cols,
        &Factors {
            layout,
            a: &a,
            b: &b,
            rank: fuse.rank as usize,
            scale: fuse.scale,
            magnitude: m.as_deref(),
        },
    );
    Ok(values)
}
