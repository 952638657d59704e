//! The CPU backend: f32 and f64 (and I32 indices) in plain `Vec`s, elementwise loops split over
//! threads with rayon, and matrix products through the `gemm` crate.
//!
//! `gemm` was picked by measurement on the 2-core development machine (see docs/benchmarks.md):
//! against `matrixmultiply` and `faer` it was the fastest at 256 and 512 and within noise of the
//! best at 1024, and it takes arbitrary row/column strides, so transposed operands need no copy.
//!
//! Every kernel here is generic over the float type through [`Float`], so f32 and f64 share one
//! body; the enum [`CpuBuffer`] says which one a buffer holds.

mod attention;
mod conv2d;
mod cross_entropy;
mod layer_norm;
pub mod pool;
mod pool2d;
mod routing;
pub use attention::ATTENTION_BLOCK;
pub use conv2d::WEIGHT_GRAD_IMAGES;
pub use pool::PooledVec;

use super::{
    AdamHyper, AttentionDims, AxisView, Backend, BinaryOp, Conv2dDims, HostData, LayerNormDims,
    MatLayout, MatmulDims, PlanBuffers, Pool2dDims, PoolKind, ReduceOp, SgdHyper, UnaryOp,
    check_gate_sizes, check_lengths, uniform_hash,
};
use crate::{DType, Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Below this many elements a loop runs on one thread (spawning costs more than it saves).
const PAR_MIN: usize = 1 << 15;

/// A CPU buffer: a shared, immutable vector of one dtype (whose allocation returns to the
/// [`pool`] when the last handle drops).
#[derive(Clone, Debug)]
pub enum CpuBuffer {
    /// f32 values
    F32(Arc<PooledVec<f32>>),
    /// f64 values
    F64(Arc<PooledVec<f64>>),
    /// i32 values (indices)
    I32(Arc<PooledVec<i32>>),
}

impl CpuBuffer {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuffer::F32(_) => DType::F32,
            CpuBuffer::F64(_) => DType::F64,
            CpuBuffer::I32(_) => DType::I32,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.len(),
            CpuBuffer::F64(v) => v.len(),
            CpuBuffer::I32(v) => v.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn indices(&self, what: &str) -> Result<&[i32]> {
        match self {
            CpuBuffer::I32(v) => Ok(v),
            other => Err(Error::DType(format!(
                "{what}: indices must be i32, got {}",
                other.dtype()
            ))),
        }
    }
}

fn f32b(v: Vec<f32>) -> CpuBuffer {
    CpuBuffer::F32(Arc::new(v.into()))
}
fn f64b(v: Vec<f64>) -> CpuBuffer {
    CpuBuffer::F64(Arc::new(v.into()))
}
fn i32b(v: Vec<i32>) -> CpuBuffer {
    CpuBuffer::I32(Arc::new(v.into()))
}

/// Runs `$body` with `$v: &Vec<T>` for the float variants and rewraps the `Vec<T>` result;
/// I32 is a dtype error naming `$what`.
macro_rules! float_map {
    ($buf:expr, $what:expr, $v:ident => $body:expr) => {
        match $buf {
            CpuBuffer::F32($v) => Ok(f32b($body)),
            CpuBuffer::F64($v) => Ok(f64b($body)),
            CpuBuffer::I32(_) => Err(Error::DType(format!(
                "{} needs a float tensor, got i32",
                $what
            ))),
        }
    };
}

/// Runs `$body` with `$v` for every dtype (layout ops that only move elements).
macro_rules! any_map {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            CpuBuffer::F32($v) => f32b($body),
            CpuBuffer::F64($v) => f64b($body),
            CpuBuffer::I32($v) => i32b($body),
        }
    };
}

/// Fills `out[i] = f(i)` in parallel when large.
fn tabulate<T: Send, F: Fn(usize) -> T + Sync + Send>(n: usize, f: F) -> Vec<T> {
    if n >= PAR_MIN {
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

/// A new buffer of `n` elements written chunk by chunk (`chunk` elements each, the last one
/// shorter) by `fill(chunk_index, chunk)`, in parallel when `n ≥ PAR_MIN`; short chunks (rows
/// of one element, say) are handed out to threads in groups of about [`MAP_CHUNK`] elements.
/// The buffer is not zeroed first: a kernel that writes every element anyway would otherwise
/// pay a single-threaded memset of its whole output before its own pass (16 MB for one expert
/// activation of the MoE benchmark).
///
/// # Safety
/// `fill` must write every element of each chunk it is handed.
unsafe fn write_chunks<T: Send + Copy>(
    n: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync + Send,
) -> Vec<T> {
    let mut out = pool::take(n).unwrap_or_else(|_| Vec::with_capacity(n));
    let spare = &mut out.spare_capacity_mut()[..n];
    let chunk = chunk.max(1);
    if n >= PAR_MIN {
        let group = (MAP_CHUNK / chunk).max(1);
        spare
            .par_chunks_mut(chunk * group)
            .enumerate()
            .for_each(|(g, block)| {
                for (q, c) in block.chunks_mut(chunk).enumerate() {
                    fill(g * group + q, c);
                }
            });
    } else {
        spare
            .chunks_mut(chunk)
            .enumerate()
            .for_each(|(k, c)| fill(k, c));
    }
    // SAFETY: the chunks cover all n elements and the caller's `fill` wrote each of them.
    unsafe { out.set_len(n) };
    out
}

/// `len` copies of `value`, allocated fallibly ([`crate::memory::try_vec`]): a buffer larger than
/// the machine's memory is an error, not an abort.
fn filled<T: Copy>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = pool::take(len)?;
    v.resize(len, value);
    Ok(v)
}

/// `len` zeros in a buffer from the [`pool`] (like `vec![zero; len]`, whose allocation the pool
/// could not take back).
pub(crate) fn zeroed<T: Copy + num_traits::Zero>(len: usize) -> Vec<T> {
    let mut v = pool::take(len).unwrap_or_default();
    v.resize(len, T::zero());
    v
}

/// A copy of `values`, allocated fallibly like [`filled`].
fn copied<T: Copy>(values: &[T]) -> Result<Vec<T>> {
    let mut v = pool::take(values.len())?;
    v.extend_from_slice(values);
    Ok(v)
}

/// Element offset of flat output index `i` in an operand with the given strides over `shape`.
#[inline]
fn strided_offset(mut i: usize, shape: &[usize], strides: &[usize]) -> usize {
    let mut off = 0;
    for d in (0..shape.len()).rev() {
        let s = shape[d];
        off += (i % s) * strides[d];
        i /= s;
    }
    off
}

fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
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
fn strided_apply<T: Copy + Send + Sync + Default, const N: usize>(
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

fn apply_unary<T: Float>(op: UnaryOp, x: T) -> T {
    let c = |v: f64| T::from(v).unwrap_or_else(T::zero);
    let zero = T::zero();
    let one = T::one();
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Relu => x.max(zero),
        UnaryOp::Gelu => {
            let k = c(0.797_884_560_802_865_4); // sqrt(2/pi)
            let inner = k * (x + c(0.044715) * x * x * x);
            c(0.5) * x * (one + inner.tanh())
        }
        UnaryOp::GeluGrad => {
            let k = c(0.797_884_560_802_865_4);
            let inner = k * (x + c(0.044715) * x * x * x);
            let t = inner.tanh();
            let dinner = k * (one + c(3.0 * 0.044715) * x * x);
            c(0.5) * (one + t) + c(0.5) * x * (one - t * t) * dinner
        }
        UnaryOp::Silu => x / (one + (-x).exp()),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => one / (one + (-x).exp()),
        UnaryOp::Softplus => x.max(zero) + (-x.abs()).exp().ln_1p(),
        UnaryOp::Recip => one / x,
        UnaryOp::Step => {
            if x > zero {
                one
            } else {
                zero
            }
        }
        UnaryOp::Sign => {
            if x > zero {
                one
            } else if x < zero {
                -one
            } else {
                zero
            }
        }
        UnaryOp::Powf(p) => x.powf(c(p)),
        UnaryOp::Clamp(lo, hi) => x.max(c(lo)).min(c(hi)),
        UnaryOp::AddScalar(s) => x + c(s),
        UnaryOp::MulScalar(s) => x * c(s),
    }
}

fn apply_binary<T: Float>(op: BinaryOp, a: T, b: T) -> T {
    let flag = |p: bool| if p { T::one() } else { T::zero() };
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Gt => flag(a > b),
        BinaryOp::Ge => flag(a >= b),
        BinaryOp::Lt => flag(a < b),
        BinaryOp::Le => flag(a <= b),
        BinaryOp::Eq => flag(a == b),
        BinaryOp::Ne => flag(a != b),
    }
}

/// Elements per rayon task in the contiguous elementwise loops.
const MAP_CHUNK: usize = 1 << 14;

/// `out[i] = f(x[i])`. `f` is a concrete closure, so the inner loop is monomorphic and vectorises;
/// big buffers are split over threads.
fn map1<T: Copy + Send + Sync + Default>(x: &[T], f: impl Fn(T) -> T + Sync + Send) -> Vec<T> {
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
fn map2<T: Copy + Send + Sync + Default>(
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
/// them vectorise; the rest go through [`apply_binary`]) and evaluates `$body`.
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
                let $f = move |x: $t, y: $t| apply_binary(other, x, y);
                $body
            }
        }
    };
}

