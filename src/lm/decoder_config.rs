//! The settings of a Llama-style decoder ([`DecoderConfig`]) and the families it takes the shape
//! of ([`Family`]): what each of transformers' `LlamaForCausalLM`, `MixtralForCausalLM`,
//! `Qwen2MoeForCausalLM` and `OlmoeForCausalLM` fixes, as presets at the baby size of moegrad's
//! language models (4 layers, d = 128, context 64), each overridable setting by setting.
//!
//! | family      | FFN                                 | router (`norm_topk_prob`) | attention extras  |
//! |-------------|-------------------------------------|---------------------------|-------------------|
//! | `llama`     | dense SwiGLU                        | —                         | —                 |
//! | `mixtral`   | MoE of SwiGLU experts in every layer| `topk` (renormalised)     | —                 |
//! | `qwen2-moe` | MoE + a shared expert with a σ gate | `topk-unnorm` (off)       | q, k, v biases    |
//! | `olmoe`     | MoE of SwiGLU experts               | `topk-unnorm` (off)       | q/k RMSNorm       |
//! | `deepseek-moe` | dense first layer, then MoE + a shared expert | `deepseek-v3` (sigmoid, groups, on) | latent attention (MLA) |
//!
//! Every family uses RMSNorm and rotary positions, and grouped-query attention except DeepSeek's
//! Multi-head Latent Attention (`DeepseekV3ForCausalLM`); routers' gates have no bias, and
//! experts none.

use crate::moe::{MoeConfig, SharedExpertsConfig};
use crate::nn::Activation;
use crate::{Error, Result};

/// A model family: which transformers architecture the decoder follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM`: dense SwiGLU feed-forward blocks
    Llama,
    /// `MixtralForCausalLM`: every feed-forward block an MoE of SwiGLU experts, top-k renormalised
    Mixtral,
    /// `Qwen2MoeForCausalLM`: MoE blocks with a gated shared expert, q/k/v biases
    Qwen2Moe,
    /// `OlmoeForCausalLM`: MoE blocks, RMSNorm on the query and key projections
    Olmoe,
    /// `DeepseekV3ForCausalLM`: dense first layers, then MoE blocks with shared experts routed by
    /// DeepSeek-V3's sigmoid, group-limited router; Multi-head Latent Attention
    DeepseekMoe,
}

impl Family {
    /// Every family, in the order of the table above.
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::Olmoe,
        Family::DeepseekMoe,
    ];

    /// The `--model` name.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2-moe",
            Family::Olmoe => "olmoe",
            Family::DeepseekMoe => "deepseek-moe",
        }
    }

    /// The family of a `--model` name.
    pub fn from_name(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Whether the family's feed-forward blocks are MoE layers.
    pub fn is_moe(self) -> bool {
        self != Family::Llama
    }
}

/// Which feed-forward blocks of a decoder are MoE layers (the others are dense), as the
/// transformers configs say it.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseLayers {
    /// the first this many layers are dense (DeepSeek's `first_k_dense_replace`)
    pub first_dense: usize,
    /// one MoE layer every this many (layer `i` when `(i + 1) % step == 0`; Qwen2-MoE's
    /// `decoder_sparse_step`)
    pub step: usize,
    /// layers that stay dense whatever the above say (Qwen2-MoE's `mlp_only_layers`)
    pub dense: Vec<usize>,
}

impl Default for SparseLayers {
    fn default() -> Self {
        SparseLayers {
            first_dense: 0,
            step: 1,
            dense: Vec::new(),
        }
    }
}

/// The sizes of Multi-head Latent Attention (transformers' DeepSeek-V3 names in brackets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentConfig {
    /// the rank of the query bottleneck (`q_lora_rank`); None: a direct query projection
    pub q_rank: Option<usize>,
    /// the width of the key/value latent (`kv_lora_rank`)
    pub kv_rank: usize,
    /// the part of each query and key without positions (`qk_nope_head_dim`)
    pub nope_dim: usize,
    /// the part with rotary positions (`qk_rope_head_dim`, even)
    pub rope_dim: usize,
    /// the width of each head's value (`v_head_dim`)
    pub v_dim: usize,
}

/// The shape of a Llama-style decoder (see the module docs for the families).
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// the family it follows
    pub family: Family,
    /// vocabulary size V
    pub vocab: usize,
    /// context length (the rotary tables' rows)
    pub block: usize,
    /// decoder layers
    pub layers: usize,
    /// query heads H
    pub heads: usize,
    /// key/value heads G (dividing H; H for plain multi-head attention)
    pub kv_heads: usize,
    /// model width d
    pub d_model: usize,
    /// width of each head (d/H unless set otherwise)
    pub head_dim: usize,
    /// hidden width of the dense feed-forward blocks (`intermediate_size`)
    pub ffn_hidden: usize,
    /// rotary base (`rope_theta`)
    pub rope_theta: f64,
    /// RMSNorm epsilon (`rms_norm_eps`)
    pub rms_eps: f64,
    /// biases on the q, k and v projections (Qwen2)
    pub qkv_bias: bool,
    /// RMSNorm on the q and k projections (OLMoE)
    pub qk_norm: bool,
    /// the output projection is the embedding matrix (`tie_word_embeddings`)
    pub tie_embeddings: bool,
    /// the MoE layers' settings (`d`, `d_out` and `seed` set per layer); None for a dense model
    pub moe: Option<MoeConfig>,
    /// which feed-forward blocks are MoE layers
    pub sparse_layers: SparseLayers,
    /// Multi-head Latent Attention in place of grouped-query attention (DeepSeek)
    pub latent: Option<LatentConfig>,
    /// seed of the initialisation (and of the routers' noise)
    pub seed: u64,
}

