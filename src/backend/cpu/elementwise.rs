//! Elementwise kernels: `unary`, `binary` (with broadcasting through strides), `where_cond` and
//! the strided copy behind `copy_strided`. Contiguous operands go through [`map1`] / [`map2`],
//! whose concrete closures vectorise; broadcast operands through [`rows_apply`] and
//! [`strided_apply`], which compute each row's offset once; copies through [`strided_copy`],
//! which steps from row to row. The f32 `exp`, `ln` and GELU have
//! their own vectorisable loops in `fast_math.rs`.

use super::fast_math::{WideF32, gelu_backward_f32, map1_f32_wide};
use super::{CpuBackend, CpuBuffer, f32b, f64b, filled, i32b, tabulate};
use super::{MAP_CHUNK, write_chunks};
use crate::Result;
use crate::backend::checks::{binary_dtype_error, where_dtype_error};
use crate::backend::{BinaryOp, UnaryOp};
use crate::backend::{BufferOps, ElementwiseOps, Strided, uniform_hash};
use crate::{DType, Error};
use num_traits::Float;
use std::mem::MaybeUninit;

/// Element offset of flat output index `i` in an operand with the given strides over `shape`.
#[inline]
pub(super) fn strided_offset(mut i: usize, shape: &[usize], strides: &[usize]) -> usize {
    let mut off = 0;
    for d in (0..shape.len()).rev() {
        let s = shape[d];
        off += (i % s) * strides[d];
        i /= s;
    }
    off
}

pub(super) fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expect = 1;
    for d in (0..shape.len()).rev() {
        if shape[d] != 1 && strides[d] != expect {
            return false;
        }
        expect *= shape[d];
    }
    true
}

/// `out[idx] = f(operand_0[idx·s_0], ..., operand_{N−1}[idx·s_{N−1}])` over a contiguous output
/// of `shape`, row by row: the offset of each row's first element is computed once and the last
/// axis is walked with each operand's stride, so broadcasting costs no per-element index math.
pub(super) fn strided_apply<T: Copy + Send + Sync + Default, const N: usize>(
    shape: &[usize],
    operands: [(&[T], &[usize]); N],
    f: impl Fn([T; N]) -> T + Sync + Send,
) -> Vec<T> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Vec::new();
    }
    let rank = shape.len();
    let lead = rank.saturating_sub(1);
    let last = if rank == 0 { 1 } else { shape[rank - 1] };
    let last_strides: [usize; N] = std::array::from_fn(|k| {
        if rank == 0 {
            0
        } else {
            operands[k].1[rank - 1]
        }
    });
    let row = |r: usize, chunk: &mut [MaybeUninit<T>]| {
        let bases: [usize; N] =
            std::array::from_fn(|k| strided_offset(r, &shape[..lead], &operands[k].1[..lead]));
        for (j, o) in chunk.iter_mut().enumerate() {
            o.write(f(std::array::from_fn(|k| {
                operands[k].0[bases[k] + j * last_strides[k]]
            })));
        }
    };
    // SAFETY: `row` writes every element of its row.
    unsafe { write_chunks(n, last, row) }
}

