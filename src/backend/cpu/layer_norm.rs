//! The CPU kernels of `Tensor::layer_norm` and `Tensor::rms_norm` (`NnOps::layer_norm_forward` /
//! `_backward`, RMSNorm when `LayerNormDims::centered` is false), generic over f32 and f64: each
//! row's statistics in two passes over it (one for RMSNorm).
//!
//! Each row's sums run in eight lanes ([`lane_sum`]), so they vectorise; groups of rows run in
//! parallel. Backward adds the parameters' gradients up per block of rows while it writes those
//! rows of `dx`, then adds the blocks' sums in order (blocks of a fixed size: the same bits on
//! any number of threads).
//!
//! Composed from elementwise ops, a layer norm over `[rows, dim]` took eight forward ops and
//! about twenty backward ones, each a pass over the whole tensor and a buffer; here forward is
//! one pass for the statistics and one for the output (into a buffer that is not zeroed first),
//! backward one pass over the rows for `dx`, `dgamma` and `dbeta` together.

use super::reduce::lane_sum;
use super::{LayerNormDims, MAP_CHUNK, PAR_MIN, buffer_pool, zeroed};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `(mean_r, rstd_r)` of row `x` (two passes: the mean, then the centred squares); uncentred
/// (RMSNorm), the mean is 0 and one pass takes the mean square.
fn row_stats<T: Float>(x: &[T], eps: T, centered: bool) -> (T, T) {
    let n = T::from(x.len()).unwrap_or_else(T::one);
    let mean = if centered {
        lane_sum(x, x, x, |v, _, _| v) / n
    } else {
        T::zero()
    };
    let var = lane_sum(x, x, x, |v, _, _| (v - mean) * (v - mean)) / n;
    (mean, T::one() / (var + eps).sqrt())
}

/// Rows per parallel task: about [`MAP_CHUNK`] elements.
fn rows_per_task(dim: usize) -> usize {
    (MAP_CHUNK / dim.max(1)).max(1)
}

/// `(y, mean, rstd)`; see `NnOps::layer_norm_forward` (`beta` unread when `d.centered` is false).
/// Lengths were checked by the caller.
pub(crate) fn forward<T: Float + Send + Sync>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    d: LayerNormDims,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let dim = d.dim;
    let eps = T::from(d.eps).unwrap_or_else(T::zero);
    let n = d.rows * dim;
    // `y` is not zeroed first: every element is written below (a third of the pass's memory
    // traffic saved); the statistics are one value per row
    let mut y: Vec<T> = buffer_pool::take(n).unwrap_or_else(|_| Vec::with_capacity(n));
    let (mut mean, mut rstd) = (zeroed(d.rows), zeroed(d.rows));
    // one group of rows: statistics, then the normalised rows
    let group = |first: usize, y: &mut [MaybeUninit<T>], mean: &mut [T], rstd: &mut [T]| {
        for (r, ((y_r, m), s)) in y
            .chunks_mut(dim)
            .zip(mean.iter_mut())
            .zip(rstd.iter_mut())
            .enumerate()
        {
            let x_r = &x[(first + r) * dim..(first + r + 1) * dim];
            (*m, *s) = row_stats(x_r, eps, d.centered);
            if d.centered {
                for (((o, &v), &g), &b) in y_r.iter_mut().zip(x_r).zip(gamma).zip(beta) {
                    o.write((v - *m) * *s * g + b);
                }
            } else {
                for ((o, &v), &g) in y_r.iter_mut().zip(x_r).zip(gamma) {
                    o.write(v * *s * g);
                }
            }
        }
    };
    let out = &mut y.spare_capacity_mut()[..n];
    if n >= PAR_MIN {
        let per = rows_per_task(dim);
        out.par_chunks_mut(per * dim)
            .zip(mean.par_chunks_mut(per))
            .zip(rstd.par_chunks_mut(per))
            .enumerate()
            .for_each(|(t, ((y, m), s))| group(t * per, y, m, s));
    } else {
        group(0, out, &mut mean, &mut rstd);
    }
    // SAFETY: the groups covered all `rows` rows, and each wrote all `dim` elements of its rows.
    unsafe { y.set_len(n) };
    (y, mean, rstd)
}

