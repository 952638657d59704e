//! The CPU kernels of `Tensor::mse` (`NnOps::mse_forward` / `_backward`), generic over f32 and
//! f64: the forward sums `(x − t)²` in blocks of [`SUM_BLOCK`] elements in parallel (each block in
//! eight lanes), adds the block sums in order and divides by the count, so the result does not
//! depend on the number of threads; the backward is one elementwise pass,
//! `dx = (2/N)·g·(x − t)`.
//!
//! Composed from ops, the loss was a subtraction, a product, a sum over each axis and a scale
//! forward, and as many backward; here it is one pass each way.

use super::reduce::{SUM_BLOCK, lane_sum};
use super::{MAP_CHUNK, write_chunks};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `mean((x − t)²)` over equal-length `x` and `t` (at least one element).
pub(super) fn forward<T: Float + Send + Sync>(x: &[T], t: &[T]) -> T {
    let block_sum = |(x, t): (&[T], &[T])| {
        lane_sum(x, t, t, |a, b, _| {
            let d = a - b;
            d * d
        })
    };
    let sums: Vec<T> = x
        .par_chunks(SUM_BLOCK)
        .zip(t.par_chunks(SUM_BLOCK))
        .map(block_sum)
        .collect();
    let total = sums.into_iter().fold(T::zero(), |s, v| s + v);
    total / T::from(x.len()).unwrap_or_else(T::nan)
}

/// `dx_i = (2/N)·g·(x_i − t_i)` for the upstream gradient `g` of the mean.
pub(super) fn backward<T: Float + Send + Sync>(g: T, x: &[T], t: &[T]) -> Vec<T> {
    let scale = (g + g) / T::from(x.len()).unwrap_or_else(T::nan);
    // SAFETY: each chunk of the output is written element by element below
    unsafe {
        write_chunks(x.len(), MAP_CHUNK, |c, out: &mut [MaybeUninit<T>]| {
            let at = c * MAP_CHUNK;
            for ((o, &a), &b) in out.iter_mut().zip(&x[at..]).zip(&t[at..]) {
                o.write(scale * (a - b));
            }
        })
    }
}