/// A contiguous copy of the strided view `(shape, strides)` of `x` (`LayoutOps::copy_strided`:
/// permute, transpose, slice, expand). The output is cut into its rows (the last axis); each
/// task takes a run of rows, finds its first row's offset with one division per axis and then
/// steps from row to row like an odometer, so a row costs a few additions and the copy of its
/// elements (a plain slice copy when the last axis has stride 1, as in every permute that keeps
/// the last axis). The caller checked that every offset is inside `x`.
pub(super) fn strided_copy<T: Copy + Send + Sync>(
    x: &[T],
    shape: &[usize],
    strides: &[usize],
) -> Vec<T> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Vec::new();
    }
    let Some((&last, lead)) = shape.split_last() else {
        return vec![x[0]]; // a scalar
    };
    let (&last_stride, lead_strides) = strides.split_last().unwrap_or((&1, &[]));
    let rows_per_task = (MAP_CHUNK / last).max(1);
    let task = |t: usize, block: &mut [MaybeUninit<T>]| {
        let first = t * rows_per_task;
        // the first row's index along each leading axis, and its offset in x
        let mut index = vec![0; lead.len()];
        let mut rest = first;
        for d in (0..lead.len()).rev() {
            index[d] = rest % lead[d];
            rest /= lead[d];
        }
        let mut base = strided_offset(first, lead, lead_strides);
        for row in block.chunks_mut(last) {
            if last_stride == 1 {
                for (o, &v) in row.iter_mut().zip(&x[base..base + last]) {
                    o.write(v);
                }
            } else {
                for (j, o) in row.iter_mut().enumerate() {
                    o.write(x[base + j * last_stride]);
                }
            }
            // the next row: the last leading axis steps, carrying into the ones before it
            for d in (0..lead.len()).rev() {
                index[d] += 1;
                base += lead_strides[d];
                if index[d] < lead[d] {
                    break;
                }
                index[d] = 0;
                base -= lead_strides[d] * lead[d];
            }
        }
    };
    // SAFETY: task t's block is rows t·rows_per_task.. of the output, and it writes each row.
    unsafe { write_chunks(n, rows_per_task * last, task) }
}

/// `out[i] = f(x[i])`. `f` is a concrete closure, so the inner loop is monomorphic and vectorises;
/// big buffers are split over threads.
pub(super) fn map1<T: Copy + Send + Sync + Default>(
    x: &[T],
    f: impl Fn(T) -> T + Sync + Send,
) -> Vec<T> {
    let body = |k: usize, o: &mut [MaybeUninit<T>]| {
        let x = &x[k * MAP_CHUNK..k * MAP_CHUNK + o.len()];
        for (o, &x) in o.iter_mut().zip(x) {
            o.write(f(x));
        }
    };
    // SAFETY: chunk k of the output is zipped with the same-length chunk k of `x`.
    unsafe { write_chunks(x.len(), MAP_CHUNK, body) }
}

/// `out[i] = f(a[i], b[i])` over two equal-length buffers (see [`map1`]).
pub(super) fn map2<T: Copy + Send + Sync + Default>(
    a: &[T],
    b: &[T],
    f: impl Fn(T, T) -> T + Sync + Send,
) -> Vec<T> {
    let n = a.len().min(b.len());
    let body = |k: usize, o: &mut [MaybeUninit<T>]| {
        let r = k * MAP_CHUNK..k * MAP_CHUNK + o.len();
        for ((o, &x), &y) in o.iter_mut().zip(&a[r.clone()]).zip(&b[r]) {
            o.write(f(x, y));
        }
    };
    // SAFETY: chunk k of the output is zipped with the same-length chunks of `a` and `b`.
    unsafe { write_chunks(n, MAP_CHUNK, body) }
}

/// Binds `$f` to a concrete closure for `$op` (the arithmetic ops get their own, so loops over
/// them vectorise; the rest go through [`BinaryOp::apply`]) and evaluates `$body`.
macro_rules! with_binary_fn {
    ($t:ty, $op:expr, |$f:ident| $body:expr) => {
        match $op {
            BinaryOp::Add => {
                let $f = |x: $t, y: $t| x + y;
                $body
            }
            BinaryOp::Sub => {
                let $f = |x: $t, y: $t| x - y;
                $body
            }
            BinaryOp::Mul => {
                let $f = |x: $t, y: $t| x * y;
                $body
            }
            BinaryOp::Div => {
                let $f = |x: $t, y: $t| x / y;
                $body
            }
            other => {
                let $f = move |x: $t, y: $t| other.apply(x, y);
                $body
            }
        }
    };
}

pub(super) fn binary_kernel<T: Float + Send + Sync + Default>(
    op: BinaryOp,
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    shape: &[usize],
) -> Vec<T> {
    let n: usize = shape.iter().product();
    let a_contig = is_contiguous(shape, sa) && a.len() == n;
    let b_contig = is_contiguous(shape, sb) && b.len() == n;
    let scalar = |s: &[usize]| s.iter().zip(shape).all(|(&s, &d)| s == 0 || d == 1);
    let (a_scalar, b_scalar) = (scalar(sa) && !a.is_empty(), scalar(sb) && !b.is_empty());
    with_binary_fn!(T, op, |f| match (a_contig, b_contig) {
        (true, true) => map2(a, b, f),
        (true, _) if b_scalar => {
            let bv = b[0];
            map1(a, move |x| f(x, bv))
        }
        (_, true) if a_scalar => {
            let av = a[0];
            map1(b, move |y| f(av, y))
        }
        _ => rows_apply(shape, a, sa, b, sb, f),
    })
}

