//! The geometry structs the primitives of [`super::Backend`] take: how a tensor is seen around one
//! axis ([`AxisView`]), how a matmul operand sits in its buffer ([`MatLayout`]), and the sizes of
//! a matmul, an attention, a layer norm, a SwiGLU, a rotary embedding, a 2-D convolution and a 2-D pooling, one strided operand
//! of an elementwise primitive ([`Strided`]) and the sizes of a scatter ([`ScatterDims`]). Plain `Copy`
//! structs, checked once by the `Tensor` layer (or by their own `check`), so that a kernel gets
//! one argument per concept instead of a long list of sizes.

/// A tensor viewed as `[outer, len, inner]` around one axis: `len` is the axis' size, `outer` the
/// product of the sizes before it and `inner` the product of those after it. Element
/// `(o, j, i)` sits at `o·len·inner + j·inner + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisView {
    /// product of the dimensions before the axis
    pub outer: usize,
    /// size of the axis
    pub len: usize,
    /// product of the dimensions after the axis
    pub inner: usize,
}

/// How one operand of a (batched) matmul is laid out in its buffer: element `(b, r, c)` is at
/// `offset + b·batch_stride + r·row_stride + c·col_stride`. A transposed operand just swaps the
/// two strides; a broadcast batch has `batch_stride = 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatLayout {
    /// element offset of `(0, 0, 0)`
    pub offset: usize,
    /// distance between consecutive matrices
    pub batch_stride: usize,
    /// distance between consecutive rows
    pub row_stride: usize,
    /// distance between consecutive columns
    pub col_stride: usize,
}

/// Sizes of a batched matmul `C[b] = A[b] · B[b]`, `A[b]: m×k`, `B[b]: k×n`, `C` contiguous `[batch, m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    /// number of matrices
    pub batch: usize,
    /// rows of A and C
    pub m: usize,
    /// columns of A, rows of B
    pub k: usize,
    /// columns of B and C
    pub n: usize,
}

/// Sizes of a causal self-attention over `heads` independent (batch, head) pairs: each of Q, K, V
/// and the output is contiguous `[heads, seq, head_dim]` (the `[B, H, T, Dh]` of
/// `Tensor::causal_attention` with B·H folded into `heads`), the row log-sum-exp `[heads, seq]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// number of (batch, head) pairs, B·H
    pub heads: usize,
    /// sequence length T (queries and keys)
    pub seq: usize,
    /// head dimension Dh
    pub head_dim: usize,
}

impl AttentionDims {
    /// The score scale `1/√Dh`, fixed (as in "Attention Is All You Need").
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
    /// Elements of Q, K, V or the output: `heads·seq·head_dim`, `None` on overflow.
    pub fn elements(&self) -> Option<usize> {
        self.heads
            .checked_mul(self.seq)
            .and_then(|n| n.checked_mul(self.head_dim))
    }
}

/// Sizes of a causal self-attention whose queries, keys and values come packed per position,
/// `qkv` `[batch, seq, 3, heads, head_dim]` (what a fused `d → 3d` projection gives, reshaped),
/// with the output and its gradient `[batch, seq, heads, head_dim]`; the row log-sum-exp is
/// `[batch·heads, seq]` (see [`crate::backend::NnOps::attention_forward_packed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedAttentionDims {
    /// batch entries B
    pub batch: usize,
    /// heads per batch entry H
    pub heads: usize,
    /// sequence length T
    pub seq: usize,
    /// head dimension Dh
    pub head_dim: usize,
}

impl PackedAttentionDims {
    /// The same attention as [`AttentionDims`]: `batch·heads` (batch entry, head) pairs
    /// (saturating; the checks refuse sizes whose element count overflows).
    pub fn flat(&self) -> AttentionDims {
        AttentionDims {
            heads: self.batch.saturating_mul(self.heads),
            seq: self.seq,
            head_dim: self.head_dim,
        }
    }
}

