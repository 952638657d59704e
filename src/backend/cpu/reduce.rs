//! Reduction kernels: `reduce` (sum, max, min, mean along one axis, with fixed blocking so the
//! result does not depend on the number of threads), `argmax` and `cumsum`.

use super::sort::argsort_kernel;
use super::{CpuBackend, CpuBuffer, f32b, f64b, i32b};
use super::{PAR_MIN, tabulate, write_chunks, zeroed};
use crate::Error;
use crate::Result;
use crate::backend::ReduceOps;
use crate::backend::{AxisView, ReduceOp};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Elements per task when a sum runs along long contiguous rows (fixed, so the result does not
/// depend on the number of threads).
pub(super) const SUM_BLOCK: usize = 1 << 16;

/// A contiguous slice folded with `f` (sum, max or min) in eight interleaved partial results
/// (so the loop vectorises and no step waits on the one before), combined pairwise at the end.
pub(super) fn fold_lanes<T: Float>(x: &[T], identity: T, f: impl Fn(T, T) -> T) -> T {
    let mut acc = [identity; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = f(*a, v);
        }
    }
    let mut s = f(
        f(f(acc[0], acc[4]), f(acc[1], acc[5])),
        f(f(acc[2], acc[6]), f(acc[3], acc[7])),
    );
    for &v in rest {
        s = f(s, v);
    }
    s
}

/// Lanes of [`fold_lanes`] and [`lane_sum`]: eight running results side by side, so that the
/// loop vectorises and no step waits for the one before it (a single running sum spends four
/// cycles per element waiting, which made a layer norm's row statistics most of its kernel's
/// time).
pub(super) const LANES: usize = 8;

/// `Σ_i f(a_i, b_i, c_i)` over three equal-length rows, in [`LANES`] running sums added at the
/// end.
#[inline(always)]
pub(super) fn lane_sum<T: Float>(a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let tail = (ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder()))
    .fold(T::zero(), |s, ((&x, &y), &z)| s + f(x, y, z));
    for ((xa, xb), xc) in ca.zip(cb).zip(cc) {
        for l in 0..LANES {
            acc[l] = acc[l] + f(xa[l], xb[l], xc[l]);
        }
    }
    acc.iter().fold(tail, |s, &v| s + v)
}

/// The sum of a contiguous slice in lanes (see [`fold_lanes`]).
pub(super) fn sum_lanes<T: Float>(x: &[T]) -> T {
    fold_lanes(x, T::zero(), |a, b| a + b)
}

/// A sum along contiguous rows (`inner = 1`: a softmax's denominator, a loss's mean, a
/// broadcast gradient summed back): each row in [`sum_lanes`], rows in parallel; a row longer
/// than [`SUM_BLOCK`] is summed in blocks in parallel and the block sums are added in order.
pub(super) fn sum_rows<T: Float + Send + Sync>(x: &[T], outer: usize, len: usize) -> Vec<T> {
    let blocks = len.div_ceil(SUM_BLOCK).max(1);
    if blocks == 1 {
        let mut out = zeroed(outer);
        let row = |(o, s): (usize, &mut T)| *s = sum_lanes(&x[o * len..(o + 1) * len]);
        if outer * len >= PAR_MIN {
            out.par_iter_mut()
                .enumerate()
                .with_min_len(64)
                .for_each(row);
        } else {
            out.iter_mut().enumerate().for_each(row);
        }
        return out;
    }
    let partial: Vec<T> = (0..outer * blocks)
        .into_par_iter()
        .map(|b| {
            let (o, j) = (b / blocks, b % blocks);
            let (lo, hi) = (j * SUM_BLOCK, ((j + 1) * SUM_BLOCK).min(len));
            sum_lanes(&x[o * len + lo..o * len + hi])
        })
        .collect();
    partial
        .chunks(blocks)
        .map(|c| c.iter().fold(T::zero(), |s, &v| s + v))
        .collect()
}

pub(super) fn reduce_kernel<T: Float + Send + Sync>(op: ReduceOp, x: &[T], v: AxisView) -> Vec<T> {
    let AxisView { outer, len, inner } = v;
    if op == ReduceOp::Sum && inner == 1 {
        return sum_rows(x, outer, len);
    }
    if inner == 1 && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        // contiguous rows (a softmax's row maximum): each row in lanes, rows in parallel. `max`
        // and `min` skip NaN whatever the order, so the lanes give the loop's result.
        let row = |o: usize| &x[o * len..(o + 1) * len];
        return if op == ReduceOp::Max {
            tabulate(outer, |o| {
                fold_lanes(row(o), T::neg_infinity(), |a, b| a.max(b))
            })
        } else {
            tabulate(outer, |o| {
                fold_lanes(row(o), T::infinity(), |a, b| a.min(b))
            })
        };
    }
    reduce_columns(op, x, v)
}

