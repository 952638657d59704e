//! A GPT (Radford et al. 2019, as in nanoGPT) whose feed-forward blocks may be MoE layers
//! (Switch Transformer, Fedus et al. 2021; GShard alternates dense and MoE blocks).
//!
//! ```text
//! idx [B, T] ─tok_emb─▶ + pos_emb[0..T] ─▶ h [B·T, d]
//! for each block:  h = h + attn(ln1(h))                 causal multi-head self-attention
//!                  h = h + ffn(ln2(h))                  dense MLP d → 4d → d, or an MoE layer
//! logits [B·T, V] = ln_f(h) · tok_embᵀ                  weight tying: one Param used twice
//! ```
//!
//! Pre-LayerNorm, GELU (the tanh form, as in GPT-2's code; PyTorch's `nn.GELU()` default is the
//! erf form, which differs by less than 1e-3), no dropout. Weights are drawn N(0, 0.02) and the
//! projections that write into the residual stream (attention's output projection, the MLP's
//! second layer, every expert's second layer) N(0, 0.02/√(2·layers)); biases start at 0, LayerNorm
//! at (1, 0). Every MoE layer routes the `B·T` tokens of the batch independently (token-level
//! routing) with its own router, so every token-choice router works; Expert Choice is refused,
//! since it picks each expert's tokens from the whole batch, which lets a position's output depend
//! on later positions of its sequence (a causal model must not see the future).

use crate::moe::{MoeConfig, MoeLayer, RoutingStats, ScoreTerm};
use crate::nn::{
    CausalSelfAttention, Embedding, LayerNorm, Linear, Module, Param, Parameters, join,
};
use crate::{Device, Error, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The feed-forward part of the blocks.
#[derive(Clone, Debug, PartialEq)]
pub enum FeedForward {
    /// a dense MLP `d → hidden → d` in every block
    Dense {
        /// hidden width (nanoGPT: 4d)
        hidden: usize,
    },
    /// an MoE layer in every `every`-th block (blocks `every−1, 2·every−1, …`), dense MLPs of
    /// width `dense_hidden` in the others
    Moe {
        /// the MoE layer's settings (`d`, `d_out` and `seed` are set per block)
        layer: Box<MoeConfig>,
        /// one MoE block in this many (1: all)
        every: usize,
        /// hidden width of the dense blocks between MoE blocks
        dense_hidden: usize,
    },
}

/// The shape of a GPT.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// vocabulary size V
    pub vocab: usize,
    /// context length (the positional table's rows)
    pub block: usize,
    /// transformer blocks
    pub layers: usize,
    /// attention heads (d must be a multiple)
    pub heads: usize,
    /// model width d
    pub d_model: usize,
    /// dense or MoE feed-forward blocks
    pub ffn: FeedForward,
    /// seed of the initialisation (and of the routers' noise)
    pub seed: u64,
}

