//! The CPU kernels of 2-D max and average pooling, the end of `Tensor::max_pool2d` /
//! `Tensor::avg_pool2d` and of their backward rules on the CPU (`CpuBackend::pool2d_forward`,
//! `pool2d_backward`).
//!
//! Each `[H, W]` plane (one channel of one image) is independent: planes are spread over the
//! threads in groups (rayon), and every kernel walks each output's window clipped to the plane,
//! so padding costs nothing:
//!
//! * **max** keeps, beside each maximum, its position `row·W + col` in the plane (I32); the
//!   backward pass adds each output gradient into the position it names;
//! * **average** divides by the full window `kernel²`, padding counted as zeros (PyTorch's
//!   `count_include_pad`); the backward pass adds `dy / kernel²` to every real pixel of the
//!   window.
//!
//! Overlapping windows (stride < kernel) add into shared pixels; that stays inside one plane,
//! which one task owns, so there are no races.

use super::{CpuBuffer, f32b, f64b, i32b};
use crate::backend::{Pool2dDims, PoolKind};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;

/// Elements of output per rayon task (planes are grouped up to about this much work).
const TASK_ELEMENTS: usize = 1 << 14;

/// The rows (or columns) `lo..hi` of the plane that window `o` covers, clipped to `0..size`.
fn span(o: usize, d: &Pool2dDims, size: usize) -> (usize, usize) {
    let start = o * d.stride;
    let lo = start.saturating_sub(d.padding).min(size);
    let hi = (start + d.kernel).saturating_sub(d.padding).min(size);
    (lo, hi)
}

/// Planes per task for planes of `out_plane` output elements.
fn planes_per_task(out_plane: usize) -> usize {
    (TASK_ELEMENTS / out_plane.max(1)).max(1)
}

/// The column span of every output column, computed once per call.
fn column_spans(d: &Pool2dDims) -> Vec<(usize, usize)> {
    (0..d.out_w()).map(|ox| span(ox, d, d.width)).collect()
}

/// Max pooling: `(y, argmax)`, both `[planes, OH, OW]`. Each output row is initialised from
/// the first pixel of each window and then updated row by row of the window with branch-free
/// selects (a pixel wins when it is larger, or NaN against a number), which keeps the loop
/// over the columns free of unpredictable branches.
fn max_forward<T: Float + Send + Sync>(x: &[T], d: &Pool2dDims) -> (Vec<T>, Vec<i32>) {
    let (oh, ow, plane) = (d.out_h(), d.out_w(), d.height * d.width);
    let out_plane = oh * ow;
    let mut y = super::zeroed(d.planes * out_plane);
    let mut arg = super::zeroed::<i32>(d.planes * out_plane);
    if y.is_empty() {
        return (y, arg);
    }
    let cols = column_spans(d);
    // the common 2×2 / stride 2 case without padding: disjoint windows, see `max_2x2`
    let pairs = d.kernel == 2 && d.stride == 2 && d.padding == 0;
    let group = planes_per_task(out_plane);
    y.par_chunks_mut(group * out_plane)
        .zip(arg.par_chunks_mut(group * out_plane))
        .enumerate()
        .for_each(|(t, (ys, args))| {
            let planes = ys
                .chunks_exact_mut(out_plane)
                .zip(args.chunks_exact_mut(out_plane));
            for (q, (yp, ap)) in planes.enumerate() {
                let xp = &x[(t * group + q) * plane..][..plane];
                for (oy, (yrow, arow)) in yp
                    .chunks_exact_mut(ow)
                    .zip(ap.chunks_exact_mut(ow))
                    .enumerate()
                {
                    if pairs {
                        let top = 2 * oy * d.width;
                        max_2x2(&xp[top..top + 2 * d.width], top, d.width, yrow, arow);
                        continue;
                    }
                    let (r0, r1) = span(oy, d, d.height);
                    for ((best, at), &(c0, _)) in yrow.iter_mut().zip(arow.iter_mut()).zip(&cols) {
                        *best = xp[r0 * d.width + c0];
                        *at = (r0 * d.width + c0) as i32;
                    }
                    for r in r0..r1 {
                        let row = &xp[r * d.width..(r + 1) * d.width];
                        for ((best, at), &(c0, c1)) in
                            yrow.iter_mut().zip(arow.iter_mut()).zip(&cols)
                        {
                            for (c, &v) in row[c0..c1].iter().enumerate() {
                                let wins = v > *best || (v.is_nan() && !best.is_nan());
                                *best = if wins { v } else { *best };
                                *at = if wins {
                                    (r * d.width + c0 + c) as i32
                                } else {
                                    *at
                                };
                            }
                        }
                    }
                }
            }
        });
    (y, arg)
}