/// What causal attention's backward reads: the forward's inputs `q`, `k`, `v`, its output `o`
/// and row log-sum-exp `lse`, and the upstream gradient `d_o` (see
/// [`crate::backend::NnOps::attention_backward`]). `B` is a backend's buffer, or a slice in the
/// CPU kernel.
#[derive(Debug)]
pub struct AttentionGradOperands<'a, B: ?Sized> {
    /// queries `[heads, seq, head_dim]`
    pub q: &'a B,
    /// keys, like `q`
    pub k: &'a B,
    /// values, like `q`
    pub v: &'a B,
    /// the forward's output, like `q`
    pub o: &'a B,
    /// the forward's row log-sum-exp `[heads, seq]`
    pub lse: &'a B,
    /// the gradient of the output, like `q`
    pub d_o: &'a B,
}

impl<B: ?Sized> Clone for AttentionGradOperands<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: ?Sized> Copy for AttentionGradOperands<'_, B> {}

/// Sizes of a layer normalisation: `rows` rows of `dim` values, each row normalised on its own,
/// with `eps` added to the variance (see `ops/layer_norm.rs` for the math). With `centered`
/// false the same kernels compute RMSNorm: the mean is taken as 0 (so the "variance" is the mean
/// square) and `beta` is not read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormDims {
    /// number of rows (the product of every axis but the last)
    pub rows: usize,
    /// the normalised (last) axis' size
    pub dim: usize,
    /// added to the variance before the square root
    pub eps: f64,
    /// true: layer norm (subtract each row's mean, add `beta`); false: RMSNorm (no mean, no
    /// `beta`)
    pub centered: bool,
}

/// Sizes of a SwiGLU (`Tensor::swiglu`): `rows` rows of `2·half` values, the gate `a` in the
/// first `half` columns and the up projection `b` in the last `half`; the output has `rows` rows
/// of `half` values, `silu(a)·b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGluDims {
    /// number of rows (the product of every axis but the last)
    pub rows: usize,
    /// the width of each half (the output's last axis)
    pub half: usize,
}

/// Sizes of a rotary position embedding (`nn::Rotary`): `batch` contiguous `[seq, head_dim]`
/// matrices (every axis before the last two folded into `batch`), rotated by the rows `0..seq`
/// of `[table_rows, head_dim]` tables `cos` and `±sin`; with `transpose`, the transposed
/// rotation (the backward rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryDims {
    /// the product of every axis before the last two
    pub batch: usize,
    /// positions (the second-to-last axis), at most `table_rows`
    pub seq: usize,
    /// the head width (the last axis), even
    pub head_dim: usize,
    /// rows of the `cos` and `sin` tables (the context they were built for)
    pub table_rows: usize,
    /// apply the transposed rotation `dx_j = g_j·cos_j + g_j'·sin_j'` (`j'` the column `j` is
    /// paired with) instead of `y_j = x_j·cos_j + x_j'·sin_j`
    pub transpose: bool,
}

/// Geometry of a 2-D convolution (cross-correlation, as in PyTorch) over a batch of images, the
/// sizes every convolution primitive takes. All buffers are contiguous:
///
/// * input `x` and its gradient: `[batch, in_channels, height, width]`;
/// * weight and its gradient: `[banks, out_channels, in_channels, kernel_h, kernel_w]`, one
///   weight per bank (a plain convolution has one bank; the CNN experts of an MoE layer have one
///   per expert, and each image uses its expert's);
/// * output and its gradient: `[batch, out_channels, out_h, out_w]` with
///   `out_h = (height + 2·padding − kernel_h) / stride + 1` (the same for `out_w`).
///
/// Padding adds `padding` zeros on every side of each image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dDims {
    /// images B
    pub batch: usize,
    /// input channels C
    pub in_channels: usize,
    /// image height H
    pub height: usize,
    /// image width W
    pub width: usize,
    /// output channels OC
    pub out_channels: usize,
    /// kernel height KH
    pub kernel_h: usize,
    /// kernel width KW
    pub kernel_w: usize,
    /// step between windows (≥ 1)
    pub stride: usize,
    /// zeros added on every side
    pub padding: usize,
    /// weight banks G (1 for a plain convolution)
    pub banks: usize,
}

