//! [`Decoder`]: the Llama-style decoder-only transformer of the MoE models people train today
//! (Llama, Mixtral, Qwen2-MoE, OLMoE; the family presets are in `decoder_config.rs`).
//!
//! ```text
//! idx [B, T] ─embed─▶ h [B·T, d]
//! for each layer:  h = h + attn(rms_norm(h))      grouped-query attention with rotary positions
//!                  h = h + ffn(rms_norm(h))       dense SwiGLU MLP, or an MoE layer of SwiGLU
//!                                                 experts (plus shared experts)
//! logits [B·T, V] = rms_norm(h)·W_head            W_head = embedᵀ when tied
//! ```
//!
//! The same computation as transformers' `LlamaForCausalLM`, `MixtralForCausalLM`,
//! `Qwen2MoeForCausalLM`, `OlmoeForCausalLM` and `DeepseekV3ForCausalLM` (pre-norm residual blocks, RMSNorm, half-split
//! rotary positions, grouped-query attention, SwiGLU), so their weights import and give the same
//! logits. Every MoE layer routes the `B·T` tokens of the batch independently with its own
//! router (any token-choice router of the crate). Weights start N(0, 0.02²) (transformers'
//! `initializer_range`), norms at 1.

use super::decoder_config::DecoderConfig;
use super::gpt::{GptOutput, MoeTally};
use crate::moe::MoeLayer;
use crate::nn::{
    Embedding, GroupedQueryAttention, LatentAttention, Linear, Mlp, Module, Param, Parameters,
    QueryProjection, RmsNorm, Rotary, join,
};
use crate::{DType, Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A feed-forward block: a dense MLP or an MoE layer.
enum Ffn {
    Dense(Mlp),
    Moe(Box<MoeLayer>),
}

/// The attention of a layer: grouped-query, or DeepSeek's latent attention.
enum Attention {
    Grouped(GroupedQueryAttention),
    Latent(LatentAttention),
}

/// One decoder layer.
struct Layer {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    ffn: Ffn,
}

/// A Llama-style decoder (see the module docs).
pub struct Decoder {
    config: DecoderConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    /// the output projection `[d, V]`; None when tied to the embedding
    head: Option<Linear>,
    rotary: Rotary,
}

/// Standard deviation of the initial weights (transformers' `initializer_range`).
const INIT_STD: f64 = 0.02;

impl Decoder {
    /// Builds and initialises the model.
    ///
    /// # Errors
    /// Settings [`DecoderConfig::validate`] refuses, or a router or size the MoE layer refuses.
    ///
    /// # Example
    /// ```
    /// use moegrad::lm::{Decoder, DecoderConfig, Family};
    /// use moegrad::{Device, Tensor};
    /// # fn main() -> moegrad::Result<()> {
    /// let mut cfg = DecoderConfig::baby(Family::Mixtral, 50);
    /// (cfg.layers, cfg.d_model, cfg.head_dim, cfg.block) = (1, 16, 4, 8);
    /// let model = Decoder::new(&cfg, Device::cpu())?;
    /// let idx = Tensor::from_i32(vec![1, 2, 3], &[1, 3], Device::cpu())?;
    /// assert_eq!(model.forward(&idx)?.logits.shape(), &[3, 50]);
    /// # Ok(()) }
    /// ```
    pub fn new(cfg: &DecoderConfig, device: Device) -> Result<Decoder> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let (d, dh) = (cfg.d_model, cfg.head_dim);
        let linear = |i: usize, o: usize, bias: bool, rng: &mut ChaCha8Rng| -> Result<Linear> {
            let mut l = Linear::normal_without_bias(i, o, INIT_STD, rng, device)?;
            if bias {
                l.bias = Some(Param::new(Tensor::zeros(&[o], DType::F32, device)?)?);
            }
            Ok(l)
        };
        let embed = Embedding {
            weight: Param::new(crate::nn::normal(
                &[cfg.vocab, d],
                INIT_STD,
                &mut rng,
                device,
            )?)?,
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let (hq, hkv) = (cfg.heads * dh, cfg.kv_heads * dh);
            let norm = |width: usize| RmsNorm::new(width, cfg.rms_eps, device);
            let attn = match &cfg.latent {
                None => Attention::Grouped(GroupedQueryAttention {
                    q: linear(d, hq, cfg.qkv_bias, &mut rng)?,
                    k: linear(d, hkv, cfg.qkv_bias, &mut rng)?,
                    v: linear(d, hkv, cfg.qkv_bias, &mut rng)?,
                    o: linear(hq, d, false, &mut rng)?,
                    heads: cfg.heads,
                    kv_heads: cfg.kv_heads,
                    q_norm: cfg.qk_norm.then(|| norm(hq)).transpose()?,
                    k_norm: cfg.qk_norm.then(|| norm(hkv)).transpose()?,
                }),
                Some(l) => {
                    let (h, qk) = (cfg.heads, l.nope_dim + l.rope_dim);
                    let q = match l.q_rank {
                        None => QueryProjection::Direct(linear(d, h * qk, false, &mut rng)?),
                        Some(rank) => QueryProjection::LowRank {
                            down: linear(d, rank, false, &mut rng)?,
                            norm: norm(rank)?,
                            up: linear(rank, h * qk, false, &mut rng)?,
                        },
                    };
                    Attention::Latent(LatentAttention {
                        q,
                        kv_down: linear(d, l.kv_rank + l.rope_dim, false, &mut rng)?,
                        kv_norm: norm(l.kv_rank)?,
                        kv_up: linear(l.kv_rank, h * (l.nope_dim + l.v_dim), false, &mut rng)?,
                        o: linear(h * l.v_dim, d, false, &mut rng)?,
                        heads: h,
                        nope_dim: l.nope_dim,
                        rope_dim: l.rope_dim,
                        v_dim: l.v_dim,
                    })
                }
            };
            let ffn = match &cfg.moe {
                Some(m) if cfg.is_moe_layer(i) => {
                    Ffn::Moe(Box::new(moe_layer(cfg, m, i, &mut rng, device)?))
                }
                _ => Ffn::Dense(Mlp::normal_without_bias(
                    d,
                    cfg.ffn_hidden,
                    d,
                    crate::nn::Activation::SwiGlu,
                    INIT_STD,
                    &mut rng,
                    device,
                )?),
            };
            layers.push(Layer {
                attn_norm: norm(d)?,
                attn,
                ffn_norm: norm(d)?,
                ffn,
            });
        }
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(linear(d, cfg.vocab, false, &mut rng)?)
        };
        Ok(Decoder {
            config: cfg.clone(),
            embed,
            layers,
            norm: RmsNorm::new(d, cfg.rms_eps, device)?,
            head,
            rotary: Rotary::new(
                cfg.latent.map_or(dh, |l| l.rope_dim),
                cfg.block,
                cfg.rope_theta,
                device,
            )?,
        })
    }

    /// The settings it was built with.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// Runs `idx` `[B, T]` (I32 ids, `1 ≤ T ≤ block`) and returns the logits of every position.
    ///
    /// # Errors
    /// `idx` of another shape or dtype, or any error of the ops.
    pub fn forward(&self, idx: &Tensor) -> Result<GptOutput> {
        let cfg = &self.config;
        if idx.rank() != 2
            || idx.dtype() != DType::I32
            || idx.shape()[1] == 0
            || idx.shape()[1] > cfg.block
        {
            return Err(Error::Shape(format!(
                "the {} model expects I32 ids [B, T] with 1 ≤ T ≤ block {}, got {} {:?}",
                cfg.family.name(),
                cfg.block,
                idx.dtype(),
                idx.shape()
            )));
        }
        let (b, t, d) = (idx.shape()[0], idx.shape()[1], cfg.d_model);
        // cast once in mixed precision: the first norm and the first residual add share it
        let h = self.embed.forward(idx)?.reshape(&[b * t, d])?;
        let mut h = crate::autocast::low_precision_activation(&h)?;
        let mut moe = MoeTally::default();
        for layer in &self.layers {
            // h + attn(norm(h)): the residual is added by the output projection's kernel
            let x = layer.attn_norm.forward(&h)?;
            h = match &layer.attn {
                Attention::Grouped(attn) => attn.forward_add(&x, (b, t), &self.rotary, &h)?,
                Attention::Latent(attn) => attn.forward_add(&x, (b, t), &self.rotary, &h)?,
            };
            // h + ffn(norm(h)): added by the MLP's down projection, or the MoE combine's kernel
            let x = layer.ffn_norm.forward(&h)?;
            h = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward_add(&x, &h)?,
                Ffn::Moe(layer) => moe.add(layer.forward_sequences_add(&x, t, &h)?)?,
            };
        }
        let h = self.norm.forward(&h)?;
        let logits = match &self.head {
            Some(head) => head.forward(&h)?,
            None => h.matmul_t(&self.embed.weight.get())?,
        };
        Ok(moe.finish(logits))
    }

    /// The MoE layers with their parameter prefixes (`layers.<i>.moe`), in layer order.
    pub fn moe_layers_named(&self) -> Vec<(String, &MoeLayer)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.ffn {
                Ffn::Moe(m) => Some((format!("layers.{i}.moe"), m.as_ref())),
                Ffn::Dense(_) => None,
            })
            .collect()
    }
}

