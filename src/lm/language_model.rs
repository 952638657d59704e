//! [`LanguageModel`]: the language models `moegrad train` builds from a run's settings — the GPT
//! (`gpt`, `moe-gpt`) or the Llama-style [`Decoder`] (`llama`, `mixtral`, `qwen2-moe`, `olmoe`,
//! `deepseek-moe`) — behind one type, so training, evaluation, checkpoints and sampling are
//! written once for all of them.

use super::decoder::Decoder;
use super::decoder_config::{DecoderConfig, Family};
use super::gpt::{Gpt, GptOutput};
use super::hf_config::{Architecture, architecture_from_hf};
use super::train::gpt_config;
use crate::moe::{MoeConfig, MoeLayer, SharedExpertsConfig};
use crate::nn::{Param, Parameters};
use crate::train::{ModelOutput, TaskModel, TrainConfig};
use crate::{Device, Error, Result, Tensor};

/// A language model of either architecture.
pub enum LanguageModel {
    /// `--model gpt|moe-gpt`
    Gpt(Gpt),
    /// `--model llama|mixtral|qwen2-moe|olmoe|deepseek-moe`
    Decoder(Box<Decoder>),
}

/// The decoder a run's settings describe, for a vocabulary of `vocab` tokens: the family's preset
/// ([`DecoderConfig::baby`]) with the run's sizes (`--layers`, `--heads`, `--kv-heads`,
/// `--d-model`, `--block`, seed) and, for the MoE families, its MoE settings (`--router` and its
/// options, `--experts`, `--k`, `--expert-hidden`, capacities, balance and z-losses, shared
/// experts). None for the GPT models.
pub fn decoder_config(cfg: &TrainConfig, vocab: usize) -> Option<DecoderConfig> {
    let family = cfg.model.family()?;
    let mut d = DecoderConfig::baby(family, vocab);
    d.layers = cfg.layers;
    d.heads = cfg.heads;
    d.kv_heads = if cfg.kv_heads == 0 {
        cfg.heads
    } else {
        cfg.kv_heads
    };
    d.d_model = cfg.d_model;
    d.head_dim = cfg.d_model / cfg.heads.max(1);
    d.ffn_hidden = 4 * cfg.d_model;
    d.block = cfg.block;
    d.seed = cfg.seed;
    if let Some(m) = d.moe.as_mut() {
        let preset: MoeConfig = m.clone();
        *m = MoeConfig {
            d: cfg.d_model,
            d_out: cfg.d_model,
            hidden: cfg.expert_hidden,
            experts: cfg.experts,
            k: cfg.k,
            router: cfg.router.clone(),
            router_options: cfg.router_options.clone(),
            capacity: crate::train::capacity(cfg.capacity_factor),
            eval_capacity: crate::train::capacity(cfg.eval_capacity_factor),
            balance_loss: cfg.balance_loss,
            balancing: cfg.balancing,
            z_loss: cfg.z_loss,
            null_experts: cfg.null_experts,
            shared: SharedExpertsConfig {
                count: cfg.shared_experts,
                hidden: if cfg.shared_hidden == 0 {
                    cfg.expert_hidden
                } else {
                    cfg.shared_hidden
                },
                gate: cfg.shared_gate,
            },
            ..preset
        };
    }
    if family == Family::DeepseekMoe
        && let Some(l) = d.latent.as_mut()
    {
        // the preset's latent sizes scale with the head width
        let head = d.head_dim;
        l.nope_dim = head / 2;
        l.rope_dim = head / 2 + head / 2 % 2;
        l.v_dim = head;
        l.kv_rank = head;
    }
    Some(d)
}