fn binary_kernel<T: Float + Send + Sync + Default>(
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
fn where_kernel<T: Float + Send + Sync + Default>(
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
fn rows_apply<T: Float + Send + Sync + Default>(
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

/// `e^x` in f32 by straight-line arithmetic that the compiler vectorises, where the C library's
/// `expf` is one call per element (softmax over `[4096, 64]` router logits spent 0.55 ms per exp
/// pass in it, against 0.06 ms here, dev-2core).
///
/// `x = n·ln 2 + r` with `n = round(x·log₂e)` and `|r| ≤ ln 2 / 2` (ln 2 is split into a short
/// head, whose product with `n` is exact, and a tail); `e^r` is its Taylor polynomial of degree 7
/// (truncation error below 6·10⁻⁹ relative) in Horner form; `2^n` is built from exponent bits in
/// two halves so that each stays a normal number down to the subnormal results. Within a few
/// ulp of the correctly rounded value (`tests/cpu_kernels.rs` checks 4 ulp over the whole
/// range); `+inf` above ln(f32::MAX), `0` below ln of the smallest subnormal, NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 355/512: 9 significant bits, so n·LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 − LN2_HI
    const HI: f32 = 88.722_84; // ln(f32::MAX)
    const LO: f32 = -103.972_08; // ln of the smallest subnormal
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let xc = x.clamp(LO, HI); // a NaN stays NaN and is passed through at the end
    let shifted = xc * LOG2E + ROUND; // n sits in the low mantissa bits
    let n = shifted - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32; // no float-to-int conversion
    let half = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let y = p * pow2(half) * pow2(n - half);
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// `ln x` in f32 by straight-line arithmetic the compiler vectorises (see [`exp_f32`]).
///
/// `x = 2^e · f` with `f` in `[√½, √2)` (read from the exponent bits; subnormal inputs are
/// first scaled by 2²³), then `ln f = 2·atanh(s) = 2(s + s³/3 + s⁵/5 + s⁷/7 + s⁹/9)` with
/// `s = (f − 1)/(f + 1)`, `|s| ≤ 0.172` (the next term is below 10⁻⁹ relative), and
/// `ln x = e·ln 2 + ln f` with ln 2 split as in [`exp_f32`]. Within a few ulp of the correctly
/// rounded value (`tests/cpu_kernels.rs` checks 4 ulp over every positive f32); `ln 0 = −∞`,
/// `ln x = NaN` for `x < 0` and NaN, `ln ∞ = ∞`.
#[inline(always)]
pub fn ln_f32(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SQRT_HALF_BITS: i32 = 0x3f35_04f3;
    let subnormal = x < f32::MIN_POSITIVE;
    let xs = if subnormal { x * 8_388_608.0 } else { x }; // 2²³
    let bits = xs.to_bits() as i32;
    // e = ⌊log₂(x / √½)⌋, so that f = x / 2^e lands in [√½, √2)
    let e = (bits - SQRT_HALF_BITS) >> 23;
    let f = f32::from_bits((bits - (e << 23)) as u32);
    let e = (e - if subnormal { 23 } else { 0 }) as f32;
    let s = (f - 1.0) / (f + 1.0);
    let s2 = s * s;
    let tail = s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0))));
    let y = e * LN2_HI + ((2.0 * s + 2.0 * s * tail) + e * LN2_LO);
    if x == 0.0 {
        f32::NEG_INFINITY
    } else if x.is_nan() || x < 0.0 {
        f32::NAN
    } else if x == f32::INFINITY {
        x
    } else {
        y
    }
}

/// GELU's tanh form through the logistic function, `0.5·x·(1 + tanh u) = x·σ(2u)` with
/// `u = √(2/π)·(x + 0.044715·x³)`, so that it needs one [`exp_f32`] and vectorises (the C library's
/// `tanhf` was a quarter of a GPT training step, dev-2core). Returns `(gelu(x), gelu'(x))`, where
/// `gelu'(x) = σ(2u) + x·σ(2u)·(1 − σ(2u))·2u'` and `u' = √(2/π)·(1 + 3·0.044715·x²)`.
/// Large `|x|` give the exact limits (`x` and slope 1, `0` and slope 0): `e^{−2u}` overflows to ∞
/// for very negative `x`, giving `σ = 0`, and the slope's second term is taken as 0 wherever `σ`
/// saturates.
#[inline(always)]
fn gelu_and_grad_f32(x: f32) -> (f32, f32) {
    const K: f32 = 0.797_884_6; // √(2/π)
    const A: f32 = 0.044_715;
    let u = K * (x + A * x * x * x);
    let s = 1.0 / (1.0 + exp_f32(-2.0 * u));
    let du = K * (1.0 + 3.0 * A * x * x);
    // where σ saturates to exactly 0 or 1 the second term is 0 (x·du may be infinite there)
    let ds = s * (1.0 - s);
    let slope = if ds == 0.0 { 0.0 } else { x * ds * 2.0 * du };
    (x * s, s + slope)
}

/// The f32 functions with a vectorisable implementation here.
#[derive(Clone, Copy)]
enum WideF32 {
    /// [`exp_f32`]
    Exp,
    /// [`ln_f32`]
    Ln,
    /// GELU, tanh form ([`gelu_and_grad_f32`])
    Gelu,
    /// GELU's derivative ([`gelu_and_grad_f32`])
    GeluGrad,
}

/// `out[i] = f(x[i])` for one of the vectorisable f32 functions: [`map1`], with each chunk's
/// loop compiled for AVX2 when the processor has it (eight lanes instead of the four of SSE2,
/// which the baseline x86-64 build targets).
fn map1_f32_wide(x: &[f32], f: WideF32) -> Vec<f32> {
    #[inline(always)]
    fn chunk_loop(f: WideF32, x: &[f32], o: &mut [MaybeUninit<f32>]) {
        match f {
            WideF32::Exp => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(exp_f32(x));
            }),
            WideF32::Ln => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(ln_f32(x));
            }),
            WideF32::Gelu => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(gelu_and_grad_f32(x).0);
            }),
            WideF32::GeluGrad => o.iter_mut().zip(x).for_each(|(o, &x)| {
                o.write(gelu_and_grad_f32(x).1);
            }),
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn chunk_loop_avx2(f: WideF32, x: &[f32], o: &mut [MaybeUninit<f32>]) {
        chunk_loop(f, x, o)
    }
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    let body = |k: usize, o: &mut [MaybeUninit<f32>]| {
        let x = &x[k * MAP_CHUNK..k * MAP_CHUNK + o.len()];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 was detected on this processor.
            return unsafe { chunk_loop_avx2(f, x, o) };
        }
        let _ = avx2;
        chunk_loop(f, x, o)
    };
    // SAFETY: chunk k of the output is zipped with the same-length chunk k of `x`.
    unsafe { write_chunks(x.len(), MAP_CHUNK, body) }
}

fn unary_kernel<T: Float + Send + Sync + Default>(op: UnaryOp, x: &[T]) -> Vec<T> {
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
        other => map1(x, move |v| apply_unary(other, v)),
    }
}

/// Elements per task when a sum runs along long contiguous rows (fixed, so the result does not
/// depend on the number of threads).
const SUM_BLOCK: usize = 1 << 16;