/// One output row of a 2×2 / stride 2 max pooling without padding: `rows` holds the window's
/// two input rows (`width` apart, the first at `offset` in the plane). Each window's four
/// pixels are compared in scan order with the rule of the general loop (a pixel wins when it is
/// larger, or NaN against a number) in registers, and the results are stored once: no
/// conditional stores, so the compiler can vectorise the loop.
fn max_2x2<T: Float>(rows: &[T], offset: usize, width: usize, yrow: &mut [T], arow: &mut [i32]) {
    let (top, bottom) = rows.split_at(width);
    // `|` and `&`, not `||` and `&&`: no short-circuit branches, so the loop stays selects
    let wins = |v: T, best: T| (v > best) | (v.is_nan() & !best.is_nan());
    for (ox, ((y, at), (t, b))) in yrow
        .iter_mut()
        .zip(arow.iter_mut())
        .zip(top.chunks_exact(2).zip(bottom.chunks_exact(2)))
        .enumerate()
    {
        let (mut m, mut i) = (t[0], 0);
        for (v, j) in [(t[1], 1), (b[0], width), (b[1], width + 1)] {
            let take = wins(v, m);
            m = if take { v } else { m };
            i = if take { j } else { i };
        }
        *y = m;
        *at = (offset + 2 * ox + i) as i32;
    }
}

/// Average pooling: `y [planes, OH, OW]`.
fn avg_forward<T: Float + Send + Sync>(x: &[T], d: &Pool2dDims) -> Vec<T> {
    let (oh, ow, plane) = (d.out_h(), d.out_w(), d.height * d.width);
    let out_plane = oh * ow;
    let mut y = super::zeroed(d.planes * out_plane);
    if y.is_empty() {
        return y;
    }
    let area = T::from(d.kernel * d.kernel).unwrap_or_else(T::one).recip();
    let group = planes_per_task(out_plane);
    y.par_chunks_mut(group * out_plane)
        .enumerate()
        .for_each(|(t, ys)| {
            for (q, yp) in ys.chunks_exact_mut(out_plane).enumerate() {
                let xp = &x[(t * group + q) * plane..][..plane];
                for oy in 0..oh {
                    let (r0, r1) = span(oy, d, d.height);
                    for ox in 0..ow {
                        let (c0, c1) = span(ox, d, d.width);
                        let sum = (r0..r1).fold(T::zero(), |s, r| {
                            xp[r * d.width..][c0..c1].iter().fold(s, |s, &v| s + v)
                        });
                        yp[oy * ow + ox] = sum * area;
                    }
                }
            }
        });
    y
}