/// The model a run's settings describe for a tokenizer of `vocab` tokens: the family's preset at
/// the run's sizes ([`decoder_config`], [`gpt_config`]), or, when the run carries an
/// architecture (`TrainConfig::architecture`: an imported or inherited model), that
/// architecture with the run's training settings (router and options, capacities, balance and
/// z-loss weights, seed).
///
/// # Errors
/// An architecture that does not parse, is not the run's `--model`, has fewer tokens than the
/// tokenizer, or disagrees with `--layers`, `--heads`, `--kv-heads` or `--d-model` (named).
pub fn model_config(cfg: &TrainConfig, vocab: usize) -> Result<Architecture> {
    let Some(json) = &cfg.architecture else {
        return Ok(match decoder_config(cfg, vocab) {
            Some(d) => Architecture::Decoder(d),
            None => Architecture::Gpt(gpt_config(cfg, vocab)),
        });
    };
    let arch = architecture_from_hf(json)
        .map_err(|e| Error::Invalid(format!("the run's architecture: {e}")))?;
    let (name, model_vocab, sizes) = match &arch {
        Architecture::Gpt(g) => (
            "gpt",
            g.vocab,
            [g.layers, g.heads, g.heads, g.d_model, g.block],
        ),
        Architecture::Decoder(d) => (
            d.family.name(),
            d.vocab,
            [d.layers, d.heads, d.kv_heads, d.d_model, d.block],
        ),
    };
    if name != cfg.model.name() {
        return Err(Error::Invalid(format!(
            "the run's architecture is a {name} model, not --model {}",
            cfg.model.name()
        )));
    }
    if vocab > model_vocab {
        return Err(Error::Invalid(format!(
            "the tokenizer has {vocab} tokens, but the model's vocabulary is {model_vocab}"
        )));
    }
    let kv = if cfg.kv_heads == 0 {
        cfg.heads
    } else {
        cfg.kv_heads
    };
    let given = [cfg.layers, cfg.heads, kv, cfg.d_model];
    for (i, flag) in ["--layers", "--heads", "--kv-heads", "--d-model"]
        .iter()
        .enumerate()
    {
        if given[i] != sizes[i] && !(i == 2 && name == "gpt") {
            return Err(Error::Invalid(format!(
                "{flag} {} differs from the model's architecture, which has {}",
                given[i], sizes[i]
            )));
        }
    }
    if cfg.block > sizes[4] {
        return Err(Error::Invalid(format!(
            "--block {} is longer than the model's context ({} positions)",
            cfg.block, sizes[4]
        )));
    }
    Ok(match arch {
        Architecture::Gpt(mut g) => {
            g.seed = cfg.seed;
            Architecture::Gpt(g)
        }
        Architecture::Decoder(mut d) => {
            d.seed = cfg.seed;
            if let Some(m) = d.moe.as_mut() {
                m.router = cfg.router.clone();
                m.router_options = cfg.router_options.clone();
                m.capacity = crate::train::capacity(cfg.capacity_factor);
                m.eval_capacity = crate::train::capacity(cfg.eval_capacity_factor);
                m.balance_loss = cfg.balance_loss;
                m.balancing = cfg.balancing;
                m.z_loss = cfg.z_loss;
                m.null_experts = cfg.null_experts;
            }
            Architecture::Decoder(d)
        }
    })
}

impl LanguageModel {
    /// The model a run's settings describe, checked (settings and memory for `batch`) before
    /// anything is allocated.
    ///
    /// # Errors
    /// Settings the model refuses, or a model and batch that do not fit in memory.
    pub fn build(cfg: &TrainConfig, vocab: usize, device: Device) -> Result<LanguageModel> {
        match model_config(cfg, vocab)? {
            Architecture::Decoder(d) => {
                d.validate()?;
                d.check_memory(cfg.batch)?;
                Ok(LanguageModel::Decoder(Box::new(Decoder::new(&d, device)?)))
            }
            Architecture::Gpt(g) => {
                g.validate()?;
                g.check_memory(cfg.batch)?;
                Ok(LanguageModel::Gpt(Gpt::new(&g, device)?))
            }
        }
    }

    /// [`LanguageModel::build`], then, when the run starts from a checkpoint
    /// (`TrainConfig::init_from`), its parameters and routers' state taken from there: copied,
    /// or upcycled from a dense model (see `lm/init_from.rs`). What a training run starts from.
    ///
    /// # Errors
    /// Those of [`LanguageModel::build`]; an unreadable checkpoint or a parameter it has no
    /// value for (named).
    pub fn build_initialised(
        cfg: &TrainConfig,
        vocab: usize,
        device: Device,
    ) -> Result<LanguageModel> {
        let model = LanguageModel::build(cfg, vocab, device)?;
        super::init_from::init_parameters(&model, cfg, device)?;
        Ok(model)
    }

