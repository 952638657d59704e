//! The CPU kernels of `Tensor::cross_entropy_per_row` (`NnOps::cross_entropy_forward` /
//! `_backward`), generic over f32 and f64: rows in parallel, each row's log-sum-exp in two
//! passes over it (the maximum, then the shifted exponentials), each in eight lanes.
//!
//! Composed from ops, the loss took seven forward ops (max, subtract, exp, sum, log, subtract,
//! gather) and as many backward; here it is one pass per row each way, and the `[rows, classes]`
//! log-probabilities are never stored (backward recomputes `e^(x − lse)` from the logits).

use super::reduce::{fold_lanes, lane_sum};
use super::{MAP_CHUNK, PAR_MIN, exp_f32, write_chunks};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `e^x`, through the vectorisable [`exp_f32`] for f32 (the size test is resolved at compile
/// time for each `T`).
#[inline(always)]
fn exp_any<T: Float>(x: T) -> T {
    if std::mem::size_of::<T>() == 4 {
        T::from(exp_f32(x.to_f32().unwrap_or(f32::NAN))).unwrap_or_else(T::nan)
    } else {
        x.exp()
    }
}

/// `(loss [rows], lse [rows])` with `loss_r = lse_r − x_{r, t_r}`; targets were checked to lie
/// in `0..classes` by the caller.
pub(crate) fn forward<T: Float + Send + Sync>(
    x: &[T],
    targets: &[i32],
    rows: usize,
    classes: usize,
) -> (Vec<T>, Vec<T>) {
    let one_row = |r: usize| {
        let row = &x[r * classes..(r + 1) * classes];
        // in lanes, so that the loops vectorise (a NaN, once in a lane, stays the maximum)
        let m = fold_lanes(row, T::neg_infinity(), |a, b| {
            if b > a || b.is_nan() { b } else { a }
        });
        // a NaN row stays NaN; a row of −∞ only has no weight anywhere: its lse is −∞
        let lse = if m.is_nan() || m == T::neg_infinity() {
            m
        } else {
            m + lane_sum(row, row, row, |v, _, _| exp_any(v - m)).ln()
        };
        (lse - row[targets[r] as usize], lse)
    };
    // in parallel by the number of logits, not of rows (a few hundred rows of many classes)
    let per_row: Vec<(T, T)> = if rows * classes >= PAR_MIN {
        (0..rows)
            .into_par_iter()
            .with_min_len((MAP_CHUNK / classes.max(1)).max(1))
            .map(one_row)
            .collect()
    } else {
        (0..rows).map(one_row).collect()
    };
    (
        per_row.iter().map(|p| p.0).collect(),
        per_row.iter().map(|p| p.1).collect(),
    )
}

/// `dlogits [rows, classes]`, `g_r·(e^(x_rc − lse_r) − [c = t_r])`.
pub(crate) fn backward<T: Float + Send + Sync>(
    g: &[T],
    x: &[T],
    targets: &[i32],
    lse: &[T],
    classes: usize,
) -> Vec<T> {
    let fill = |r: usize, out: &mut [MaybeUninit<T>]| {
        let row = &x[r * classes..(r + 1) * classes];
        let (gr, l, t) = (g[r], lse[r], targets[r] as usize);
        for (c, (o, &v)) in out.iter_mut().zip(row).enumerate() {
            let onehot = if c == t { T::one() } else { T::zero() };
            o.write(gr * (exp_any(v - l) - onehot));
        }
    };
    // SAFETY: chunk r is row r of the output, and `fill` writes all `classes` of its elements.
    unsafe { write_chunks(g.len() * classes, classes, fill) }
}