/// A contiguous slice folded with `f` (sum, max or min) in eight interleaved partial results
/// (so the loop vectorises and no step waits on the one before), combined pairwise at the end.
fn fold_lanes<T: Float>(x: &[T], identity: T, f: impl Fn(T, T) -> T) -> T {
    let mut acc = [identity; 8];
    let chunks = x.chunks_exact(8);
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

/// The sum of a contiguous slice in lanes (see [`fold_lanes`]).
fn sum_lanes<T: Float>(x: &[T]) -> T {
    fold_lanes(x, T::zero(), |a, b| a + b)
}

/// A sum along contiguous rows (`inner = 1`: a softmax's denominator, a loss's mean, a
/// broadcast gradient summed back): each row in [`sum_lanes`], rows in parallel; a row longer
/// than [`SUM_BLOCK`] is summed in blocks in parallel and the block sums are added in order.
fn sum_rows<T: Float + Send + Sync>(x: &[T], outer: usize, len: usize) -> Vec<T> {
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

fn reduce_kernel<T: Float + Send + Sync>(op: ReduceOp, x: &[T], v: AxisView) -> Vec<T> {
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
fn reduce_columns<T: Float + Send + Sync>(op: ReduceOp, x: &[T], v: AxisView) -> Vec<T> {
    match op {
        ReduceOp::Sum => fold_columns(x, v, T::zero(), |a, b| a + b),
        ReduceOp::Max => fold_columns(x, v, T::neg_infinity(), |a, b| a.max(b)),
        ReduceOp::Min => fold_columns(x, v, T::infinity(), |a, b| a.min(b)),
        ReduceOp::ArgMax => unreachable!("argmax handled separately"),
    }
}

/// [`reduce_columns`] for one fold `f` (a concrete closure, so the row loop vectorises).
fn fold_columns<T: Float + Send + Sync>(
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

fn argmax_kernel<T: Float + Send + Sync>(x: &[T], v: AxisView) -> Vec<i32> {
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

fn matmul_kernel<T: Float + Send + Sync + 'static>(
    a: &[T],
    la: MatLayout,
    b: &[T],
    lb: MatLayout,
    d: MatmulDims,
) -> Vec<T> {
    let MatmulDims { batch, m, k, n } = d;
    let mut c = zeroed(batch * m * n);
    if m == 0 || n == 0 {
        return c;
    }
    let par = if m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    for (bi, cb) in c.chunks_mut(m * n).enumerate() {
        let a_off = la.offset + bi * la.batch_stride;
        let b_off = lb.offset + bi * lb.batch_stride;
        if k == 0 {
            continue;
        }
        // SAFETY: the Tensor layer checked that every (row, col) of both operands addresses an
        // element inside its buffer, and `cb` is exactly m·n elements with row stride n.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                cb.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr().add(a_off),
                la.col_stride as isize,
                la.row_stride as isize,
                b.as_ptr().add(b_off),
                lb.col_stride as isize,
                lb.row_stride as isize,
                T::zero(),
                T::one(),
                false,
                false,
                false,
                par,
            );
        }
    }
    c
}

/// Checks every index of `idx` against an axis of size `len` (before any parallel loop).
fn check_indices(idx: &[i32], len: usize, what: &str) -> Result<()> {
    match idx.iter().find(|&&i| i < 0 || i as usize >= len) {
        Some(&bad) => Err(Error::Invalid(format!(
            "{what}: index {bad} out of range for an axis of size {len}"
        ))),
        None => Ok(()),
    }
}

fn gather_kernel<T: Copy + Send + Sync + Default>(
    x: &[T],
    v: AxisView,
    idx: &[i32],
    s: [usize; 3],
    m: usize,
) -> Result<Vec<T>> {
    let AxisView { outer, len, inner } = v;
    check_indices(idx, len, "gather")?;
    if inner == 0 {
        return Ok(Vec::new());
    }
    // One output row (o, j) of `inner` elements at a time; a shared index per row is a memcpy.
    let row = |r: usize, dst: &mut [MaybeUninit<T>]| {
        let (o, j) = (r / m.max(1), r % m.max(1));
        if s[2] == 0 {
            let k = idx[o * s[0] + j * s[1]] as usize;
            let src = &x[(o * len + k) * inner..(o * len + k + 1) * inner];
            for (d, &v) in dst.iter_mut().zip(src) {
                d.write(v);
            }
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                d.write(x[(o * len + k) * inner + i]);
            }
        }
    };
    // SAFETY: every row is `inner` long and both branches write all of it.
    Ok(unsafe { write_chunks(outer * m * inner, inner, row) })
}

/// The row case of [`scatter_add_kernel`], one index per source row (index_select's adjoint, the
/// MoE combine `y[t] = Σ_{rows r of t} contrib[r]`): the source rows are grouped by destination
/// row with a counting sort that keeps source order, then every output row is written once, in
/// parallel, as the in-order sum of its sources. No zeroing pass, no per-thread copies; the
/// additions happen in the same order as the serial loop's, so the result is deterministic.
fn scatter_rows<T: Float + Send + Sync>(
    src: &[T],
    idx: &[i32],
    s: [usize; 3],
    outer: usize,
    m: usize,
    inner: usize,
    len: usize,
) -> Vec<T> {
    let dest = |o: usize, j: usize| o * len + idx[o * s[0] + j * s[1]] as usize;
    // start[r]..start[r + 1]: where output row r's sources sit in `order`
    let mut start = vec![0usize; outer * len + 1];
    for o in 0..outer {
        for j in 0..m {
            start[dest(o, j) + 1] += 1;
        }
    }
    for r in 0..outer * len {
        start[r + 1] += start[r];
    }
    let mut next = start.clone();
    let mut order = vec![0usize; outer * m];
    for o in 0..outer {
        for j in 0..m {
            let d = dest(o, j);
            order[next[d]] = o * m + j;
            next[d] += 1;
        }
    }
    let source = |i: usize| &src[i * inner..(i + 1) * inner];
    let row = |r: usize, dst: &mut [MaybeUninit<T>]| match &order[start[r]..start[r + 1]] {
        [] => dst.fill(MaybeUninit::new(T::zero())),
        [a] => {
            for (d, &x) in dst.iter_mut().zip(source(*a)) {
                d.write(x);
            }
        }
        [a, b] => {
            for ((d, &x), &y) in dst.iter_mut().zip(source(*a)).zip(source(*b)) {
                d.write(x + y);
            }
        }
        [a, rest @ ..] => {
            for (i, (d, &x)) in dst.iter_mut().zip(source(*a)).enumerate() {
                d.write(rest.iter().fold(x, |acc, &b| acc + src[b * inner + i]));
            }
        }
    };
    // SAFETY: every row is `inner` long and each arm writes all of it (the source rows it zips
    // with hold `inner` elements).
    unsafe { write_chunks(outer * len * inner, inner, row) }
}

#[allow(clippy::too_many_arguments)]
fn scatter_add_kernel<T: Float + Send + Sync>(
    src: &[T],
    idx: &[i32],
    s: [usize; 3],
    outer: usize,
    m: usize,
    inner: usize,
    len: usize,
) -> Result<Vec<T>> {
    check_indices(idx, len, "scatter_add")?;
    if s[2] == 0 && inner >= 16 {
        return Ok(scatter_rows(src, idx, s, outer, m, inner, len));
    }
    let mut out = zeroed(outer * len * inner);
    if inner == 0 {
        return Ok(out);
    }
    if inner < 16 {
        // scattering single elements (a top-k's chosen values back into [T, n] logits): one
        // serial pass in source order; splitting a few thousand additions over threads, or
        // grouping them by destination, costs more than the additions
        for o in 0..outer {
            for j in 0..m {
                for i in 0..inner {
                    let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                    let d = &mut out[(o * len + k) * inner + i];
                    *d = *d + src[(o * m + j) * inner + i];
                }
            }
        }
        return Ok(out);
    }
    // Each thread owns a band of columns of every output row, so no two threads add into the same
    // element; within a band the additions happen in source order (deterministic).
    let band = if outer * m * inner >= PAR_MIN {
        inner.div_ceil(rayon::current_num_threads().max(1)).max(64)
    } else {
        inner
    };
    let bands: Vec<(usize, usize)> = (0..inner)
        .step_by(band)
        .map(|c| (c, (c + band).min(inner)))
        .collect();
    let columns: Vec<Vec<T>> = bands
        .par_iter()
        .map(|&(c0, c1)| {
            let w = c1 - c0;
            let mut acc = vec![T::zero(); outer * len * w];
            for o in 0..outer {
                for j in 0..m {
                    let src_row = &src[(o * m + j) * inner..(o * m + j + 1) * inner];
                    if s[2] == 0 {
                        // one index for the whole row (index_select's adjoint, the MoE combine):
                        // add the row slice at once, a loop that vectorises
                        let k = idx[o * s[0] + j * s[1]] as usize;
                        let dst = &mut acc[(o * len + k) * w..(o * len + k + 1) * w];
                        for (d, &x) in dst.iter_mut().zip(&src_row[c0..c1]) {
                            *d = *d + x;
                        }
                        continue;
                    }
                    for i in c0..c1 {
                        let k = idx[o * s[0] + j * s[1] + i * s[2]] as usize;
                        let d = &mut acc[(o * len + k) * w + (i - c0)];
                        *d = *d + src_row[i];
                    }
                }
            }
            acc
        })
        .collect();
    for (&(c0, c1), acc) in bands.iter().zip(&columns) {
        let w = c1 - c0;
        for r in 0..outer * len {
            out[r * inner + c0..r * inner + c1].copy_from_slice(&acc[r * w..(r + 1) * w]);
        }
    }
    Ok(out)
}

fn cumsum_kernel<T: Float>(x: &[T], v: AxisView, reverse: bool) -> Vec<T> {
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

/// A key whose unsigned order is the order of `x` as the sort sees it: NaN as −∞, −0 as +0
/// (each compares equal to its partner, so both must get one key), then the IEEE bits with the
/// sign flipped for positive values and all bits flipped for negative ones.
fn sort_key(x: f64) -> u64 {
    let x = if x.is_nan() {
        f64::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x
    };
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

/// [`sort_key`] for an f32, in 32 bits.
fn sort_key_f32(x: f32) -> u32 {
    let x = if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x
    };
    let bits = x.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | (1 << 31)
    }
}

/// Stable argsort of each row, keeping the first `keep` columns (`keep = len` for a full
/// argsort). Each element becomes one integer, its key (from [`sort_key`], inverted for a
/// descending sort) above its index, so one unstable sort of plain integers gives the stable
/// order: equal keys fall back to the index. With `keep < len` the `keep` first keys are
/// selected (`select_nth_unstable`) and only they are sorted. f32 rows pack into u64, f64 rows
/// into u128. One scratch vector per rayon task, none per row.
fn argsort_kernel<T: Float + Send + Sync>(
    x: &[T],
    rows: usize,
    len: usize,
    keep: usize,
    descending: bool,
) -> Vec<i32> {
    let keep = keep.min(len);
    let mut out = vec![0i32; rows * keep];
    let narrow = std::mem::size_of::<T>() == 4;
    let flip = |k: u64| if descending { !k } else { k };
    let sort_row = |(narrow_keys, wide_keys): &mut (Vec<u64>, Vec<u128>),
                    (r, row_out): (usize, &mut [i32])| {
        let row = &x[r * len..(r + 1) * len];
        if narrow {
            narrow_keys.clear();
            narrow_keys.extend(row.iter().enumerate().map(|(i, v)| {
                let k = sort_key_f32(v.to_f32().unwrap_or(f32::NAN)) as u64;
                (flip(k << 32) & !0xFFFF_FFFF) | i as u64
            }));
            sort_first(narrow_keys, keep);
            for (slot, &k) in row_out.iter_mut().zip(narrow_keys.iter()) {
                *slot = k as u32 as i32;
            }
        } else {
            wide_keys.clear();
            wide_keys.extend(row.iter().enumerate().map(|(i, v)| {
                let k = flip(sort_key(v.to_f64().unwrap_or(f64::NAN)));
                ((k as u128) << 64) | i as u128
            }));
            sort_first(wide_keys, keep);
            for (slot, &k) in row_out.iter_mut().zip(wide_keys.iter()) {
                *slot = k as u64 as i32;
            }
        }
    };
    let scratch = || (Vec::with_capacity(len), Vec::new());
    if keep > 0 {
        if rows * len >= PAR_MIN && rows > 1 {
            out.par_chunks_mut(keep)
                .enumerate()
                .for_each_init(scratch, sort_row);
        } else {
            let mut keys = scratch();
            out.chunks_mut(keep)
                .enumerate()
                .for_each(|row| sort_row(&mut keys, row));
        }
    }
    out
}

/// Sorts the `keep` smallest elements of `v` into its front (all of `v` when `keep ≥ len`).
fn sort_first<K: Ord + Copy>(v: &mut [K], keep: usize) {
    if keep < v.len() {
        if keep == 0 {
            return;
        }
        if keep <= 8 {
            // a router's top-k: one pass that keeps the `keep` smallest keys sorted in front
            // (an insertion when a key beats the worst kept one), cheaper than a selection for
            // short lists; the keys are distinct, so the result is the selection's
            v[..keep].sort_unstable();
            for i in keep..v.len() {
                let key = v[i];
                if key < v[keep - 1] {
                    let mut j = keep - 1;
                    while j > 0 && v[j - 1] > key {
                        v[j] = v[j - 1];
                        j -= 1;
                    }
                    v[j] = key;
                }
            }
            return;
        }
        v.select_nth_unstable(keep - 1);
        v[..keep].sort_unstable();
    } else {
        v.sort_unstable();
    }
}

fn concat_kernel<T: Copy>(parts: &[&[T]], lens: &[usize], outer: usize, inner: usize) -> Vec<T> {
    let total: usize = lens.iter().sum();
    let mut out = pool::take(outer * total * inner).unwrap_or_default();
    for o in 0..outer {
        for (p, &l) in parts.iter().zip(lens) {
            out.extend_from_slice(&p[o * l * inner..(o + 1) * l * inner]);
        }
    }
    out
}

/// The CPU backend (stateless; rayon's global pool does the threading).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn upload(&self, data: &HostData) -> Result<CpuBuffer> {
        Ok(match data {
            HostData::F32(v) => f32b(copied(v)?),
            HostData::F64(v) => f64b(copied(v)?),
            HostData::I32(v) => i32b(copied(v)?),
        })
    }

    fn download(&self, x: &CpuBuffer) -> Result<HostData> {
        Ok(match x {
            CpuBuffer::F32(v) => HostData::F32(v.to_vec()),
            CpuBuffer::F64(v) => HostData::F64(v.to_vec()),
            CpuBuffer::I32(v) => HostData::I32(v.to_vec()),
        })
    }

    fn full(&self, len: usize, value: f64, dtype: DType) -> Result<CpuBuffer> {
        Ok(match dtype {
            DType::F32 => f32b(filled(len, value as f32)?),
            DType::F64 => f64b(filled(len, value)?),
            DType::I32 => i32b(filled(len, value as i32)?),
        })
    }

    fn cast(&self, x: &CpuBuffer, dtype: DType) -> Result<CpuBuffer> {
        let v = self.download(x)?.to_f64();
        Ok(match dtype {
            DType::F32 => f32b(v.iter().map(|&e| e as f32).collect()),
            DType::F64 => f64b(v),
            DType::I32 => i32b(v.iter().map(|&e| e as i32).collect()),
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
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(binary_kernel(op, a, sa, b, sb, shape)))
            }
            _ => Err(Error::DType(format!(
                "{op:?} needs two float tensors of one dtype, got {} and {}",
                a.dtype(),
                b.dtype()
            ))),
        }
    }

    fn where_cond(
        &self,
        cond: &CpuBuffer,
        sc: &[usize],
        a: &CpuBuffer,
        sa: &[usize],
        b: &CpuBuffer,
        sb: &[usize],
        shape: &[usize],
    ) -> Result<CpuBuffer> {
        match (cond, a, b) {
            (CpuBuffer::F32(c), CpuBuffer::F32(a), CpuBuffer::F32(b)) => {
                Ok(f32b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            (CpuBuffer::F64(c), CpuBuffer::F64(a), CpuBuffer::F64(b)) => {
                Ok(f64b(where_kernel(c, sc, a, sa, b, sb, shape)))
            }
            _ => Err(Error::DType(format!(
                "where needs a condition and two values of one float dtype, got {}, {} and {}",
                cond.dtype(),
                a.dtype(),
                b.dtype()
            ))),
        }
    }

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

    fn matmul(
        &self,
        a: &CpuBuffer,
        la: MatLayout,
        b: &CpuBuffer,
        lb: MatLayout,
        d: MatmulDims,
    ) -> Result<CpuBuffer> {
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => Ok(f32b(matmul_kernel(a, la, b, lb, d))),
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => Ok(f64b(matmul_kernel(a, la, b, lb, d))),
            _ => Err(Error::DType(format!(
                "matmul needs two float tensors of one dtype, got {} and {}",
                a.dtype(),
                b.dtype()
            ))),
        }
    }

    fn copy_strided(
        &self,
        x: &CpuBuffer,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<CpuBuffer> {
        if shape.iter().product::<usize>() == 0 {
            return Ok(any_map!(x, _v => Vec::new()));
        }
        Ok(any_map!(x, v => strided_apply(shape, [(&v[offset.min(v.len())..], strides)], |[e]| e)))
    }

    fn concat(
        &self,
        parts: &[&CpuBuffer],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<CpuBuffer> {
        let dtype = parts.first().map(|p| p.dtype()).unwrap_or(DType::F32);
        if parts.iter().any(|p| p.dtype() != dtype) {
            return Err(Error::DType(
                "concat: all tensors must share one dtype".into(),
            ));
        }
        macro_rules! join {
            ($variant:ident, $wrap:ident) => {{
                let slices: Vec<&[_]> = parts
                    .iter()
                    .map(|p| match p {
                        CpuBuffer::$variant(v) => v.as_slice(),
                        _ => unreachable!("dtype checked above"),
                    })
                    .collect();
                $wrap(concat_kernel(&slices, lens, outer, inner))
            }};
        }
        Ok(match dtype {
            DType::F32 => join!(F32, f32b),
            DType::F64 => join!(F64, f64b),
            DType::I32 => join!(I32, i32b),
        })
    }

    fn gather(
        &self,
        x: &CpuBuffer,
        view: AxisView,
        idx: &CpuBuffer,
        s: [usize; 3],
        m: usize,
    ) -> Result<CpuBuffer> {
        let idx = idx.indices("gather")?;
        Ok(match x {
            CpuBuffer::F32(v) => f32b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::F64(v) => f64b(gather_kernel(v, view, idx, s, m)?),
            CpuBuffer::I32(v) => i32b(gather_kernel(v, view, idx, s, m)?),
        })
    }

    fn scatter_add(
        &self,
        src: &CpuBuffer,
        idx: &CpuBuffer,
        s: [usize; 3],
        outer: usize,
        m: usize,
        inner: usize,
        len: usize,
    ) -> Result<CpuBuffer> {
        let idx = idx.indices("scatter_add")?;
        match src {
            CpuBuffer::F32(v) => Ok(f32b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::F64(v) => Ok(f64b(scatter_add_kernel(v, idx, s, outer, m, inner, len)?)),
            CpuBuffer::I32(_) => Err(Error::DType(
                "scatter_add needs a float source, got i32".into(),
            )),
        }
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

    fn grouped_matmul(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        row_expert: &CpuBuffer,
        rows: usize,
        k: usize,
        m: usize,
        experts: usize,
        transpose_w: bool,
    ) -> Result<CpuBuffer> {
        let re = row_expert.indices("grouped_matmul")?;
        match (x, w) {
            (CpuBuffer::F32(x), CpuBuffer::F32(w)) => Ok(f32b(grouped_matmul_kernel(
                x,
                w,
                re,
                rows,
                k,
                m,
                experts,
                transpose_w,
            ))),
            (CpuBuffer::F64(x), CpuBuffer::F64(w)) => Ok(f64b(grouped_matmul_kernel(
                x,
                w,
                re,
                rows,
                k,
                m,
                experts,
                transpose_w,
            ))),
            _ => Err(Error::DType(
                "grouped_matmul needs two float buffers of one dtype".into(),
            )),
        }
    }

    fn grouped_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        row_expert: &CpuBuffer,
        offsets: &CpuBuffer,
        k: usize,
        m: usize,
        experts: usize,
    ) -> Result<CpuBuffer> {
        let routing = expert_routing(row_expert, offsets, experts, "grouped_weight_grad")?;
        match (x, dy) {
            (CpuBuffer::F32(x), CpuBuffer::F32(dy)) => Ok(f32b(
                WeightGradProblem::new(x, dy, routing, (k, m, experts)).all(),
            )),
            (CpuBuffer::F64(x), CpuBuffer::F64(dy)) => Ok(f64b(
                WeightGradProblem::new(x, dy, routing, (k, m, experts)).all(),
            )),
            _ => Err(Error::DType(
                "grouped_weight_grad needs two float buffers of one dtype".into(),
            )),
        }
    }

    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<CpuBuffer> {
        let v: Vec<f32> = tabulate(len, |i| uniform_hash(seed, i as u32));
        self.cast(&f32b(v), dtype)
    }

    fn adam_step(
        &self,
        param: &CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m: &CpuBuffer,
        v: &CpuBuffer,
        h: AdamHyper,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        let (mut p, mut m, mut v) = (param.clone(), m.clone(), v.clone());
        self.adam_step_mut(&mut p, grad, grad_scale, &mut m, &mut v, h)?;
        Ok((p, m, v))
    }

    fn sgd_step(
        &self,
        param: &CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        buf: &CpuBuffer,
        h: SgdHyper,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        let (mut p, mut b) = (param.clone(), buf.clone());
        self.sgd_step_mut(&mut p, grad, grad_scale, &mut b, h)?;
        Ok((p, b))
    }

    fn attention_forward(
        &self,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        check_attention_lengths("attention_forward", &[("q", q), ("k", k), ("v", v)], dims)?;
        match (q, k, v) {
            (CpuBuffer::F32(q), CpuBuffer::F32(k), CpuBuffer::F32(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f32b(o), f32b(lse)))
            }
            (CpuBuffer::F64(q), CpuBuffer::F64(k), CpuBuffer::F64(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f64b(o), f64b(lse)))
            }
            _ => Err(Error::DType(format!(
                "attention_forward needs q, k, v float buffers of one dtype, got {}, {}, {}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ))),
        }
    }

    fn attention_backward(
        &self,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        o: &CpuBuffer,
        lse: &CpuBuffer,
        d_o: &CpuBuffer,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "attention_backward";
        check_attention_lengths(
            WHAT,
            &[("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o)],
            dims,
        )?;
        let rows = dims.heads * dims.seq; // fits: heads·seq·head_dim did, and head_dim ≥ 1
        if lse.len() != rows {
            return Err(Error::Shape(format!(
                "{WHAT}: lse holds {} elements, expected [{}, {}] = {rows}",
                lse.len(),
                dims.heads,
                dims.seq
            )));
        }
        match (q, k, v, o, lse, d_o) {
            (
                CpuBuffer::F32(q),
                CpuBuffer::F32(k),
                CpuBuffer::F32(v),
                CpuBuffer::F32(o),
                CpuBuffer::F32(lse),
                CpuBuffer::F32(d_o),
            ) => {
                let (dq, dk, dv) = attention::backward(q, k, v, o, lse, d_o, dims);
                Ok((f32b(dq), f32b(dk), f32b(dv)))
            }
            (
                CpuBuffer::F64(q),
                CpuBuffer::F64(k),
                CpuBuffer::F64(v),
                CpuBuffer::F64(o),
                CpuBuffer::F64(lse),
                CpuBuffer::F64(d_o),
            ) => {
                let (dq, dk, dv) = attention::backward(q, k, v, o, lse, d_o, dims);
                Ok((f64b(dq), f64b(dk), f64b(dv)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got q {}, k {}, v {}, o {}, lse {}, dO {}",
                q.dtype(),
                k.dtype(),
                v.dtype(),
                o.dtype(),
                lse.dtype(),
                d_o.dtype()
            ))),
        }
    }

    fn layer_norm_forward(
        &self,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        beta: &CpuBuffer,
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_forward";
        check_layer_norm_lengths(
            WHAT,
            &[("x", x)],
            &[("gamma", gamma), ("beta", beta)],
            &[],
            dims,
        )?;
        match (x, gamma, beta) {
            (CpuBuffer::F32(x), CpuBuffer::F32(g), CpuBuffer::F32(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f32b(y), f32b(m), f32b(r)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(g), CpuBuffer::F64(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f64b(y), f64b(m), f64b(r)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, gamma {}, beta {}",
                x.dtype(),
                gamma.dtype(),
                beta.dtype()
            ))),
        }
    }

    fn layer_norm_backward(
        &self,
        g: &CpuBuffer,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        (mean, rstd): (&CpuBuffer, &CpuBuffer),
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_backward";
        check_layer_norm_lengths(
            WHAT,
            &[("g", g), ("x", x)],
            &[("gamma", gamma)],
            &[("mean", mean), ("rstd", rstd)],
            dims,
        )?;
        match (g, x, gamma, mean, rstd) {
            (
                CpuBuffer::F32(g),
                CpuBuffer::F32(x),
                CpuBuffer::F32(w),
                CpuBuffer::F32(m),
                CpuBuffer::F32(r),
            ) => {
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), dims);
                Ok((f32b(dx), f32b(dg), f32b(db)))
            }
            (
                CpuBuffer::F64(g),
                CpuBuffer::F64(x),
                CpuBuffer::F64(w),
                CpuBuffer::F64(m),
                CpuBuffer::F64(r),
            ) => {
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), dims);
                Ok((f64b(dx), f64b(dg), f64b(db)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, x {}, gamma {}, mean {}, rstd {}",
                g.dtype(),
                x.dtype(),
                gamma.dtype(),
                mean.dtype(),
                rstd.dtype()
            ))),
        }
    }

    fn cross_entropy_forward(
        &self,
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        classes: usize,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "cross_entropy";
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        match logits {
            CpuBuffer::F32(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f32b(l), f32b(s)))
            }
            CpuBuffer::F64(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f64b(l), f64b(s)))
            }
            CpuBuffer::I32(_) => Err(Error::DType(format!(
                "{WHAT}: logits must be float, got i32"
            ))),
        }
    }

    fn cross_entropy_backward(
        &self,
        g: &CpuBuffer,
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        lse: &CpuBuffer,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "cross_entropy backward";
        let classes = if targets.is_empty() {
            0
        } else {
            logits.len() / targets.len()
        };
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        if g.len() != t.len() || lse.len() != t.len() {
            return Err(Error::Shape(format!(
                "{WHAT}: g and lse hold {} and {} values, expected one per row ({})",
                g.len(),
                lse.len(),
                t.len()
            )));
        }
        match (g, logits, lse) {
            (CpuBuffer::F32(g), CpuBuffer::F32(x), CpuBuffer::F32(l)) => {
                Ok(f32b(cross_entropy::backward(g, x, t, l, classes)))
            }
            (CpuBuffer::F64(g), CpuBuffer::F64(x), CpuBuffer::F64(l)) => {
                Ok(f64b(cross_entropy::backward(g, x, t, l, classes)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, logits {}, lse {}",
                g.dtype(),
                logits.dtype(),
                lse.dtype()
            ))),
        }
    }

    fn topk_gate(
        &self,
        logits: &CpuBuffer,
        scores: Option<&CpuBuffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "topk_gate";
        check_gate_sizes(WHAT, rows, n, k)?;
        let scores_buf = scores.unwrap_or(logits);
        check_lengths(
            WHAT,
            &[
                ("logits", logits.len(), rows * n),
                ("scores", scores_buf.len(), rows * n),
            ],
        )?;
        let dims = (rows, n, k);
        match (logits, scores_buf) {
            (CpuBuffer::F32(l), CpuBuffer::F32(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = routing::topk_gate(l, s, dims, renormalise);
                Ok((f32b(p), i32b(i), f32b(w)))
            }
            (CpuBuffer::F64(l), CpuBuffer::F64(s)) => {
                let s = scores.map(|_| s.as_slice());
                let (p, i, w) = routing::topk_gate(l, s, dims, renormalise);
                Ok((f64b(p), i32b(i), f64b(w)))
            }
            (l, s) => Err(Error::DType(format!(
                "{WHAT} needs float logits and scores of one dtype, got {} and {}",
                l.dtype(),
                s.dtype()
            ))),
        }
    }

    fn topk_gate_backward(
        &self,
        weights: &CpuBuffer,
        idx: &CpuBuffer,
        d_weights: &CpuBuffer,
        probs: Option<&CpuBuffer>,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "topk_gate backward";
        check_gate_sizes(WHAT, rows, n, k)?;
        let idx = idx.indices(WHAT)?;
        let p_buf = probs.unwrap_or(weights);
        check_lengths(
            WHAT,
            &[
                ("weights", weights.len(), rows * k),
                ("idx", idx.len(), rows * k),
                ("d_weights", d_weights.len(), rows * k),
                (
                    "probs",
                    p_buf.len(),
                    if probs.is_some() { rows * n } else { rows * k },
                ),
            ],
        )?;
        let dims = (rows, n, k);
        match (weights, d_weights, p_buf) {
            (CpuBuffer::F32(w), CpuBuffer::F32(a), CpuBuffer::F32(p)) => Ok(f32b(
                routing::topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            (CpuBuffer::F64(w), CpuBuffer::F64(a), CpuBuffer::F64(p)) => Ok(f64b(
                routing::topk_gate_backward(w, idx, a, probs.map(|_| p.as_slice()), dims),
            )),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weights, gradient and probabilities of one dtype, got {}, {}, {}",
                weights.dtype(),
                d_weights.dtype(),
                p_buf.dtype()
            ))),
        }
    }

    fn softmax_backward(
        &self,
        y: &CpuBuffer,
        dy: &CpuBuffer,
        rows: usize,
        n: usize,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "softmax backward";
        check_gate_sizes(WHAT, rows, n, 1)?;
        check_lengths(
            WHAT,
            &[("y", y.len(), rows * n), ("dy", dy.len(), rows * n)],
        )?;
        match (y, dy) {
            (CpuBuffer::F32(y), CpuBuffer::F32(g)) => Ok(f32b(routing::softmax_backward(y, g, n))),
            (CpuBuffer::F64(y), CpuBuffer::F64(g)) => Ok(f64b(routing::softmax_backward(y, g, n))),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float y and dy of one dtype, got {} and {}",
                y.dtype(),
                dy.dtype()
            ))),
        }
    }

    fn dispatch_plan(
        &self,
        token: &CpuBuffer,
        expert: &CpuBuffer,
        weight: &CpuBuffer,
        rank: &CpuBuffer,
        valid: &CpuBuffer,
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<CpuBuffer>> {
        const WHAT: &str = "dispatch_plan";
        let (token, expert) = (token.indices(WHAT)?, expert.indices(WHAT)?);
        let a = token.len();
        check_lengths(
            WHAT,
            &[
                ("expert", expert.len(), a),
                ("weight", weight.len(), a),
                ("rank", rank.len(), a),
                ("valid", valid.len(), a),
            ],
        )?;
        if experts == 0 || i32::try_from(a).is_err() {
            return Err(Error::Shape(format!(
                "{WHAT}: needs at least one expert and fewer than 2³¹ assignments, got {experts} experts, {a} assignments"
            )));
        }
        match (weight, rank, valid) {
            (CpuBuffer::F32(w), CpuBuffer::F32(r), CpuBuffer::F32(v)) => Ok(
                routing::dispatch_plan(token, expert, (w, r, v), experts, capacity),
            ),
            (CpuBuffer::F64(w), CpuBuffer::F64(r), CpuBuffer::F64(v)) => Ok(
                routing::dispatch_plan(token, expert, (w, r, v), experts, capacity),
            ),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float weight, rank and valid of one dtype, got {}, {}, {}",
                weight.dtype(),
                rank.dtype(),
                valid.dtype()
            ))),
        }
    }

    fn conv2d_forward(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::forward(x, w, image_bank, dims)
    }

    fn conv2d_input_grad(
        &self,
        dy: &CpuBuffer,
        w: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::input_grad(dy, w, image_bank, dims)
    }

    fn conv2d_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::weight_grad(x, dy, image_bank, dims)
    }

    fn pool2d_forward(
        &self,
        kind: PoolKind,
        x: &CpuBuffer,
        dims: Pool2dDims,
    ) -> Result<(CpuBuffer, Option<CpuBuffer>)> {
        pool2d::forward(kind, x, dims)
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        dy: &CpuBuffer,
        argmax: Option<&CpuBuffer>,
        dims: Pool2dDims,
    ) -> Result<CpuBuffer> {
        pool2d::backward(kind, dy, argmax, dims)
    }
}

