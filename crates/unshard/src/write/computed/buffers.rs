//! The float32 buffers computed rows are evaluated in, kept per worker thread and
//! handed from batch to batch: a block evaluates the same few sizes again and again,
//! and a fresh buffer would cost an allocation and the kernel zeroing its pages
//! every time. Also the little-endian views the kernels read and readers fill.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Buffers a thread keeps for reuse (each at most a batch, or a fuse's factor).
const KEPT: usize = 8;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// `n` float32 values in a reused buffer, returned to the thread's pool on drop.
/// The values are whatever the buffer last held: every user overwrites all of them.
pub(super) struct Buf {
    v: Vec<f32>,
    n: usize,
}

impl Buf {
    pub(super) fn new(n: usize) -> Buf {
        let mut v = POOL.with_borrow_mut(|p| p.pop()).unwrap_or_default();
        // Kept at its longest, so that it is zeroed only when it grows.
        if v.len() < n {
            v.resize(n, 0.0);
        }
        Buf { v, n }
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v[..self.n]
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v[..self.n]
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        // A thread that is exiting has no pool any more: the buffer is just freed.
        let _ = POOL.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < KEPT {
                    p.push(v);
                }
            }
        });
    }
}

/// `(rows, elements per row)` of a value of `shape`: a scalar is one row of one.
pub(super) fn rows_of(shape: &[u64]) -> (u64, u64) {
    match shape.split_first() {
        None => (1, 1),
        Some((&rows, rest)) => (rows, rest.iter().product()),
    }
}

/// The values as little-endian bytes (the kernels' input), without a copy on a
/// little-endian machine.
pub(super) fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: an f32 is 4 bytes without padding and any byte may be read as a
        // u8; the slice borrows `v` for its whole life and covers exactly its bytes.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        })
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The bytes of `v`, for a reader to fill with little-endian float32s (then
/// [`from_le`]).
pub(super) fn bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: an f32 is 4 bytes without padding and every bit pattern is a valid
    // f32, so any bytes written through the slice leave valid values; the slice
    // borrows `v` mutably for its whole life and covers exactly its bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Values filled as little-endian bytes, in the machine's order.
pub(super) fn from_le(v: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in v {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
}
