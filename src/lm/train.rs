//! `moegrad train --model gpt|moe-gpt`: training a GPT by iterations, on characters or subword
//! tokens (`--tokenizer`, `data/tokenizer.rs`).
//!
//! Each iteration draws `--batch` random windows of `--block` tokens from the training split
//! (the windows depend only on the seed and the iteration number, see `data/text.rs`), computes
//! the mean next-token cross-entropy plus the MoE layers' auxiliary losses (and the
//! REINFORCE surrogate for a score-function router), clips the global gradient norm and takes an
//! AdamW step. Every `--eval-every` iterations it measures the validation loss on a fixed set of
//! `--eval-windows` windows (in nats per token and bits per character), appends a line to
//! `metrics.jsonl`, and writes the checkpoint (parameters, optimizer state, router state, the
//! run's settings and the tokenizer: a character vocabulary or a tokenizer's JSON, so
//! `moegrad generate` needs nothing else). Within an evaluation interval nothing is read back
//! but the loss every `--log-every` iterations.
//!
//! The checks and guarantees of the image runs apply unchanged, through the same code: a
//! protected, locked `--out`; `--resume` refusing a checkpoint of another run; nothing
//! non-finite ever written. For `--resume` an evaluation interval plays the part of an epoch:
//! `--iters` must be a multiple of `--eval-every`.
//!
//! [`run`] is the one training loop of the image models (`train/trainer.rs`) run on the
//! language-model task (`lm/task.rs`); this file keeps the pieces that task uses (the model's
//! settings, the optimizer, the validation loss) and [`load_model`].

use super::gpt::{FeedForward, Gpt, GptConfig};
use super::language_model::LanguageModel;
use super::task::LmTask;
use crate::data::{TokenCorpus, Tokenizer};
use crate::moe::MoeConfig;
use crate::nn::Parameters;
use crate::optim::Adam;
use crate::train::{DataKind, ModelKind, RunOptions, TrainConfig, TrainObserver};
use crate::train::{ModelOutput, TaskModel};
use crate::{DType, Device, Error, Result, Tensor};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The final figures of a language-model run (`--json` prints this object).
#[derive(Clone, Debug, Serialize)]
pub struct LmSummary {
    /// "cpu" or "gpu"
    pub device: String,
    /// iterations trained in total
    pub iters: u64,
    /// wall-clock seconds of this invocation
    pub seconds: f64,
    /// mean training loss over the last evaluation interval
    pub train_loss: f64,
    /// validation loss (mean cross-entropy, nats per token) at the end
    pub val_loss: f64,
    /// validation perplexity, `exp(val_loss)`
    pub val_ppl: f64,
    /// validation bits per character: the validation windows' nats over the characters their
    /// target tokens stand for, / ln 2 (`val_loss / ln 2` for `--tokenizer char`), so models
    /// with different tokenizers compare
    pub val_bpc: f64,
    /// milliseconds per training iteration (evaluation excluded)
    pub ms_per_iter: f64,
    /// training tokens per second
    pub tokens_per_s: f64,
    /// trainable parameters
    pub params: usize,
    /// parameters one token uses: each MoE layer's experts counted at the experts per token
    /// measured over the last interval (`experts_per_token`), or at k of n before any
    pub active_params_per_token: usize,
    /// per MoE layer, the fraction of kept assignments per expert over the last interval
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<Vec<f64>>>,
    /// MoE: the routing diagnostics of the last evaluation interval (`moe::RoutingDiagnostics`: load/ideal,
    /// dead experts, entropy, logits, per layer and across layers)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<crate::moe::RoutingDiagnostics>,
    /// fraction of routed assignments dropped by capacity over the last interval (all layers)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_rate: Option<f64>,
    /// kept assignments per token, averaged over the MoE layers and the last interval's
    /// training steps (k for top-k without drops; variable for threshold routing)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<f64>,
    /// vocabulary size (tokens)
    pub vocab: usize,
    /// with `RunOptions::profile`: wall time per op and pass, summed over the training
    /// iterations, longest first, then `other` (see [`crate::profile`])
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Vec<crate::profile::ProfileRow>>,
    /// with `RunOptions::profile` on the GPU: GPU time per kernel (timestamp queries)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_profile: Option<crate::profile::GpuProfile>,
}

/// The text file a run trains on: the bundled Shakespeare or `--data-file`.
pub fn text_path(cfg: &TrainConfig) -> Result<PathBuf> {
    match cfg.data {
        DataKind::Shakespeare => Ok(cfg.data_dir.join(crate::data::text::SHAKESPEARE_FILE)),
        DataKind::Text => cfg.data_file.clone().ok_or_else(|| {
            Error::Invalid(
                "--data text needs --data-file PATH (a UTF-8 text file, plain or .gz)".into(),
            )
        }),
        other => Err(Error::Invalid(format!(
            "--model {} trains on text: use --data shakespeare or --data text, not {}",
            cfg.model.name(),
            other.name()
        ))),
    }
}

