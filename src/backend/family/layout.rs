//! [`LayoutOps`]: the primitives that move elements without computing on them: strided copies
//! (transpose, permute, expand, slice), concatenation, gather and its adjoint scatter-add.

use crate::Result;
use crate::backend::{AxisView, BufferOps, ScatterDims};

/// Data-movement primitives: strided copies, concatenation, gather and scatter-add.
pub(crate) trait LayoutOps: BufferOps {
    /// Makes a contiguous copy of the strided view `(shape, strides, offset)` of `x`
    /// (transpose, permute, expand and slice all end here). Any dtype.
    fn copy_strided(
        &self,
        x: &Self::Buffer,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self::Buffer>;
    /// Joins buffers along the middle axis: part `p` is `[outer, lens[p], inner]`, the output
    /// `[outer, Σ lens, inner]`. Any dtype (all parts the same).
    fn concat(
        &self,
        parts: &[&Self::Buffer],
        lens: &[usize],
        outer: usize,
        inner: usize,
    ) -> Result<Self::Buffer>;
    /// `out[o, j, i] = x[o, idx[o·s0 + j·s1 + i·s2], i]` for `j < m`, with `x` viewed as `view`.
    /// `idx_strides = [s0, s1, s2]` lets one primitive serve `gather` (full index tensor) and
    /// `index_select` (one index per row: strides `[0, 1, 0]`). Output `[outer, m, inner]`.
    fn gather(
        &self,
        x: &Self::Buffer,
        view: AxisView,
        idx: &Self::Buffer,
        idx_strides: [usize; 3],
        m: usize,
    ) -> Result<Self::Buffer>;
    /// The adjoint of [`LayoutOps::gather`]: starts from zeros `[outer, len, inner]` and adds
    /// `src[o, j, i]` into `out[o, idx[o·s0 + j·s1 + i·s2], i]`; `src` is `[outer, m, inner]`
    /// (the sizes are `dims`).
    fn scatter_add(
        &self,
        src: &Self::Buffer,
        idx: &Self::Buffer,
        idx_strides: [usize; 3],
        dims: ScatterDims,
    ) -> Result<Self::Buffer>;
}
