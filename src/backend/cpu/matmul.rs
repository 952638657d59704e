//! The dense `matmul` kernel: one batched `m×k` by `k×n` product through the `gemm` crate
//! (`cpu/gemm.rs`), which takes arbitrary row and column strides (transposed operands need no
//! copy). The grouped (per-expert) products are in `grouped_matmul.rs`.

use super::gemm::{Mat, gemm_uninit};
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
    let mut c = super::buffer_pool::take(batch * m * n)
        .unwrap_or_else(|_| Vec::with_capacity(batch * m * n));
    let par = if m * n * k >= 64 * 64 * 64 {
        ::gemm::Parallelism::Rayon(0)
    } else {
        ::gemm::Parallelism::None
    };
    let out = &mut c.spare_capacity_mut()[..batch * m * n];
    for (bi, cb) in out.chunks_mut(m * n).enumerate() {
        let (mut am, mut bm) = (Mat::from_layout(la), Mat::from_layout(lb));
        am.offset += bi * la.batch_stride;
        bm.offset += bi * lb.batch_stride;
        // SAFETY: no accumulation, so `cb` may be uninitialised; gemm writes every element.
        unsafe {
            gemm_uninit(
                (cb, Mat::rows(0, n)),
                am.over(a),
                bm.over(b),
                (m, k, n),
                false,
                T::one(),
                par,
            )
        };
    }
    // SAFETY: every one of the batch·m·n elements was written by its batch's product above.
    unsafe { c.set_len(batch * m * n) };
    c
}
