//! The CPU's [`NnOps`]: checks each fused primitive's operands, matches on their dtype and
//! calls the kernel of its file (`attention.rs`, `layer_norm.rs`, `swiglu.rs`, `rotary.rs`,
//! `cross_entropy.rs`, `mse.rs`, `routing.rs` for the softmax backward, `conv2d.rs`,
//! `pool2d.rs`).

use super::{
    CpuBackend, CpuBuffer, attention, conv2d, cross_entropy, f32b, f64b, layer_norm, mse, pool2d,
    rotary, routing, swiglu,
};
use crate::Error;
use crate::Result;
use crate::backend::checks::{
    check_attention_lengths, check_cross_entropy, check_layer_norm_lengths, check_rotary_lengths,
    check_swiglu_lengths,
};
use crate::backend::checks::{check_mse, check_softmax_backward, check_softmax_forward};
use crate::backend::{
    AttentionDims, AttentionGradOperands, Conv2dDims, LayerNormDims, NnOps, PackedAttentionDims,
    Pool2dDims, PoolKind, RotaryDims, SwiGluDims,
};

impl NnOps for CpuBackend {
    fn attention_forward(
        &self,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        check_attention_lengths("attention_forward", &[("q", q), ("k", k), ("v", v)], dims)?;
        match (q, k, v) {
            (CpuBuffer::F32(q), CpuBuffer::F32(k), CpuBuffer::F32(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f32b(o), f32b(lse)))
            }
            (CpuBuffer::F64(q), CpuBuffer::F64(k), CpuBuffer::F64(v)) => {
                let (o, lse) = attention::forward(q, k, v, dims);
                Ok((f64b(o), f64b(lse)))
            }
            _ => Err(Error::DType(format!(
                "attention_forward needs q, k, v float buffers of one dtype, got {}, {}, {}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ))),
        }
    }

    fn attention_backward(
        &self,
        operands: AttentionGradOperands<'_, CpuBuffer>,
        dims: AttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        attention::backward_buffers(operands, dims)
    }

    fn attention_forward_packed(
        &self,
        qkv: &CpuBuffer,
        dims: PackedAttentionDims,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        attention::forward_packed_buffer(qkv, dims)
    }

    fn attention_backward_packed(
        &self,
        qkv: &CpuBuffer,
        forward: (&CpuBuffer, &CpuBuffer, &CpuBuffer),
        dims: PackedAttentionDims,
    ) -> Result<CpuBuffer> {
        attention::backward_packed_buffers(qkv, forward, dims)
    }

    fn layer_norm_forward(
        &self,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        beta: &CpuBuffer,
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_forward";
        check_layer_norm_lengths(
            WHAT,
            &[("x", x)],
            &[("gamma", gamma), ("beta", beta)],
            &[],
            dims,
        )?;
        match (x, gamma, beta) {
            (CpuBuffer::F32(x), CpuBuffer::F32(g), CpuBuffer::F32(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f32b(y), f32b(m), f32b(r)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(g), CpuBuffer::F64(b)) => {
                let (y, m, r) = layer_norm::forward(x, g, b, dims);
                Ok((f64b(y), f64b(m), f64b(r)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, gamma {}, beta {}",
                x.dtype(),
                gamma.dtype(),
                beta.dtype()
            ))),
        }
    }

    fn layer_norm_backward(
        &self,
        g: &CpuBuffer,
        x: &CpuBuffer,
        gamma: &CpuBuffer,
        (mean, rstd): (&CpuBuffer, &CpuBuffer),
        pending: Option<&CpuBuffer>,
        dims: LayerNormDims,
    ) -> Result<(CpuBuffer, CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "layer_norm_backward";
        let mut matrices = vec![("g", g), ("x", x)];
        matrices.extend(pending.map(|p| ("the pending gradient", p)));
        check_layer_norm_lengths(
            WHAT,
            &matrices,
            &[("gamma", gamma)],
            &[("mean", mean), ("rstd", rstd)],
            dims,
        )?;
        match (g, x, gamma, mean, rstd, pending.unwrap_or(g)) {
            (
                CpuBuffer::F32(g),
                CpuBuffer::F32(x),
                CpuBuffer::F32(w),
                CpuBuffer::F32(m),
                CpuBuffer::F32(r),
                CpuBuffer::F32(p),
            ) => {
                let p = pending.map(|_| p.as_slice());
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), p, dims);
                Ok((f32b(dx), f32b(dg), f32b(db)))
            }
            (
                CpuBuffer::F64(g),
                CpuBuffer::F64(x),
                CpuBuffer::F64(w),
                CpuBuffer::F64(m),
                CpuBuffer::F64(r),
                CpuBuffer::F64(p),
            ) => {
                let p = pending.map(|_| p.as_slice());
                let (dx, dg, db) = layer_norm::backward(g, x, w, (m, r), p, dims);
                Ok((f64b(dx), f64b(dg), f64b(db)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, x {}, gamma {}, mean {}, rstd {}{}",
                g.dtype(),
                x.dtype(),
                gamma.dtype(),
                mean.dtype(),
                rstd.dtype(),
                pending
                    .map(|p| format!(", the pending gradient {}", p.dtype()))
                    .unwrap_or_default()
            ))),
        }
    }

    fn swiglu_forward(&self, x: &CpuBuffer, dims: SwiGluDims) -> Result<CpuBuffer> {
        const WHAT: &str = "swiglu";
        check_swiglu_lengths(WHAT, &[("x", x)], &[], dims)?;
        float_map!(x, WHAT, x => swiglu::forward(x, dims))
    }

    fn swiglu_backward(&self, x: &CpuBuffer, g: &CpuBuffer, dims: SwiGluDims) -> Result<CpuBuffer> {
        const WHAT: &str = "swiglu backward";
        check_swiglu_lengths(WHAT, &[("x", x)], &[("g", g)], dims)?;
        match (x, g) {
            (CpuBuffer::F32(x), CpuBuffer::F32(g)) => Ok(f32b(swiglu::backward(x, g, dims))),
            (CpuBuffer::F64(x), CpuBuffer::F64(g)) => Ok(f64b(swiglu::backward(x, g, dims))),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, g {}",
                x.dtype(),
                g.dtype()
            ))),
        }
    }

    fn rotary(
        &self,
        x: &CpuBuffer,
        cos: &CpuBuffer,
        sin: &CpuBuffer,
        dims: RotaryDims,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "rotary";
        check_rotary_lengths(WHAT, x, (cos, sin), dims)?;
        match (x, cos, sin) {
            (CpuBuffer::F32(x), CpuBuffer::F32(c), CpuBuffer::F32(s)) => {
                Ok(f32b(rotary::rotary(x, c, s, dims)))
            }
            (CpuBuffer::F64(x), CpuBuffer::F64(c), CpuBuffer::F64(s)) => {
                Ok(f64b(rotary::rotary(x, c, s, dims)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got x {}, cos {}, sin {}",
                x.dtype(),
                cos.dtype(),
                sin.dtype()
            ))),
        }
    }

    fn cross_entropy_forward(
        &self,
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        classes: usize,
    ) -> Result<(CpuBuffer, CpuBuffer)> {
        const WHAT: &str = "cross_entropy";
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        match logits {
            CpuBuffer::F32(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f32b(l), f32b(s)))
            }
            CpuBuffer::F64(x) => {
                let (l, s) = cross_entropy::forward(x, t, t.len(), classes);
                Ok((f64b(l), f64b(s)))
            }
            CpuBuffer::I32(_) => Err(Error::DType(format!(
                "{WHAT}: logits must be float, got i32"
            ))),
        }
    }

    fn cross_entropy_backward(
        &self,
        (g, scale): (&CpuBuffer, f64),
        logits: &CpuBuffer,
        targets: &CpuBuffer,
        lse: &CpuBuffer,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "cross_entropy backward";
        let classes = if targets.is_empty() {
            0
        } else {
            logits.len() / targets.len()
        };
        let t = check_cross_entropy(WHAT, logits, targets, classes)?;
        if !(g.len() == t.len() || g.len() == 1) || lse.len() != t.len() {
            return Err(Error::Shape(format!(
                "{WHAT}: g and lse hold {} and {} values, expected one per row ({}; g may \
                 hold one for all)",
                g.len(),
                lse.len(),
                t.len()
            )));
        }
        match (g, logits, lse) {
            (CpuBuffer::F32(g), CpuBuffer::F32(x), CpuBuffer::F32(l)) => Ok(f32b(
                cross_entropy::backward((g, scale as f32), x, t, l, classes),
            )),
            (CpuBuffer::F64(g), CpuBuffer::F64(x), CpuBuffer::F64(l)) => {
                Ok(f64b(cross_entropy::backward((g, scale), x, t, l, classes)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT} needs float buffers of one dtype, got g {}, logits {}, lse {}",
                g.dtype(),
                logits.dtype(),
                lse.dtype()
            ))),
        }
    }

    fn mse_forward(&self, x: &CpuBuffer, t: &CpuBuffer) -> Result<CpuBuffer> {
        const WHAT: &str = "mse";
        check_mse(WHAT, x, t, None)?;
        match (x, t) {
            (CpuBuffer::F32(x), CpuBuffer::F32(t)) => Ok(f32b(vec![mse::forward(x, t)])),
            (CpuBuffer::F64(x), CpuBuffer::F64(t)) => Ok(f64b(vec![mse::forward(x, t)])),
            _ => Err(Error::DType(format!(
                "{WHAT}: the CPU computes f32 or f64, got {}",
                x.dtype()
            ))),
        }
    }

    fn mse_backward(&self, g: &CpuBuffer, x: &CpuBuffer, t: &CpuBuffer) -> Result<CpuBuffer> {
        const WHAT: &str = "mse backward";
        check_mse(WHAT, x, t, Some(g))?;
        match (g, x, t) {
            (CpuBuffer::F32(g), CpuBuffer::F32(x), CpuBuffer::F32(t)) => {
                Ok(f32b(mse::backward(g[0], x, t)))
            }
            (CpuBuffer::F64(g), CpuBuffer::F64(x), CpuBuffer::F64(t)) => {
                Ok(f64b(mse::backward(g[0], x, t)))
            }
            _ => Err(Error::DType(format!(
                "{WHAT}: the CPU computes f32 or f64, got {}",
                x.dtype()
            ))),
        }
    }

    fn softmax_forward(&self, x: &CpuBuffer, rows: usize, n: usize) -> Result<CpuBuffer> {
        const WHAT: &str = "softmax";
        check_softmax_forward(WHAT, x, rows, n)?;
        match x {
            CpuBuffer::F32(x) => Ok(f32b(routing::softmax_rows(x, n))),
            CpuBuffer::F64(x) => Ok(f64b(routing::softmax_rows(x, n))),
            _ => Err(Error::DType(format!(
                "{WHAT}: the CPU computes f32 or f64, got {}",
                x.dtype()
            ))),
        }
    }

    fn softmax_backward(
        &self,
        (y, dy): (&CpuBuffer, &CpuBuffer),
        pending: Option<&CpuBuffer>,
        rows: usize,
        n: usize,
    ) -> Result<CpuBuffer> {
        const WHAT: &str = "softmax backward";
        check_softmax_backward(WHAT, y, dy, rows, n)?;
        let out = match (y, dy) {
            (CpuBuffer::F32(y), CpuBuffer::F32(g)) => Ok(f32b(routing::softmax_backward(y, g, n))),
            (CpuBuffer::F64(y), CpuBuffer::F64(g)) => Ok(f64b(routing::softmax_backward(y, g, n))),
            _ => Err(Error::DType(format!(
                "{WHAT} needs float y and dy of one dtype, got {} and {}",
                y.dtype(),
                dy.dtype()
            ))),
        }?;
        routing::fold_pending(WHAT, out, pending)
    }

    fn conv2d_forward(
        &self,
        x: &CpuBuffer,
        w: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::forward(x, w, bias, image_bank, dims)
    }

    fn conv2d_input_grad(
        &self,
        dy: &CpuBuffer,
        w: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
    ) -> Result<CpuBuffer> {
        conv2d::input_grad(dy, w, image_bank, dims)
    }

    fn conv2d_weight_grad(
        &self,
        x: &CpuBuffer,
        dy: &CpuBuffer,
        image_bank: Option<&CpuBuffer>,
        dims: Conv2dDims,
        out: crate::DType,
    ) -> Result<CpuBuffer> {
        conv2d::weight_grad(x, dy, image_bank, dims, out)
    }

    fn pool2d_forward(
        &self,
        kind: PoolKind,
        x: &CpuBuffer,
        dims: Pool2dDims,
    ) -> Result<(CpuBuffer, Option<CpuBuffer>)> {
        pool2d::forward(kind, x, dims)
    }

    fn pool2d_backward(
        &self,
        kind: PoolKind,
        dy: &CpuBuffer,
        argmax: Option<&CpuBuffer>,
        dims: Pool2dDims,
    ) -> Result<CpuBuffer> {
        pool2d::backward(kind, dy, argmax, dims)
    }
}