    /// Trainable parameters the settings describe, counted before building (an estimate for
    /// routers with extra parameters; None on overflow or settings that describe no model).
    pub fn parameter_count(cfg: &TrainConfig, vocab: usize) -> Option<u64> {
        match model_config(cfg, vocab).ok()? {
            Architecture::Decoder(d) => d.parameter_count(),
            Architecture::Gpt(g) => g.parameter_count(),
        }
    }

    /// The settings of the model built: its architecture as a transformers config would say
    /// it ([`crate::lm::architecture_to_hf`] writes that config).
    pub fn architecture(&self) -> Architecture {
        match self {
            LanguageModel::Gpt(m) => Architecture::Gpt(m.config.clone()),
            LanguageModel::Decoder(m) => Architecture::Decoder(m.config().clone()),
        }
    }

    /// The logits of every position of `idx` `[B, T]`, with the MoE layers' losses and routing.
    ///
    /// # Errors
    /// Those of [`Gpt::forward`] and [`Decoder::forward`].
    pub fn forward(&self, idx: &Tensor) -> Result<GptOutput> {
        match self {
            LanguageModel::Gpt(m) => m.forward(idx),
            LanguageModel::Decoder(m) => m.forward(idx),
        }
    }

    /// The longest context the model takes.
    pub fn block(&self) -> usize {
        match self {
            LanguageModel::Gpt(m) => m.config.block,
            LanguageModel::Decoder(m) => m.config().block,
        }
    }

    /// The MoE layers with their parameter prefixes, in layer order.
    pub fn moe_layers_named(&self) -> Vec<(String, &MoeLayer)> {
        match self {
            LanguageModel::Gpt(m) => m.moe_layers_named(),
            LanguageModel::Decoder(m) => m.moe_layers_named(),
        }
    }

    /// Parameters a token uses when it reaches `experts_per_token` routed experts of each MoE
    /// layer on average: every parameter outside the routed expert banks, plus that share of
    /// them.
    pub fn active_params_at(&self, experts_per_token: f64) -> usize {
        let layers = self.moe_layers_named();
        let Some((_, first)) = layers.first() else {
            return self.num_params();
        };
        let share = experts_per_token / first.config().experts.max(1) as f64;
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

    /// [`LanguageModel::active_params_at`] k experts per token (as configured).
    pub fn active_params_per_token(&self) -> usize {
        match self.moe_layers_named().first() {
            Some((_, m)) => self.active_params_at(m.config().k as f64),
            None => self.num_params(),
        }
    }

    /// Whether AdamW decays a parameter: the matrices (and embeddings), not the biases, norms or
    /// GPT's positional table.
    pub fn decays(name: &str, shape: &[usize]) -> bool {
        Gpt::decays(name, shape)
    }
}

impl Parameters for LanguageModel {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Param)) {
        match self {
            LanguageModel::Gpt(m) => m.visit_params(prefix, f),
            LanguageModel::Decoder(m) => m.visit_params(prefix, f),
        }
    }
    fn set_training(&self, on: bool) {
        match self {
            LanguageModel::Gpt(m) => m.set_training(on),
            LanguageModel::Decoder(m) => m.set_training(on),
        }
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        match self {
            LanguageModel::Gpt(m) => m.state(),
            LanguageModel::Decoder(m) => m.state(),
        }
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        match self {
            LanguageModel::Gpt(m) => m.load_state(name, value),
            LanguageModel::Decoder(m) => m.load_state(name, value),
        }
    }
}

impl TaskModel for LanguageModel {
    /// `x`: I32 ids `[B, T]`; one task, the logits `[B·T, V]`.
    fn forward(&self, x: &Tensor) -> Result<ModelOutput> {
        Ok(LanguageModel::forward(self, x)?.into())
    }
}