/// `out = if cond != 0 { a } else { b }` elementwise. When the condition and `a` are
/// contiguous and `b` is contiguous or one value (a ReLU's gradient, a masked output), it is a
/// flat loop over chunks; otherwise it goes through [`strided_apply`].
pub(super) fn where_kernel<T: Float + Send + Sync + Default>(
    c: &[T],
    sc: &[usize],
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    shape: &[usize],
) -> Vec<T> {
    let n: usize = shape.iter().product();
    let contig = |x: &[T], s: &[usize]| is_contiguous(shape, s) && x.len() == n;
    let scalar = |x: &[T], s: &[usize]| {
        !x.is_empty() && s.iter().zip(shape).all(|(&s, &d)| s == 0 || d == 1)
    };
    let pick = |c: T, x: T, y: T| if c != T::zero() { x } else { y };
    if !(contig(c, sc) && contig(a, sa)) {
        return strided_apply(shape, [(c, sc), (a, sa), (b, sb)], move |[c, x, y]| {
            pick(c, x, y)
        });
    }
    if contig(b, sb) {
        // chunk k of the output against the same range of each operand
        let body = |k: usize, o: &mut [MaybeUninit<T>]| {
            let r = k * MAP_CHUNK..k * MAP_CHUNK + o.len();
            let (c, x, y) = (&c[r.clone()], &a[r.clone()], &b[r]);
            for (((o, &c), &x), &y) in o.iter_mut().zip(c).zip(x).zip(y) {
                o.write(pick(c, x, y));
            }
        };
        // SAFETY: all three operands are contiguous with n elements, so every zip is full.
        return unsafe { write_chunks(n, MAP_CHUNK, body) };
    }
    if scalar(b, sb) {
        let y = b[0];
        return map2(c, a, move |c, x| pick(c, x, y));
    }
    strided_apply(shape, [(c, sc), (a, sa), (b, sb)], move |[c, x, y]| {
        pick(c, x, y)
    })
}

/// The broadcasting case of [`binary_kernel`], row by row over the last axis: when each operand
/// walks that axis with stride 1 or 0 (a row of values or one value per row, e.g. expert outputs
/// times their routing weight), the row loop is a plain slice loop that vectorises; otherwise it
/// falls back to [`strided_apply`].
pub(super) fn rows_apply<T: Float + Send + Sync + Default>(
    shape: &[usize],
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    f: impl Fn(T, T) -> T + Sync + Send + Copy,
) -> Vec<T> {
    let rank = shape.len();
    let n: usize = shape.iter().product();
    if rank == 0 || n == 0 || sa[rank - 1] > 1 || sb[rank - 1] > 1 {
        return strided_apply(shape, [(a, sa), (b, sb)], move |[x, y]| f(x, y));
    }
    let (last, lead) = (shape[rank - 1], rank - 1);
    let (la, lb) = (sa[rank - 1], sb[rank - 1]);
    let row = |r: usize, o: &mut [MaybeUninit<T>]| {
        let ba = strided_offset(r, &shape[..lead], &sa[..lead]);
        let bb = strided_offset(r, &shape[..lead], &sb[..lead]);
        match (la, lb) {
            (1, 1) => {
                for ((o, &x), &y) in o.iter_mut().zip(&a[ba..ba + last]).zip(&b[bb..bb + last]) {
                    o.write(f(x, y));
                }
            }
            (1, _) => {
                let y = b[bb];
                for (o, &x) in o.iter_mut().zip(&a[ba..ba + last]) {
                    o.write(f(x, y));
                }
            }
            (_, 1) => {
                let x = a[ba];
                for (o, &y) in o.iter_mut().zip(&b[bb..bb + last]) {
                    o.write(f(x, y));
                }
            }
            _ => o.fill(MaybeUninit::new(f(a[ba], b[bb]))),
        }
    };
    // SAFETY: each row is `last` long and every arm writes all of it (the operand rows the
    // arms zip with hold `last` elements).
    unsafe { write_chunks(n, last, row) }
}