impl Conv2dDims {
    /// Output height `(H + 2·padding − KH) / stride + 1` (0 when the kernel does not fit).
    pub fn out_h(&self) -> usize {
        window_count(self.height, self.kernel_h, self.stride, self.padding)
    }
    /// Output width `(W + 2·padding − KW) / stride + 1` (0 when the kernel does not fit).
    pub fn out_w(&self) -> usize {
        window_count(self.width, self.kernel_w, self.stride, self.padding)
    }
    /// Elements of one window, `C·KH·KW`: the inner dimension of the convolution's GEMM.
    pub fn window(&self) -> usize {
        self.in_channels * self.kernel_h * self.kernel_w
    }
    /// `(input, weight, output)` element counts, `None` when one overflows a `usize`.
    pub fn lengths(&self) -> Option<(usize, usize, usize)> {
        let image = self
            .in_channels
            .checked_mul(self.height)?
            .checked_mul(self.width)?;
        let kernel = self.kernel_h.checked_mul(self.kernel_w)?;
        let input = self.batch.checked_mul(image)?;
        let weight = self
            .banks
            .checked_mul(self.out_channels)?
            .checked_mul(self.in_channels)?
            .checked_mul(kernel)?;
        let output = self
            .batch
            .checked_mul(self.out_channels)?
            .checked_mul(self.out_h())?
            .checked_mul(self.out_w())?;
        Some((input, weight, output))
    }
    /// Checks the geometry: stride and kernel at least 1, the kernel within the padded image,
    /// at least one bank, no size overflowing. Returns the `(input, weight, output)` lengths.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] naming the sizes at fault.
    pub fn check(&self, what: &str) -> crate::Result<(usize, usize, usize)> {
        let Conv2dDims {
            batch,
            in_channels,
            height,
            width,
            out_channels,
            kernel_h,
            kernel_w,
            stride,
            padding,
            banks,
        } = *self;
        let bad = |why: String| {
            Err(crate::Error::Shape(format!(
                "{what}: {why} (input [{batch}, {in_channels}, {height}, {width}], weight \
                 [{banks}, {out_channels}, {in_channels}, {kernel_h}, {kernel_w}], stride \
                 {stride}, padding {padding})"
            )))
        };
        if stride == 0 || kernel_h == 0 || kernel_w == 0 || banks == 0 {
            return bad("stride, kernel sides and banks must be at least 1".into());
        }
        if kernel_h > height + 2 * padding || kernel_w > width + 2 * padding {
            return bad(format!(
                "a {kernel_h}×{kernel_w} kernel does not fit the padded {}×{} image",
                height + 2 * padding,
                width + 2 * padding
            ));
        }
        match self.lengths() {
            Some(l) => Ok(l),
            None => bad("more elements than a usize can count".into()),
        }
    }
}

/// Windows of side `kernel` moved by `stride` over `size + 2·padding` positions.
fn window_count(size: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    let padded = size + 2 * padding;
    if stride == 0 || kernel == 0 || kernel > padded {
        return 0;
    }
    (padded - kernel) / stride + 1
}

/// Which pooling a pooling primitive computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// the maximum of each window; the forward pass also returns the position of the maximum
    /// (the first one, scanning rows then columns; NaN counts as the largest) for backward
    Max,
    /// the mean of each window, padding counted as zeros (PyTorch's `count_include_pad`)
    Avg,
}

/// Geometry of a 2-D pooling: `planes` independent `height × width` planes (batch × channels),
/// square `kernel × kernel` windows moved by `stride`, `padding` on every side (at most half
/// the kernel, as in PyTorch, so every window holds at least one real pixel; max pooling pads
/// with −∞). Input `[planes, height, width]`, output `[planes, out_h, out_w]`, contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dDims {
    /// batch × channels
    pub planes: usize,
    /// plane height H
    pub height: usize,
    /// plane width W
    pub width: usize,
    /// window side
    pub kernel: usize,
    /// step between windows (≥ 1)
    pub stride: usize,
    /// padding on every side (≤ kernel / 2)
    pub padding: usize,
}

