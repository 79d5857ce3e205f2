//! Tensor reading: a tensor's elements from the pieces the readers described,
//! converted to a dtype. Below the engine, which fills output blocks with
//! [`pieces::fill_bytes`] and [`batched::Batch`]; above the readers. The read API
//! proper is [`read_tensor`] and [`read_tensor_range`] (values in memory, whole or a
//! window at a time, for `verify`, `diff`, `stats` and the LoRA report), and
//! [`windows`], how every streaming pass cuts a tensor.
//!
//! By job: `pieces` (a window of one tensor from its pieces), `geometry` (a piece's
//! runs of elements inside its tensor), `batched` (the small pieces of a block read
//! together, file by file).

use std::sync::Arc;

pub(crate) mod batched;
pub(crate) mod geometry;
pub(crate) mod pieces;

use crate::dtype::ConvertStats;
use crate::dtype::DType;
use crate::error::Result;
use crate::source::{Blob, TensorSource};
use pieces::{fill_window, Copied};

thread_local! {
    /// Scratch for [`read_tensor`] and [`read_tensor_range`], which `verify` and `diff`
    /// call once per window.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads a whole tensor into memory in C order, converted to `to`. For tests,
/// `verify` and `diff` on tensors of reasonable size; merging streams instead.
pub fn read_tensor(
    files: &[Arc<Blob>],
    source: &TensorSource,
    to: DType,
) -> Result<(Vec<u8>, ConvertStats)> {
    let n = source.numel();
    let mut out = vec![0u8; (n * to.size() as u64) as usize];
    let stats = read_tensor_range(files, source, to, 0, n, &mut out)?;
    Ok((out, stats))
}

/// Reads elements `[e0, e1)` of a tensor (C order), converted to `to`, into `out`.
pub fn read_tensor_range(
    files: &[Arc<Blob>],
    source: &TensorSource,
    to: DType,
    e0: u64,
    e1: u64,
    out: &mut [u8],
) -> Result<ConvertStats> {
    let t = Copied {
        name: &source.name,
        source,
        dtype: to,
    };
    SCRATCH.with_borrow_mut(|scratch| fill_window(&t, files, e0, e1, out, scratch))
}

/// Cuts elements `[start, n)` into windows of at most `per` elements (at least
/// one), in order: the unit of work of every streaming pass over a tensor.
pub fn windows(start: u64, n: u64, per: u64) -> impl Iterator<Item = (u64, u64)> {
    let per = per.max(1);
    let mut e0 = start;
    std::iter::from_fn(move || {
        (e0 < n).then(|| {
            let e1 = n.min(e0.saturating_add(per));
            let w = (e0, e1);
            e0 = e1;
            w
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_range_once_in_order() {
        let w: Vec<_> = windows(0, 10, 4).collect();
        assert_eq!(w, [(0, 4), (4, 8), (8, 10)]);
        let w: Vec<_> = windows(3, 5, 100).collect();
        assert_eq!(w, [(3, 5)]);
        assert_eq!(windows(5, 5, 4).count(), 0);
        // A zero window size still makes progress.
        assert_eq!(windows(0, 2, 0).count(), 2);
    }
}
