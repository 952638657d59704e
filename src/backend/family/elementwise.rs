//! [`ElementwiseOps`]: the primitives that compute each output element from the elements at the
//! same index (fill, cast, unary and binary maps, `where`), and the counter-based random fill.
//! The operators themselves are listed once in `backend/elementwise_ops.rs`.

use crate::backend::{BinaryOp, BufferOps, Strided, UnaryOp};
use crate::{DType, Result};

/// Element-by-element primitives: fills, casts, unary and binary maps, selection and random
/// fills.
pub(crate) trait ElementwiseOps: BufferOps {
    /// A new buffer of `len` elements all equal to `value`.
    fn full(&self, len: usize, value: f64, dtype: DType) -> Result<Self::Buffer>;
    /// Converts every element to `dtype` (floats to I32 truncate toward zero).
    fn cast(&self, x: &Self::Buffer, dtype: DType) -> Result<Self::Buffer>;
    /// `y[i] = op(x[i])` (float dtypes).
    fn unary(&self, op: UnaryOp, x: &Self::Buffer) -> Result<Self::Buffer>;
    /// `c[idx] = op(a[idx·a_strides], b[idx·b_strides])` for every multi-index of `out_shape`
    /// (a broadcast dimension has stride 0). Output contiguous.
    fn binary(
        &self,
        op: BinaryOp,
        a: &Self::Buffer,
        a_strides: &[usize],
        b: &Self::Buffer,
        b_strides: &[usize],
        out_shape: &[usize],
    ) -> Result<Self::Buffer>;
    /// `out[idx] = if cond[idx] != 0 { a[idx] } else { b[idx] }`, each operand through its own
    /// strides over `out_shape`. `cond` has the dtype of `a` and `b`.
    fn where_cond(
        &self,
        cond: Strided<'_, Self::Buffer>,
        a: Strided<'_, Self::Buffer>,
        b: Strided<'_, Self::Buffer>,
        out_shape: &[usize],
    ) -> Result<Self::Buffer>;
    /// `len` values uniform in [0, 1) from a counter-based hash of `(seed, index)`: the same seed
    /// gives the same values on every backend (see [`uniform_hash`](crate::backend::uniform_hash)).
    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<Self::Buffer>;
}
