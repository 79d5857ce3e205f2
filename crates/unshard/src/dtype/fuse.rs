//! The fuse itself, in float32, as peft's `merge_and_unload` computes it.
//!
//! peft (`tuners/lora/layer.py`, `variants.py`, `dora.py`) does, per adapted layer:
//! `delta = transpose(B @ A, fan_in_fan_out) * scale` (float32 products, then one
//! multiply by the scale), `W += delta`; for DoRA, `norm = ||W + delta||` over the
//! input dimension (one norm per output channel) and `W' = (m / norm) * (W + delta)`.
//! Embeddings use `transpose(B @ A, True)`. The same steps are taken here, in the same
//! order, so results differ from peft's only by the summation order of the matrix
//! product (matrixmultiply's blocked kernel instead of torch's) and of the norm.
//!
//! Memory: the weight being fused (float32) plus, per thread, one tile of the
//! update (256 KiB); the adapter's A and B are small (rank r).

use rayon::prelude::*;

/// How the update `B @ A` lies over the stored weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `nn.Linear`: the weight is `[out, in]`, A is `[r, in]`, B is `[out, r]`.
    Linear,
    /// GPT-2 `Conv1D` (`fan_in_fan_out`): the weight is `[in, out]`, A is `[r, in]`,
    /// B is `[out, r]`; the update is `(B @ A)^T`.
    FanInFanOut,
    /// `nn.Embedding`: the weight is `[num_embeddings, dim]`, A is
    /// `[r, num_embeddings]`, B is `[dim, r]`; the update is `(B @ A)^T`.
    Embedding,
}

impl Layout {
    /// Whether the update is `(B @ A)^T`.
    pub fn transposed(self) -> bool {
        !matches!(self, Layout::Linear)
    }

    /// The expected shapes of A and B for a stored weight `[rows, cols]` and rank `r`.
    pub fn factor_shapes(self, rows: u64, cols: u64, r: u64) -> ([u64; 2], [u64; 2]) {
        if self.transposed() {
            ([r, rows], [cols, r])
        } else {
            ([r, cols], [rows, r])
        }
    }

    /// Output channels (the length of a DoRA magnitude) of a stored weight `[rows, cols]`.
    pub fn out_channels(self, rows: u64, cols: u64) -> u64 {
        if self.transposed() {
            cols
        } else {
            rows
        }
    }
}

/// Elements of the update computed at a time.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub const BLOCK_ELEMS: usize = 1 << 20;

/// One adapted weight's factors.
#[derive(Clone, Copy, Debug)]
pub struct Factors<'a> {
    /// How the update lies over the weight.
    pub layout: Layout,
    /// `[r, ..]`, row-major.
    pub a: &'a [f32],
    /// `[.., r]`, row-major.
    pub b: &'a [f32],
    /// `r`: rows of A, columns of B.
    pub rank: usize,
    /// The scale as peft holds it (a Python float), applied in float32.
    pub scale: f64,
    /// DoRA's magnitude, one per output channel.
    pub magnitude: Option<&'a [f32]>,
}

/// Fuses the factors into `w` (`[rows, cols]`, row-major) in place. The caller has
/// checked the shapes (see [`Layout::factor_shapes`]); a mismatch here is a bug and
/// only fails the debug assertions.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn fuse(w: &mut [f32], rows: usize, cols: usize, f: &Factors<'_>) {
    debug_assert_eq!(w.len(), rows * cols);
    if rows == 0 || cols == 0 {
        return;
    }
    // Blocks of rows are independent: each thread computes its block of the update
    // into its own tiles and adds them (one tile buffer per thread).
    let block_rows = (BLOCK_ELEMS / cols).clamp(1, rows);
    w.par_chunks_mut(block_rows * cols)
        .enumerate()
        .for_each_init(Vec::new, |delta, (i, wblock)| {
            add_update(wblock, rows, cols, i * block_rows, f, delta);
        });
    if let Some(m) = f.magnitude {
        apply_dora(w, rows, cols, f.layout, m);
    }
}