impl Pool2dDims {
    /// Output height `(H + 2·padding − kernel) / stride + 1`.
    pub fn out_h(&self) -> usize {
        window_count(self.height, self.kernel, self.stride, self.padding)
    }
    /// Output width `(W + 2·padding − kernel) / stride + 1`.
    pub fn out_w(&self) -> usize {
        window_count(self.width, self.kernel, self.stride, self.padding)
    }
    /// Checks the geometry and returns the `(input, output)` element counts.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] naming the sizes at fault: a zero stride or kernel, padding over
    /// half the kernel, a window larger than the padded plane, or an overflowing size.
    pub fn check(&self, what: &str) -> crate::Result<(usize, usize)> {
        let Pool2dDims {
            planes,
            height,
            width,
            kernel,
            stride,
            padding,
        } = *self;
        let bad = |why: String| {
            Err(crate::Error::Shape(format!(
                "{what}: {why} ({planes} planes of {height}×{width}, kernel {kernel}, stride \
                 {stride}, padding {padding})"
            )))
        };
        if stride == 0 || kernel == 0 {
            return bad("kernel and stride must be at least 1".into());
        }
        if 2 * padding > kernel {
            return bad("padding must be at most half the kernel".into());
        }
        if kernel > height + 2 * padding || kernel > width + 2 * padding {
            return bad("the window does not fit the padded plane".into());
        }
        let plane = height.checked_mul(width);
        let out_plane = self.out_h().checked_mul(self.out_w());
        match (
            plane.and_then(|p| p.checked_mul(planes)),
            out_plane.and_then(|p| p.checked_mul(planes)),
        ) {
            (Some(i), Some(o)) => Ok((i, o)),
            _ => bad("more elements than a usize can count".into()),
        }
    }
}

/// Sizes of a grouped (per-expert) matmul ([`super::MatmulOps::grouped_matmul`]): `x` is
/// `[rows, k]`, the expert bank `w` is `[experts, k, m]` (`[experts, m, k]` with
/// `transpose_w`, read transposed), the output `[rows, m]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedMatmulDims {
    /// rows of `x` (and of the output)
    pub rows: usize,
    /// inputs per row
    pub k: usize,
    /// outputs per row
    pub m: usize,
    /// experts in the bank
    pub experts: usize,
    /// whether the bank is stored `[experts, m, k]` and multiplied transposed (the backward
    /// pass's `dx = dy·Wᵀ`)
    pub transpose_w: bool,
}

/// Sizes of an MoE expert bank's weights `[experts, k, m]`, as its weight gradient
/// ([`super::MatmulOps::grouped_weight_grad`]) produces them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertBankDims {
    /// inputs per expert
    pub k: usize,
    /// outputs per expert
    pub m: usize,
    /// experts in the bank
    pub experts: usize,
}

/// Sizes of one step's routing statistics ([`super::RoutingOps::routing_stats`]): the router's
/// distribution `probs [rows, cols]`, its `logits` values, and `experts` counts per expert
/// routed and kept; the window's sums hold `cols + 2·experts + 3` values (the layout is in
/// `shaders/router_sums.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutingStatsDims {
    /// tokens (rows of `probs`)
    pub rows: usize,
    /// columns of `probs` (the router's outputs per token)
    pub cols: usize,
    /// values in the logits (any shape, flattened)
    pub logits: usize,
    /// experts counted (the length of `routed` and `kept`)
    pub experts: usize,
}

impl RoutingStatsDims {
    /// Values in the window's sums: the distribution's column sums, the routed and kept counts,
    /// then the entropy sum, the logits' square sum and their largest magnitude.
    pub fn out_len(&self) -> usize {
        self.cols + 2 * self.experts + 3
    }
}

/// One operand of an elementwise primitive: a buffer read through its own strides over the
/// output's shape (stride 0 along an axis it is broadcast over).
#[derive(Debug)]
pub struct Strided<'a, B> {
    /// the buffer
    pub buf: &'a B,
    /// one stride per axis of the output shape, in elements
    pub strides: &'a [usize],
}

// derived `Clone`/`Copy` would require `B: Copy`; the operand is two shared references
impl<B> Clone for Strided<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Strided<'_, B> {}

/// Sizes of a scatter-add ([`super::LayoutOps::scatter_add`]): a source `[outer, m, inner]` is
/// added into a zeroed output `[outer, len, inner]` along the middle axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScatterDims {
    /// product of the sizes before the axis
    pub outer: usize,
    /// the source's length along the axis (rows scattered per outer index)
    pub m: usize,
    /// product of the sizes after the axis
    pub inner: usize,
    /// the output's length along the axis (the range of the indices)
    pub len: usize,
}