/// Checks a cross-entropy's operands (logits `[rows, classes]`, I32 targets `[rows]` inside
/// `0..classes`, sizes ≥ 1) and returns the targets.
fn check_cross_entropy<'a>(
    what: &str,
    logits: &CpuBuffer,
    targets: &'a CpuBuffer,
    classes: usize,
) -> Result<&'a [i32]> {
    let t = targets.indices(what)?;
    if t.is_empty() || classes == 0 || t.len().checked_mul(classes) != Some(logits.len()) {
        return Err(Error::Shape(format!(
            "{what}: logits of {} values are not [{} rows, {classes} classes] (sizes ≥ 1)",
            logits.len(),
            t.len()
        )));
    }
    if let Some((r, &bad)) = t
        .iter()
        .enumerate()
        .find(|&(_, &c)| c < 0 || c as usize >= classes)
    {
        return Err(Error::Invalid(format!(
            "{what}: target {bad} of row {r} is not a class in 0..{classes}"
        )));
    }
    Ok(t)
}

/// Checks a layer norm's operands: `[rows, dim]` ones, `[dim]` ones and `[rows]` ones hold that
/// many elements, and no size is zero.
fn check_layer_norm_lengths(
    what: &str,
    matrices: &[(&str, &CpuBuffer)],
    vectors: &[(&str, &CpuBuffer)],
    per_row: &[(&str, &CpuBuffer)],
    dims: LayerNormDims,
) -> Result<()> {
    let LayerNormDims { rows, dim, .. } = dims;
    let n = rows.checked_mul(dim).filter(|&n| n > 0).ok_or_else(|| {
        Error::Shape(format!(
            "{what}: [{rows}, {dim}] must have sizes of at least 1 and fit in memory"
        ))
    })?;
    let groups = [
        (matrices, n, "[rows, dim]"),
        (vectors, dim, "[dim]"),
        (per_row, rows, "[rows]"),
    ];
    for (operands, want, shape) in groups {
        for (name, b) in operands {
            if b.len() != want {
                return Err(Error::Shape(format!(
                    "{what}: {name} holds {} elements, expected {shape} = {want} for rows {rows}, dim {dim}",
                    b.len()
                )));
            }
        }
    }
    Ok(())
}

