//! The Backend trait: device buffers and the primitive kernels every device must provide.
//!
//! This layer knows nothing about autograd. A backend owns flat, contiguous buffers (each buffer
//! knows its [`DType`] and length) and runs a small set of primitives over them. Everything the
//! `Tensor` API offers (softmax, cross-entropy, top-k, every backward rule) is composed from these
//! primitives in `ops/`, once, for all devices: that is the tinygrad lesson, and it means a new
//! backend implements this file's trait and nothing else.
//!
//! Shapes passed here are already checked by the `Tensor` layer; a backend may still return an
//! error (unsupported dtype, GPU failure) but must never panic.
//!
//! Two implementations exist: [`cpu::CpuBackend`] (f32/f64, rayon, GEMM crate) and
//! [`gpu::GpuBackend`] (wgpu + WGSL kernels in `shaders/`, f32). [`Storage`] is the enum a tensor
//! holds; its methods dispatch to the right backend.

mod checks;
pub mod cpu;
mod dims;
mod elementwise_ops;
pub mod gpu;

pub use dims::{
    AttentionDims, AttentionGradOperands, AxisView, Conv2dDims, ExpertBankDims, GroupedMatmulDims,
    LayerNormDims, MatLayout, MatmulDims, Pool2dDims, PoolKind, ScatterDims, Strided,
};

pub(crate) use elementwise_ops::wgsl_op_consts;
pub use elementwise_ops::{BinaryOp, UnaryOp};

use crate::{DType, Result};

/// Reductions along one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// sum
    Sum,
    /// maximum
    Max,
    /// minimum
    Min,
    /// index of the first maximum (output dtype I32)
    ArgMax,
}

/// Hyper-parameters of one fused Adam/AdamW update (see `optim::Adam` for the formulas).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    /// learning rate at this step
    pub lr: f64,
    /// first-moment decay β₁
    pub beta1: f64,
    /// second-moment decay β₂
    pub beta2: f64,
    /// added to √v̂
    pub eps: f64,
    /// weight decay λ
    pub weight_decay: f64,
    /// AdamW (decoupled: `p −= lr·λ·p`) instead of Adam's L2 (`g += λ·p`)
    pub decoupled: bool,
    /// `1 − β₁ᵗ`
    pub bias_correction1: f64,
    /// `1 − β₂ᵗ`
    pub bias_correction2: f64,
}

/// Hyper-parameters of one fused SGD update (see `optim::Sgd`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdHyper {
    /// learning rate at this step
    pub lr: f64,
    /// momentum μ (0 for plain SGD)
    pub momentum: f64,
    /// weight decay λ (L2: `g += λ·p`)
    pub weight_decay: f64,
    /// Nesterov momentum
    pub nesterov: bool,
}

/// Host-side data, as uploaded to or read back from a device.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// 32-bit floats
    F32(Vec<f32>),
    /// 64-bit floats
    F64(Vec<f64>),
    /// 32-bit signed integers (indices, labels)
    I32(Vec<i32>),
}

impl HostData {
    /// The dtype of the data.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F64(_) => DType::F64,
            HostData::I32(_) => DType::I32,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F64(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values as f64 (lossless for every dtype moegrad has).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            HostData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::F64(v) => v.clone(),
            HostData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }
}

/// The operands of an expert bank's weight gradient ([`Backend::grouped_weight_grad`]): the
/// rows `x` `[R, k]`, the upstream gradient `dy` `[R, m]`, each row's expert `row_expert`
/// `[R]` and the experts' segments `offsets` `[experts + 1]` (both I32), and the bank's sizes.
/// The fused optimizer steps (`grouped_weight_grad_adam_mut`) take it to compute the gradient
/// inside the update instead of storing it.
#[derive(Debug)]
pub struct BankGradOperands<'a, B> {
    /// the rows `[R, k]`
    pub x: &'a B,
    /// the upstream gradient `[R, m]`
    pub dy: &'a B,
    /// each row's expert `[R]`
    pub row_expert: &'a B,
    /// each expert's first row, then `R`: `[experts + 1]`
    pub offsets: &'a B,
    /// the bank's sizes `[experts, k, m]`
    pub bank: ExpertBankDims,
}

