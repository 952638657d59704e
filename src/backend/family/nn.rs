//! [`NnOps`]: the fused neural-network primitives, each a forward and its backward written as
//! one kernel: causal attention, layer normalisation, SwiGLU, the rotary embedding, softmax
//! cross-entropy, the mean squared error, the row softmax, 2-D convolution and 2-D pooling.

use crate::Result;
use crate::backend::{
    AttentionDims, AttentionGradOperands, BufferOps, Conv2dDims, LayerNormDims,
    PackedAttentionDims, Pool2dDims, PoolKind, RotaryDims, SwiGluDims,
};

/// Fused neural-network primitives: attention, layer norm, SwiGLU, the rotary embedding,
/// cross-entropy, MSE, the row softmax, convolution and pooling.
pub trait NnOps: BufferOps {
    /// Causal self-attention, forward: for each of `dims.heads` pairs, `o = softmax(q·kᵀ·s +
    /// mask)·v` with `s = 1/√Dh` and the mask hiding keys after the query, and the row
    /// log-sum-exp `lse[i] = ln Σ_{j ≤ i} e^{s·q_i·k_j}`. `q`, `k`, `v` are `[heads, seq,
    /// head_dim]`; returns `(o [heads, seq, head_dim], lse [heads, seq])`. The `[seq, seq]` score
    /// matrix is never stored whole (online softmax over key blocks). Sizes ≥ 1.
    fn attention_forward(
        &self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        dims: AttentionDims,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
    /// Causal self-attention, backward: the gradients `(dq, dk, dv)` of
    /// [`NnOps::attention_forward`] for the upstream gradient `d_o`, from its inputs, its
    /// output `o` and its `lse`. The scores are recomputed block by block as
    /// `P = e^{s·q·kᵀ − lse}`, with `D_i = Σ_c dO_ic·O_ic`: `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − D)`,
    /// `dQ = s·dS·K`, `dK = s·dSᵀ·Q`; no `[seq, seq]` buffer is stored.
    fn attention_backward(
        &self,
        operands: AttentionGradOperands<'_, Self::Buffer>,
        dims: AttentionDims,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// [`NnOps::attention_forward`] with `q`, `k` and `v` packed per position in one buffer
    /// `qkv` `[batch, seq, 3, heads, head_dim]` (as `Tensor::causal_attention_packed` takes
    /// them: a fused projection's output, reshaped), read where they are. Returns `(o [batch,
    /// seq, heads, head_dim], lse [batch·heads, seq])`: the output in the layout the output
    /// projection reads, so neither side needs a permute.
    fn attention_forward_packed(
        &self,
        qkv: &Self::Buffer,
        dims: PackedAttentionDims,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
    /// [`NnOps::attention_backward`] for [`NnOps::attention_forward_packed`], from the packed
    /// `qkv` and the forward's `(o, lse, d_o)` (output and upstream gradient `[batch, seq,
    /// heads, head_dim]`, row log-sum-exp): the gradient packed like `qkv`, `[batch, seq, 3,
    /// heads, head_dim]`.
    fn attention_backward_packed(
        &self,
        qkv: &Self::Buffer,
        forward: (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        dims: PackedAttentionDims,
    ) -> Result<Self::Buffer>;
    /// Layer normalisation, forward: for each row `r` of `x` `[rows, dim]`, `mean_r`, the biased
    /// variance `var_r` (two passes), `rstd_r = 1/√(var_r + eps)` and
    /// `y_rj = (x_rj − mean_r)·rstd_r·gamma_j + beta_j`. Returns `(y [rows, dim], mean [rows],
    /// rstd [rows])`; `gamma` and `beta` are `[dim]`. Sizes ≥ 1. With `dims.centered` false it
    /// is RMSNorm: `mean_r = 0` (returned as zeros), `var_r` the mean square and
    /// `y_rj = x_rj·rstd_r·gamma_j`, `beta` unread (callers pass `gamma` again).
    fn layer_norm_forward(
        &self,
        x: &Self::Buffer,
        gamma: &Self::Buffer,
        beta: &Self::Buffer,
        dims: LayerNormDims,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// Layer normalisation, backward: `(dx [rows, dim], dgamma [dim], dbeta [dim])` for the
    /// upstream gradient `g`, from the input `x`, `gamma` and the forward's `mean` and `rstd`.
    /// With `x̂ = (x − mean)·rstd` and `h = g·gamma`:
    /// `dx = rstd·(h − mean_j(h) − x̂·mean_j(h·x̂))`, `dgamma = Σ_r g·x̂`, `dbeta = Σ_r g`, the
    /// column sums taken over the rows in order. RMSNorm (`dims.centered` false) drops the
    /// `mean_j(h)` term (`dbeta` is still returned, and unused). With `pending` (`[rows, dim]`,
    /// `x`'s dtype: the gradient `x` has already received from its other consumers, such as a
    /// residual connection), `dx` is `pending + dx`, one addition per element as the tape's sum
    /// makes it, so the sum costs no launch of its own.
    fn layer_norm_backward(
        &self,
        g: &Self::Buffer,
        x: &Self::Buffer,
        gamma: &Self::Buffer,
        stats: (&Self::Buffer, &Self::Buffer),
        pending: Option<&Self::Buffer>,
        dims: LayerNormDims,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// SwiGLU, forward: for `x` `[rows, 2·half]` with gate `a_rj = x_rj` and up projection
    /// `b_rj = x_r,half+j`, `y_rj = silu(a_rj)·b_rj` with `silu(a) = a·σ(a)`; `y` is
    /// `[rows, half]`. Sizes ≥ 1.
    fn swiglu_forward(&self, x: &Self::Buffer, dims: SwiGluDims) -> Result<Self::Buffer>;
    /// SwiGLU, backward: `dx` `[rows, 2·half]` for the upstream gradient `g` `[rows, half]`,
    /// from the input `x`: `dx_rj = g_rj·b_rj·silu'(a_rj)` in the gate half and
    /// `dx_r,half+j = g_rj·silu(a_rj)` in the up half, `silu'(a) = σ(a)·(1 + a·(1 − σ(a)))`
    /// (recomputed, so only `x` is kept between the passes).
    fn swiglu_backward(
        &self,
        x: &Self::Buffer,
        g: &Self::Buffer,
        dims: SwiGluDims,
    ) -> Result<Self::Buffer>;
    /// Rotary position embedding: `x` is `batch` contiguous `[seq, head_dim]` matrices, `cos`
    /// and `sin` `[table_rows, head_dim]` tables of which rows `0..seq` are read. With `h =
    /// head_dim/2` and `j'` the column paired with `j` (`j ± h`), row `p` of each matrix becomes
    /// `y_pj = x_pj·cos_pj + x_pj'·sin_pj`, or with `dims.transpose` (the backward rule)
    /// `y_pj = x_pj·cos_pj + x_pj'·sin_pj'`. Sizes ≥ 1, `head_dim` even, `seq ≤ table_rows`.
    fn rotary(
        &self,
        x: &Self::Buffer,
        cos: &Self::Buffer,
        sin: &Self::Buffer,
        dims: RotaryDims,
    ) -> Result<Self::Buffer>;
    /// Softmax cross-entropy of each row of `logits` `[rows, classes]` against the I32 class
    /// `targets` `[rows]`: `(loss [rows], lse [rows])` with `lse_r = ln Σ_c e^{x_rc}` (computed
    /// after subtracting the row's maximum) and `loss_r = lse_r − x_{r,t_r}`. A target outside
    /// `0..classes` is an error on the CPU; on the GPU (where checking would need a read-back)
    /// its row's loss is 0. Sizes ≥ 1.
    fn cross_entropy_forward(
        &self,
        logits: &Self::Buffer,
        targets: &Self::Buffer,
        classes: usize,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
    /// The gradient of [`NnOps::cross_entropy_forward`]'s losses for the upstream gradient
    /// `(g, scale)`, `g` `[rows]` or `[1]` (one value for every row: the gradient of the mean
    /// loss, with `scale` `1/rows`): `dlogits_rc = (g_r·scale)·(e^{x_rc − lse_r} − [c = t_r])`
    /// (zero for a GPU row whose target is out of range).
    fn cross_entropy_backward(
        &self,
        g: (&Self::Buffer, f64),
        logits: &Self::Buffer,
        targets: &Self::Buffer,
        lse: &Self::Buffer,
    ) -> Result<Self::Buffer>;
    /// The mean squared error of equal-length float buffers `x` and `t` (at least one element):
    /// a one-element buffer `mean_i (x_i − t_i)²`, of `x`'s dtype.
    fn mse_forward(&self, x: &Self::Buffer, t: &Self::Buffer) -> Result<Self::Buffer>;
    /// The gradient of [`NnOps::mse_forward`] with respect to `x` for the one-element upstream
    /// gradient `g`: `dx_i = (2/N)·g·(x_i − t_i)` (the target's is its negation).
    fn mse_backward(
        &self,
        g: &Self::Buffer,
        x: &Self::Buffer,
        t: &Self::Buffer,
    ) -> Result<Self::Buffer>;
    /// The softmax of each row of `[rows, n]`: `y = e^(x − m) / Σ_c e^(x_c − m)`, `m` the row's
    /// maximum (so every exponent is ≤ 0 and the sum ≥ 1). Sizes ≥ 1.
    fn softmax_forward(&self, x: &Self::Buffer, rows: usize, n: usize) -> Result<Self::Buffer>;
    /// The backward of a softmax over the rows of `[rows, n]` from its output `y`:
    /// `∂x = y ⊙ (dy − Σ_c dy_c y_c)`; with `pending` (`[rows, n]`, the gradient `x` already has)
    /// `pending + ∂x`, to the bit of that add (the tape's folding rule).
    fn softmax_backward(
        &self,
        y_dy: (&Self::Buffer, &Self::Buffer),
        pending: Option<&Self::Buffer>,
        rows: usize,
        n: usize,
    ) -> Result<Self::Buffer>;
    /// 2-D convolution, forward: `y[b, o] = Σ_{c,i,j} w[g_b, o, c, i, j] · x[b, c, s·y + i − p,
    /// s·x + j − p]` (zeros outside the image) with `g_b = image_bank[b]`, or bank 0 for every
    /// image when `image_bank` is `None`. `image_bank` is I32 `[batch]`; an image whose bank is
    /// outside `0..banks` gets a zero output. With `bias` (`[out_channels]`, the weight's dtype)
    /// `bias[o]` is added to every output of channel `o` of an image whose bank is in range, in
    /// the accumulation's precision before the output's rounding (the bits of adding it after
    /// the convolution, in f32 and f64). Layouts in [`Conv2dDims`].
    fn conv2d_forward(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
    ) -> Result<Self::Buffer>;
    /// The input gradient of [`NnOps::conv2d_forward`] for the output gradient `dy`: each
    /// image's `dx` is its bank's weight, transposed, applied to `dy` and folded back onto the
    /// image (col2im). Zero for an image whose bank is out of range.
    fn conv2d_input_grad(
        &self,
        dy: &Self::Buffer,
        w: &Self::Buffer,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
    ) -> Result<Self::Buffer>;
    /// The weight gradient of [`NnOps::conv2d_forward`]: `dw[g] = Σ_{images b of bank g}
    /// dy[b] · windows(x[b])ᵀ`, `[banks, out_channels, in_channels, kernel_h, kernel_w]`, of
    /// dtype `out` (the weight's: that of `x` and `dy`, or on the GPU f32 from f16 operands,
    /// mixed precision's f32 weight, summed without an f16 rounding). A bank no image uses gets
    /// exactly zero.
    fn conv2d_weight_grad(
        &self,
        x: &Self::Buffer,
        dy: &Self::Buffer,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
        out: crate::DType,
    ) -> Result<Self::Buffer>;
    /// 2-D pooling, forward: the max or mean of each window (see [`Pool2dDims`]). Max pooling
    /// also returns, for each output, the position `row·width + col` in its plane of the input
    /// it took (I32, `[planes, out_h, out_w]`); average pooling returns `None` there.
    fn pool2d_forward(
        &self,
        kind: PoolKind,
        x: &Self::Buffer,
        dims: Pool2dDims,
    ) -> Result<(Self::Buffer, Option<Self::Buffer>)>;
    /// The input gradient of [`NnOps::pool2d_forward`]: max pooling adds each output's
    /// gradient to the input its `argmax` names (required); average pooling spreads it evenly,
    /// `dy / kernel²`, over the real pixels of its window.
    fn pool2d_backward(
        &self,
        kind: PoolKind,
        dy: &Self::Buffer,
        argmax: Option<&Self::Buffer>,
        dims: Pool2dDims,
    ) -> Result<Self::Buffer>;
}