/// Checks that each `[heads, seq, head_dim]` operand of an attention kernel holds exactly
/// `dims.elements()` elements and that no size is zero.
fn check_attention_lengths(
    what: &str,
    operands: &[(&str, &CpuBuffer)],
    dims: AttentionDims,
) -> Result<()> {
    let AttentionDims {
        heads,
        seq,
        head_dim,
    } = dims;
    let n = dims.elements().ok_or_else(|| {
        Error::Shape(format!(
            "{what}: [{heads}, {seq}, {head_dim}] has more than usize::MAX elements"
        ))
    })?;
    if n == 0 {
        return Err(Error::Shape(format!(
            "{what}: sizes [{heads}, {seq}, {head_dim}] must all be at least 1"
        )));
    }
    for (name, b) in operands {
        if b.len() != n {
            return Err(Error::Shape(format!(
                "{what}: {name} holds {} elements, expected [{heads}, {seq}, {head_dim}] = {n}",
                b.len()
            )));
        }
    }
    Ok(())
}

/// Elements per rayon task in the fused optimizer loops.
const OPT_CHUNK: usize = 1 << 14;

/// Adam's per-step constants in the buffer's own precision (so the f32 loop runs in f32 lanes).
#[derive(Clone, Copy)]
struct AdamConsts<T> {
    b1: T,
    b2: T,
    one_minus_b1: T,
    one_minus_b2: T,
    lr: T,
    wd: T,
    eps: T,
    scale: T,
    inv_bc1: T,
    inv_bc2: T,
}

