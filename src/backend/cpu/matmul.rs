//! The dense `matmul` kernel: one batched `m×k` by `k×n` product through the `gemm` crate,
//! which takes arbitrary row and column strides (transposed operands need no copy). The
//! grouped (per-expert) products are in `grouped_matmul.rs`.

use super::zeroed;
use crate::backend::{MatLayout, MatmulDims};
use num_traits::Float;

pub(super) fn matmul_kernel<T: Float + Send + Sync + 'static>(
    a: &[T],
    la: MatLayout,
    b: &[T],
    lb: MatLayout,
    d: MatmulDims,
) -> Vec<T> {
    let MatmulDims { batch, m, k, n } = d;
    if m == 0 || n == 0 || k == 0 {
        return zeroed(batch * m * n);
    }
    // Not zeroed first: `gemm` is told not to read the output, and writes every element of it.
    let mut c =
        super::pool::take(batch * m * n).unwrap_or_else(|_| Vec::with_capacity(batch * m * n));
    let par = if m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let out = &mut c.spare_capacity_mut()[..batch * m * n];
    for (bi, cb) in out.chunks_mut(m * n).enumerate() {
        let a_off = la.offset + bi * la.batch_stride;
        let b_off = lb.offset + bi * lb.batch_stride;
        // SAFETY: the Tensor layer checked that every (row, col) of both operands addresses an
        // element inside its buffer, and `cb` is exactly m·n elements with row stride n, which
        // gemm writes without reading (`read_dst` false).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                cb.as_mut_ptr() as *mut T,
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
    // SAFETY: every one of the batch·m·n elements was written by its batch's product above.
    unsafe { c.set_len(batch * m * n) };
    c
}