/// A reduction along an axis with `inner > 1` (a bias gradient: `[rows, n]` summed over rows):
/// each `[len, inner]` slab is walked row by row, folding each row into a row of `inner`
/// results, so the reads are contiguous and the loop vectorises, where reading each output's
/// column down the slab strides through memory. Every output still folds its values in the
/// order `j = 0, 1, …`, so the result is that of the column loop, bit for bit.
pub(super) fn reduce_columns<T: Float + Send + Sync>(op: ReduceOp, x: &[T], v: AxisView) -> Vec<T> {
    match op {
        ReduceOp::Sum => fold_columns(x, v, T::zero(), |a, b| a + b),
        ReduceOp::Max => fold_columns(x, v, T::neg_infinity(), |a, b| a.max(b)),
        ReduceOp::Min => fold_columns(x, v, T::infinity(), |a, b| a.min(b)),
        ReduceOp::ArgMax => unreachable!("argmax handled separately"),
    }
}

/// [`reduce_columns`] for one fold `f` (a concrete closure, so the row loop vectorises).
pub(super) fn fold_columns<T: Float + Send + Sync>(
    x: &[T],
    v: AxisView,
    identity: T,
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Vec<T> {
    let AxisView { outer, len, inner } = v;
    let slab = |o: usize, out: &mut [MaybeUninit<T>]| {
        for acc in out.iter_mut() {
            acc.write(identity);
        }
        // SAFETY: every element was just written.
        let out = unsafe { &mut *(out as *mut [MaybeUninit<T>] as *mut [T]) };
        for j in 0..len {
            let row = &x[(o * len + j) * inner..(o * len + j + 1) * inner];
            for (acc, &value) in out.iter_mut().zip(row) {
                *acc = f(*acc, value);
            }
        }
    };
    // SAFETY: chunk o is output slab o (`inner` elements), filled first and then folded into.
    unsafe { write_chunks(outer * inner, inner, slab) }
}

pub(super) fn argmax_kernel<T: Float + Send + Sync>(x: &[T], v: AxisView) -> Vec<i32> {
    let AxisView { outer, len, inner } = v;
    tabulate(outer * inner, |oi| {
        let (o, i) = (oi / inner, oi % inner);
        let mut best = 0usize;
        for j in 1..len {
            let (cur, b) = (
                x[o * len * inner + j * inner + i],
                x[o * len * inner + best * inner + i],
            );
            if cur > b || (b.is_nan() && !cur.is_nan()) {
                best = j;
            }
        }
        best as i32
    })
}

pub(super) fn cumsum_kernel<T: Float + Send>(x: &[T], v: AxisView, reverse: bool) -> Vec<T> {
    let AxisView { outer, len, inner } = v;
    let mut out = zeroed(x.len());
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = T::zero();
            for step in 0..len {
                let j = if reverse { len - 1 - step } else { step };
                let at = o * len * inner + j * inner + i;
                acc = acc + x[at];
                out[at] = acc;
            }
        }
    }
    out
}

impl ReduceOps for CpuBackend {
    fn reduce(&self, op: ReduceOp, x: &CpuBuffer, view: AxisView) -> Result<CpuBuffer> {
        if op == ReduceOp::ArgMax {
            return match x {
                CpuBuffer::F32(v) => Ok(i32b(argmax_kernel(v, view))),
                CpuBuffer::F64(v) => Ok(i32b(argmax_kernel(v, view))),
                CpuBuffer::I32(_) => {
                    Err(Error::DType("argmax needs a float tensor, got i32".into()))
                }
            };
        }
        float_map!(x, format!("{op:?}"), v => reduce_kernel(op, v, view))
    }

    fn cumsum(&self, x: &CpuBuffer, view: AxisView, reverse: bool) -> Result<CpuBuffer> {
        float_map!(x, "cumsum", v => cumsum_kernel(v, view, reverse))
    }

    fn argsort(
        &self,
        x: &CpuBuffer,
        rows: usize,
        len: usize,
        descending: bool,
    ) -> Result<CpuBuffer> {
        match x {
            CpuBuffer::F32(v) => Ok(i32b(argsort_kernel(v, rows, len, len, descending))),
            CpuBuffer::F64(v) => Ok(i32b(argsort_kernel(v, rows, len, len, descending))),
            CpuBuffer::I32(_) => Err(Error::DType("argsort needs a float tensor, got i32".into())),
        }
    }

    fn argsort_top(
        &self,
        x: &CpuBuffer,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<CpuBuffer> {
        if k > len {
            return Err(Error::Shape(format!(
                "argsort_top: k = {k} exceeds the row length {len}"
            )));
        }
        match x {
            CpuBuffer::F32(v) => Ok(i32b(argsort_kernel(v, rows, len, k, descending))),
            CpuBuffer::F64(v) => Ok(i32b(argsort_kernel(v, rows, len, k, descending))),
            CpuBuffer::I32(_) => Err(Error::DType("argsort needs a float tensor, got i32".into())),
        }
    }
}