impl<T: Float> AdamConsts<T> {
    fn new(h: AdamHyper, scale: f64) -> AdamConsts<T> {
        let c = |x: f64| T::from(x).unwrap_or_else(T::nan);
        let (b1, b2) = (c(h.beta1), c(h.beta2));
        AdamConsts {
            b1,
            b2,
            one_minus_b1: T::one() - b1,
            one_minus_b2: T::one() - b2,
            lr: c(h.lr),
            wd: c(h.weight_decay),
            eps: c(h.eps),
            scale: c(scale),
            inv_bc1: c(1.0 / h.bias_correction1),
            inv_bc2: c(1.0 / h.bias_correction2),
        }
    }
}

/// The widest vector instructions this processor offers beyond the baseline build's SSE2, for
/// the loops that are compiled once per width (see [`adam_chunk_wide`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wide {
    /// only the baseline (SSE2 on x86-64, or another architecture)
    Baseline,
    /// AVX2: eight f32 lanes
    Avx2,
    /// AVX-512F: sixteen f32 lanes
    Avx512,
}

impl Wide {
    fn detect() -> Wide {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Wide::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Wide::Avx2;
            }
        }
        Wide::Baseline
    }
}

/// [`adam_chunk`] compiled for the widest vectors `wide` names. Adam is a streaming loop whose
/// `sqrt` and division keep SSE2's four lanes busy for about as long as memory takes to deliver
/// the four arrays; wider lanes leave it bound by memory alone. The results are identical (the
/// same IEEE operations, no fused multiply-adds).
fn adam_chunk_wide<T: Float, const DECOUPLED: bool>(
    wide: Wide,
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    c: AdamConsts<T>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<T: Float, const D: bool>(
            p: &mut [T],
            g: &[T],
            m: &mut [T],
            v: &mut [T],
            c: AdamConsts<T>,
        ) {
            adam_chunk::<T, D>(p, g, m, v, c)
        }
        #[target_feature(enable = "avx2")]
        fn avx2<T: Float, const D: bool>(
            p: &mut [T],
            g: &[T],
            m: &mut [T],
            v: &mut [T],
            c: AdamConsts<T>,
        ) {
            adam_chunk::<T, D>(p, g, m, v, c)
        }
        match wide {
            // SAFETY: `Wide::detect` found the feature on this processor.
            Wide::Avx512 => return unsafe { avx512::<T, DECOUPLED>(p, g, m, v, c) },
            // SAFETY: as above.
            Wide::Avx2 => return unsafe { avx2::<T, DECOUPLED>(p, g, m, v, c) },
            Wide::Baseline => {}
        }
    }
    let _ = wide;
    adam_chunk::<T, DECOUPLED>(p, g, m, v, c)
}

/// One Adam (`DECOUPLED = false`, L2 decay folded into the gradient) or AdamW
/// (`DECOUPLED = true`) update over one chunk, in place. The constants arrive by value and the
/// slices are cut to one length, so the loop has no branch or reload and vectorises.
#[inline(always)]
fn adam_chunk<T: Float, const DECOUPLED: bool>(
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    c: AdamConsts<T>,
) {
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let pi = p[i];
        let mut gi = g[i] * c.scale;
        if !DECOUPLED {
            gi = gi + c.wd * pi;
        }
        let mi = c.b1 * m[i] + c.one_minus_b1 * gi;
        let vi = c.b2 * v[i] + c.one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let update = (mi * c.inv_bc1) / ((vi * c.inv_bc2).sqrt() + c.eps);
        let decay = if DECOUPLED {
            c.lr * c.wd * pi
        } else {
            T::zero()
        };
        p[i] = pi - c.lr * update - decay;
    }
}

impl CpuBackend {
    /// [`Backend::adam_step`] in place: the parameter and moment buffers are updated where they
    /// are when nothing else shares them (copied first otherwise), so a steady-state optimizer
    /// step allocates nothing and touches each element once.
    pub fn adam_step_mut(
        &self,
        param: &mut CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m: &mut CpuBuffer,
        v: &mut CpuBuffer,
        h: AdamHyper,
    ) -> Result<()> {
        let scale = scale_of(grad_scale)?;
        check_same_len(&[param, grad, m, v], "adam_step")?;
        fn run<T: Float + Send + Sync + Clone>(
            p: &mut Arc<PooledVec<T>>,
            g: &[T],
            m: &mut Arc<PooledVec<T>>,
            v: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: AdamHyper,
        ) {
            let (p, m, v) = (Arc::make_mut(p), Arc::make_mut(m), Arc::make_mut(v));
            let c = AdamConsts::new(h, scale);
            let chunks = p
                .par_chunks_mut(OPT_CHUNK)
                .zip(g.par_chunks(OPT_CHUNK))
                .zip(m.par_chunks_mut(OPT_CHUNK))
                .zip(v.par_chunks_mut(OPT_CHUNK));
            // the Adam/AdamW choice is made once here, not per element, so the loop vectorises
            let wide = Wide::detect();
            if h.decoupled {
                chunks.for_each(|(((p, g), m), v)| adam_chunk_wide::<T, true>(wide, p, g, m, v, c));
            } else {
                chunks
                    .for_each(|(((p, g), m), v)| adam_chunk_wide::<T, false>(wide, p, g, m, v, c));
            }
        }
        match (param, grad, m, v) {
            (CpuBuffer::F32(p), CpuBuffer::F32(g), CpuBuffer::F32(m), CpuBuffer::F32(v)) => {
                run(p, g, m, v, scale, h)
            }
            (CpuBuffer::F64(p), CpuBuffer::F64(g), CpuBuffer::F64(m), CpuBuffer::F64(v)) => {
                run(p, g, m, v, scale, h)
            }
            _ => {
                return Err(Error::DType(
                    "adam_step: parameter, gradient and state must share one float dtype".into(),
                ));
            }
        }
        Ok(())
    }