/// The buffers of an MoE dispatch plan ([`Backend::dispatch_plan`]; `moe::DispatchPlan` wraps
/// them as tensors). `A` is the number of assignments, `n` the number of experts.
#[derive(Clone, Debug)]
pub struct PlanBuffers<B> {
    /// `[A]` I32: sorted position → assignment
    pub order: B,
    /// `[A]` I32: the token of each sorted row
    pub row_token: B,
    /// `[A]` I32: the expert of each sorted row, `−1` when dropped or invalid
    pub row_expert: B,
    /// `[A]` I32: the expert of each sorted row clamped to `0..n`
    pub row_expert_clamped: B,
    /// `[A]` F32 0/1: whether the sorted row is kept
    pub row_kept: B,
    /// `[n + 1]` I32: where each expert's rows start, and (last) where the invalid ones start
    pub offsets: B,
    /// `[n]` F32: kept assignments per expert
    pub kept_per_expert: B,
    /// `[n]` F32: valid assignments per expert before capacity
    pub routed_per_expert: B,
}

/// Checks the sizes of a routing primitive's operands (shared by both backends): each
/// `(name, length, expected)` must match, and `what` names the primitive in the error.
pub(crate) fn check_lengths(what: &str, operands: &[(&str, usize, usize)]) -> Result<()> {
    match operands.iter().find(|(_, len, want)| len != want) {
        None => Ok(()),
        Some((name, len, want)) => Err(crate::Error::Shape(format!(
            "{what}: {name} holds {len} elements, expected {want}"
        ))),
    }
}

/// Checks the sizes of a top-k gate: `rows, n ≥ 1` and `1 ≤ k ≤ n`.
pub(crate) fn check_gate_sizes(what: &str, rows: usize, n: usize, k: usize) -> Result<()> {
    if rows == 0 || n == 0 || k == 0 || k > n {
        return Err(crate::Error::Shape(format!(
            "{what}: needs rows ≥ 1, n ≥ 1 and 1 ≤ k ≤ n, got rows {rows}, n {n}, k {k}"
        )));
    }
    rows.checked_mul(n)
        .map(|_| ())
        .ok_or_else(|| crate::Error::Shape(format!("{what}: {rows} × {n} is too large")))
}

/// Checks the operand lengths of a top-k gate's backward rule: `weights`, `idx` and
/// `d_weights` hold `rows·k` elements, and the probabilities `rows·n` when they are given
/// (`probs_given`) or `rows·k` when the weights stand in for them.
pub(crate) fn check_gate_backward_lengths(
    what: &str,
    [weights, idx, d_weights, probs]: [usize; 4],
    probs_given: bool,
    (rows, n, k): (usize, usize, usize),
) -> Result<()> {
    check_lengths(
        what,
        &[
            ("weights", weights, rows * k),
            ("idx", idx, rows * k),
            ("d_weights", d_weights, rows * k),
            (
                "probs",
                probs,
                if probs_given { rows * n } else { rows * k },
            ),
        ],
    )
}

/// The primitives a device provides. Buffers are flat and contiguous; each knows its dtype and length.
///
/// Index buffers (`idx` arguments, argsort and argmax outputs) are [`DType::I32`]. Index values are
/// checked by the caller to lie in range before they reach a kernel, where that is cheap; kernels
/// must still never read or write out of bounds (they clamp or skip).
pub trait Backend {
    /// A device buffer.
    type Buffer: Clone;

