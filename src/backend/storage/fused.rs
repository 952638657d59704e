//! [`Storage`]'s fused layer primitives, forwarded to the owning backend: causal attention,
//! layer normalisation, cross-entropy, 2-D convolution and 2-D pooling (forward and backward).

use super::*;
use crate::backend::AttentionGradOperands;

impl Storage {
    /// See [`Backend::attention_forward`]; `self` is `q`. Returns `(o, lse)`.
    pub fn attention_forward(
        &self,
        k: &Storage,
        v: &Storage,
        dims: AttentionDims,
    ) -> Result<(Storage, Storage)> {
        let (ok, ov) = (
            same_dev!(self, k, "causal_attention"),
            same_dev!(self, v, "causal_attention"),
        );
        match self {
            Storage::Cpu(q) => {
                let (o, lse) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.attention_forward(q, ok.cpu(), ov.cpu(), dims)
                })?;
                Ok((Storage::Cpu(o), Storage::Cpu(lse)))
            }
            Storage::Gpu(q) => {
                let (o, lse) =
                    gpu::GpuBackend::get()?.attention_forward(q, ok.gpu(), ov.gpu(), dims)?;
                Ok((Storage::Gpu(o), Storage::Gpu(lse)))
            }
        }
    }
    /// See [`Backend::attention_backward`]; `self` is `q`. Returns `(dq, dk, dv)`.
    pub fn attention_backward(
        &self,
        (k, v, o, lse, d_o): (&Storage, &Storage, &Storage, &Storage, &Storage),
        dims: AttentionDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "causal_attention backward";
        let (ok, ov, oo, ol, og) = (
            same_dev!(self, k, WHAT),
            same_dev!(self, v, WHAT),
            same_dev!(self, o, WHAT),
            same_dev!(self, lse, WHAT),
            same_dev!(self, d_o, WHAT),
        );
        match self {
            Storage::Cpu(q) => {
                let (dq, dk, dv) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.attention_backward(
                        AttentionGradOperands {
                            q,
                            k: ok.cpu(),
                            v: ov.cpu(),
                            o: oo.cpu(),
                            lse: ol.cpu(),
                            d_o: og.cpu(),
                        },
                        dims,
                    )
                })?;
                Ok((Storage::Cpu(dq), Storage::Cpu(dk), Storage::Cpu(dv)))
            }
            Storage::Gpu(q) => {
                let (dq, dk, dv) = gpu::GpuBackend::get()?.attention_backward(
                    AttentionGradOperands {
                        q,
                        k: ok.gpu(),
                        v: ov.gpu(),
                        o: oo.gpu(),
                        lse: ol.gpu(),
                        d_o: og.gpu(),
                    },
                    dims,
                )?;
                Ok((Storage::Gpu(dq), Storage::Gpu(dk), Storage::Gpu(dv)))
            }
        }
    }
    /// See [`Backend::layer_norm_forward`]; `self` is `x`. Returns `(y, mean, rstd)`.
    pub fn layer_norm_forward(
        &self,
        gamma: &Storage,
        beta: &Storage,
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        let (og, ob) = (
            same_dev!(self, gamma, "layer_norm"),
            same_dev!(self, beta, "layer_norm"),
        );
        match self {
            Storage::Cpu(x) => {
                let (y, m, r) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.layer_norm_forward(x, og.cpu(), ob.cpu(), dims)
                })?;
                Ok((Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r)))
            }
            Storage::Gpu(x) => {
                let (y, m, r) =
                    gpu::GpuBackend::get()?.layer_norm_forward(x, og.gpu(), ob.gpu(), dims)?;
                Ok((Storage::Gpu(y), Storage::Gpu(m), Storage::Gpu(r)))
            }
        }
    }
    /// See [`Backend::layer_norm_backward`]; `self` is the upstream gradient. Returns
    /// `(dx, dgamma, dbeta)`.
    pub fn layer_norm_backward(
        &self,
        (x, gamma, mean, rstd): (&Storage, &Storage, &Storage, &Storage),
        dims: LayerNormDims,
    ) -> Result<(Storage, Storage, Storage)> {
        const WHAT: &str = "layer_norm backward";
        let (ox, og, om, or) = (
            same_dev!(self, x, WHAT),
            same_dev!(self, gamma, WHAT),
            same_dev!(self, mean, WHAT),
            same_dev!(self, rstd, WHAT),
        );
        match self {
            Storage::Cpu(g) => {
                let (dx, dg, db) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.layer_norm_backward(
                        g,
                        ox.cpu(),
                        og.cpu(),
                        (om.cpu(), or.cpu()),
                        dims,
                    )
                })?;
                Ok((Storage::Cpu(dx), Storage::Cpu(dg), Storage::Cpu(db)))
            }
            Storage::Gpu(g) => {
                let (dx, dg, db) = gpu::GpuBackend::get()?.layer_norm_backward(
                    g,
                    ox.gpu(),
                    og.gpu(),
                    (om.gpu(), or.gpu()),
                    dims,
                )?;
                Ok((Storage::Gpu(dx), Storage::Gpu(dg), Storage::Gpu(db)))
            }
        }
    }
    /// See [`Backend::cross_entropy_forward`]; `self` is the logits. Returns `(loss, lse)`.
    pub fn cross_entropy_forward(
        &self,
        targets: &Storage,
        classes: usize,
    ) -> Result<(Storage, Storage)> {
        let ot = same_dev!(self, targets, "cross_entropy");
        match self {
            Storage::Cpu(x) => {
                let (l, s) = cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.cross_entropy_forward(x, ot.cpu(), classes)
                })?;
                Ok((Storage::Cpu(l), Storage::Cpu(s)))
            }
            Storage::Gpu(x) => {
                let (l, s) = gpu::GpuBackend::get()?.cross_entropy_forward(x, ot.gpu(), classes)?;
                Ok((Storage::Gpu(l), Storage::Gpu(s)))
            }
        }
    }
    /// See [`Backend::cross_entropy_backward`]; `self` is the upstream gradient `[rows]`.
    pub fn cross_entropy_backward(
        &self,
        logits: &Storage,
        targets: &Storage,
        lse: &Storage,
    ) -> Result<Storage> {
        const WHAT: &str = "cross_entropy backward";
        let (ox, ot, ol) = (
            same_dev!(self, logits, WHAT),
            same_dev!(self, targets, WHAT),
            same_dev!(self, lse, WHAT),
        );
        match self {
            Storage::Cpu(g) => cpu::on_pool(self.len(), || {
                cpu::CpuBackend.cross_entropy_backward(g, ox.cpu(), ot.cpu(), ol.cpu())
            })
            .map(Storage::Cpu),
            Storage::Gpu(g) => gpu::GpuBackend::get()?
                .cross_entropy_backward(g, ox.gpu(), ot.gpu(), ol.gpu())
                .map(Storage::Gpu),
        }
    }

    /// See [`Backend::conv2d_forward`]; `self` is the input `x`.
    pub fn conv2d_forward(
        &self,
        w: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d";
        match self {
            Storage::Cpu(x) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.conv2d_forward(x, as_cpu(w, WHAT)?, bank, dims)
                })
                .map(Storage::Cpu)
            }
            Storage::Gpu(x) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_forward(x, as_gpu(w, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::conv2d_input_grad`]; `self` is the output gradient `dy`.
    pub fn conv2d_input_grad(
        &self,
        w: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        match self {
            Storage::Cpu(dy) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.conv2d_input_grad(dy, as_cpu(w, WHAT)?, bank, dims)
                })
                .map(Storage::Cpu)
            }
            Storage::Gpu(dy) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_input_grad(dy, as_gpu(w, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::conv2d_weight_grad`]; `self` is the input `x`.
    pub fn conv2d_weight_grad(
        &self,
        dy: &Storage,
        image_bank: Option<&Storage>,
        dims: Conv2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "conv2d backward";
        match self {
            Storage::Cpu(x) => {
                let bank = image_bank.map(|b| as_cpu(b, WHAT)).transpose()?;
                cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.conv2d_weight_grad(x, as_cpu(dy, WHAT)?, bank, dims)
                })
                .map(Storage::Cpu)
            }
            Storage::Gpu(x) => {
                let bank = image_bank.map(|b| as_gpu(b, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .conv2d_weight_grad(x, as_gpu(dy, WHAT)?, bank, dims)
                    .map(Storage::Gpu)
            }
        }
    }
    /// See [`Backend::pool2d_forward`]; returns `(y, argmax)` (argmax for max pooling only).
    pub fn pool2d_forward(
        &self,
        kind: PoolKind,
        dims: Pool2dDims,
    ) -> Result<(Storage, Option<Storage>)> {
        match self {
            Storage::Cpu(x) => {
                let (y, a) =
                    cpu::on_pool(self.len(), || cpu::CpuBackend.pool2d_forward(kind, x, dims))?;
                Ok((Storage::Cpu(y), a.map(Storage::Cpu)))
            }
            Storage::Gpu(x) => {
                let (y, a) = gpu::GpuBackend::get()?.pool2d_forward(kind, x, dims)?;
                Ok((Storage::Gpu(y), a.map(Storage::Gpu)))
            }
        }
    }
    /// See [`Backend::pool2d_backward`]; `self` is the output gradient `dy`.
    pub fn pool2d_backward(
        &self,
        kind: PoolKind,
        argmax: Option<&Storage>,
        dims: Pool2dDims,
    ) -> Result<Storage> {
        const WHAT: &str = "pool2d backward";
        match self {
            Storage::Cpu(dy) => {
                let arg = argmax.map(|a| as_cpu(a, WHAT)).transpose()?;
                cpu::on_pool(self.len(), || {
                    cpu::CpuBackend.pool2d_backward(kind, dy, arg, dims)
                })
                .map(Storage::Cpu)
            }
            Storage::Gpu(dy) => {
                let arg = argmax.map(|a| as_gpu(a, WHAT)).transpose()?;
                gpu::GpuBackend::get()?
                    .pool2d_backward(kind, dy, arg, dims)
                    .map(Storage::Gpu)
            }
        }
    }
}