    /// One Adam step on an expert bank `param` (`[experts, k, m]`, with moments `m_state`,
    /// `v_state`) whose gradient is the grouped weight gradient of `x` and `dy` (see
    /// [`Backend::grouped_weight_grad`]), in place and without storing that gradient: each
    /// expert's block is applied while still in cache. The result equals
    /// `grouped_weight_grad` followed by [`CpuBackend::adam_step_mut`], element for element.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_weight_grad_adam_mut(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        row_expert: &CpuBuffer,
        offsets: &CpuBuffer,
        (k, m, experts): (usize, usize, usize),
        param: &mut CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        m_state: &mut CpuBuffer,
        v_state: &mut CpuBuffer,
        h: AdamHyper,
    ) -> Result<()> {
        let what = "grouped_weight_grad_adam";
        let routing = expert_routing(row_expert, offsets, experts, what)?;
        let rows = routing.0.len();
        if x.len() < rows * k || dy.len() < rows * m {
            return Err(Error::Shape(format!(
                "{what}: {rows} rows need x of {rows}×{k} and dy of {rows}×{m} elements, got {} and {}",
                x.len(),
                dy.len()
            )));
        }
        if param.len() != experts * k * m {
            return Err(Error::Shape(format!(
                "{what}: a bank of {experts}×{k}×{m} has {} elements, the parameter has {}",
                experts * k * m,
                param.len()
            )));
        }
        check_same_len(&[param, m_state, v_state], what)?;
        let scale = scale_of(grad_scale)?;
        fn run<T: Float + Send + Sync + Clone + 'static>(
            prob: WeightGradProblem<'_, T>,
            p: &mut Arc<PooledVec<T>>,
            mo: &mut Arc<PooledVec<T>>,
            ve: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: AdamHyper,
        ) {
            let (p, mo, ve) = (Arc::make_mut(p), Arc::make_mut(mo), Arc::make_mut(ve));
            let c = AdamConsts::new(h, scale);
            if h.decoupled {
                prob.adam_step::<true>(p, mo, ve, c)
            } else {
                prob.adam_step::<false>(p, mo, ve, c)
            }
        }
        let dims = (k, m, experts);
        match (x, dy, param, m_state, v_state) {
            (
                CpuBuffer::F32(x),
                CpuBuffer::F32(dy),
                CpuBuffer::F32(p),
                CpuBuffer::F32(mo),
                CpuBuffer::F32(ve),
            ) => run(
                WeightGradProblem::new(x, dy, routing, dims),
                p,
                mo,
                ve,
                scale,
                h,
            ),
            (
                CpuBuffer::F64(x),
                CpuBuffer::F64(dy),
                CpuBuffer::F64(p),
                CpuBuffer::F64(mo),
                CpuBuffer::F64(ve),
            ) => run(
                WeightGradProblem::new(x, dy, routing, dims),
                p,
                mo,
                ve,
                scale,
                h,
            ),
            _ => {
                return Err(Error::DType(format!(
                    "{what}: rows, gradient, parameter and state must share one float dtype"
                )));
            }
        }
        Ok(())
    }

    /// [`Backend::sgd_step`] in place (see [`CpuBackend::adam_step_mut`]).
    pub fn sgd_step_mut(
        &self,
        param: &mut CpuBuffer,
        grad: &CpuBuffer,
        grad_scale: Option<&CpuBuffer>,
        buf: &mut CpuBuffer,
        h: SgdHyper,
    ) -> Result<()> {
        let scale = scale_of(grad_scale)?;
        check_same_len(&[param, grad, buf], "sgd_step")?;
        fn run<T: Float + Send + Sync + Clone>(
            p: &mut Arc<PooledVec<T>>,
            g: &[T],
            b: &mut Arc<PooledVec<T>>,
            scale: f64,
            h: SgdHyper,
        ) {
            let p = Arc::make_mut(p);
            if h.momentum == 0.0 {
                // plain SGD: the momentum buffer is neither read nor written
                p.par_chunks_mut(OPT_CHUNK)
                    .zip(g.par_chunks(OPT_CHUNK))
                    .for_each(|(p, g)| {
                        for (p, g) in p.iter_mut().zip(g) {
                            let pi = p.to_f64().unwrap_or(0.0);
                            let gi = g.to_f64().unwrap_or(0.0) * scale + h.weight_decay * pi;
                            *p = T::from(pi - h.lr * gi).unwrap_or(T::nan());
                        }
                    });
                return;
            }
            let b = Arc::make_mut(b);
            let f = |p: &mut [T], g: &[T], b: &mut [T]| {
                for i in 0..p.len() {
                    let pi = p[i].to_f64().unwrap_or(0.0);
                    let gi = g[i].to_f64().unwrap_or(0.0) * scale + h.weight_decay * pi;
                    let bi = h.momentum * b[i].to_f64().unwrap_or(0.0) + gi;
                    let step = if h.nesterov { gi + h.momentum * bi } else { bi };
                    p[i] = T::from(pi - h.lr * step).unwrap_or(T::nan());
                    b[i] = T::from(bi).unwrap_or(T::nan());
                }
            };
            p.par_chunks_mut(OPT_CHUNK)
                .zip(g.par_chunks(OPT_CHUNK))
                .zip(b.par_chunks_mut(OPT_CHUNK))
                .for_each(|((p, g), b)| f(p, g, b));
        }
        match (param, grad, buf) {
            (CpuBuffer::F32(p), CpuBuffer::F32(g), CpuBuffer::F32(b)) => run(p, g, b, scale, h),
            (CpuBuffer::F64(p), CpuBuffer::F64(g), CpuBuffer::F64(b)) => run(p, g, b, scale, h),
            _ => {
                return Err(Error::DType(
                    "sgd_step: parameter, gradient and state must share one float dtype".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Contiguous runs of rows with one expert: `(expert, first_row, end_row)`.
fn expert_runs(row_expert: &[i32], experts: usize) -> Vec<(usize, usize, usize)> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < row_expert.len() {
        let e = row_expert[start];
        let mut end = start + 1;
        while end < row_expert.len() && row_expert[end] == e {
            end += 1;
        }
        if e >= 0 && (e as usize) < experts {
            runs.push((e as usize, start, end));
        }
        start = end;
    }
    runs
}

/// `c = a·b` (or `c += a·b` with `accumulate`) for one `m×k` by `k×n` product with arbitrary
/// operand strides, written straight into `c` (contiguous, row stride `n`).
///
/// Without `accumulate`, `c` may be uninitialised: its first m·n elements are all written
/// (zeros when `k = 0`) and none is read, so callers skip a zeroing pass over the output.
///
/// # Safety
/// With `accumulate`, the first m·n elements of `c` must be initialised.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into<T: Float + 'static>(
    c: &mut [MaybeUninit<T>],
    a: &[T],
    la: MatLayout,
    b: &[T],
    lb: MatLayout,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || c.len() < m * n {
        if !accumulate {
            c.fill(MaybeUninit::new(T::zero()));
        }
        return;
    }
    // SAFETY: the callers derive every layout from buffers whose sizes the Tensor layer checked
    // (each (row, col) of both operands lies inside its slice), and `c` holds m·n elements.
    // With `read_dst = false` gemm stores `a·b` into every element of `c` without loading it
    // (its `alpha` becomes 0), so uninitialised memory is never read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr().cast::<T>(),
            1,
            n as isize,
            accumulate,
            a.as_ptr().add(la.offset),
            la.col_stride as isize,
            la.row_stride as isize,
            b.as_ptr().add(lb.offset),
            lb.col_stride as isize,
            lb.row_stride as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        );
    }
}

/// With many small per-expert products, threads take whole experts (each GEMM single-threaded);
/// with few large ones, each GEMM uses every thread.
fn per_expert_parallel(runs: usize) -> bool {
    runs >= 2 * rayon::current_num_threads()
}

/// One task of the grouped matmul: a block of rows of one expert (GEMM), or a gap of rows
/// with no expert (zeros).
enum RowTask<'a, T> {
    Gemm(usize, usize, &'a mut [MaybeUninit<T>]),
    Zeros(&'a mut [MaybeUninit<T>]),
}

#[allow(clippy::too_many_arguments)]
fn grouped_matmul_kernel<T: Float + Send + Sync + 'static>(
    x: &[T],
    w: &[T],
    row_expert: &[i32],
    rows: usize,
    k: usize,
    m: usize,
    experts: usize,
    transpose_w: bool,
) -> Vec<T> {
    let len = rows * m;
    let mut out: Vec<T> = pool::take(len).unwrap_or_else(|_| Vec::with_capacity(len));
    // One GEMM per block of rows that share an expert (rows arrive sorted by expert), written
    // into that block's own slice of the output. Long runs are cut into blocks so that the
    // threads take whole single-threaded GEMMs: measured on 2 cores, that is faster than one
    // GEMM split by `gemm`'s own threading, and it serves many small experts alike. The output
    // is not zeroed first: the blocks and the gaps between them (rows with no expert, set to
    // zero) cover every row exactly once.
    let runs = expert_runs(&row_expert[..rows.min(row_expert.len())], experts);
    let block = row_block(rows);
    let mut tasks: Vec<RowTask<T>> = Vec::with_capacity(2 * runs.len() + 1);
    let mut rest: &mut [MaybeUninit<T>] = &mut out.spare_capacity_mut()[..len];
    let mut at = 0;
    for &(e, r0, r1) in &runs {
        let (gap, tail) = std::mem::take(&mut rest).split_at_mut((r0 - at) * m);
        if !gap.is_empty() {
            tasks.push(RowTask::Zeros(gap));
        }
        rest = tail;
        let mut b0 = r0;
        while b0 < r1 {
            let b1 = (b0 + block).min(r1);
            let (part, tail) = std::mem::take(&mut rest).split_at_mut((b1 - b0) * m);
            tasks.push(RowTask::Gemm(e, b0, part));
            rest = tail;
            b0 = b1;
        }
        at = r1;
    }
    if !rest.is_empty() {
        tasks.push(RowTask::Zeros(rest));
    }
    let (rs, cs) = if transpose_w { (1, k) } else { (m, 1) };
    let one = |task: RowTask<T>| match task {
        RowTask::Zeros(part) => part.fill(MaybeUninit::new(T::zero())),
        RowTask::Gemm(e, r0, part) => {
            let la = MatLayout {
                offset: r0 * k,
                batch_stride: 0,
                row_stride: k,
                col_stride: 1,
            };
            let lb = MatLayout {
                offset: e * k * m,
                batch_stride: 0,
                row_stride: rs,
                col_stride: cs,
            };
            let r = part.len() / m.max(1);
            // SAFETY: no accumulation, so `part` may be uninitialised.
            unsafe {
                gemm_into(
                    part,
                    x,
                    la,
                    w,
                    lb,
                    (r, k, m),
                    false,
                    gemm::Parallelism::None,
                )
            };
        }
    };
    tasks.into_par_iter().for_each(one);
    // SAFETY: the tasks covered all `len` elements (gaps, then each run's blocks, then the
    // tail), and each wrote every element of its slice.
    unsafe { out.set_len(len) };
    out
}

/// Rows per task of the grouped matmul: about four tasks per thread over `rows`, at least 64
/// rows (below that a GEMM is mostly packing).
fn row_block(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads().max(1))
        .max(64)
}