/// Fuses the factors into some rows of a weight `[rows, cols]`: `w` holds rows
/// `[row0, row0 + w.len() / cols)`, and becomes exactly what [`fuse`] makes of
/// them (each element's update is the same dot product over the rank, whichever
/// rows are computed with it). `delta` is scratch (one tile, grown once). A
/// DoRA update of a transposed layout rescales columns, whose norms run over every
/// row: the caller passes them as `column_factors` ([`dora_column_factors`]).
pub fn fuse_rows(
    w: &mut [f32],
    rows: usize,
    cols: usize,
    row0: usize,
    f: &Factors<'_>,
    column_factors: Option<&[f32]>,
    delta: &mut Vec<f32>,
) {
    if cols == 0 || w.is_empty() {
        return;
    }
    add_update(w, rows, cols, row0, f, delta);
    match (f.magnitude, f.layout.transposed()) {
        (Some(m), false) => {
            let n = w.len() / cols;
            dora_rows(w, cols, &m[row0.min(m.len())..(row0 + n).min(m.len())]);
        }
        (Some(_), true) => {
            if let Some(factors) = column_factors {
                scale_columns(w, cols, factors);
            }
        }
        (None, _) => {}
    }
}

/// `w += scale * update` for rows `[row0, row0 + w.len() / cols)`.
fn add_update(
    w: &mut [f32],
    rows: usize,
    cols: usize,
    row0: usize,
    f: &Factors<'_>,
    delta: &mut Vec<f32>,
) {
    debug_assert_eq!(
        f.a.len(),
        f.rank * if f.layout.transposed() { rows } else { cols }
    );
    debug_assert_eq!(
        f.b.len(),
        f.rank * if f.layout.transposed() { cols } else { rows }
    );
    // torch multiplies a float32 tensor by a Python float in float32.
    let scale = f.scale as f32;
    let n_rows = w.len() / cols;
    // The update is computed a tile at a time and added while the tile is still in
    // the core's cache (each element's sum over the rank is the same whatever the
    // tile: the rank is far below the kernel's depth block).
    let tile_cols = cols.min(TILE_COLS);
    let tile_rows = (TILE_ELEMS / tile_cols).max(1);
    // Grown once and reused: sgemm overwrites what it uses (beta = 0).
    if delta.len() < tile_rows * tile_cols {
        delta.resize(tile_rows * tile_cols, 0f32);
    }
    for r in (0..n_rows).step_by(tile_rows) {
        let nr = tile_rows.min(n_rows - r);
        for c in (0..cols).step_by(tile_cols) {
            let nc = tile_cols.min(cols - c);
            let tile = &mut delta[..nr * nc];
            product_tile(f, rows, cols, (row0 + r, nr), (c, nc), tile);
            for (i, d) in tile.chunks_exact(nc).enumerate() {
                let at = (r + i) * cols + c;
                for (wv, d) in w[at..at + nc].iter_mut().zip(d) {
                    // Two roundings, as peft: delta = (B@A) * scale, then W += delta.
                    *wv += *d * scale;
                }
            }
        }
    }
}

/// Elements of the update computed at a time (256 KiB of float32, which stays in a
/// core's cache between the product and the add), and the widest tile.
const TILE_ELEMS: usize = 1 << 16;
const TILE_COLS: usize = 2048;

