//! The backend layer: device buffers and the primitive kernels every device must provide.
//!
//! This layer knows nothing about autograd. A backend owns flat, contiguous buffers (each buffer
//! knows its [`DType`] and length) and runs a small set of primitives over them. Everything the
//! `Tensor` API offers (log-softmax, top-k, every backward rule) is composed from these
//! primitives in `ops/`, once, for all devices: that is the tinygrad lesson. Where one fused
//! kernel saves many small ones (softmax, cross-entropy, attention), the fused op is itself a
//! primitive ([`NnOps`]). A new backend implements the family traits of `family/` (one per op
//! family, gathered by [`Backend`]) and nothing else.
//!
//! Shapes passed here are already checked by the `Tensor` layer; a backend may still return an
//! error (unsupported dtype, GPU failure) but must never panic.
//!
//! Two implementations exist: [`cpu::CpuBackend`] (f32/f64, rayon, GEMM crate) and
//! [`gpu::GpuBackend`] (wgpu + WGSL kernels in `shaders/`, f32). [`Storage`] is the enum a tensor
//! holds; its methods dispatch to the right backend.

mod checks;
pub(crate) mod cpu;
mod dims;
mod elementwise_ops;
mod family;
pub(crate) mod gpu;

pub(crate) use dims::{
    AttentionDims, AttentionGradOperands, AxisView, Conv2dDims, ExpertBankDims, GroupedMatmulDims,
    LayerNormDims, MatLayout, MatmulDims, PackedAttentionDims, Pool2dDims, PoolKind, RotaryDims,
    RoutingStatsDims, ScatterDims, Strided, SwiGluDims,
};

pub(crate) use family::{
    Backend, BufferOps, ElementwiseOps, LayoutOps, MatmulOps, MatmulProduct, NnOps, OptimOps,
    ReduceOps, RoutingOps,
};

pub(crate) use elementwise_ops::wgsl_elementwise_ops;
pub(crate) use elementwise_ops::{BinaryOp, UnaryOp};

use crate::{DType, Result};

/// Reductions along one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceOp {
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
pub(crate) struct AdamHyper {
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
    /// the step count `t` (1 at the first step) the bias corrections are for
    pub step: u64,
    /// `1 − β₁ᵗ`
    pub bias_correction1: f64,
    /// `1 − β₂ᵗ`
    pub bias_correction2: f64,
}

impl AdamHyper {
    /// The hyper-parameters for the step count `t − skipped`: a gradient scale of two values
    /// (`optim::LossScale`'s factor and the steps it skipped so far, see `OptimOps::adam_step`)
    /// says that `skipped` of the `t` steps changed nothing, so the bias corrections are for
    /// `t − skipped` steps (at least 1), as with PyTorch's `GradScaler`, which skips
    /// `optimizer.step()` itself. Unchanged when nothing was skipped.
    pub(crate) fn after_skipped_steps(self, skipped: f64) -> AdamHyper {
        if skipped <= 0.0 {
            return self;
        }
        let t = (self.step as f64 - skipped).max(1.0);
        AdamHyper {
            bias_correction1: 1.0 - self.beta1.powf(t),
            bias_correction2: 1.0 - self.beta2.powf(t),
            ..self
        }
    }
}

/// Hyper-parameters of one fused SGD update (see `optim::Sgd`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SgdHyper {
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

/// The operands of an expert bank's weight gradient ([`MatmulOps::grouped_weight_grad`]): the
/// rows `x` `[R, k]`, the upstream gradient `dy` `[R, m]`, each row's expert `row_expert`
/// `[R]` and the experts' segments `offsets` `[experts + 1]` (both I32), and the bank's sizes.
/// The fused optimizer steps (`grouped_weight_grad_adam_mut`) take it to compute the gradient
/// inside the update instead of storing it.
#[derive(Debug)]
pub(crate) struct BankGradOperands<'a, B> {
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

/// The buffers of an MoE dispatch plan ([`RoutingOps::dispatch_plan`]; `moe::DispatchPlan` wraps
/// them as tensors). `A` is the number of assignments, `n` the number of experts.
#[derive(Clone, Debug)]
pub(crate) struct PlanBuffers<B> {
    /// `[A]` I32: sorted position → assignment
    pub order: B,
    /// `[A]` I32: assignment → sorted position (`order`'s inverse permutation)
    pub position: B,
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

/// The counter-based generator behind [`ElementwiseOps::random_uniform`], written once here and
/// mirrored in `shaders/random.wgsl`: two rounds of the MurmurHash3 32-bit finaliser over the
/// element index mixed with the two halves of the seed; the top 24 bits give a float in [0, 1).
pub(crate) fn uniform_hash(seed: u64, index: u32) -> f32 {
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
#[cfg(test)]
mod tests;
pub(crate) use storage::{Storage, side_by_side};
