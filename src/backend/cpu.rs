//! The CPU backend: f32 and f64 (and I32 indices) in plain `Vec`s, elementwise loops split over
//! threads with rayon, and matrix products through the `gemm` crate.
//!
//! `gemm` was picked by measurement on the 2-core development machine (see docs/benchmarks.md):
//! against `matrixmultiply` and `faer` it was the fastest at 256 and 512 and within noise of the
//! best at 1024, and it takes arbitrary row/column strides, so transposed operands need no copy.
//!
//! Every kernel here is generic over the float type through [`Float`](num_traits::Float), so f32 and f64 share one
//! body; the enum [`CpuBuffer`] says which one a buffer holds.
//!
//! This file is the hub: the buffer type [`CpuBuffer`], the handle [`CpuBackend`] and the
//! helpers every kernel uses to allocate its output (`write_chunks`, `tabulate`, the
//! [`buffer_pool`]), and the [`BufferOps`] impl (upload, download). Each family trait of
//! `backend/family/` is implemented in the file of its family, as in `backend/gpu/`; an impl
//! checks the operands, matches on the dtype and calls the kernel:
//!
//! * `elementwise.rs` (unary, binary, where, strided copies; the [`ElementwiseOps`](crate::backend::ElementwiseOps) impl) and
//!   `fast_math.rs` (vectorisable f32 `exp`, `ln`, GELU);
//! * `reduce.rs` (reductions, argmax, cumsum; [`ReduceOps`](crate::backend::ReduceOps)), `layout.rs` (gather,
//!   scatter_add, concat; [`LayoutOps`](crate::backend::LayoutOps)), `sort.rs` (argsort, top-k kernels);
//! * `matmul.rs` (dense products; [`MatmulOps`](crate::backend::MatmulOps)) and `grouped_matmul.rs` (per-expert products
//!   and the expert bank's weight gradient);
//! * `optim.rs` (fused Adam, AdamW and SGD steps, in place; [`OptimOps`](crate::backend::OptimOps));
//! * `routing.rs` (top-k gate, dispatch plan; [`RoutingOps`](crate::backend::RoutingOps)) and `nn.rs`, the [`NnOps`](crate::backend::NnOps) impl
//!   over the fused kernels `attention.rs`, `layer_norm.rs`, `swiglu.rs`, `rotary.rs`,
//!   `cross_entropy.rs`, `conv2d.rs`,
//!   `pool2d.rs` (pooling layers), whose argument checks are the device-neutral ones of
//!   `backend/checks.rs`;
//! * `buffer_pool.rs` (recycled allocations) and `worker.rs` (how a kernel reaches rayon's
//!   worker threads: the `Storage` layer runs every CPU kernel through `worker::on_pool`).

use super::LayerNormDims;
use crate::backend::{BufferOps, HostData};
use crate::{DType, Result};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Below this many elements a loop runs on one thread (spawning costs more than it saves).
const PAR_MIN: usize = 1 << 15;

/// The error of an f16 request on the CPU, which has no f16 buffers.
fn f16_error(what: &str) -> crate::Error {
    crate::Error::DType(format!(
        "{what}: f16 tensors live on the GPU (half precision is a GPU storage format); on the \
         CPU use f32"
    ))
}

/// A CPU buffer: a shared, immutable vector of one dtype (whose allocation returns to the
/// [`buffer_pool`] when the last handle drops).
#[derive(Clone, Debug)]
pub(crate) enum CpuBuffer {
    /// f32 values
    F32(Arc<PooledVec<f32>>),
    /// f64 values
    F64(Arc<PooledVec<f64>>),
    /// i32 values (indices)
    I32(Arc<PooledVec<i32>>),
}

impl CpuBuffer {
    /// The dtype of the elements.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuBuffer::F32(_) => DType::F32,
            CpuBuffer::F64(_) => DType::F64,
            CpuBuffer::I32(_) => DType::I32,
        }
    }
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.len(),
            CpuBuffer::F64(v) => v.len(),
            CpuBuffer::I32(v) => v.len(),
        }
    }
    /// True when empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub(crate) fn indices(&self, what: &str) -> Result<&[i32]> {
        match self {
            CpuBuffer::I32(v) => Ok(v),
            other => Err(crate::backend::checks::indices_dtype_error(
                what,
                other.dtype(),
            )),
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

// The family files come after the macros above, which they use (a `macro_rules!` is visible
// to the modules declared below it).
mod attention;
pub(crate) mod buffer_pool;
mod conv2d;
mod cross_entropy;
mod elementwise;
mod fast_math;
mod gemm;
mod grouped_matmul;
mod layer_norm;
mod layout;
mod matmul;
pub(crate) mod moe_combine;
mod mse;
mod nn;
mod optim;
mod pool2d;
mod reduce;
mod rotary;
mod router_sums;
mod routing;
mod sort;
mod swiglu;
mod worker;
// the block sizes the backend's own tests (backend/tests/) pick their sizes around
#[cfg(test)]
pub(crate) use attention::ATTENTION_BLOCK;
use buffer_pool::PooledVec;
#[cfg(test)]
pub(crate) use conv2d::WEIGHT_GRAD_IMAGES;
pub(crate) use worker::on_pool;
pub(crate) use worker::on_worker_thread;
// read by the fused kernels' files as `super::…`
use sort::{sort_key, sort_key_f32};

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
    let mut out = buffer_pool::take(n).unwrap_or_else(|_| Vec::with_capacity(n));
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
    let mut v = buffer_pool::take(len)?;
    v.resize(len, value);
    Ok(v)
}

/// `len` zeros in a buffer from the [`buffer_pool`] (like `vec![zero; len]`, whose allocation the pool
/// could not take back). A large buffer is zeroed by all the threads, a block each, instead of
/// by the caller alone while the others wait for the kernel that follows.
pub(crate) fn zeroed<T: Copy + Send + num_traits::Zero>(len: usize) -> Vec<T> {
    if len >= PAR_MIN {
        // SAFETY: every chunk is written in full with zeros.
        return unsafe { write_chunks(len, MAP_CHUNK, |_, c| c.fill(MaybeUninit::new(T::zero()))) };
    }
    let mut v = buffer_pool::take(len).unwrap_or_default();
    v.resize(len, T::zero());
    v
}

/// A copy of `values`, allocated fallibly like [`filled`].
fn copied<T: Copy>(values: &[T]) -> Result<Vec<T>> {
    let mut v = buffer_pool::take(values.len())?;
    v.extend_from_slice(values);
    Ok(v)
}

/// Elements per rayon task in the contiguous elementwise loops.
const MAP_CHUNK: usize = 1 << 14;

/// The CPU backend (stateless; rayon's global pool does the threading).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CpuBackend;

impl BufferOps for CpuBackend {
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
}