impl GptConfig {
    /// nanoGPT's "baby" Shakespeare setting: 4 layers, 4 heads, d = 128, block 64, MLP 4d.
    pub fn baby(vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            block: 64,
            layers: 4,
            heads: 4,
            d_model: 128,
            ffn: FeedForward::Dense { hidden: 512 },
            seed: 0,
        }
    }

    /// Checks the shape; the error names the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.vocab == 0 || self.block == 0 || self.layers == 0 || self.d_model == 0 {
            return bad(format!(
                "GPT needs a vocabulary, --block, --layers and --d-model of at least 1, got {}, {}, {}, {}",
                self.vocab, self.block, self.layers, self.d_model
            ));
        }
        if self.heads == 0 || !self.d_model.is_multiple_of(self.heads) {
            return bad(format!(
                "--d-model {} must be a positive multiple of --heads {}",
                self.d_model, self.heads
            ));
        }
        match &self.ffn {
            FeedForward::Dense { hidden } if *hidden == 0 => {
                bad("the MLP's hidden width must be at least 1".into())
            }
            FeedForward::Moe { layer, every, .. } => {
                if *every == 0 || *every > self.layers {
                    return bad(format!(
                        "--moe-every {every} must be between 1 and --layers {}",
                        self.layers
                    ));
                }
                if layer.router == "expert-choice" {
                    return bad("--router expert-choice cannot train a causal language model: it picks each expert's tokens from the whole batch, so a position's output would depend on later positions of its own sequence (the future); use a token-choice router such as topk or switch".into());
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Trainable parameters of the model, counted before building it (None if the count
    /// overflows). Equals [`Parameters::num_params`] for routers whose only parameters are the linear
    /// gate (others add a few, e.g. SparseMixer's ω).
    pub fn parameter_count(&self) -> Option<u64> {
        let (v, t, d) = (self.vocab as u64, self.block as u64, self.d_model as u64);
        let linear = |i: u64, o: u64| i.checked_mul(o)?.checked_add(o);
        let attn = linear(d, d.checked_mul(3)?)?.checked_add(linear(d, d)?)?;
        let mut total = v.checked_mul(d)?.checked_add(t.checked_mul(d)?)?;
        for i in 0..self.layers {
            let ffn = match &self.ffn {
                FeedForward::Moe { layer, .. } if self.is_moe_block(i) => {
                    let (n, h) = (layer.experts as u64, layer.hidden as u64);
                    let expert = linear(d, h)?.checked_add(linear(h, d)?)?;
                    let s = (layer.shared.count * layer.shared.hidden) as u64;
                    let shared = if s > 0 {
                        linear(d, s)?
                            .checked_add(linear(s, d)?)?
                            .checked_add(if layer.shared.gate { d } else { 0 })?
                    } else {
                        0
                    };
                    n.checked_mul(expert)?
                        .checked_add(linear(d, n)?)?
                        .checked_add(shared)?
                }
                FeedForward::Moe { dense_hidden, .. } => {
                    let h = *dense_hidden as u64;
                    linear(d, h)?.checked_add(linear(h, d)?)?
                }
                FeedForward::Dense { hidden } => {
                    let h = *hidden as u64;
                    linear(d, h)?.checked_add(linear(h, d)?)?
                }
            };
            // two LayerNorms of 2d each
            total = total
                .checked_add(attn)?
                .checked_add(ffn)?
                .checked_add(4 * d)?;
        }
        total.checked_add(2 * d)
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
            let width = match &self.ffn {
                FeedForward::Moe { layer, .. } => {
                    (layer.hidden * layer.k.max(1)).max(4 * self.d_model)
                }
                FeedForward::Dense { hidden } => *hidden,
            } as u64;
            // per token and layer: ~16 d-wide activations kept for backward, the FFN's hidden
            // rows, and the logits
            let per_token = (self.layers as u64)
                .checked_mul((16 * self.d_model as u64).checked_add(2 * width)?)?
                .checked_add(3 * self.vocab as u64)?;
            params
                .checked_mul(4 * 4)?
                .checked_add(tokens.checked_mul(per_token)?.checked_mul(4)?)
        })();
        crate::memory::check_fits(
            &format!(
                "a GPT of --layers {} --d-model {} --block {}{} (--batch {batch})",
                self.layers,
                self.d_model,
                self.block,
                match &self.ffn {
                    FeedForward::Moe { layer, .. } => format!(
                        " with --experts {} × --expert-hidden {}",
                        layer.experts, layer.hidden
                    ),
                    FeedForward::Dense { .. } => String::new(),
                }
            ),
            bytes,
        )
    }

    /// Whether block `i` has an MoE feed-forward.
    pub fn is_moe_block(&self, i: usize) -> bool {
        matches!(&self.ffn, FeedForward::Moe { every, .. } if (i + 1).is_multiple_of(*every))
    }
}

/// A feed-forward block: a dense MLP or an MoE layer.
enum Ffn {
    Dense { fc: Linear, proj: Linear },
    Moe(Box<MoeLayer>),
}

struct Block {
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    ffn: Ffn,
}

/// What a forward pass returns.
pub struct GptOutput {
    /// `[B·T, V]` next-character logits
    pub logits: Tensor,
    /// the MoE layers' balance and z-losses, summed (None for a dense model)
    pub aux_loss: Option<Tensor>,
    /// one entry per MoE block, in block order
    pub routing: Vec<RoutingStats>,
    /// score-function terms of REINFORCE routers (see `moe/score_function.rs`)
    pub score_terms: Vec<ScoreTerm>,
}

/// What a forward pass gathers from its MoE layers, in layer order (used by the GPT and the
/// Llama-style decoder): the summed auxiliary losses, each layer's routing and score terms.
#[derive(Default)]
pub(super) struct MoeTally {
    aux: Option<Tensor>,
    routing: Vec<RoutingStats>,
    score_terms: Vec<ScoreTerm>,
}

impl MoeTally {
    /// Takes one MoE layer's output and returns its `y`.
    pub(super) fn add(&mut self, out: crate::moe::MoeOutput) -> Result<Tensor> {
        self.aux = Some(match self.aux.take() {
            Some(s) => s.add(&out.aux_loss)?,
            None => out.aux_loss,
        });
        self.routing.push(out.stats);
        self.score_terms.extend(out.score_terms);
        Ok(out.y)
    }

    /// The forward pass's output with these logits.
    pub(super) fn finish(self, logits: Tensor) -> GptOutput {
        GptOutput {
            logits,
            aux_loss: self.aux,
            routing: self.routing,
            score_terms: self.score_terms,
        }
    }
}

impl From<GptOutput> for crate::train::ModelOutput {
    /// One task: the logits `[B·T, V]`.
    fn from(out: GptOutput) -> Self {
        crate::train::ModelOutput {
            logits: vec![out.logits],
            aux_loss: out.aux_loss,
            routing: out.routing,
            score_terms: out.score_terms,
        }
    }
}

/// The model.
pub struct Gpt {
    /// the settings it was built with
    pub config: GptConfig,
    tok_emb: Embedding,
    pos_emb: Param,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

/// A tensor of `shape` drawn N(0, std²) from `rng` (f32).
fn normal(shape: &[usize], std: f64, rng: &mut ChaCha8Rng, device: Device) -> Result<Tensor> {
    crate::nn::normal(shape, std, rng, device)
}

impl Gpt {
    /// Builds and initialises the model (see the module docs).
    pub fn new(cfg: &GptConfig, device: Device) -> Result<Gpt> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let d = cfg.d_model;
        let std = 0.02;
        let residual_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let linear = |i: usize, o: usize, std: f64, rng: &mut ChaCha8Rng| -> Result<Linear> {
            Ok(Linear {
                weight: Param::new(normal(&[i, o], std, rng, device)?)?,
                bias: Some(Param::new(Tensor::zeros(&[o], crate::DType::F32, device)?)?),
            })
        };
        let tok_emb = Embedding {
            weight: Param::new(normal(&[cfg.vocab, d], std, &mut rng, device)?)?,
        };
        let pos_emb = Param::new(normal(&[cfg.block, d], std, &mut rng, device)?)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let attn = CausalSelfAttention {
                qkv: linear(d, 3 * d, std, &mut rng)?,
                proj: linear(d, d, residual_std, &mut rng)?,
                heads: cfg.heads,
            };
            let ffn = match (&cfg.ffn, cfg.is_moe_block(i)) {
                (FeedForward::Moe { layer, .. }, true) => {
                    let mut mc = layer.clone();
                    mc.d = d;
                    mc.d_out = d;
                    mc.seed = cfg.seed.wrapping_add(1000 + i as u64);
                    let moe = MoeLayer::new(&mc, device)?;
                    // the experts as nanoGPT would draw an MLP: N(0, 0.02), second layer scaled
                    let mut err = None;
                    moe.experts().visit_params("", &mut |name, p| {
                        let shape = p.get().shape().to_vec();
                        let value = match name.as_str() {
                            "w1" => normal(&shape, std, &mut rng, device),
                            "w2" => normal(&shape, residual_std, &mut rng, device),
                            _ => Tensor::zeros(&shape, crate::DType::F32, device),
                        };
                        if let Err(e) = value.and_then(|v| p.set(v)) {
                            err = Some(e);
                        }
                    });
                    if let Some(e) = err {
                        return Err(e);
                    }
                    Ffn::Moe(Box::new(moe))
                }
                (FeedForward::Dense { hidden }, _)
                | (
                    FeedForward::Moe {
                        dense_hidden: hidden,
                        ..
                    },
                    false,
                ) => Ffn::Dense {
                    fc: linear(d, *hidden, std, &mut rng)?,
                    proj: linear(*hidden, d, residual_std, &mut rng)?,
                },
            };
            blocks.push(Block {
                ln1: LayerNorm::new(d, device)?,
                attn,
                ln2: LayerNorm::new(d, device)?,
                ffn,
            });
        }
        Ok(Gpt {
            config: cfg.clone(),
            tok_emb,
            pos_emb,
            blocks,
            ln_f: LayerNorm::new(d, device)?,
        })
    }

    /// Runs `idx` `[B, T]` (I32 ids, T ≤ block) and returns the logits of every position.
    ///
    /// # Errors
    /// `idx` not `[B, T]` I32 with `1 ≤ T ≤ block`, or any error of the ops.
    pub fn forward(&self, idx: &Tensor) -> Result<GptOutput> {
        let cfg = &self.config;
        if idx.rank() != 2
            || idx.dtype() != crate::DType::I32
            || idx.shape()[1] == 0
            || idx.shape()[1] > cfg.block
        {
            return Err(Error::Shape(format!(
                "GPT expects I32 ids [B, T] with 1 ≤ T ≤ block {}, got {} {:?}",
                cfg.block,
                idx.dtype(),
                idx.shape()
            )));
        }
        let (b, t, d) = (idx.shape()[0], idx.shape()[1], cfg.d_model);
        let tok = self.tok_emb.forward(idx)?; // [B, T, d]
        let pos = self.pos_emb.get().slice(0, 0, t)?; // [T, d]
        // cast once in mixed precision: the first norm and the first residual add share it
        let h = tok.add(&pos)?.reshape(&[b * t, d])?;
        let mut h = crate::autocast::low_precision_activation(&h)?;
        let mut moe = MoeTally::default();
        for block in &self.blocks {
            // h + attn(ln1(h)): the residual is added by the output projection's kernel
            h = block.attn.forward_add(&block.ln1.forward(&h)?, b, t, &h)?;
            // h + ffn(ln2(h)): added by the last projection's kernel, or the MoE combine's
            let x = block.ln2.forward(&h)?;
            h = match &block.ffn {
                Ffn::Dense { fc, proj } => proj.forward_add(&fc.forward(&x)?.gelu()?, &h)?,
                Ffn::Moe(layer) => moe.add(layer.forward_sequences_add(&x, t, &h)?)?,
            };
        }
        let h = self.ln_f.forward(&h)?;
        let logits = h.matmul_t(&self.tok_emb.weight.get())?;
        Ok(moe.finish(logits))
    }

    /// The MoE layers, in block order (empty for a dense model).
    pub fn moe_layers(&self) -> Vec<&MoeLayer> {
        self.blocks
            .iter()
            .filter_map(|b| match &b.ffn {
                Ffn::Moe(m) => Some(m.as_ref()),
                Ffn::Dense { .. } => None,
            })
            .collect()
    }

    /// The MoE layers with their parameter prefixes (`blocks.<i>.moe`), in block order.
    pub fn moe_layers_named(&self) -> Vec<(String, &MoeLayer)> {
        self.blocks
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match &b.ffn {
                Ffn::Moe(m) => Some((format!("blocks.{i}.moe"), m.as_ref())),
                Ffn::Dense { .. } => None,
            })
            .collect()
    }

    /// Whether AdamW should decay a parameter: the matrices of the linear layers and of the
    /// experts, and the token embedding (which is also the output projection, as in nanoGPT);
    /// not biases, LayerNorm parameters, or the positional table.
    pub fn decays(name: &str, shape: &[usize]) -> bool {
        shape.len() >= 2 && name != "pos_emb"
    }

    /// Parameters a token uses, by configuration: every parameter outside the expert banks, plus
    /// k/n of each MoE layer's experts (k experts per token as configured). For routers whose
    /// count varies (threshold routing, DSelect-k, capacity drops) see
    /// [`Gpt::active_params_at`] with the measured count.
    pub fn active_params_per_token(&self) -> usize {
        match &self.config.ffn {
            FeedForward::Moe { layer, .. } => self.active_params_at(layer.k as f64),
            FeedForward::Dense { .. } => self.num_params(),
        }
    }

    /// Parameters a token uses when it reaches `experts_per_token` experts of each MoE layer on
    /// average (as measured by training: kept assignments per token): every parameter outside
    /// the expert banks, plus that fraction of each layer's experts.
    pub fn active_params_at(&self, experts_per_token: f64) -> usize {
        let share = match &self.config.ffn {
            FeedForward::Moe { layer, .. } => experts_per_token / layer.experts.max(1) as f64,
            FeedForward::Dense { .. } => 1.0,
        };
        let mut total = 0.0;
        for (name, p) in self.named_params() {
            let n = p.get().numel() as f64;
            total += if name.contains(".moe.experts.") {
                n * share
            } else {
                n
            };
        }
        total.round() as usize
    }
}

