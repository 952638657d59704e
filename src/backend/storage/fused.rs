//! [`Storage`]'s fused layer primitives, forwarded to the owning backend: causal attention,
//! layer normalisation, SwiGLU, the rotary embedding, cross-entropy, 2-D convolution and 2-D pooling (forward and backward).

use super::*;
use crate::backend::{AttentionGradOperands, PackedAttentionDims};

impl Storage {
    /// See [`NnOps::attention_forward`]; `self` is `q`. Returns `(o, lse)`.
    pub(crate) fn attention_forward(
        &self,
        k: &Storage,
        v: &Storage,
        dims: AttentionDims,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "causal_attention";
        on_device!(self, |be| be.attention_forward(
            be.buf(self, WHAT)?,
            be.buf(k, WHAT)?,
            be.buf(v, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::attention_backward`]; `self` is `q`. Returns `(dq, dk, dv)`.
    pub(crate) fn attention_backward(
        &self,
        (k, v, o, lse, d_o): (&Storage, &Storage, &Storage, &Storage, &Storage),
        dims: AttentionDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "causal_attention backward";
        on_device!(self, |be| {
            let operands = AttentionGradOperands {
                q: be.buf(self, WHAT)?,
                k: be.buf(k, WHAT)?,
                v: be.buf(v, WHAT)?,
                o: be.buf(o, WHAT)?,
                lse: be.buf(lse, WHAT)?,
                d_o: be.buf(d_o, WHAT)?,
            };
            be.attention_backward(operands, dims)
        })
    }
    /// See [`NnOps::attention_forward_packed`]; `self` is the packed `qkv`. Returns `(o, lse)`.
    pub(crate) fn attention_forward_packed(
        &self,
        dims: PackedAttentionDims,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "causal_attention_packed";
        on_device!(self, |be| be
            .attention_forward_packed(be.buf(self, WHAT)?, dims))
    }
    /// See [`NnOps::attention_backward_packed`]; `self` is the packed `qkv`. Returns the packed
    /// gradient.
    pub(crate) fn attention_backward_packed(
        &self,
        (o, lse, d_o): (&Storage, &Storage, &Storage),
        dims: PackedAttentionDims,
    ) -> Result<Storage> {
        const WHAT: &str = "causal_attention_packed backward";
        on_device!(self, |be| be.attention_backward_packed(
            be.buf(self, WHAT)?,
            (be.buf(o, WHAT)?, be.buf(lse, WHAT)?, be.buf(d_o, WHAT)?),
            dims
        ))
    }
    /// See [`NnOps::layer_norm_forward`]; `self` is `x`. Returns `(y, mean, rstd)`.
    pub(crate) fn layer_norm_forward(
        &self,
        gamma: &Storage,
        beta: &Storage,
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "layer_norm";
        on_device!(self, |be| be.layer_norm_forward(
            be.buf(self, WHAT)?,
            be.buf(gamma, WHAT)?,
            be.buf(beta, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::layer_norm_backward`]; `self` is the upstream gradient, `pending` the
    /// gradient `x` already has (added into `dx`). Returns `(dx, dgamma, dbeta)`.
    pub(crate) fn layer_norm_backward(
        &self,
        (x, gamma, mean, rstd): (&Storage, &Storage, &Storage, &Storage),
        pending: Option<&Storage>,
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "layer_norm backward";
        on_device!(self, |be| be.layer_norm_backward(
            be.buf(self, WHAT)?,
            be.buf(x, WHAT)?,
            be.buf(gamma, WHAT)?,
            (be.buf(mean, WHAT)?, be.buf(rstd, WHAT)?),
            be.opt(pending, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::swiglu_forward`]; `self` is `x`.
    pub(crate) fn swiglu_forward(&self, dims: SwiGluDims) -> Result<Storage> {
        on_device!(self, |be| be.swiglu_forward(be.buf(self, "swiglu")?, dims))
    }
    /// See [`NnOps::swiglu_backward`]; `self` is `x`, `g` the upstream gradient.
    pub(crate) fn swiglu_backward(&self, g: &Storage, dims: SwiGluDims) -> Result<Storage> {
        const WHAT: &str = "swiglu backward";
        on_device!(self, |be| be.swiglu_backward(
            be.buf(self, WHAT)?,
            be.buf(g, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::rotary`]; `self` is `x`.
    pub(crate) fn rotary(&self, cos: &Storage, sin: &Storage, dims: RotaryDims) -> Result<Storage> {
        const WHAT: &str = "rotary";
        on_device!(self, |be| be.rotary(
            be.buf(self, WHAT)?,
            be.buf(cos, WHAT)?,
            be.buf(sin, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::mse_forward`]; `self` is the prediction.
    pub(crate) fn mse_forward(&self, target: &Storage) -> Result<Storage> {
        const WHAT: &str = "mse";
        on_device!(self, |be| be
            .mse_forward(be.buf(self, WHAT)?, be.buf(target, WHAT)?))
    }
    /// See [`NnOps::mse_backward`]; `self` is the one-element upstream gradient.
    pub(crate) fn mse_backward(&self, x: &Storage, target: &Storage) -> Result<Storage> {
        const WHAT: &str = "mse backward";
        on_device!(self, |be| be.mse_backward(
            be.buf(self, WHAT)?,
            be.buf(x, WHAT)?,
            be.buf(target, WHAT)?
        ))
    }
    /// See [`NnOps::cross_entropy_forward`]; `self` is the logits. Returns `(loss, lse)`.
    pub(crate) fn cross_entropy_forward(
        &self,
        targets: &Storage,
        classes: usize,
    ) -> Result<(Storage, Storage)> {
        const WHAT: &str = "cross_entropy";
        on_device!(self, |be| be.cross_entropy_forward(
            be.buf(self, WHAT)?,
            be.buf(targets, WHAT)?,
            classes
        ))
    }
    /// See [`NnOps::cross_entropy_backward`]; `self` is the upstream gradient `[rows]` or
    /// `[1]`, multiplied by `scale`.
    pub(crate) fn cross_entropy_backward(
        &self,
        scale: f64,
        logits: &Storage,
        targets: &Storage,
        lse: &Storage,
    ) -> Result<Storage> {
        const WHAT: &str = "cross_entropy backward";
        on_device!(self, |be| be.cross_entropy_backward(
            (be.buf(self, WHAT)?, scale),
            be.buf(logits, WHAT)?,
            be.buf(targets, WHAT)?,
            be.buf(lse, WHAT)?
        ))
    }

    /// See [`NnOps::conv2d_forward`]; `self` is the input `x`.
    pub(crate) fn conv2d_forward(
        &self,
        w: &Storage,
        bias: Option<&Storage>,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d";
        on_device!(self, |be| be.conv2d_forward(
            be.buf(self, WHAT)?,
            be.buf(w, WHAT)?,
            be.opt(bias, WHAT)?,
            be.opt(image_bank, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::conv2d_input_grad`]; `self` is the output gradient `dy`.
    pub(crate) fn conv2d_input_grad(
        &self,
        w: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        on_device!(self, |be| be.conv2d_input_grad(
            be.buf(self, WHAT)?,
            be.buf(w, WHAT)?,
            be.opt(image_bank, WHAT)?,
            dims
        ))
    }
    /// See [`NnOps::conv2d_weight_grad`]; `self` is the input `x`.
    pub(crate) fn conv2d_weight_grad(
        &self,
        dy: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
        out: crate::DType,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        on_device!(self, |be| be.conv2d_weight_grad(
            be.buf(self, WHAT)?,
            be.buf(dy, WHAT)?,
            be.opt(image_bank, WHAT)?,
            dims,
            out
        ))
    }
    /// See [`NnOps::pool2d_forward`]; returns `(y, argmax)` (argmax for max pooling only).
    pub(crate) fn pool2d_forward(
        &self,
        kind: PoolKind,
        dims: Pool2dDims,
    ) -> Result<(Storage, Option<Storage>)> {
        on_device!(self, |be| be.pool2d_forward(
            kind,
            be.buf(self, "pool2d")?,
            dims
        ))
    }
    /// See [`NnOps::pool2d_backward`]; `self` is the output gradient `dy`.
    pub(crate) fn pool2d_backward(
        &self,
        kind: PoolKind,
        argmax: Option<&Storage>,
        dims: Pool2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "pool2d backward";
        on_device!(self, |be| be.pool2d_backward(
            kind,
            be.buf(self, WHAT)?,
            be.opt(argmax, WHAT)?,
            dims
        ))
    }
}
