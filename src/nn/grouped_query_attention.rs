//! [`GroupedQueryAttention`]: the causal self-attention of Llama-style blocks (Llama, Mixtral,
//! Qwen2-MoE, OLMoE), over the fused op [`Tensor::causal_attention`].
//!
//! ```text
//! x [B·T, d] ─q─▶ [B·T, H·Dh]  ─(q_norm)─▶ [B, H, T, Dh]   ─rope─▶ q
//!            ─k─▶ [B·T, G·Dh]  ─(k_norm)─▶ [B, G, T, Dh]   ─rope─▶ k ─repeat H/G─▶ [B, H, T, Dh]
//!            ─v─▶ [B·T, G·Dh]             ▶ [B, G, T, Dh]          v ─repeat H/G─▶ [B, H, T, Dh]
//! causal_attention(q, k, v) [B, H, T, Dh] ─▶ [B·T, H·Dh] ─o─▶ [B·T, d]
//! ```
//!
//! Grouped-query attention (Ainslie et al., 2023, "GQA") shares each of the `G` key/value heads
//! among `H/G` query heads: query head `i` reads key/value head `i / (H/G)`, as transformers'
//! `repeat_kv` does; `G = H` is ordinary multi-head attention. The projections have no bias
//! except where a family adds one to q, k and v (Qwen2). OLMoE normalises the whole query and
//! key projections (`q_norm` over `H·Dh`, `k_norm` over `G·Dh`) with RMSNorm before the heads
//! are split. The scores are scaled by `1/√Dh`.

use super::module::join;
use super::{Linear, Module, Param, Parameters, RmsNorm, Rotary};
use crate::{Error, Result, Tensor};

/// Causal grouped-query self-attention with rotary positions.
pub struct GroupedQueryAttention {
    /// `d → H·Dh`
    pub q: Linear,
    /// `d → G·Dh`
    pub k: Linear,
    /// `d → G·Dh`
    pub v: Linear,
    /// `H·Dh → d`
    pub o: Linear,
    /// query heads H
    pub heads: usize,
    /// key/value heads G (dividing H)
    pub kv_heads: usize,
    /// RMSNorm of the query projection (OLMoE), None elsewhere
    pub q_norm: Option<RmsNorm>,
    /// RMSNorm of the key projection (OLMoE), None elsewhere
    pub k_norm: Option<RmsNorm>,
}

impl GroupedQueryAttention {
    /// Head width Dh (the query projection's width over the heads).
    pub fn head_dim(&self) -> usize {
        self.q.outputs() / self.heads.max(1)
    }

    /// Attends within each of the `b` sequences of `t` positions of `x` `[b·t, d]`, rotating
    /// queries and keys with `rope`; returns `[b·t, d]`.
    ///
    /// # Errors
    /// Heads that do not divide the projections, `x` not `[b·t, d]`, or errors of the ops.
    pub fn forward(&self, x: &Tensor, b: usize, t: usize, rope: &Rotary) -> Result<Tensor> {
        self.attend(x, (b, t), rope, None)
    }

    /// `residual + self.forward(x, b, t, rope)`, with its bits, the residual added by the
    /// output projection's kernel ([`Linear::forward_add`]).
    ///
    /// # Errors
    /// Those of [`GroupedQueryAttention::forward`] and of the add.
    pub fn forward_add(
        &self,
        x: &Tensor,
        (b, t): (usize, usize),
        rope: &Rotary,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.attend(x, (b, t), rope, Some(residual))
    }

    /// The attention's output, plus `residual` where given.
    fn attend(
        &self,
        x: &Tensor,
        (b, t): (usize, usize),
        rope: &Rotary,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (h, g, dh) = (self.heads, self.kv_heads, self.head_dim());
        if h == 0 || g == 0 || !h.is_multiple_of(g) || self.q.outputs() != h * dh {
            return Err(Error::Shape(format!(
                "attention: {h} query heads must be a positive multiple of {g} key/value heads \
                 and divide the query width {}",
                self.q.outputs()
            )));
        }
        if x.rank() != 2 || x.shape()[0] != b * t {
            return Err(Error::Shape(format!(
                "attention: expects x [{b}·{t}, d], got {:?}",
                x.shape()
            )));
        }
        // [b·t, heads·dh] → [b, heads, t, dh], normalised first when the family does
        let heads_of = |proj: &Linear, norm: &Option<RmsNorm>, heads: usize| -> Result<Tensor> {
            let y = proj.forward(x)?;
            let y = match norm {
                Some(n) => n.forward(&y)?,
                None => y,
            };
            y.reshape(&[b, t, heads, dh])?.permute(&[0, 2, 1, 3])
        };
        let q = rope.apply(&heads_of(&self.q, &self.q_norm, h)?)?;
        let k = rope.apply(&heads_of(&self.k, &self.k_norm, g)?)?;
        let v = heads_of(&self.v, &None, g)?;
        // each key/value head serves h/g query heads in a row
        let repeat = |kv: Tensor| -> Result<Tensor> {
            if g == h {
                return Ok(kv);
            }
            kv.reshape(&[b, g, 1, t, dh])?
                .expand(&[b, g, h / g, t, dh])?
                .reshape(&[b, h, t, dh])
        };
        let y = q.causal_attention(&repeat(k)?, &repeat(v)?)?; // [b, h, t, dh]
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b * t, h * dh])?;
        self.o.project(&y, residual)
    }
}

impl Parameters for GroupedQueryAttention {
    /// Names `<prefix>.q.*`, `.k.*`, `.v.*`, `.o.*`, and `.q_norm.weight`, `.k_norm.weight` when
    /// present.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.q.visit_params(&join(prefix, "q"), f);
        self.k.visit_params(&join(prefix, "k"), f);
        self.v.visit_params(&join(prefix, "v"), f);
        self.o.visit_params(&join(prefix, "o"), f);
        if let Some(n) = &self.q_norm {
            n.visit_params(&join(prefix, "q_norm"), f);
        }
        if let Some(n) = &self.k_norm {
            n.visit_params(&join(prefix, "k_norm"), f);
        }
    }
}
