//! [`LatentAttention`]: Multi-head Latent Attention (MLA; DeepSeek-AI, 2024, "DeepSeek-V2",
//! §2.1, kept in DeepSeek-V3), the attention of the `deepseek-moe` family, composed from
//! existing ops over the fused [`Tensor::causal_attention`].
//!
//! Keys and values are rebuilt per head from one small latent vector per token, and only a narrow
//! slice of each query and key carries rotary positions:
//!
//! ```text
//! q       = x·W_q  (or rms_norm(x·W_qa)·W_qb, a low-rank query)      [B·T, H·(n + r)]
//!           per head: q_nope [n] | q_rope [r]
//! [c | k_rope] = x·W_kva                                              [B·T, L + r]
//! [k_nope | v] = rms_norm(c)·W_kvb                                    [B·T, H·(n + v)]
//! q = [q_nope | rope(q_rope)],  k = [k_nope | rope(k_rope) (one for every head)]
//! out = causal_attention(q, k, v)·W_o,   scores scaled by 1/√(n + r)
//! ```
//!
//! (`n` = `qk_nope_head_dim`, `r` = `qk_rope_head_dim`, `L` = `kv_lora_rank`, `v` =
//! `v_head_dim`). The fused attention op takes one width for q, k and v, so the narrower side is
//! padded with zero columns (which change no score and no output), and when the values are wider
//! than `n + r` the queries are scaled by `√(v/(n + r))` to keep the softmax scale `1/√(n + r)`.
//!
//! DeepSeek-V3's checkpoints lay the rotary columns out in interleaved pairs (`rope_interleave`);
//! moegrad rotates the half-split pairs of [`Rotary`], and the importer reorders those weight
//! rows once, which gives the same scores.

use super::module::join;
use super::{Linear, Module, Param, Parameters, RmsNorm, Rotary};
use crate::{Error, Result, Tensor};

/// How the queries are projected.
pub enum QueryProjection {
    /// `x·W_q`, `d → H·(n + r)` (`q_lora_rank` null)
    Direct(Linear),
    /// `rms_norm(x·W_qa)·W_qb`, through a rank-`q_lora_rank` bottleneck
    LowRank {
        /// `d → q_lora_rank` (`q_a_proj`)
        down: Linear,
        /// RMSNorm of the bottleneck (`q_a_layernorm`)
        norm: RmsNorm,
        /// `q_lora_rank → H·(n + r)` (`q_b_proj`)
        up: Linear,
    },
}

/// Multi-head Latent Attention (see the module docs).
pub struct LatentAttention {
    /// the query projection
    pub q: QueryProjection,
    /// `d → L + r`: the latent and the shared rotary key (`kv_a_proj_with_mqa`)
    pub kv_down: Linear,
    /// RMSNorm of the latent (`kv_a_layernorm`)
    pub kv_norm: RmsNorm,
    /// `L → H·(n + v)`: per-head keys (without positions) and values (`kv_b_proj`)
    pub kv_up: Linear,
    /// `H·v → d` (`o_proj`)
    pub o: Linear,
    /// heads H
    pub heads: usize,
    /// `qk_nope_head_dim` n
    pub nope_dim: usize,
    /// `qk_rope_head_dim` r
    pub rope_dim: usize,
    /// `v_head_dim` v
    pub v_dim: usize,
}

impl LatentAttention {
    /// Attends within each of the `b` sequences of `t` positions of `x` `[b·t, d]`; `rope` holds
    /// the tables of width `rope_dim`. Returns `[b·t, d]`.
    ///
    /// # Errors
    /// Projections whose widths do not match the head sizes, `x` not `[b·t, d]`, or errors of
    /// the ops.
    pub fn forward(&self, x: &Tensor, b: usize, t: usize, rope: &Rotary) -> Result<Tensor> {
        self.attend(x, (b, t), rope, None)
    }

