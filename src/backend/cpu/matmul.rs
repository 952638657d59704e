//! The dense `matmul` kernel: one batched `m×k` by `k×n` product through the `gemm` crate
//! (`cpu/gemm.rs`), which takes arbitrary row and column strides (transposed operands need no
//! copy). A pair of products (a matmul's backward pass) runs side by side, each on half the
//! threads. The grouped (per-expert) products are in `grouped_matmul.rs`.

use super::gemm::{Mat, gemm_uninit_threaded};
use super::grouped_matmul::{WeightGradProblem, expert_routing, grouped_matmul_kernel};
use super::zeroed;
use super::{CpuBackend, CpuBuffer, f32b, f64b};
use crate::Error;
use crate::Result;
use crate::backend::checks::{binary_dtype_error, check_grouped_bias, check_matmul_bias};
use crate::backend::{ExpertBankDims, GroupedMatmulDims, MatmulOps, MatmulProduct};
use crate::backend::{MatLayout, MatmulDims};
use num_traits::Float;

/// `C[b] = A[b]·B[b]` for every batch entry, contiguous `[batch, m, n]`, each product using
/// up to `threads` threads (see [`gemm_uninit_threaded`]).
pub(super) fn matmul_kernel<T: Float + Send + Sync + 'static>(
    a: &[T],
    la: MatLayout,
    b: &[T],
    lb: MatLayout,
    d: MatmulDims,
    threads: usize,
) -> Vec<T> {
    let MatmulDims { batch, m, k, n } = d;
    if m == 0 || n == 0 || k == 0 {
        return zeroed(batch * m * n);
    }
    // Not zeroed first: `gemm` is told not to read the output, and writes every element of it.
    let mut c = super::buffer_pool::take(batch * m * n)
        .unwrap_or_else(|_| Vec::with_capacity(batch * m * n));
    let out = &mut c.spare_capacity_mut()[..batch * m * n];
    for (bi, cb) in out.chunks_mut(m * n).enumerate() {
        let (mut am, mut bm) = (Mat::from_layout(la), Mat::from_layout(lb));
        am.offset += bi * la.batch_stride;
        bm.offset += bi * lb.batch_stride;
        // SAFETY: no accumulation, so `cb` may be uninitialised; gemm writes every element.
        unsafe {
            gemm_uninit_threaded(
                (cb, Mat::rows(0, n)),
                am.over(a),
                bm.over(b),
                (m, k, n),
                threads,
            )
        };
    }
    // SAFETY: every one of the batch·m·n elements was written by its batch's product above.
    unsafe { c.set_len(batch * m * n) };
    c
}

/// The error of a CPU product asked for an output of another dtype than its operands'.
fn same_dtype_out(what: &str, operands: crate::DType, out: crate::DType) -> Error {
    Error::DType(format!(
        "{what}: {operands} operands give a {operands} output on the CPU, not {out} (f16 \
         products are a GPU format)"
    ))
}

/// [`matmul_kernel`] on buffers of one float dtype, each product on up to `threads` threads,
/// with `bias` (`[n]`) added to every output row after the product (the bits of the product
/// followed by an `add`, in one call).
fn matmul_on(
    p: MatmulProduct<'_, CpuBuffer>,
    bias: Option<&CpuBuffer>,
    threads: usize,
) -> Result<CpuBuffer> {
    let MatmulProduct {
        a,
        a_layout: la,
        b,
        b_layout: lb,
        dims: d,
        out,
        pending,
    } = p;
    if let Some(pending) = pending {
        // the product, then `pending + C` in place (the add's bits)
        let c = matmul_on(MatmulProduct { pending: None, ..p }, bias, threads)?;
        return add_pending(pending, c);
    }
    // the CPU computes in the operands' dtype (mixed precision is a GPU format)
    if out != a.dtype() {
        return Err(same_dtype_out("matmul", a.dtype(), out));
    }
    check_matmul_bias("matmul", bias, d.n, b.dtype())?;
    match (a, b, bias) {
        (CpuBuffer::F32(a), CpuBuffer::F32(b), None) => {
            Ok(f32b(matmul_kernel(a, la, b, lb, d, threads)))
        }
        (CpuBuffer::F32(a), CpuBuffer::F32(b), Some(CpuBuffer::F32(bias))) => {
            let mut c = matmul_kernel(a, la, b, lb, d, threads);
            add_bias(&mut c, bias);
            Ok(f32b(c))
        }
        (CpuBuffer::F64(a), CpuBuffer::F64(b), None) => {
            Ok(f64b(matmul_kernel(a, la, b, lb, d, threads)))
        }
        (CpuBuffer::F64(a), CpuBuffer::F64(b), Some(CpuBuffer::F64(bias))) => {
            let mut c = matmul_kernel(a, la, b, lb, d, threads);
            add_bias(&mut c, bias);
            Ok(f64b(c))
        }
        _ => Err(binary_dtype_error("matmul", a.dtype(), b.dtype())),
    }
}

