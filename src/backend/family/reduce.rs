//! [`ReduceOps`]: the primitives that fold or order along one axis: reductions, prefix sums and
//! the stable argsort (whole rows or the first `k` columns).

use crate::Result;
use crate::backend::{AxisView, LayoutOps, ReduceOp};

/// Primitives along one axis: reductions, prefix sums, argsort. It builds on [`LayoutOps`]
/// because the provided [`ReduceOps::argsort_top`] keeps `k` columns with a strided copy.
pub(crate) trait ReduceOps: LayoutOps {
    /// Reduces the middle axis of `x` viewed as `view`; output `[outer, inner]` (I32 for ArgMax).
    fn reduce(&self, op: ReduceOp, x: &Self::Buffer, view: AxisView) -> Result<Self::Buffer>;
    /// The sum along the middle axis of `view` as it is accumulated, without rounding it to
    /// `x`'s dtype: f32 for an f16 `x` (where [`ReduceOps::reduce`] rounds the f32 sum to f16),
    /// `x`'s dtype otherwise. The gradient of an f32 parameter from an f16 upstream gradient
    /// (a bias's, in mixed precision) in one pass, with no trip through f16.
    fn sum_unrounded(&self, x: &Self::Buffer, view: AxisView) -> Result<Self::Buffer> {
        self.reduce(ReduceOp::Sum, x, view)
    }
    /// Inclusive prefix sum along the middle axis of `view` (from the end when `reverse`).
    fn cumsum(&self, x: &Self::Buffer, view: AxisView, reverse: bool) -> Result<Self::Buffer>;
    /// Per row of `x` viewed as `[rows, len]`, the indices that sort it, stable (equal values keep
    /// index order). Output I32 `[rows, len]`.
    fn argsort(
        &self,
        x: &Self::Buffer,
        rows: usize,
        len: usize,
        descending: bool,
    ) -> Result<Self::Buffer>;
    /// The first `k` columns of [`ReduceOps::argsort`]: per row of `x` viewed as `[rows, len]`, the
    /// indices of its `k` largest (`descending`) or smallest values, in sorted order, ties by
    /// index. Output I32 `[rows, k]` (`k ≤ len`). This provided body sorts whole rows and keeps
    /// `k` columns; a backend may select the `k` first instead (top-k routing over many experts).
    fn argsort_top(
        &self,
        x: &Self::Buffer,
        rows: usize,
        len: usize,
        k: usize,
        descending: bool,
    ) -> Result<Self::Buffer> {
        let order = self.argsort(x, rows, len, descending)?;
        if k == len {
            return Ok(order);
        }
        self.copy_strided(&order, &[rows, k], &[len, 1], 0)
    }
}