/// `(dx, dgamma, dbeta)`, `pending` added into `dx` (`pending + dx`) when given; see
/// `NnOps::layer_norm_backward`. Lengths were checked by the caller.
pub(crate) fn backward<T: Float + Send + Sync>(
    g: &[T],
    x: &[T],
    gamma: &[T],
    (mean, rstd): (&[T], &[T]),
    pending: Option<&[T]>,
    d: LayerNormDims,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let dim = d.dim;
    let n = T::from(dim).unwrap_or_else(T::one);
    // one row: its `dx` into `out`, and its terms of dgamma and dbeta added into `dg`, `db`
    let row = |r: usize, out: &mut [MaybeUninit<T>], dg: &mut [T], db: &mut [T]| {
        let (gr, xr) = (&g[r * dim..(r + 1) * dim], &x[r * dim..(r + 1) * dim]);
        let (m, s) = (mean[r], rstd[r]);
        // mean_j(h) (layer norm only: RMSNorm subtracts no mean) and mean_j(h·x̂), h = g·gamma
        let sh = if d.centered {
            lane_sum(gr, gamma, gamma, |gv, w, _| gv * w) / n
        } else {
            T::zero()
        };
        let shx = lane_sum(gr, gamma, xr, |gv, w, xv| gv * w * (xv - m) * s) / n;
        let pr = pending.map(|p| &p[r * dim..(r + 1) * dim]);
        for (j, (((o, &gv), &xv), &w)) in out.iter_mut().zip(gr).zip(xr).zip(gamma).enumerate() {
            let v = s * (gv * w - sh - (xv - m) * s * shx);
            o.write(pr.map_or(v, |p| p[j] + v));
        }
        for (((dg, db), &gv), &xv) in dg.iter_mut().zip(db.iter_mut()).zip(gr).zip(xr) {
            *dg = *dg + gv * (xv - m) * s;
            *db = *db + gv;
        }
    };
    // Rows in blocks of a fixed size (not a function of the threads, so the sums are the same
    // on any number of them): each block writes its rows of dx and its own partial sums of
    // dgamma and dbeta while the rows are in cache, and the partial sums are then added in block
    // order. One pass over g and x, where a separate walk down the columns read both again.
    let per = rows_per_task(dim);
    let blocks = d.rows.div_ceil(per);
    let len = d.rows * dim;
    let mut dx: Vec<T> = buffer_pool::take(len).unwrap_or_else(|_| Vec::with_capacity(len));
    let mut partial = zeroed::<T>(blocks * 2 * dim);
    let block = |b: usize, out: &mut [MaybeUninit<T>], sums: &mut [T]| {
        let (dg, db) = sums.split_at_mut(dim);
        for (i, out) in out.chunks_mut(dim).enumerate() {
            row(b * per + i, out, dg, db);
        }
    };
    let out = &mut dx.spare_capacity_mut()[..len];
    if len >= PAR_MIN {
        out.par_chunks_mut(per * dim)
            .zip(partial.par_chunks_mut(2 * dim))
            .enumerate()
            .for_each(|(b, (out, sums))| block(b, out, sums));
    } else {
        for (b, (out, sums)) in out
            .chunks_mut(per * dim)
            .zip(partial.chunks_mut(2 * dim))
            .enumerate()
        {
            block(b, out, sums);
        }
    }
    // SAFETY: the blocks covered all rows, and `row` wrote all `dim` elements of each.
    unsafe { dx.set_len(len) };
    let (mut dgamma, mut dbeta) = (zeroed::<T>(dim), zeroed::<T>(dim));
    for sums in partial.chunks(2 * dim) {
        let (dg, db) = sums.split_at(dim);
        dgamma.iter_mut().zip(dg).for_each(|(a, &v)| *a = *a + v);
        dbeta.iter_mut().zip(db).for_each(|(a, &v)| *a = *a + v);
    }
    (dx, dgamma, dbeta)
}
