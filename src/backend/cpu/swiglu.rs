//! The CPU kernels of `Tensor::swiglu` (`NnOps::swiglu_forward` / `_backward`), generic over f32
//! and f64: each row `[a | b]` of the input is read once, and the SiLU's value and slope come
//! from one exponential (in f32 the vectorisable `exp` of `fast_math.rs`, compiled for AVX2
//! where the processor has it). Groups of rows run in parallel.
//!
//! Forward writes `silu(a)·b`; backward recomputes `σ(a)` from the kept input instead of
//! keeping `silu(a)` and its slope between the passes, and writes both halves of `dx` in one
//! pass (`[g·b·silu'(a) | g·silu(a)]`), where the composed op took a slice, a SiLU, a product
//! and, backward, two products and a concatenation, each a pass and a buffer.

use super::fast_math::{has_avx2, silu_and_grad_f32, with_avx2};
use super::{MAP_CHUNK, write_chunks};
use crate::backend::SwiGluDims;
use num_traits::Float;
use std::mem::MaybeUninit;

/// A float type with `(silu(x), silu'(x))` from one exponential.
pub(super) trait SiluFloat: Float + Send + Sync {
    /// `(x·σ(x), σ(x)·(1 + x·(1 − σ(x))))`.
    fn silu_and_slope(x: Self) -> (Self, Self);
}

impl SiluFloat for f32 {
    #[inline(always)]
    fn silu_and_slope(x: f32) -> (f32, f32) {
        silu_and_grad_f32(x)
    }
}

impl SiluFloat for f64 {
    #[inline(always)]
    fn silu_and_slope(x: f64) -> (f64, f64) {
        let s = 1.0 / (1.0 + (-x).exp());
        (x * s, s * (1.0 + x * (1.0 - s)))
    }
}

/// One output row: `y_j = silu(a_j)·b_j`.
#[inline(always)]
fn forward_row<T: SiluFloat>(a: &[T], b: &[T], y: &mut [MaybeUninit<T>]) {
    for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
        y.write(T::silu_and_slope(a).0 * b);
    }
}

/// One gradient row `[da | db]` from the input row `[a | b]` and the upstream row `g`.
#[inline(always)]
fn backward_row<T: SiluFloat>(a: &[T], b: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
    let (da, db) = dx.split_at_mut(a.len());
    for ((((da, db), &a), &b), &g) in da.iter_mut().zip(db).zip(a).zip(b).zip(g) {
        let (value, slope) = T::silu_and_slope(a);
        da.write(g * b * slope);
        db.write(g * value);
    }
}

/// `y [rows, half]`; see `NnOps::swiglu_forward`. Lengths were checked by the caller.
pub(crate) fn forward<T: SiluFloat>(x: &[T], d: SwiGluDims) -> Vec<T> {
    let (h, avx2) = (d.half, has_avx2());
    let rows_per_task = (MAP_CHUNK / (2 * h)).max(1);
    // SAFETY: each chunk is `rows_per_task` whole output rows, all written by `forward_row`.
    unsafe {
        write_chunks(d.rows * h, rows_per_task * h, |task, y| {
            with_avx2(avx2, || {
                let first = task * rows_per_task;
                for (r, y) in y.chunks_mut(h).enumerate() {
                    let row = &x[(first + r) * 2 * h..(first + r + 1) * 2 * h];
                    forward_row(&row[..h], &row[h..], y);
                }
            })
        })
    }
}

/// `dx [rows, 2·half]`; see `NnOps::swiglu_backward`. Lengths were checked by the caller.
pub(crate) fn backward<T: SiluFloat>(x: &[T], g: &[T], d: SwiGluDims) -> Vec<T> {
    let (h, avx2) = (d.half, has_avx2());
    let rows_per_task = (MAP_CHUNK / (2 * h)).max(1);
    // SAFETY: each chunk is `rows_per_task` whole gradient rows, all written by `backward_row`.
    unsafe {
        write_chunks(d.rows * 2 * h, rows_per_task * 2 * h, |task, dx| {
            with_avx2(avx2, || {
                let first = task * rows_per_task;
                for (r, dx) in dx.chunks_mut(2 * h).enumerate() {
                    let row = &x[(first + r) * 2 * h..(first + r + 1) * 2 * h];
                    let g = &g[(first + r) * h..(first + r + 1) * h];
                    backward_row(&row[..h], &row[h..], g, dx);
                }
            })
        })
    }
}