/// The model a run's settings describe, for a vocabulary of `vocab` tokens.
pub fn gpt_config(cfg: &TrainConfig, vocab: usize) -> GptConfig {
    let ffn = match cfg.model {
        ModelKind::MoeGpt => {
            let mut layer = MoeConfig::new(cfg.d_model, cfg.expert_hidden, cfg.experts, cfg.k);
            layer.router = cfg.router.clone();
            layer.capacity = crate::train::capacity(cfg.capacity_factor);
            layer.eval_capacity = crate::train::capacity(cfg.eval_capacity_factor);
            layer.activation = crate::nn::Activation::Gelu;
            layer.balance_loss = cfg.balance_loss;
            layer.balancing = cfg.balancing;
            layer.z_loss = cfg.z_loss;
            layer.null_experts = cfg.null_experts;
            layer.router_options = cfg.router_options.clone();
            layer.shared = crate::moe::SharedExpertsConfig {
                count: cfg.shared_experts,
                hidden: if cfg.shared_hidden == 0 {
                    cfg.expert_hidden
                } else {
                    cfg.shared_hidden
                },
                gate: cfg.shared_gate,
            };
            FeedForward::Moe {
                layer: Box::new(layer),
                every: cfg.moe_every,
                dense_hidden: 4 * cfg.d_model,
            }
        }
        _ => FeedForward::Dense {
            hidden: 4 * cfg.d_model,
        },
    };
    GptConfig {
        vocab,
        block: cfg.block,
        layers: cfg.layers,
        heads: cfg.heads,
        d_model: cfg.d_model,
        ffn,
        seed: cfg.seed,
    }
}

impl TaskModel for Gpt {
    /// `x`: I32 ids `[B, T]`; one task, the logits `[B·T, V]`.
    fn forward(&self, x: &Tensor) -> Result<ModelOutput> {
        Ok(Gpt::forward(self, x)?.into())
    }
}

/// AdamW (or Adam with L2 decay, `--optimizer adam`) as nanoGPT sets it up: betas (0.9, 0.99),
/// weight decay on the matrices only ([`LanguageModel::decays`]).
///
/// # Errors
/// A learning rate or weight decay Adam rejects (named in the message).
pub fn make_optimizer(cfg: &TrainConfig, model: &LanguageModel) -> Result<Adam> {
    let mut opt = Adam::new(cfg.lr)?;
    opt.weight_decay = cfg.weight_decay;
    opt.decoupled = cfg.optimizer == crate::train::OptimizerKind::Adamw;
    opt.beta2 = 0.99;
    opt.no_decay = model
        .named_params()
        .iter()
        .filter(|(n, p)| !LanguageModel::decays(n, p.get().shape()))
        .map(|(n, _)| n.clone())
        .collect();
    Ok(opt)
}

/// Mean validation loss over the fixed windows at `starts`, in batches of `batch`.
pub(super) fn evaluate(
    model: &LanguageModel,
    corpus: &TokenCorpus,
    starts: &[usize],
    block: usize,
    batch: usize,
    device: Device,
) -> Result<f64> {
    let _guard = crate::NoGradGuard::new();
    model.set_training(false);
    let mut sum = Tensor::zeros(&[], DType::F32, device)?;
    for chunk in starts.chunks(batch.max(1)) {
        let (x, y) = corpus.val_batch(chunk, block);
        let b = chunk.len();
        let x = Tensor::from_i32(x, &[b, block], device)?;
        let y = Tensor::from_i32(y, &[b * block], device)?;
        let ce = model.forward(&x)?.logits.cross_entropy(&y)?;
        sum = sum.add(&ce.to_dtype(DType::F32)?.mul_scalar(b as f64)?)?;
    }
    model.set_training(true);
    Ok(sum.item()? / starts.len().max(1) as f64)
}

/// Runs a language-model training job as configured (see the module docs).
///
/// # Errors
/// Bad settings or data (named), a diverged run (naming the step and the last good checkpoint),
/// and the refusals of `--out` and `--resume`.
pub fn run(cfg: &TrainConfig, opts: RunOptions) -> Result<LmSummary> {
    run_observed(cfg, opts, &mut crate::train::Silent)
}