    /// `residual + self.forward(x, b, t, rope)`, with its bits, the residual added by the
    /// output projection's kernel ([`Linear::forward_add`]).
    ///
    /// # Errors
    /// Those of [`LatentAttention::forward`] and of the add.
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
        let (h, n, r, v) = (self.heads, self.nope_dim, self.rope_dim, self.v_dim);
        let latent = self.kv_norm.weight.get().shape()[0];
        let qk = n + r;
        if x.rank() != 2 || x.shape()[0] != b * t {
            return Err(Error::Shape(format!(
                "latent attention: expects x [{b}·{t}, d], got {:?}",
                x.shape()
            )));
        }
        if self.kv_down.outputs() != latent + r || self.kv_up.outputs() != h * (n + v) {
            return Err(Error::Shape(format!(
                "latent attention: kv projections of widths {} and {} do not fit latent {latent}, \
                 {h} heads, nope {n}, rope {r}, value {v}",
                self.kv_down.outputs(),
                self.kv_up.outputs()
            )));
        }
        let q = match &self.q {
            QueryProjection::Direct(l) => l.forward(x)?,
            QueryProjection::LowRank { down, norm, up } => {
                up.forward(&norm.forward(&down.forward(x)?)?)?
            }
        };
        // [b, h, t, n + r]
        let q = q.reshape(&[b, t, h, qk])?.permute(&[0, 2, 1, 3])?;
        let q = Tensor::concat(&[q.slice(-1, 0, n)?, rope.apply(&q.slice(-1, n, qk)?)?], -1)?;
        let kv_a = self.kv_down.forward(x)?; // [b·t, latent + r]
        let k_rope = kv_a.slice(-1, latent, latent + r)?.reshape(&[b, 1, t, r])?;
        let k_rope = rope.apply(&k_rope)?.expand(&[b, h, t, r])?;
        let kv = self
            .kv_up
            .forward(&self.kv_norm.forward(&kv_a.slice(-1, 0, latent)?)?)?
            .reshape(&[b, t, h, n + v])?
            .permute(&[0, 2, 1, 3])?; // [b, h, t, n + v]
        let k = Tensor::concat(&[kv.slice(-1, 0, n)?, k_rope], -1)?;
        let values = kv.slice(-1, n, n + v)?;
        // one width for the fused op: pad the narrower side with zero columns
        let width = qk.max(v);
        let pad = |m: Tensor, have: usize| -> Result<Tensor> {
            if have == width {
                return Ok(m);
            }
            let zeros = Tensor::zeros(&[b, h, t, width - have], m.dtype(), m.device())?;
            Tensor::concat(&[m, zeros], -1)
        };
        let q = if width > qk {
            // keep the softmax scale 1/√(n + r) although the kernel divides by √width
            q.mul_scalar((width as f64 / qk as f64).sqrt())?
        } else {
            q
        };
        let y = pad(q, qk)?.causal_attention(&pad(k, qk)?, &pad(values, v)?)?;
        let y = if width > v { y.slice(-1, 0, v)? } else { y };
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b * t, h * v])?;
        self.o.project(&y, residual)
    }
}

impl Parameters for LatentAttention {
    /// Names `<prefix>.q.*` (or `.q_down.*`, `.q_norm.weight`, `.q_up.*`), `.kv_down.*`,
    /// `.kv_norm.weight`, `.kv_up.*`, `.o.*`.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        match &self.q {
            QueryProjection::Direct(l) => l.visit_params(&join(prefix, "q"), f),
            QueryProjection::LowRank { down, norm, up } => {
                down.visit_params(&join(prefix, "q_down"), f);
                norm.visit_params(&join(prefix, "q_norm"), f);
                up.visit_params(&join(prefix, "q_up"), f);
            }
        }
        self.kv_down.visit_params(&join(prefix, "kv_down"), f);
        self.kv_norm.visit_params(&join(prefix, "kv_norm"), f);
        self.kv_up.visit_params(&join(prefix, "kv_up"), f);
        self.o.visit_params(&join(prefix, "o"), f);
    }
}