/// A tile of the unscaled update, in the stored weight's layout: rows
/// `[row0, row0 + n_rows)` by columns `[col0, col0 + n_cols)`, into `out` (row-major,
/// `n_cols` wide).
fn product_tile(
    f: &Factors<'_>,
    rows: usize,
    cols: usize,
    (row0, n_rows): (usize, usize),
    (col0, n_cols): (usize, usize),
    out: &mut [f32],
) {
    let r = f.rank;
    if r == 0 || n_rows == 0 || n_cols == 0 {
        out.fill(0.0);
        return;
    }
    // out[i][j] = sum_k lhs[i][k] * rhs[k][j], with strides in elements.
    let (lhs, rsa, csa, rhs, rsb, csb) = if f.layout.transposed() {
        // out = A^T[row0.., :] @ B^T[:, col0..]: lhs(i, k) = A[k][row0 + i],
        // rhs(k, j) = B[col0 + j][k].
        (
            &f.a[row0.min(f.a.len())..],
            1isize,
            rows as isize,
            &f.b[(col0 * r).min(f.b.len())..],
            1isize,
            r as isize,
        )
    } else {
        // out = B[row0.., :] @ A[:, col0..]: lhs(i, k) = B[row0 + i][k],
        // rhs(k, j) = A[k][col0 + j].
        (
            &f.b[(row0 * r).min(f.b.len())..],
            r as isize,
            1isize,
            &f.a[col0.min(f.a.len())..],
            cols as isize,
            1isize,
        )
    };
    // Bounds the last element each operand is read at, so the unsafe call below
    // stays inside the slices whatever the caller passed.
    let lhs_last = (n_rows - 1) as isize * rsa + (r - 1) as isize * csa;
    let rhs_last = (r - 1) as isize * rsb + (n_cols - 1) as isize * csb;
    assert!(
        (lhs_last as usize) < lhs.len()
            && (rhs_last as usize) < rhs.len()
            && out.len() >= n_rows * n_cols,
        "lora factors do not fit the weight"
    );
    // SAFETY: the assert above proves every element sgemm reads (lhs at
    // i*rsa + k*csa, rhs at k*rsb + j*csb for i < n_rows, k < r, j < n_cols) and
    // writes (out at i*n_cols + j) lies inside its slice; the slices do not overlap
    // (out is a separate buffer), and beta = 0 means out is not read.
    unsafe {
        matrixmultiply::sgemm(
            n_rows,
            r,
            n_cols,
            1.0,
            lhs.as_ptr(),
            rsa,
            csa,
            rhs.as_ptr(),
            rsb,
            csb,
            0.0,
            out.as_mut_ptr(),
            n_cols as isize,
            1,
        );
    }
}

/// `W' = m / ||W|| * W` per output channel, `W` already holding `W + delta`. The norm
/// is summed in float64 and rounded once to float32 (torch's float32 reduction gives
/// the correctly rounded value or one next to it).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
fn apply_dora(w: &mut [f32], rows: usize, cols: usize, layout: Layout, m: &[f32]) {
    if layout.transposed() {
        // Output channels are columns.
        let mut sums = vec![0f64; cols];
        dora_column_sums(&mut sums, w);
        scale_columns(w, cols, &dora_column_factors(&sums, m));
    } else {
        dora_rows(&mut w[..rows * cols], cols, m);
    }
}

/// Adds the squares of `w`'s rows (fused values, `sums.len()` columns) to `sums`, a
/// row at a time in order: the column norms of a transposed DoRA update, summed the
/// same way whether the rows come at once or a block at a time.
pub fn dora_column_sums(sums: &mut [f64], w: &[f32]) {
    if sums.is_empty() {
        return;
    }
    for row in w.chunks_exact(sums.len()) {
        for (s, &v) in sums.iter_mut().zip(row) {
            *s += (v as f64) * (v as f64);
        }
    }
}

/// `m / ||column||` from the column sums of [`dora_column_sums`].
pub fn dora_column_factors(sums: &[f64], m: &[f32]) -> Vec<f32> {
    sums.iter()
        .zip(m)
        .map(|(&s, &mag)| mag / (s.sqrt() as f32))
        .collect()
}

fn scale_columns(w: &mut [f32], cols: usize, factors: &[f32]) {
    for row in w.chunks_exact_mut(cols) {
        for (v, &f) in row.iter_mut().zip(factors) {
            *v *= f;
        }
    }
}