/// The input gradient of either pooling, `[planes, H, W]`.
fn backward_kernel<T: Float + Send + Sync>(
    dy: &[T],
    argmax: Option<&[i32]>,
    d: &Pool2dDims,
) -> Vec<T> {
    let (oh, ow, plane) = (d.out_h(), d.out_w(), d.height * d.width);
    let out_plane = oh * ow;
    let mut dx = super::zeroed(d.planes * plane);
    if dx.is_empty() || out_plane == 0 {
        return dx;
    }
    let area = T::from(d.kernel * d.kernel).unwrap_or_else(T::one).recip();
    let group = planes_per_task(out_plane);
    dx.par_chunks_mut(group * plane)
        .enumerate()
        .for_each(|(t, dxs)| {
            for (q, dxp) in dxs.chunks_exact_mut(plane).enumerate() {
                let first = (t * group + q) * out_plane;
                let dyp = &dy[first..][..out_plane];
                match argmax {
                    Some(arg) => {
                        for (&g, &at) in dyp.iter().zip(&arg[first..][..out_plane]) {
                            // checked by `backward` to lie in the plane
                            dxp[at as usize] = dxp[at as usize] + g;
                        }
                    }
                    None => {
                        for oy in 0..oh {
                            let (r0, r1) = span(oy, d, d.height);
                            for ox in 0..ow {
                                let (c0, c1) = span(ox, d, d.width);
                                let share = dyp[oy * ow + ox] * area;
                                for r in r0..r1 {
                                    dxp[r * d.width..][c0..c1]
                                        .iter_mut()
                                        .for_each(|v| *v = *v + share);
                                }
                            }
                        }
                    }
                }
            }
        });
    dx
}

fn check_len(
    what: &str,
    name: &str,
    buf: &CpuBuffer,
    expected: usize,
    d: &Pool2dDims,
) -> Result<()> {
    crate::backend::checks::check_lengths(what, &[(name, buf, expected)], d)
}

/// `NnOps::pool2d_forward` on the CPU.
pub(super) fn forward(
    kind: PoolKind,
    x: &CpuBuffer,
    d: Pool2dDims,
) -> Result<(CpuBuffer, Option<CpuBuffer>)> {
    const WHAT: &str = "pool2d_forward";
    let (xl, _) = d.check(WHAT)?;
    check_len(WHAT, "x", x, xl, &d)?;
    match (kind, x) {
        (PoolKind::Max, CpuBuffer::F32(x)) => {
            let (y, a) = max_forward(x, &d);
            Ok((f32b(y), Some(i32b(a))))
        }
        (PoolKind::Max, CpuBuffer::F64(x)) => {
            let (y, a) = max_forward(x, &d);
            Ok((f64b(y), Some(i32b(a))))
        }
        (PoolKind::Avg, CpuBuffer::F32(x)) => Ok((f32b(avg_forward(x, &d)), None)),
        (PoolKind::Avg, CpuBuffer::F64(x)) => Ok((f64b(avg_forward(x, &d)), None)),
        (_, CpuBuffer::I32(_)) => Err(Error::DType(format!(
            "{WHAT} needs a float tensor, got i32"
        ))),
    }
}

/// `NnOps::pool2d_backward` on the CPU.
pub(super) fn backward(
    kind: PoolKind,
    dy: &CpuBuffer,
    argmax: Option<&CpuBuffer>,
    d: Pool2dDims,
) -> Result<CpuBuffer> {
    const WHAT: &str = "pool2d_backward";
    let (_, yl) = d.check(WHAT)?;
    check_len(WHAT, "dy", dy, yl, &d)?;
    let arg = match (kind, argmax) {
        (PoolKind::Max, None) => {
            return Err(crate::backend::checks::missing_argmax_error(WHAT));
        }
        (PoolKind::Max, Some(a)) => {
            check_len(WHAT, "argmax", a, yl, &d)?;
            let v = a.indices(WHAT)?;
            let plane = d.height * d.width;
            if let Some(&bad) = v.iter().find(|&&i| i < 0 || i as usize >= plane) {
                return Err(Error::Invalid(format!(
                    "{WHAT}: argmax {bad} lies outside a {}×{} plane",
                    d.height, d.width
                )));
            }
            Some(v)
        }
        (PoolKind::Avg, _) => None,
    };
    match dy {
        CpuBuffer::F32(g) => Ok(f32b(backward_kernel(g, arg, &d))),
        CpuBuffer::F64(g) => Ok(f64b(backward_kernel(g, arg, &d))),
        CpuBuffer::I32(_) => Err(Error::DType(format!(
            "{WHAT} needs a float gradient, got i32"
        ))),
    }
}