impl Parameters for Gpt {
    /// Every parameter with its PyTorch-style name (`tok_emb.weight`, `blocks.0.attn.qkv.weight`,
    /// `blocks.1.moe.experts.w1`, …). The tied output projection is `tok_emb.weight` itself.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        self.tok_emb.visit_params(&join(prefix, "tok_emb"), f);
        f(join(prefix, "pos_emb"), &self.pos_emb);
        for (i, block) in self.blocks.iter().enumerate() {
            let scope = join(prefix, &join("blocks", &i.to_string()));
            block.ln1.visit_params(&join(&scope, "ln1"), f);
            block.attn.visit_params(&join(&scope, "attn"), f);
            block.ln2.visit_params(&join(&scope, "ln2"), f);
            match &block.ffn {
                Ffn::Dense { fc, proj } => {
                    fc.visit_params(&join(&scope, "mlp.fc"), f);
                    proj.visit_params(&join(&scope, "mlp.proj"), f);
                }
                Ffn::Moe(moe) => moe.visit_params(&join(&scope, "moe"), f),
            }
        }
        self.ln_f.visit_params(&join(prefix, "ln_f"), f);
    }

    /// Training mode (router noise, training capacity) or evaluation.
    fn set_training(&self, on: bool) {
        for m in self.moe_layers() {
            m.set_training(on);
        }
    }

    /// The MoE layers' router state, named `blocks.<i>.moe.router.<name>`.
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        super::moe_state::state(&self.moe_layers_named())
    }

    /// Restores one entry of [`Parameters::state`] by its full name.
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        super::moe_state::load_state(&self.moe_layers_named(), name, value, "the language model")
    }
}