impl DecoderConfig {
    /// The family's preset at the baby size: 4 layers, 4 heads (4 key/value heads), d = 128,
    /// context 64, dense FFN 512 (`llama`); for the MoE families the configuration of
    /// `../shared/peers/pytorch_hf_moe_step.py`: `mixtral` 8 SwiGLU experts of 256, top-2;
    /// `qwen2-moe` 8 experts of 128, top-2, a shared expert of 256 with its gate; `olmoe` 16
    /// experts of 128, top-4. Balance loss 0.01 (transformers' `router_aux_loss_coef` default
    /// for Mixtral and OLMoE; 0.001 for Qwen2-MoE).
    pub fn baby(family: Family, vocab: usize) -> DecoderConfig {
        let d = 128;
        let moe = |hidden: usize, experts: usize, k: usize, router: &str, balance: f64| {
            let mut m = MoeConfig::new(d, hidden, experts, k);
            m.router = router.into();
            m.activation = Activation::SwiGlu;
            m.expert_bias = false;
            m.gate_bias = false;
            m.balance_loss = balance;
            m
        };
        let mut cfg = DecoderConfig {
            family,
            vocab,
            block: 64,
            layers: 4,
            heads: 4,
            kv_heads: 4,
            d_model: d,
            head_dim: d / 4,
            ffn_hidden: 4 * d,
            rope_theta: 10_000.0,
            rms_eps: 1e-6,
            qkv_bias: false,
            qk_norm: false,
            tie_embeddings: false,
            moe: None,
            sparse_layers: SparseLayers::default(),
            latent: None,
            seed: 0,
        };
        match family {
            Family::Llama => {}
            Family::Mixtral => {
                cfg.rope_theta = 1e6;
                cfg.rms_eps = 1e-5;
                cfg.moe = Some(moe(2 * d, 8, 2, "topk", 0.01));
            }
            Family::Qwen2Moe => {
                cfg.qkv_bias = true;
                let mut m = moe(d, 8, 2, "topk-unnorm", 0.001);
                m.shared = SharedExpertsConfig {
                    count: 1,
                    hidden: 2 * d,
                    gate: true,
                };
                cfg.moe = Some(m);
            }
            Family::Olmoe => {
                cfg.rms_eps = 1e-5;
                cfg.qk_norm = true;
                cfg.moe = Some(moe(d, 16, 4, "topk-unnorm", 0.01));
            }
            Family::DeepseekMoe => {
                let mut m = moe(d / 2, 16, 4, "deepseek-v3", 0.0);
                for (key, value) in [
                    ("n_group", "4"),
                    ("topk_group", "2"),
                    ("norm_topk_prob", "true"),
                    ("routed_scaling_factor", "2.5"),
                ] {
                    m.router_options.insert(key.into(), value.into());
                }
                m.shared = SharedExpertsConfig {
                    count: 1,
                    hidden: d / 2,
                    gate: false,
                };
                cfg.moe = Some(m);
                cfg.sparse_layers.first_dense = 1;
                cfg.latent = Some(LatentConfig {
                    q_rank: None,
                    kv_rank: 32,
                    nope_dim: 16,
                    rope_dim: 16,
                    v_dim: 32,
                });
            }
        }
        cfg
    }