/// Each row of `w` rescaled to its magnitude in `m` (a linear layout's output
/// channels are rows).
fn dora_rows(w: &mut [f32], cols: usize, m: &[f32]) {
    for (row, &mag) in w.chunks_exact_mut(cols).zip(m) {
        let s: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let factor = mag / (s.sqrt() as f32);
        for v in row {
            *v *= factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// W = 0, r = 1: the update is the outer product, in the right orientation.
    #[test]
    fn orientation_follows_the_layout() {
        let a = [1.0f32, 2.0, 3.0]; // [1, 3]
        let b = [10.0f32, 20.0]; // [2, 1]
        let f = |layout| Factors {
            layout,
            a: &a,
            b: &b,
            rank: 1,
            scale: 0.5,
            magnitude: None,
        };
        // Linear: W [out=2, in=3], delta[o][i] = b[o] * a[i] * 0.5.
        let mut w = vec![0f32; 6];
        fuse(&mut w, 2, 3, &f(Layout::Linear));
        assert_eq!(w, [5.0, 10.0, 15.0, 10.0, 20.0, 30.0]);
        // Conv1D: W [in=3, out=2], the transpose.
        let mut w = vec![0f32; 6];
        fuse(&mut w, 3, 2, &f(Layout::FanInFanOut));
        assert_eq!(w, [5.0, 10.0, 10.0, 20.0, 15.0, 30.0]);
    }

    #[test]
    fn dora_rescales_each_output_channel_to_its_magnitude() {
        let a = [0.0f32, 0.0]; // r = 1, no update
        let b = [0.0f32, 0.0];
        let m = [1.0f32, 10.0];
        let mut w = vec![3.0f32, 4.0, 0.0, 2.0]; // rows (3,4) and (0,2)
        fuse(
            &mut w,
            2,
            2,
            &Factors {
                layout: Layout::Linear,
                a: &a,
                b: &b,
                rank: 1,
                scale: 1.0,
                magnitude: Some(&m),
            },
        );
        assert_eq!(w, [0.6, 0.8, 0.0, 10.0]);
    }

    /// Tiles of rows and columns, edges included, put every element of the update
    /// at its place: small integers make every product and sum exact, so the tiled
    /// fuse must equal a plain triple loop in any layout.
    #[test]
    fn tiles_cover_every_row_and_column() {
        let (rows, cols, r) = (150usize, 2 * TILE_COLS + 77, 3usize);
        let int = |i: usize, m: usize| ((i * 7919 + m) % 9) as f32 - 4.0;
        for layout in [Layout::Linear, Layout::FanInFanOut, Layout::Embedding] {
            let (sa, sb) = layout.factor_shapes(rows as u64, cols as u64, r as u64);
            let a: Vec<f32> = (0..(sa[0] * sa[1]) as usize).map(|i| int(i, 1)).collect();
            let b: Vec<f32> = (0..(sb[0] * sb[1]) as usize).map(|i| int(i, 2)).collect();
            let w0: Vec<f32> = (0..rows * cols).map(|i| int(i, 3)).collect();
            let mut w = w0.clone();
            let f = Factors {
                layout,
                a: &a,
                b: &b,
                rank: r,
                scale: 0.5,
                magnitude: None,
            };
            fuse(&mut w, rows, cols, &f);
            for i in 0..rows {
                for j in 0..cols {
                    let d: f32 = (0..r)
                        .map(|k| match layout {
                            Layout::Linear => b[i * r + k] * a[k * cols + j],
                            _ => a[k * rows + i] * b[j * r + k],
                        })
                        .sum();
                    assert_eq!(
                        w[i * cols + j],
                        w0[i * cols + j] + d * 0.5,
                        "{layout:?} [{i}][{j}]"
                    );
                }
            }
        }
    }

    #[test]
    fn blocks_cover_every_row() {
        // More rows than one block holds, so the update is computed in pieces.
        let cols = 3;
        let rows = BLOCK_ELEMS / cols + 5;
        let a = vec![1.0f32; cols];
        let b: Vec<f32> = (0..rows).map(|i| i as f32).collect();
        let mut w = vec![0f32; rows * cols];
        fuse(
            &mut w,
            rows,
            cols,
            &Factors {
                layout: Layout::Linear,
                a: &a,
                b: &b,
                rank: 1,
                scale: 1.0,
                magnitude: None,
            },
        );
        assert_eq!(w[(rows - 1) * cols], (rows - 1) as f32);
        assert_eq!(w[7 * cols + 2], 7.0);
    }
}
