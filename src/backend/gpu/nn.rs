//! The GPU's [`NnOps`]: each fused primitive forwards to the launcher of its shader's file
//! (`attention.rs`, `layer_norm.rs`, `swiglu.rs`, `rotary.rs`, `cross_entropy.rs`, `routing.rs` for the softmax backward,
//! `conv2d.rs`, `pool2d.rs`), which checks the operands and records the kernels.

use super::{GpuBackend, GpuBuffer};
use crate::Result;
use crate::backend::{
    AttentionDims, AttentionGradOperands, Conv2dDims, LayerNormDims, NnOps, PackedAttentionDims,
    Pool2dDims, PoolKind, RotaryDims, SwiGluDims,
};

impl NnOps for GpuBackend {
    fn attention_forward(
        &self,
        q: &GpuBuffer,
        k: &GpuBuffer,
        v: &GpuBuffer,
        dims: AttentionDims,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        super::attention::attention_forward(self, q, k, v, dims)
    }

    fn attention_backward(
        &self,
        operands: AttentionGradOperands<'_, GpuBuffer>,
        dims: AttentionDims,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        super::attention::attention_backward(self, operands, dims)
    }

    fn attention_forward_packed(
        &self,
        qkv: &GpuBuffer,
        dims: PackedAttentionDims,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        super::attention::attention_forward_packed(self, qkv, dims)
    }

    fn attention_backward_packed(
        &self,
        qkv: &GpuBuffer,
        forward: (&GpuBuffer, &GpuBuffer, &GpuBuffer),
        dims: PackedAttentionDims,
    ) -> Result<GpuBuffer> {
        super::attention::attention_backward_packed(self, qkv, forward, dims)
    }

    fn layer_norm_forward(
        &self,
        x: &GpuBuffer,
        gamma: &GpuBuffer,
        beta: &GpuBuffer,
        dims: LayerNormDims,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        super::layer_norm::layer_norm_forward(self, x, gamma, beta, dims)
    }

    fn layer_norm_backward(
        &self,
        g: &GpuBuffer,
        x: &GpuBuffer,
        gamma: &GpuBuffer,
        stats: (&GpuBuffer, &GpuBuffer),
        pending: Option<&GpuBuffer>,
        dims: LayerNormDims,
    ) -> Result<(GpuBuffer, GpuBuffer, GpuBuffer)> {
        super::layer_norm::layer_norm_backward(self, (g, pending), x, gamma, stats, dims)
    }

    fn swiglu_forward(&self, x: &GpuBuffer, dims: SwiGluDims) -> Result<GpuBuffer> {
        super::swiglu::swiglu_forward(self, x, dims)
    }

    fn swiglu_backward(&self, x: &GpuBuffer, g: &GpuBuffer, dims: SwiGluDims) -> Result<GpuBuffer> {
        super::swiglu::swiglu_backward(self, x, g, dims)
    }

    fn rotary(
        &self,
        x: &GpuBuffer,
        cos: &GpuBuffer,
        sin: &GpuBuffer,
        dims: RotaryDims,
    ) -> Result<GpuBuffer> {
        super::rotary::rotary(self, x, cos, sin, dims)
    }

    fn cross_entropy_forward(
        &self,
        logits: &GpuBuffer,
        targets: &GpuBuffer,
        classes: usize,
    ) -> Result<(GpuBuffer, GpuBuffer)> {
        super::cross_entropy::cross_entropy_forward(self, logits, targets, classes)
    }

    fn cross_entropy_backward(
        &self,
        g: (&GpuBuffer, f64),
        logits: &GpuBuffer,
        targets: &GpuBuffer,
        lse: &GpuBuffer,
    ) -> Result<GpuBuffer> {
        super::cross_entropy::cross_entropy_backward(self, g, logits, targets, lse)
    }

    fn mse_forward(&self, x: &GpuBuffer, t: &GpuBuffer) -> Result<GpuBuffer> {
        super::mse::mse_forward(self, x, t)
    }

    fn mse_backward(&self, g: &GpuBuffer, x: &GpuBuffer, t: &GpuBuffer) -> Result<GpuBuffer> {
        super::mse::mse_backward(self, g, x, t)
    }

    fn softmax_forward(&self, x: &GpuBuffer, rows: usize, n: usize) -> Result<GpuBuffer> {
        super::routing::softmax_forward(self, x, rows, n)
    }

    fn softmax_backward(
        &self,
        y_dy: (&GpuBuffer, &GpuBuffer),
        pending: Option<&GpuBuffer>,
        rows: usize,
        n: usize,
    ) -> Result<GpuBuffer> {
        super::routing::softmax_backward(self, y_dy, pending, rows, n)
    }

    fn conv2d_forward(
        &self,
        x: &GpuBuffer,
        w: &GpuBuffer,
        bias: Option<&GpuBuffer>,
        image_bank: Option<&GpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<GpuBuffer> {
        super::conv2d::conv2d_forward(self, x, w, bias, image_bank, dims)
    }

    fn conv2d_input_grad(
        &self,
        dy: &GpuBuffer,
        w: &GpuBuffer,
        image_bank: Option<&GpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<GpuBuffer> {
        super::conv2d::conv2d_input_grad(self, dy, w, image_bank, dims)
    }

    fn conv2d_weight_grad(
        &self,
        x: &GpuBuffer,
        dy: &GpuBuffer,
        image_bank: Option<&GpuBuffer>,
        dims: Conv2dDims,
        out: crate::DType,
    ) -> Result<GpuBuffer> {
        super::conv2d::conv2d_weight_grad(self, x, dy, image_bank, dims, out)
    }

    fn pool2d_forward(
        &self,
        kind: PoolKind,
        x: &GpuBuffer,
        dims: Pool2dDims,
    ) -> Result<(GpuBuffer, Option<GpuBuffer>)> {
        super::pool2d::pool2d_forward(self, kind, x, dims)
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        dy: &GpuBuffer,
        argmax: Option<&GpuBuffer>,
        dims: Pool2dDims,
    ) -> Result<GpuBuffer> {
        super::pool2d::pool2d_backward(self, kind, dy, argmax, dims)
    }
}