    /// Whether layer `i`'s feed-forward block is an MoE layer.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        let s = &self.sparse_layers;
        self.moe.is_some()
            && i >= s.first_dense
            && s.step > 0
            && (i + 1).is_multiple_of(s.step)
            && !s.dense.contains(&i)
    }

    /// Checks the shape; the error names the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.vocab == 0 || self.block == 0 || self.layers == 0 || self.d_model == 0 {
            return bad(format!(
                "--model {} needs a vocabulary, --block, --layers and --d-model of at least 1, got {}, {}, {}, {}",
                self.family.name(),
                self.vocab,
                self.block,
                self.layers,
                self.d_model
            ));
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "--heads {} must be a positive multiple of --kv-heads {}",
                self.heads, self.kv_heads
            ));
        }
        if let Some(l) = &self.latent {
            if l.rope_dim == 0
                || !l.rope_dim.is_multiple_of(2)
                || l.kv_rank == 0
                || l.v_dim == 0
                || l.q_rank == Some(0)
            {
                return bad(format!(
                    "latent attention needs an even rotary width and positive latent and value widths, got {l:?}"
                ));
            }
        } else if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "the head width (--d-model {} / --heads {} = {}) must be even and at least 2: rotary positions turn pairs of columns",
                self.d_model, self.heads, self.head_dim
            ));
        }
        if self.ffn_hidden == 0 {
            return bad("the dense feed-forward width must be at least 1".into());
        }
        if let Some(m) = &self.moe {
            if m.router == "expert-choice" {
                return bad("--router expert-choice cannot train a causal language model: it picks each expert's tokens from the whole batch, so a position's output would depend on later positions of its own sequence (the future); use a token-choice router such as topk or switch".into());
            }
            if m.experts == 0 || m.k == 0 || m.k > m.experts || m.hidden == 0 {
                return bad(format!(
                    "--experts {} and --k {} need 1 ≤ k ≤ experts, and --expert-hidden {} at least 1",
                    m.experts, m.k, m.hidden
                ));
            }
            if self.sparse_layers.step == 0 {
                return bad("the MoE layer step (decoder_sparse_step) must be at least 1".into());
            }
        }
        Ok(())
    }

    /// Trainable parameters of the model, counted before building it (None on overflow): the
    /// linear gate is counted for routers with one (others differ by a few).
    pub fn parameter_count(&self) -> Option<u64> {
        let (v, d) = (self.vocab as u64, self.d_model as u64);
        let (h, g, dh) = (
            self.heads as u64,
            self.kv_heads as u64,
            self.head_dim as u64,
        );
        let mlp = |width: u64| -> Option<u64> { d.checked_mul(width)?.checked_mul(3) };
        let bias = if self.qkv_bias { (h + 2 * g) * dh } else { 0 };
        let norms = if self.qk_norm { (h + g) * dh } else { 0 };
        let attn = match &self.latent {
            Some(l) => {
                let (q, kv) = ((l.nope_dim + l.rope_dim) as u64, l.kv_rank as u64);
                let query = match l.q_rank {
                    Some(rank) => (rank as u64).checked_mul(d + 1 + h * q)?,
                    None => d.checked_mul(h * q)?,
                };
                query
                    .checked_add(d.checked_mul(kv + l.rope_dim as u64)?)?
                    .checked_add(kv)?
                    .checked_add(kv.checked_mul(h * (l.nope_dim + l.v_dim) as u64)?)?
                    .checked_add(h * l.v_dim as u64 * d)?
            }
            None => d
                .checked_mul((h + 2 * g) * dh)?
                .checked_add(h * dh * d)?
                .checked_add(bias + norms)?,
        };
        let mut total = v.checked_mul(d)?;
        if !self.tie_embeddings {
            total = total.checked_add(v.checked_mul(d)?)?;
        }
        for i in 0..self.layers {
            let ffn = match &self.moe {
                Some(m) if self.is_moe_layer(i) => {
                    let routed = (m.experts as u64).checked_mul(mlp(m.hidden as u64)?)?;
                    let shared = mlp((m.shared.count * m.shared.hidden) as u64)?
                        .checked_add(if m.shared.gate { d } else { 0 })?;
                    routed
                        .checked_add(shared)?
                        .checked_add(d.checked_mul(m.experts as u64)?)?
                }
                _ => mlp(self.ffn_hidden as u64)?,
            };
            total = total
                .checked_add(attn)?
                .checked_add(ffn)?
                .checked_add(2 * d)?;
        }
        total.checked_add(d)
    }

    /// Refuses, before anything is allocated, a model and batch whose parameters, gradients,
    /// Adam moments and activations would not fit in memory (see `memory.rs`).
    ///
    /// # Errors
    /// The estimate exceeds the limit or cannot be counted (the message names the settings).
    pub fn check_memory(&self, batch: usize) -> Result<()> {
        let bytes = (|| {
            let params = self.parameter_count()?;
            let tokens = (batch as u64).checked_mul(self.block as u64)?;
            let width = match &self.moe {
                Some(m) => (2 * m.hidden * m.k.max(1) + 2 * m.shared.count * m.shared.hidden)
                    .max(2 * self.ffn_hidden),
                None => 2 * self.ffn_hidden,
            } as u64;
            let heads = (self.heads * self.head_dim) as u64;
            let per_token = (self.layers as u64)
                .checked_mul((12 * self.d_model as u64 + 8 * heads).checked_add(2 * width)?)?
                .checked_add(3 * self.vocab as u64)?;
            params
                .checked_mul(4 * 4)?
                .checked_add(tokens.checked_mul(per_token)?.checked_mul(4)?)
        })();
        crate::memory::check_fits(
            &format!(
                "a {} model of --layers {} --d-model {} --block {} (--batch {batch})",
                self.family.name(),
                self.layers,
                self.d_model,
                self.block
            ),
            bytes,
        )
    }
}