/// The MoE layer of decoder layer `i`, its experts drawn N(0, 0.02²) like the dense blocks.
fn moe_layer(
    cfg: &DecoderConfig,
    m: &crate::moe::MoeConfig,
    i: usize,
    rng: &mut ChaCha8Rng,
    device: Device,
) -> Result<MoeLayer> {
    let mut mc = m.clone();
    mc.d = cfg.d_model;
    mc.d_out = cfg.d_model;
    mc.seed = cfg.seed.wrapping_add(1000 + i as u64);
    let moe = MoeLayer::new(&mc, device)?;
    let mut err = None;
    moe.experts().visit_params("", &mut |_, p| {
        let shape = p.get().shape().to_vec();
        if let Err(e) = crate::nn::normal(&shape, INIT_STD, rng, device).and_then(|v| p.set(v)) {
            err = Some(e);
        }
    });
    err.map_or(Ok(moe), Err)
}

impl Parameters for Decoder {
    /// Every parameter with its name: `embed.weight`, `layers.<i>.attn_norm.weight`,
    /// `layers.<i>.attn.{q,k,v,o}.*`, `layers.<i>.ffn_norm.weight`, `layers.<i>.mlp.{up,down}.weight`
    /// or `layers.<i>.moe.*`, `norm.weight`, `head.weight` (untied).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.embed.visit_params(&join(prefix, "embed"), f);
        for (i, layer) in self.layers.iter().enumerate() {
            let scope = join(prefix, &format!("layers.{i}"));
            layer.attn_norm.visit_params(&join(&scope, "attn_norm"), f);
            match &layer.attn {
                Attention::Grouped(attn) => attn.visit_params(&join(&scope, "attn"), f),
                Attention::Latent(attn) => attn.visit_params(&join(&scope, "attn"), f),
            }
            layer.ffn_norm.visit_params(&join(&scope, "ffn_norm"), f);
            match &layer.ffn {
                Ffn::Dense(mlp) => mlp.visit_params(&join(&scope, "mlp"), f),
                Ffn::Moe(moe) => moe.visit_params(&join(&scope, "moe"), f),
            }
        }
        self.norm.visit_params(&join(prefix, "norm"), f);
        if let Some(head) = &self.head {
            head.visit_params(&join(prefix, "head"), f);
        }
    }

    /// Training mode (router noise, training capacity) or evaluation.
    fn set_training(&self, on: bool) {
        for (_, m) in self.moe_layers_named() {
            m.set_training(on);
        }
    }

    /// The MoE layers' router state, named `layers.<i>.moe.router.<name>`.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        super::moe_state::state(&self.moe_layers_named())
    }

    /// Restores one entry of [`Parameters::state`] by its full name.
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        super::moe_state::load_state(
            &self.moe_layers_named(),
            name,
            value,
            &format!("the {} model", self.config.family.name()),
        )
    }
}