    /// Copies host data to the device.
    fn upload(&self, data: &HostData) -> Result<Self::Buffer>;
    /// Copies a buffer back to the host (on the GPU this waits for pending work).
    fn download(&self, x: &Self::Buffer) -> Result<HostData>;
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
    /// Reduces the middle axis of `x` viewed as `view`; output `[outer, inner]` (I32 for ArgMax).
    fn reduce(&self, op: ReduceOp, x: &Self::Buffer, view: AxisView) -> Result<Self::Buffer>;
    /// Batched matrix product, output contiguous `[batch, m, n]`.
    fn matmul(
        &self,
        a: &Self::Buffer,
        a_layout: MatLayout,
        b: &Self::Buffer,
        b_layout: MatLayout,
        dims: MatmulDims,
    ) -> Result<Self::Buffer>;
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
    /// The adjoint of [`Backend::gather`]: starts from zeros `[outer, len, inner]` and adds
    /// `src[o, j, i]` into `out[o, idx[o·s0 + j·s1 + i·s2], i]`; `src` is `[outer, m, inner]`
    /// (the sizes are `dims`).
    fn scatter_add(
        &self,
        src: &Self::Buffer,
        idx: &Self::Buffer,
        idx_strides: [usize; 3],
        dims: ScatterDims,
    ) -> Result<Self::Buffer>;
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
    /// The first `k` columns of [`Backend::argsort`]: per row of `x` viewed as `[rows, len]`, the
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
    /// The weight gradient of [`Backend::grouped_matmul`]: `dW[e] = Σ_{r in e's segment,
    /// row_expert[r] = e} x[r]ᵀ · dy[r]`, `x: [R, k]`, `dy: [R, m]`, output `[n, k, m]`. Rows are
    /// sorted by expert and `offsets` (I32, `n + 1` entries) gives each expert's segment; an expert
    /// with no rows gets exactly zero.
    fn grouped_weight_grad(
        &self,
        x: &Self::Buffer,
        dy: &Self::Buffer,
        row_expert: &Self::Buffer,
        offsets: &Self::Buffer,
        bank: ExpertBankDims,
    ) -> Result<Self::Buffer>;
    /// `len` values uniform in [0, 1) from a counter-based hash of `(seed, index)`: the same seed
    /// gives the same values on every backend (see [`uniform_hash`]).
    fn random_uniform(&self, len: usize, seed: u64, dtype: DType) -> Result<Self::Buffer>;
    /// One fused Adam/AdamW step over a parameter buffer. `grad_scale`, when given, is a
    /// one-element buffer multiplying the gradient first (gradient clipping without a read-back).
    /// Returns the new `(param, m, v)`.
    fn adam_step(
        &self,
        param: &Self::Buffer,
        grad: &Self::Buffer,
        grad_scale: Option<&Self::Buffer>,
        m: &Self::Buffer,
        v: &Self::Buffer,
        h: AdamHyper,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// One fused SGD step (momentum buffer `buf`, ignored when momentum is 0). Returns the new
    /// `(param, buf)`.
    fn sgd_step(
        &self,
        param: &Self::Buffer,
        grad: &Self::Buffer,
        grad_scale: Option<&Self::Buffer>,
        buf: &Self::Buffer,
        h: SgdHyper,
    ) -> Result<(Self::Buffer, Self::Buffer)>;
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
    /// [`Backend::attention_forward`] for the upstream gradient `d_o`, from its inputs, its
    /// output `o` and its `lse`. The scores are recomputed block by block as
    /// `P = e^{s·q·kᵀ − lse}`, with `D_i = Σ_c dO_ic·O_ic`: `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − D)`,
    /// `dQ = s·dS·K`, `dK = s·dSᵀ·Q`; no `[seq, seq]` buffer is stored.
    fn attention_backward(
        &self,
        operands: AttentionGradOperands<'_, Self::Buffer>,
        dims: AttentionDims,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// The fused gate of a top-k router, one row of `[rows, n]` at a time: `probs = softmax(logits)`;
    /// `idx` (I32 `[rows, k]`) the `k` largest `scores` (the logits when `scores` is `None`) in
    /// descending order, ties by the lowest index, NaN as the smallest value (as
    /// [`Backend::argsort`]); `weights` (`[rows, k]`) the softmax over the `k` selected scores
    /// (`renormalise`, Shazeer's gate) or the probabilities at `idx` (unnormalised). Returns
    /// `(probs, idx, weights)`. Sizes ≥ 1, `k ≤ n`.
    fn topk_gate(
        &self,
        logits: &Self::Buffer,
        scores: Option<&Self::Buffer>,
        rows: usize,
        n: usize,
        k: usize,
        renormalise: bool,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
    /// The gradient of [`Backend::topk_gate`]'s `weights` with respect to what they were computed
    /// from, for the upstream gradient `d_weights` (`[rows, k]`); output `[rows, n]`. Renormalised
    /// (`probs` is `None`): `∂scores[idx_j] = w_j (a_j − Σ_i w_i a_i)`, zero elsewhere.
    /// Unnormalised (`probs` given, `[rows, n]`): `∂logits_c = p_c (a'_c − Σ_j a_j w_j)`, with
    /// `a'_c = a_j` where `c = idx_j` and 0 elsewhere. `sizes` is `(rows, n, k)`.
    fn topk_gate_backward(
        &self,
        weights: &Self::Buffer,
        idx: &Self::Buffer,
        d_weights: &Self::Buffer,
        probs: Option<&Self::Buffer>,
        sizes: (usize, usize, usize),
    ) -> Result<Self::Buffer>;
    /// The backward of a softmax over the rows of `[rows, n]` from its output `y`:
    /// `∂x = y ⊙ (dy − Σ_c dy_c y_c)`.
    fn softmax_backward(
        &self,
        y: &Self::Buffer,
        dy: &Self::Buffer,
        rows: usize,
        n: usize,
    ) -> Result<Self::Buffer>;
    /// The MoE dispatch plan of `A` assignments over `experts` experts (see `moe::dispatch`):
    /// assignment `i` goes to expert `expert[i]` (I32) when `valid[i] ≠ 0` and the expert is in
    /// `0..experts`, else to a trash group after the last expert. The rows are the assignments
    /// sorted by (expert, `rank` ascending, `weight` descending with NaN last, `i`), and a row is
    /// kept while its position within its expert is below `capacity` (`None`: always).
    /// `token` (I32) and the float `(weight, rank, valid)` are `[A]`.
    fn dispatch_plan(
        &self,
        token: &Self::Buffer,
        expert: &Self::Buffer,
        order_keys: (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<PlanBuffers<Self::Buffer>>;
    /// Layer normalisation, forward: for each row `r` of `x` `[rows, dim]`, `mean_r`, the biased
    /// variance `var_r` (two passes), `rstd_r = 1/√(var_r + eps)` and
    /// `y_rj = (x_rj − mean_r)·rstd_r·gamma_j + beta_j`. Returns `(y [rows, dim], mean [rows],
    /// rstd [rows])`; `gamma` and `beta` are `[dim]`. Sizes ≥ 1.
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
    /// column sums taken over the rows in order.
    fn layer_norm_backward(
        &self,
        g: &Self::Buffer,
        x: &Self::Buffer,
        gamma: &Self::Buffer,
        stats: (&Self::Buffer, &Self::Buffer),
        dims: LayerNormDims,
    ) -> Result<(Self::Buffer, Self::Buffer, Self::Buffer)>;
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
    /// The gradient of [`Backend::cross_entropy_forward`]'s losses for the upstream gradient `g`
    /// `[rows]`: `dlogits_rc = g_r·(e^{x_rc − lse_r} − [c = t_r])` (zero for a GPU row whose
    /// target is out of range).
    fn cross_entropy_backward(
        &self,
        g: &Self::Buffer,
        logits: &Self::Buffer,
        targets: &Self::Buffer,
        lse: &Self::Buffer,
    ) -> Result<Self::Buffer>;
    /// 2-D convolution, forward: `y[b, o] = Σ_{c,i,j} w[g_b, o, c, i, j] · x[b, c, s·y + i − p,
    /// s·x + j − p]` (zeros outside the image) with `g_b = image_bank[b]`, or bank 0 for every
    /// image when `image_bank` is `None`. `image_bank` is I32 `[batch]`; an image whose bank is
    /// outside `0..banks` gets a zero output. Layouts in [`Conv2dDims`].
    fn conv2d_forward(
        &self,
        x: &Self::Buffer,
        w: &Self::Buffer,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
    ) -> Result<Self::Buffer>;
    /// The input gradient of [`Backend::conv2d_forward`] for the output gradient `dy`: each
    /// image's `dx` is its bank's weight, transposed, applied to `dy` and folded back onto the
    /// image (col2im). Zero for an image whose bank is out of range.
    fn conv2d_input_grad(
        &self,
        dy: &Self::Buffer,
        w: &Self::Buffer,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
    ) -> Result<Self::Buffer>;
    /// The weight gradient of [`Backend::conv2d_forward`]: `dw[g] = Σ_{images b of bank g}
    /// dy[b] · windows(x[b])ᵀ`, `[banks, out_channels, in_channels, kernel_h, kernel_w]`. A bank
    /// no image uses gets exactly zero.
    fn conv2d_weight_grad(
        &self,
        x: &Self::Buffer,
        dy: &Self::Buffer,
        image_bank: Option<&Self::Buffer>,
        dims: Conv2dDims,
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
    /// The input gradient of [`Backend::pool2d_forward`]: max pooling adds each output's
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

/// The counter-based generator behind [`Backend::random_uniform`], written once here and
/// mirrored in `shaders/random.wgsl`: two rounds of the MurmurHash3 32-bit finaliser over the
/// element index mixed with the two halves of the seed; the top 24 bits give a float in [0, 1).
pub fn uniform_hash(seed: u64, index: u32) -> f32 {
    fn fmix(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x85eb_ca6b);
        x ^= x >> 13;
        x = x.wrapping_mul(0xc2b2_ae35);
        x ^= x >> 16;
        x
    }
    let (lo, hi) = (seed as u32, (seed >> 32) as u32);
    let h = fmix(fmix(index ^ lo).wrapping_add(0x9e37_79b9) ^ hi);
    (h >> 8) as f32 / 16_777_216.0
}

mod storage;
pub use storage::Storage;