/// The operands of a grouped weight gradient `dW[e] = Σ_{rows r of e} x[r]ᵀ·dy[r]`: `x` is
/// `[rows, k]`, `dy` is `[rows, m]`, rows sorted by expert (`row_expert`, with `offsets[e]..
/// offsets[e+1]` bounding expert e's rows), and `dW` is `[experts, k, m]`.
struct WeightGradProblem<'a, T> {
    x: &'a [T],
    dy: &'a [T],
    row_expert: &'a [i32],
    offsets: &'a [i32],
    k: usize,
    m: usize,
    experts: usize,
}

/// A grouped weight gradient's routing (`row_expert`, `offsets`) as i32 slices, checked to
/// describe `experts` experts.
fn expert_routing<'a>(
    row_expert: &'a CpuBuffer,
    offsets: &'a CpuBuffer,
    experts: usize,
    what: &str,
) -> Result<(&'a [i32], &'a [i32])> {
    let re = row_expert.indices(what)?;
    let off = offsets.indices(what)?;
    if off.len() != experts + 1 {
        return Err(Error::Shape(format!(
            "{what}: {} offsets for {experts} experts",
            off.len()
        )));
    }
    Ok((re, off))
}

impl<'a, T: Float + Send + Sync + 'static> WeightGradProblem<'a, T> {
    fn new(
        x: &'a [T],
        dy: &'a [T],
        (row_expert, offsets): (&'a [i32], &'a [i32]),
        (k, m, experts): (usize, usize, usize),
    ) -> Self {
        WeightGradProblem {
            x,
            dy,
            row_expert,
            offsets,
            k,
            m,
            experts,
        }
    }

    /// Writes expert `e`'s block `dW[e]` (k·m elements) into `dw`: the first run of e's rows
    /// writes it, the others add to it, and an expert with no rows gets zeros, so `dw` may be
    /// uninitialised and needs no zeroing pass.
    fn expert(&self, e: usize, dw: &mut [MaybeUninit<T>], par: gemm::Parallelism) {
        let (k, m) = (self.k, self.m);
        let (lo, hi) = (
            self.offsets[e].max(0) as usize,
            (self.offsets[e + 1].max(0) as usize).min(self.row_expert.len()),
        );
        let mut first = true;
        for (_, r0, r1) in expert_runs(&self.row_expert[lo..hi.max(lo)], self.experts)
            .into_iter()
            .filter(|r| r.0 == e)
        {
            let (r0, r1) = (lo + r0, lo + r1);
            let la = MatLayout {
                offset: r0 * k,
                batch_stride: 0,
                row_stride: 1,
                col_stride: k,
            };
            let lb = MatLayout {
                offset: r0 * m,
                batch_stride: 0,
                row_stride: m,
                col_stride: 1,
            };
            // SAFETY: the first product writes all of `dw` (no accumulation); later ones add
            // to what it wrote.
            unsafe { gemm_into(dw, self.x, la, self.dy, lb, (k, r1 - r0, m), !first, par) };
            first = false;
        }
        if first {
            dw.fill(MaybeUninit::new(T::zero()));
        }
    }

    /// Expert `e`'s block written into `scratch` (reused across calls, so a thread's blocks
    /// stay in its cache) and returned.
    fn expert_into<'s>(
        &self,
        e: usize,
        scratch: &'s mut Vec<T>,
        par: gemm::Parallelism,
    ) -> &'s [T] {
        let block = self.k * self.m;
        scratch.clear();
        scratch.reserve(block);
        self.expert(e, &mut scratch.spare_capacity_mut()[..block], par);
        // SAFETY: `expert` wrote all `block` elements.
        unsafe { scratch.set_len(block) };
        scratch
    }

    /// All of `dW`, `[experts, k, m]`.
    fn all(&self) -> Vec<T> {
        let block = self.k * self.m;
        let len = self.experts * block;
        if block == 0 {
            return zeroed(len);
        }
        let mut out: Vec<T> = pool::take(len).unwrap_or_else(|_| Vec::with_capacity(len));
        let blocks = &mut out.spare_capacity_mut()[..len];
        if per_expert_parallel(self.experts) {
            blocks
                .par_chunks_mut(block)
                .enumerate()
                .for_each(|(e, dw)| self.expert(e, dw, gemm::Parallelism::None));
        } else {
            for (e, dw) in blocks.chunks_mut(block).enumerate() {
                self.expert(e, dw, gemm::Parallelism::Rayon(0));
            }
        }
        // SAFETY: each of the `experts` blocks of k·m elements was written by `expert`.
        unsafe { out.set_len(len) };
        out
    }

    /// One Adam step on the expert bank `p` (with moments `mo`, `ve`, all `[experts, k, m]`)
    /// whose gradient is `dW`, without ever storing `dW`: each expert's block is computed into
    /// a per-thread scratch and applied while it is still in cache. Element for element this is
    /// `all()` followed by the Adam step (same products, same update), but the 4·k·m-byte
    /// gradient of every expert is neither written to memory nor read back.
    fn adam_step<const DECOUPLED: bool>(
        &self,
        p: &mut [T],
        mo: &mut [T],
        ve: &mut [T],
        c: AdamConsts<T>,
    ) {
        let block = self.k * self.m;
        if block == 0 {
            return;
        }
        let wide = Wide::detect();
        if per_expert_parallel(self.experts) {
            p.par_chunks_mut(block)
                .zip(mo.par_chunks_mut(block))
                .zip(ve.par_chunks_mut(block))
                .enumerate()
                .for_each_init(Vec::new, |scratch, (e, ((p, m), v))| {
                    let g = self.expert_into(e, scratch, gemm::Parallelism::None);
                    adam_chunk_wide::<T, DECOUPLED>(wide, p, g, m, v, c);
                });
        } else {
            let mut scratch = Vec::new();
            let banks = p
                .chunks_mut(block)
                .zip(mo.chunks_mut(block))
                .zip(ve.chunks_mut(block))
                .enumerate();
            for (e, ((p, m), v)) in banks {
                let g = self.expert_into(e, &mut scratch, gemm::Parallelism::Rayon(0));
                p.par_chunks_mut(OPT_CHUNK)
                    .zip(g.par_chunks(OPT_CHUNK))
                    .zip(m.par_chunks_mut(OPT_CHUNK))
                    .zip(v.par_chunks_mut(OPT_CHUNK))
                    .for_each(|(((p, g), m), v)| {
                        adam_chunk_wide::<T, DECOUPLED>(wide, p, g, m, v, c)
                    });
            }
        }
    }
}

fn scale_of(grad_scale: Option<&CpuBuffer>) -> Result<f64> {
    match grad_scale {
        None => Ok(1.0),
        Some(s) if s.len() == 1 => Ok(CpuBackend.download(s)?.to_f64()[0]),
        Some(s) => Err(Error::Shape(format!(
            "gradient scale must hold one value, it holds {}",
            s.len()
        ))),
    }
}

fn check_same_len(bufs: &[&CpuBuffer], what: &str) -> Result<()> {
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    if lens.iter().any(|&l| l != lens[0]) {
        return Err(Error::Shape(format!(
            "{what}: buffers of lengths {lens:?} must be equal"
        )));
    }
    Ok(())
}
