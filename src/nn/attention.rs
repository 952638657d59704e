//! [`CausalSelfAttention`]: the multi-head self-attention block of a GPT, a thin module over the
//! fused op [`Tensor::causal_attention`] (see `ops/attention.rs` for its math and kernels).
//!
//! ```text
//! x [B·T, d] ─qkv─▶ [B·T, 3d] = [B, T, 3, H, Dh] (q, k, v packed per position, a reshape)
//!            ─causal_attention_packed─▶ [B, T, H, Dh] = [B·T, d] ─proj─▶ [B·T, d]
//! ```

use super::module::join;
use super::{Linear, Module, Param, Parameters};
use crate::{Error, Result, Tensor};

/// Causal multi-head self-attention with a fused query/key/value projection `d → 3d` and an
/// output projection `d → d` (nanoGPT's `c_attn` and `c_proj`).
pub struct CausalSelfAttention {
    /// `d → 3d`: queries, keys and values, in that order, each split into `heads` heads
    pub qkv: Linear,
    /// `d → d`: the output projection
    pub proj: Linear,
    /// number of heads H (d = H·Dh)
    pub heads: usize,
}

impl CausalSelfAttention {
    /// Attends within each of the `b` sequences of `t` positions of `x` `[b·t, d]` (position i
    /// sees positions ≤ i of its own sequence); returns `[b·t, d]`.
    ///
    /// # Errors
    /// `x` not `[b·t, d]` with d a multiple of the heads, or an error of the ops.
    pub fn forward(&self, x: &Tensor, b: usize, t: usize) -> Result<Tensor> {
        self.attend(x, b, t, None)
    }

    /// `residual + self.forward(x, b, t)`, with its bits, the residual added by the output
    /// projection's kernel ([`Linear::forward_add`]).
    ///
    /// # Errors
    /// Those of [`CausalSelfAttention::forward`] and of the add.
    pub fn forward_add(&self, x: &Tensor, b: usize, t: usize, residual: &Tensor) -> Result<Tensor> {
        self.attend(x, b, t, Some(residual))
    }

    /// The attention's output, plus `residual` where given.
    fn attend(&self, x: &Tensor, b: usize, t: usize, residual: Option<&Tensor>) -> Result<Tensor> {
        let d = self.proj.weight.get().shape()[0];
        if x.shape() != [b * t, d] || self.heads == 0 || !d.is_multiple_of(self.heads) {
            return Err(Error::Shape(format!(
                "attention: expects x [{b}·{t}, {d}] with d a multiple of {} heads, got {:?}",
                self.heads,
                x.shape()
            )));
        }
        let (h, dh) = (self.heads, d / self.heads);
        let qkv = self.qkv.forward(x)?.reshape(&[b, t, 3, h, dh])?;
        let y = qkv.causal_attention_packed()?; // [B, T, H, Dh]
        let y = y.reshape(&[b * t, d])?;
        self.proj.project(&y, residual)
    }
}

impl Parameters for CausalSelfAttention {
    /// Names `<prefix>.qkv.*`, `<prefix>.proj.*`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.qkv.visit_params(&join(prefix, "qkv"), f);
        self.proj.visit_params(&join(prefix, "proj"), f);
    }
}