pub(super) fn unary_kernel<T: Float + Send + Sync + Default>(op: UnaryOp, x: &[T]) -> Vec<T> {
    let c = |v: f64| T::from(v).unwrap_or_else(T::nan);
    let zero = T::zero();
    match op {
        UnaryOp::Neg => map1(x, |v| -v),
        UnaryOp::Relu => map1(x, |v| v.max(zero)),
        UnaryOp::Abs => map1(x, |v| v.abs()),
        UnaryOp::Step => map1(x, |v| if v > zero { T::one() } else { zero }),
        UnaryOp::AddScalar(k) => {
            let k = c(k);
            map1(x, move |v| v + k)
        }
        UnaryOp::MulScalar(k) => {
            let k = c(k);
            map1(x, move |v| v * k)
        }
        other => map1(x, move |v| other.apply(v)),
    }
}

impl ElementwiseOps for CpuBackend {
    fn full(&self, len: usize, value: f64, dtype: DType) -> Result<CpuBuffer> {
        Ok(match dtype {
            DType::F32 => f32b(filled(len, value as f32)?),
            DType::F64 => f64b(filled(len, value)?),
            DType::I32 => i32b(filled(len, value as i32)?),
            DType::F16 => return Err(super::f16_error("full")),
        })
    }

    fn cast(&self, x: &CpuBuffer, dtype: DType) -> Result<CpuBuffer> {
        let v = self.download(x)?.to_f64();
        Ok(match dtype {
            DType::F32 => f32b(v.iter().map(|&e| e as f32).collect()),
            DType::F64 => f64b(v),
            DType::I32 => i32b(v.iter().map(|&e| e as i32).collect()),
            DType::F16 => return Err(super::f16_error("to_dtype")),
        })
    }

    fn unary(&self, op: UnaryOp, x: &CpuBuffer) -> Result<CpuBuffer> {
        match (op, x) {
            (UnaryOp::Exp, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Exp))),
            (UnaryOp::Log, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Ln))),
            (UnaryOp::Gelu, CpuBuffer::F32(v)) => return Ok(f32b(map1_f32_wide(v, WideF32::Gelu))),
            (UnaryOp::GeluGrad, CpuBuffer::F32(v)) => {
                return Ok(f32b(map1_f32_wide(v, WideF32::GeluGrad)));
            }
            _ => {}
        }
        float_map!(x, format!("{op:?}"), v => unary_kernel(op, v))
    }

    fn binary(
        &self,
        op: BinaryOp,
        a: &CpuBuffer,
        sa: &[usize],
        b: &CpuBuffer,
        sb: &[usize],
        shape: &[usize],
    ) -> Result<CpuBuffer> {
        let n: usize = shape.iter().product();
        let contiguous = |s: &[usize], len: usize| len == n && is_contiguous(shape, s);
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b))
                if op == BinaryOp::GeluBackward
                    && contiguous(sa, a.len())
                    && contiguous(sb, b.len()) =>
            {
                Ok(f32b(gelu_backward_f32(a, b)))
            }
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            _ => Err(binary_dtype_error(&format!("{op:?}"), a.dtype(), b.dtype())),
        }
    }

    fn where_cond(
        &self,
        cond: Strided<'_, CpuBuffer>,
        a: Strided<'_, CpuBuffer>,
        b: Strided<'_, CpuBuffer>,
        shape: &[usize],
    ) -> Result<CpuBuffer> {
        let (sc, sa, sb) = (cond.strides, a.strides, b.strides);
        match (cond.buf, a.buf, b.buf) {
            (CpuBuffer::F32(c), CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(c), CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            _ => Err(where_dtype_error(
                cond.buf.dtype(),
                a.buf.dtype(),
                b.buf.dtype(),
            )),
        }
    }

    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<CpuBuffer> {
        let v: Vec<f32> = tabulate(len, |i| uniform_hash(seed, i as u32));
        self.cast(&f32b(v), dtype)
    }
}