/// `pending + c`, element by element (the CPU's add kernel: the add's bits): a matmul's
/// backward folding the gradient its input already had.
fn add_pending(pending: &CpuBuffer, c: CpuBuffer) -> Result<CpuBuffer> {
    use crate::backend::{BinaryOp, ElementwiseOps};
    if pending.len() != c.len() || pending.dtype() != c.dtype() {
        return Err(Error::Shape(format!(
            "matmul: the pending gradient holds {} {} values, the product {} {}",
            pending.len(),
            pending.dtype(),
            c.len(),
            c.dtype()
        )));
    }
    CpuBackend.binary(BinaryOp::Add, pending, &[1], &c, &[1], &[c.len()])
}

/// `bias` (`[n]`) added to every row of `c` (`[rows, n]`), in place, the rows split over the
/// threads when `c` is large.
fn add_bias<T: Float + Send + Sync>(c: &mut [T], bias: &[T]) {
    use rayon::prelude::*;
    if bias.is_empty() {
        return; // n = 0: no output
    }
    let add = |row: &mut [T]| row.iter_mut().zip(bias).for_each(|(v, &b)| *v = *v + b);
    if c.len() >= super::PAR_MIN {
        c.par_chunks_mut(bias.len()).for_each(add);
    } else {
        c.chunks_mut(bias.len()).for_each(add);
    }
}

impl MatmulOps for CpuBackend {
    fn matmul(
        &self,
        a: (&CpuBuffer, MatLayout),
        b: (&CpuBuffer, MatLayout),
        bias: Option<&CpuBuffer>,
        dims: MatmulDims,
        out: crate::DType,
    ) -> Result<CpuBuffer> {
        let product = MatmulProduct::new(a, b, dims, out, None);
        matmul_on(product, bias, rayon::current_num_threads())
    }

    fn matmul_plus(
        &self,
        a: (&CpuBuffer, MatLayout),
        b: (&CpuBuffer, MatLayout),
        bias: Option<&CpuBuffer>,
        dims: MatmulDims,
        out: crate::DType,
        pending: &CpuBuffer,
    ) -> Result<CpuBuffer> {
        let product = MatmulProduct::new(a, b, dims, out, Some(pending));
        matmul_on(product, bias, rayon::current_num_threads())
    }

    /// The two products side by side, each on half the threads (on two cores: each a
    /// single-threaded GEMM, instead of each cut in two strips that both pack its shared
    /// operand; 5–9% faster on a `llama` step's gradient shapes, docs/benchmarks.md). Each
    /// output has the bits [`MatmulOps::matmul`] gives: a product's elements do not depend on
    /// how it is cut.
    fn matmul_pair(
        &self,
        first: MatmulProduct<'_, CpuBuffer>,
        second: MatmulProduct<'_, CpuBuffer>,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        let threads = rayon::current_num_threads();
        if threads < 2 {
            return Ok((matmul_on(first, None, 1)?, matmul_on(second, None, 1)?));
        }
        let half = threads / 2;
        let (x, y) = rayon::join(
            || matmul_on(first, None, half),
            || matmul_on(second, None, threads - half),
        );
        Ok((x?, y?))
    }

    fn grouped_matmul(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        row_expert: &CpuBuffer,
        dims: GroupedMatmulDims,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "grouped_matmul";
        let re = row_expert.indices(WHAT)?;
        check_grouped_bias(WHAT, bias, dims)?;
        match (x, w, bias) {
            (CpuBuffer::F32(x), CpuBuffer::F32(w), None) => {
                Ok(f32b(grouped_matmul_kernel(x, w, None, re, dims)))
            }
            (CpuBuffer::F32(x), CpuBuffer::F32(w), Some(CpuBuffer::F32(b))) => {
                Ok(f32b(grouped_matmul_kernel(x, w, Some(b), re, dims)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(w), None) => {
                Ok(f64b(grouped_matmul_kernel(x, w, None, re, dims)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(w), Some(CpuBuffer::F64(b))) => {
                Ok(f64b(grouped_matmul_kernel(x, w, Some(b), re, dims)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, w {}{}",
                x.dtype(),
                w.dtype(),
                bias.map(|b| format!(", bias {}", b.dtype()))
                    .unwrap_or_default()
            ))),
        }
    }

    fn grouped_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        row_expert: &CpuBuffer,
        offsets: &CpuBuffer,
        bank: ExpertBankDims,
        out: crate::DType,
    ) -> Result<CpuBuffer> {
        if out != x.dtype() {
            return Err(same_dtype_out("grouped_weight_grad", x.dtype(), out));
        }
        let ExpertBankDims { k, m, experts } = bank;
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

    fn grouped_bias_grad(
        &self,
        dy: &CpuBuffer,
        (row_expert, offsets): (&CpuBuffer, &CpuBuffer),
        (m, experts): (usize, usize),
        out: crate::DType,
    ) -> Result<CpuBuffer> {
        use crate::backend::ElementwiseOps;
        let ones = self.full(row_expert.len(), 1.0, dy.dtype())?;
        let bank = ExpertBankDims { k: 1, m, experts };
        self.grouped_weight_grad(&ones, dy, row_expert, offsets, bank, out)
    }
}
