//! [`MatmulOps`]: the matrix products: the batched dense matmul (alone, or two independent
//! ones at once as a matmul's backward pass needs), and the grouped (per-expert) matmul of an MoE
//! layer with its expert bank's weight gradient.

use crate::backend::{BufferOps, ExpertBankDims, GroupedMatmulDims, MatLayout, MatmulDims};
use crate::{DType, Result};

/// One product of [`MatmulOps::matmul_pair`]: `A·B` with each operand's layout, the sizes and
/// the output's dtype (no bias: the pair is a backward pass), and the gradient the product's
/// tensor already has, to add to it (see [`MatmulOps::matmul_plus`]).
pub(crate) struct MatmulProduct<'a, B> {
    pub(crate) a: &'a B,
    pub(crate) a_layout: MatLayout,
    pub(crate) b: &'a B,
    pub(crate) b_layout: MatLayout,
    pub(crate) dims: MatmulDims,
    pub(crate) out: DType,
    pub(crate) pending: Option<&'a B>,
}

impl<'a, B> MatmulProduct<'a, B> {
    /// `A·B` (plus `pending`) of the operands with their layouts, into `out`.
    pub(crate) fn new(
        (a, a_layout): (&'a B, MatLayout),
        (b, b_layout): (&'a B, MatLayout),
        dims: MatmulDims,
        out: DType,
        pending: Option<&'a B>,
    ) -> MatmulProduct<'a, B> {
        MatmulProduct {
            a,
            a_layout,
            b,
            b_layout,
            dims,
            out,
            pending,
        }
    }
}

/// Matrix products: dense batched, grouped per expert, and the grouped weight gradient.
pub(crate) trait MatmulOps: BufferOps {
    /// Batched matrix product, output contiguous `[batch, m, n]` of dtype `out`: the operands'
    /// dtype, or on the GPU, for mixed precision, f16 or f32 from f16 A and f32 B, f32 from
    /// f16 A and B, or f16 from f32 A and B (the GPU's `MatmulBuild`); any other combination
    /// is an error. With `bias` (`[n]`,
    /// B's dtype) every output row gets it added, `C[b][r] = A[b][r]·B[b] + bias`, after the
    /// product's sum and before the output is rounded to its dtype: the linear layer's
    /// `x·W + b` in one pass over the output.
    fn matmul(
        &self,
        a: (&Self::Buffer, MatLayout),
        b: (&Self::Buffer, MatLayout),
        bias: Option<&Self::Buffer>,
        dims: MatmulDims,
        out: DType,
    ) -> Result<Self::Buffer>;
    /// `pending + (A·B + bias)`: the product [`MatmulOps::matmul`] computes (with `bias`
    /// where given), rounded to `out`, plus `pending` (contiguous `[batch, m, n]` of dtype
    /// `out`: the gradient a tensor already has, which a matmul's backward folds into the one
    /// it computes, or the residual stream a block's last projection is added to), with the
    /// bits of adding it afterwards. The GPU adds it in the product's own pass (no launch of
    /// its own, no second pass over the output; a product split along k adds it in the pass
    /// that sums the slices).
    fn matmul_plus(
        &self,
        a: (&Self::Buffer, MatLayout),
        b: (&Self::Buffer, MatLayout),
        bias: Option<&Self::Buffer>,
        dims: MatmulDims,
        out: DType,
        pending: &Self::Buffer,
    ) -> Result<Self::Buffer>;
    /// Two independent products, each as [`MatmulOps::matmul`] (or, with its `pending`,
    /// [`MatmulOps::matmul_plus`]) would compute it. A matmul's
    /// backward pass needs two (`dA = dC·Bᵀ` and `dB = Aᵀ·dC`, always the same number of
    /// multiply-adds). This default runs them one after the other; a backend may run them side
    /// by side (the CPU gives each half of its threads, so that no product is cut in strips
    /// whose threads each pack the same shared operand).
    fn matmul_pair(
        &self,
        first: MatmulProduct<'_, Self::Buffer>,
        second: MatmulProduct<'_, Self::Buffer>,
    ) -> Result<(Self::Buffer, Self::Buffer)> {
        let one = |p: MatmulProduct<'_, Self::Buffer>| match p.pending {
            Some(q) => {
                self.matmul_plus((p.a, p.a_layout), (p.b, p.b_layout), None, p.dims, p.out, q)
            }
            None => self.matmul((p.a, p.a_layout), (p.b, p.b_layout), None, p.dims, p.out),
        };
        Ok((one(first)?, one(second)?))
    }
    /// The grouped (per-expert) matmul of an MoE layer: `out[r] = x[r] · W[e_r]` (or `W[e_r]ᵀ`
    /// with `transpose_w`), `x: [R, k]`, `w: [n, k, m]` (`[n, m, k]` when transposed),
    /// `row_expert: [R]` I32. With `bias` (`[n, m]`, not with `transpose_w`), each row gets its
    /// expert's bias added: `out[r] = x[r] · W[e_r] + b[e_r]`. Rows whose expert is outside `0..n`
    /// produce zeros (no bias). Rows should be sorted by expert (the dispatch plan does this) so a
    /// GPU tile mostly meets one expert; the result does not depend on it. Output `[R, m]`. Each
    /// expert's weights are read only for its own rows.
    fn grouped_matmul(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        row_expert: &Self::Buffer,
        dims: GroupedMatmulDims,
    ) -> Result<Self::Buffer>;
    /// The weight gradient of [`MatmulOps::grouped_matmul`]: `dW[e] = Σ_{r in e's segment,
    /// row_expert[r] = e} x[r]ᵀ · dy[r]`, `x: [R, k]`, `dy: [R, m]`, output `[n, k, m]`. Rows are
    /// sorted by expert and `offsets` (I32, `n + 1` entries) gives each expert's segment; an expert
    /// with no rows gets exactly zero. The output has dtype `out`: that of `x` and `dy`, or f32
    /// from f16 ones on the GPU (an f32 bank's gradient in mixed precision).
    fn grouped_weight_grad(
        &self,
        x: &Self::Buffer,
        dy: &Self::Buffer,
        row_expert: &Self::Buffer,
        offsets: &Self::Buffer,
        bank: ExpertBankDims,
        out: DType,
    ) -> Result<Self::Buffer>;
    /// The bias gradient of [`MatmulOps::grouped_matmul`]: `db[e] = Σ_{r in e's segment,
    /// row_expert[r] = e} dy[r]`, `dy: [R, m]`, output `[n, m]` of dtype `out`: the same as
    /// [`MatmulOps::grouped_weight_grad`] with `x` a column of ones (`k = 1`), to the bit. The
    /// GPU's kernel reads the ones it is not given; the CPU builds them.
    fn grouped_bias_grad(
        &self,
        dy: &Self::Buffer,
        routing: (&Self::Buffer, &Self::Buffer),
        sizes: (usize, usize),
        out: DType,
    ) -> Result<Self::Buffer>;
}