/// [`run`], reporting its iterations, finished evaluation intervals and notes to `obs`.
pub fn run_observed(
    cfg: &TrainConfig,
    opts: RunOptions,
    obs: &mut (dyn TrainObserver + Send),
) -> Result<LmSummary> {
    // on a rayon worker, so that each CPU kernel's parallel part starts without a hand-over
    crate::backend::cpu::on_worker_thread(|| run_on_this_thread(cfg, opts, obs))
}

/// [`run_observed`]'s body, on the calling thread.
fn run_on_this_thread(
    cfg: &TrainConfig,
    opts: RunOptions,
    obs: &mut dyn TrainObserver,
) -> Result<LmSummary> {
    let cfg = &cfg.clone().with_lm_intervals();
    cfg.validate()?;
    if !cfg.model.is_lm() {
        return Err(Error::Invalid(format!(
            "lm::run trains --model gpt or moe-gpt, not {}",
            cfg.model.name()
        )));
    }
    crate::train::trainer::run_task(cfg, opts, || LmTask::new(cfg), obs)
}

/// Loads a language model from a checkpoint written by [`run`] or `moegrad import`: its
/// settings and tokenizer from the metadata (a character vocabulary, or a tokenizer's JSON;
/// checkpoints written before tokenizers existed hold the first), its parameters (checked
/// finite) and its routers' state, on `device`.
///
/// # Errors
/// A file that is not a moegrad language-model checkpoint, one without a tokenizer (an import
/// without `tokenizer.json`: [`load_checkpoint`] reads it), or whose tensors do not fit the
/// model its metadata describes (each names the file and the item).
pub fn load_model(path: &Path, device: Device) -> Result<(LanguageModel, Tokenizer)> {
    let (model, tokenizer) = load_checkpoint(path, device)?;
    let tokenizer = tokenizer.ok_or_else(|| {
        Error::Io(format!(
            "{}: the checkpoint has no tokenizer (imported without a tokenizer.json), so it cannot turn text into ids: use moegrad logits with token ids, or import again with --tokenizer PATH/tokenizer.json",
            path.display()
        ))
    })?;
    Ok((model, tokenizer))
}

/// [`load_model`] for checkpoints with or without a tokenizer.
///
/// # Errors
/// As [`load_model`], but for the missing tokenizer.
pub fn load_checkpoint(path: &Path, device: Device) -> Result<(LanguageModel, Option<Tokenizer>)> {
    let ck = crate::checkpoint::Checkpoint::load(path, device)?;
    let (cfg, tokenizer) = super::init_from::settings_from_metadata(&ck.metadata, path)?;
    if let Some(bad) = ck.first_non_finite()? {
        return Err(Error::Io(format!("{}: {bad}", path.display())));
    }
    // the settings are the checkpoint's: check them, and check that the model they describe
    // is the size of the tensors the file holds, before anything is built
    let in_checkpoint = |e: Error| {
        Error::Io(format!(
            "{}: the run settings in the checkpoint's metadata are not valid ({e})",
            path.display()
        ))
    };
    cfg.validate().map_err(in_checkpoint)?;
    // without a tokenizer, the vocabulary is the model's own (an imported architecture)
    let vocab = tokenizer.as_ref().map_or(0, Tokenizer::vocab_size);
    let model_cfg = super::language_model::model_config(&cfg, vocab).map_err(in_checkpoint)?;
    if tokenizer.is_none() && cfg.architecture.is_none() {
        return Err(Error::Io(format!(
            "{}: no vocab or tokenizer in the metadata: not a checkpoint of a moegrad language model",
            path.display()
        )));
    }
    let described = match &model_cfg {
        super::hf_config::Architecture::Decoder(d) => d.parameter_count(),
        super::hf_config::Architecture::Gpt(g) => g.parameter_count(),
    };
    let held: u64 = ck
        .tensors
        .iter()
        .filter(|(name, _)| !name.starts_with("adam.") && !name.starts_with("sgd."))
        .map(|(_, t)| t.numel() as u64)
        .sum();
    // (routers own gates of different sizes, so the count is an estimate: a metadata that
    // describes a model twice the size of the tensors is not theirs; a smaller mismatch is found
    // by the shape check below, once the model is built)
    if described.is_none_or(|n| n > held.saturating_mul(2)) {
        return Err(Error::Io(format!(
            "{}: the metadata describes a model of {} parameters (--layers {} --d-model {}), but the file holds only {held} values: the metadata does not belong to these tensors",
            path.display(),
            described.map_or("more than can be counted".into(), |n| n.to_string()),
            cfg.layers,
            cfg.d_model
        )));
    }
    // the model is built for one sequence: the run's batch does not matter here
    let mut one = cfg.clone();
    one.batch = 1;
    let model = LanguageModel::build(&one, vocab, device)?;
    ck.load_into(&model, path)?;
    Ok((model, tokenizer))
}
