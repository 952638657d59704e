//! The CPU kernels of `Tensor::layer_norm` (`Backend::layer_norm_forward` / `_backward`), generic
//! over f32 and f64: rows in parallel, each row's statistics in two passes over it.
//!
//! Composed from elementwise ops, a layer norm over `[rows, dim]` took eight forward ops and
//! about twenty backward ones, each a pass over the whole tensor and a buffer; here forward is
//! one pass for the statistics and one for the output, backward one pass per row for `dx` and
//! one walk over the rows for `dgamma` and `dbeta`.

use super::{LayerNormDims, write_chunks, zeroed};
use num_traits::Float;
use std::mem::MaybeUninit;

/// `(mean_r, rstd_r)` of row `x` (two passes: the mean, then the centred squares).
fn row_stats<T: Float>(x: &[T], eps: T) -> (T, T) {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    let mean = x.iter().fold(T::zero(), |s, &v| s + v) / n;
    let var = x
        .iter()
        .fold(T::zero(), |s, &v| s + (v - mean) * (v - mean))
        / n;
    (mean, T::one() / (var + eps).sqrt())
}

/// `(y, mean, rstd)`; see `Backend::layer_norm_forward`. Lengths were checked by the caller.
pub(crate) fn forward<T: Float + Send + Sync>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    d: LayerNormDims,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let dim = d.dim;
    let eps = T::from(d.eps).unwrap_or_else(T::zero);
    let row = |r: usize| &x[r * dim..(r + 1) * dim];
    let stats: Vec<(T, T)> = super::tabulate(d.rows, |r| row_stats(row(r), eps));
    let fill = |r: usize, out: &mut [MaybeUninit<T>]| {
        let (mean, rstd) = stats[r];
        for (((o, &v), &g), &b) in out.iter_mut().zip(row(r)).zip(gamma).zip(beta) {
            o.write((v - mean) * rstd * g + b);
        }
    };
    // SAFETY: chunk r is row r of the output, and `fill` writes all `dim` of its elements.
    let y = unsafe { write_chunks(d.rows * dim, dim, fill) };
    let mean = stats.iter().map(|s| s.0).collect();
    let rstd = stats.iter().map(|s| s.1).collect();
    (y, mean, rstd)
}

/// `(dx, dgamma, dbeta)`; see `Backend::layer_norm_backward`. Lengths were checked by the caller.
pub(crate) fn backward<T: Float + Send + Sync>(
    g: &[T],
    x: &[T],
    gamma: &[T],
    (mean, rstd): (&[T], &[T]),
    d: LayerNormDims,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let dim = d.dim;
    let n = T::from(dim).unwrap_or_else(T::one);
    let fill = |r: usize, out: &mut [MaybeUninit<T>]| {
        let (gr, xr) = (&g[r * dim..(r + 1) * dim], &x[r * dim..(r + 1) * dim]);
        let (m, s) = (mean[r], rstd[r]);
        // mean_j(h) and mean_j(h·x̂), h = g·gamma
        let (mut sh, mut shx) = (T::zero(), T::zero());
        for ((&gv, &xv), &w) in gr.iter().zip(xr).zip(gamma) {
            let h = gv * w;
            sh = sh + h;
            shx = shx + h * (xv - m) * s;
        }
        let (sh, shx) = (sh / n, shx / n);
        for (((o, &gv), &xv), &w) in out.iter_mut().zip(gr).zip(xr).zip(gamma) {
            o.write(s * (gv * w - sh - (xv - m) * s * shx));
        }
    };
    // SAFETY: chunk r is row r of dx, and `fill` writes all `dim` of its elements.
    let dx = unsafe { write_chunks(d.rows * dim, dim, fill) };
    // the parameters' gradients: rows folded in order into one row of sums (contiguous reads)
    let (mut dgamma, mut dbeta) = (zeroed::<T>(dim), zeroed::<T>(dim));
    for r in 0..d.rows {
        let (gr, xr) = (&g[r * dim..(r + 1) * dim], &x[r * dim..(r + 1) * dim]);
        let (m, s) = (mean[r], rstd[r]);
        for (((dg, db), &gv), &xv) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(gr).zip(xr) {
            *dg = *dg + gv * (xv - m) * s;
            *db = *db + gv;
        }
    }
    (dx, dgamma, dbeta)
}
