//! `moegrad train --model gpt|moe-gpt`: training a character-level GPT by iterations.
//!
//! Each iteration draws `--batch` random windows of `--block` characters from the training split
//! (the windows depend only on the seed and the iteration number, see `data/text.rs`), computes
//! the mean next-character cross-entropy plus the MoE layers' auxiliary losses (and the
//! REINFORCE surrogate for a score-function router), clips the global gradient norm and takes an
//! AdamW step. Every `--eval-every` iterations it measures the validation loss on a fixed set of
//! `--eval-windows` windows, appends a line to `metrics.jsonl`, and writes the checkpoint
//! (parameters, optimizer state, router state, the run's settings and the vocabulary, so
//! `moegrad generate` needs nothing else). Within an evaluation interval nothing is read back
//! but the loss every `--log-every` iterations.
//!
//! The checks and guarantees of the image runs apply unchanged, through the same code: a
//! protected, locked `--out`; `--resume` refusing a checkpoint of another run; nothing
//! non-finite ever written. For `--resume` an evaluation interval plays the part of an epoch:
//! `--iters` must be a multiple of `--eval-every`.

use super::gpt::{FeedForward, Gpt, GptConfig};
use crate::data::text::CharCorpus;
use crate::moe::{MoeConfig, RoutingStats};
use crate::optim::{Adam, Optimizer, Schedule, ScheduleKind, clip_grad_norm};
use crate::train::models::{ModelOutput, TaskModel};
use crate::train::out_dir::OutDir;
use crate::train::{DataKind, ModelKind, RunOptions, TrainConfig, resume};
use crate::{DType, Device, Error, Result, Tensor};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    /// validation loss (mean cross-entropy, nats per character) at the end
    pub val_loss: f64,
    /// validation perplexity, `exp(val_loss)`
    pub val_ppl: f64,
    /// milliseconds per training iteration (evaluation excluded)
    pub ms_per_iter: f64,
    /// training tokens (characters) per second
    pub tokens_per_s: f64,
    /// trainable parameters
    pub params: usize,
    /// parameters one token uses (experts counted at k of n)
    pub active_params_per_token: usize,
    /// per MoE layer, the fraction of kept assignments per expert over the last interval
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<Vec<f64>>>,
    /// fraction of routed assignments dropped by capacity over the last interval (all layers)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_rate: Option<f64>,
    /// kept assignments per token, averaged over the MoE layers and the last interval's
    /// training steps (k for top-k without drops; variable for threshold routing)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<f64>,
    /// vocabulary size
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

/// The model a run's settings describe, for a vocabulary of `vocab` characters.
pub fn gpt_config(cfg: &TrainConfig, vocab: usize) -> GptConfig {
    let ffn = match cfg.model {
        ModelKind::MoeGpt => {
            let mut layer = MoeConfig::new(cfg.d_model, cfg.expert_hidden, cfg.experts, cfg.k);
            layer.router = cfg.router.clone();
            layer.capacity = crate::train::models::capacity(cfg.capacity_factor);
            layer.eval_capacity = crate::train::models::capacity(cfg.eval_capacity_factor);
            layer.activation = crate::nn::Activation::Gelu;
            layer.balance_loss = cfg.balance_loss;
            layer.z_loss = cfg.z_loss;
            layer.router_options = cfg.router_options.clone();
            FeedForward::Moe {
                layer,
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
        let out = Gpt::forward(self, x)?;
        Ok(ModelOutput {
            logits: vec![out.logits],
            aux_loss: out.aux_loss,
            routing: None,
            score_terms: out.score_terms,
        })
    }
    fn named_params(&self) -> Vec<(String, crate::nn::Param)> {
        Gpt::named_params(self)
    }
    fn set_training(&self, on: bool) {
        Gpt::set_training(self, on)
    }
    fn named_state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (prefix, layer) in self.moe_layers_named() {
            out.extend(layer.named_state(&prefix)?);
        }
        Ok(out)
    }
    fn load_state(&self, name: &str, value: &Tensor) -> Result<()> {
        for (prefix, layer) in self.moe_layers_named() {
            if crate::nn::within(&prefix, name).is_some() {
                return layer.load_state(&prefix, name, value);
            }
        }
        Err(Error::Invalid(format!(
            "the language model has no state named {name:?}"
        )))
    }
}

/// AdamW (or Adam with L2 decay, `--optimizer adam`) as nanoGPT sets it up: betas (0.9, 0.99),
/// weight decay on the matrices only ([`Gpt::decays`]).
pub(crate) fn make_optimizer(cfg: &TrainConfig, model: &Gpt) -> Result<Adam> {
    let mut opt = Adam::new(cfg.lr)?;
    opt.weight_decay = cfg.weight_decay;
    opt.decoupled = cfg.optimizer == crate::train::OptimizerKind::Adamw;
    opt.beta2 = 0.99;
    opt.no_decay = model
        .named_params()
        .iter()
        .filter(|(n, p)| !Gpt::decays(n, p.get().shape()))
        .map(|(n, _)| n.clone())
        .collect();
    Ok(opt)
}

/// What one language-model training step leaves on the device; nothing of it has been read back.
pub struct LmStepOutput {
    /// the objective minimised: mean cross-entropy plus the MoE layers' auxiliary losses
    pub loss: Tensor,
    /// the mean next-character cross-entropy
    pub cross_entropy: Tensor,
    /// one entry per MoE block
    pub routing: Vec<RoutingStats>,
}

/// One optimizer step of `model` on ids `x: [B, T]` with next-character targets `y: [B·T]`:
/// forward, mean cross-entropy plus auxiliary losses (plus the REINFORCE surrogates), backward,
/// global-norm clipping when `max_grad_norm > 0` (on the device) and the update. It waits for
/// nothing and reads nothing back.
pub fn train_step(
    model: &Gpt,
    params: &[(String, crate::nn::Param)],
    opt: &mut Adam,
    x: &Tensor,
    y: &Tensor,
    max_grad_norm: f64,
) -> Result<LmStepOutput> {
    let out = Gpt::forward(model, x)?;
    let ce = out.logits.cross_entropy(y)?;
    let loss = match &out.aux_loss {
        Some(aux) => ce.add(&aux.to_dtype(ce.dtype())?)?,
        None => ce.clone(),
    };
    let objective = if out.score_terms.is_empty() {
        loss.clone()
    } else {
        // each position's own cross-entropy, as its share of the mean
        let per_token = crate::no_grad(|| {
            out.logits
                .cross_entropy_per_row(y)?
                .mul_scalar(1.0 / y.numel().max(1) as f64)
        })?;
        crate::moe::score_function::add_surrogates(&loss, &out.score_terms, &per_token)?
    };
    objective.backward()?;
    let scale = if max_grad_norm > 0.0 {
        clip_grad_norm(params, max_grad_norm)?
    } else {
        None
    };
    opt.step(params, scale.as_ref().map(|(_, s)| s))?;
    Ok(LmStepOutput {
        loss,
        cross_entropy: ce,
        routing: out.routing,
    })
}

/// Mean validation loss over the fixed windows at `starts`, in batches of `batch`.
fn evaluate(
    model: &Gpt,
    corpus: &CharCorpus,
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
        let ce = Gpt::forward(model, &x)?.logits.cross_entropy(&y)?;
        sum = sum.add(&ce.to_dtype(DType::F32)?.mul_scalar(b as f64)?)?;
    }
    model.set_training(true);
    Ok(sum.item()? / starts.len().max(1) as f64)
}

/// Sums per-expert kept/routed counts over the interval, one pair per MoE layer.
fn add_routing(sums: &mut Vec<(Tensor, Tensor)>, stats: &[RoutingStats]) -> Result<()> {
    if sums.is_empty() {
        sums.extend(
            stats
                .iter()
                .map(|s| (s.kept_per_expert.clone(), s.routed_per_expert.clone())),
        );
        return Ok(());
    }
    for ((k, r), s) in sums.iter_mut().zip(stats) {
        *k = k.add(&s.kept_per_expert)?;
        *r = r.add(&s.routed_per_expert)?;
    }
    Ok(())
}

/// Expert load per layer and the overall drop rate from interval sums.
fn load_and_drop(sums: &[(Tensor, Tensor)]) -> Result<(Vec<Vec<f64>>, f64)> {
    let (mut kept_all, mut routed_all) = (0.0, 0.0);
    let mut loads = Vec::with_capacity(sums.len());
    for (k, r) in sums {
        let k = k.to_vec_f64()?;
        let kept: f64 = k.iter().sum();
        kept_all += kept;
        routed_all += r.to_vec_f64()?.iter().sum::<f64>();
        loads.push(
            k.iter()
                .map(|v| if kept > 0.0 { v / kept } else { 0.0 })
                .collect(),
        );
    }
    let drop = if routed_all > 0.0 {
        1.0 - kept_all / routed_all
    } else {
        0.0
    };
    Ok((loads, drop))
}

/// Runs a language-model training job as configured (see the module docs).
///
/// # Errors
/// Bad settings or data (named), a diverged run (naming the step and the last good checkpoint),
/// and the refusals of `--out` and `--resume`.
pub fn run(cfg: &TrainConfig, opts: RunOptions) -> Result<LmSummary> {
    let cfg = &cfg.clone().with_lm_intervals();
    cfg.validate()?;
    if !cfg.model.is_lm() {
        return Err(Error::Invalid(format!(
            "lm::train::run trains --model gpt or moe-gpt, not {}",
            cfg.model.name()
        )));
    }
    let allowed = opts.check()?;
    let started = Instant::now();
    let recording = opts.profile.then(crate::profile::start);
    let device = Device::from_name(&cfg.device)?;
    if cfg.optimizer == crate::train::OptimizerKind::Sgd {
        return Err(Error::Invalid(
            "the language models train with --optimizer adamw (the default) or adam".into(),
        ));
    }
    let corpus = CharCorpus::load(&text_path(cfg)?, cfg.block)?;
    let gpt = gpt_config(cfg, corpus.vocab_size());
    gpt.validate()?;
    gpt.check_memory(cfg.batch)?;
    let model = Gpt::new(&gpt, device)?;
    let params = model.named_params();
    let n_params = model.num_params();
    let mut opt = make_optimizer(cfg, &model)?;
    let interval = cfg.eval_every as u64;
    let schedule = Schedule::new(
        cfg.lr,
        cfg.warmup_steps,
        interval * cfg.schedule_length_epochs() as u64,
        if cfg.schedule == "cosine" {
            ScheduleKind::Cosine { min_lr: cfg.min_lr }
        } else {
            ScheduleKind::Constant
        },
    )?;

    let out = OutDir::claim(&cfg.out, opts.resume, opts.overwrite)?;
    if opts.progress {
        for note in &out.notes {
            eprintln!("moegrad: note: {note}");
        }
        if let Some(w) = cfg.warmup_warning(cfg.iters as u64) {
            eprintln!("moegrad: warning: {w}");
        }
    }
    let ckpt_path = out.path().join("checkpoint.safetensors");
    let metrics_path = out.path().join("metrics.jsonl");
    let config_json = serde_json::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
    let vocab: String = corpus.vocab.iter().collect();

    let mut saved: Option<u64> = None;
    let mut start_interval = 0;
    if opts.resume {
        let target = resume::ResumeTarget {
            cfg,
            allowed: &allowed,
            device,
            model: &model,
            params: &params,
            steps_per_epoch: interval,
        };
        start_interval = resume::restore(&ckpt_path, &target, &mut opt)?;
        saved = Some(start_interval as u64 * interval);
        crate::train::truncate_metrics(&metrics_path, start_interval)?;
    } else if opts.overwrite {
        out.clear_previous_run()?;
    }
    let last_checkpoint = |saved: Option<u64>| match saved {
        Some(it) => format!(
            "the last good checkpoint, written after iteration {it}, is kept at {}",
            ckpt_path.display()
        ),
        None => "no checkpoint has been written by this run yet".to_string(),
    };

    let val_starts = corpus.val_windows(cfg.eval_windows, cfg.block, cfg.seed);
    let eval_batch = cfg.batch.max(32);
    let intervals = cfg.iters / cfg.eval_every;
    let total = (intervals - start_interval) as u64 * interval;
    let bar = if opts.progress {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "iter {pos}/{len} [{bar:30}] {msg} ({elapsed}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };

    let (b, t) = (cfg.batch, cfg.block);
    let mut step = opt.steps();
    let mut last_finite_read = step;
    let mut train_seconds = 0.0;
    let mut trained_iters = 0u64;
    let mut last = (f64::NAN, f64::NAN);
    let mut last_routing: Option<(Vec<Vec<f64>>, f64)> = None;
    let mut last_experts_per_token: Option<f64> = None;
    for it in start_interval..intervals {
        let mut loss_sum = Tensor::zeros(&[], DType::F32, device)?;
        let mut routing_sums: Vec<(Tensor, Tensor)> = Vec::new();
        let interval_start = Instant::now();
        for _ in 0..interval {
            let _step = crate::profile::step();
            opt.set_lr(schedule.lr(step));
            let (x, y) = corpus.train_batch(b, t, cfg.seed, step);
            let x = Tensor::from_i32(x, &[b, t], device)?;
            let y = Tensor::from_i32(y, &[b * t], device)?;
            let out = train_step(&model, &params, &mut opt, &x, &y, cfg.clip_grad_norm)?;
            let (loss, ce) = (out.loss, out.cross_entropy);
            add_routing(&mut routing_sums, &out.routing)?;
            step += 1;
            loss_sum = crate::no_grad(|| loss_sum.add(&ce.detach().to_dtype(DType::F32)?))?;
            if step % cfg.log_every as u64 == 0 {
                let l = loss.item()?;
                if !l.is_finite() {
                    bar.abandon();
                    return Err(Error::Invalid(format!(
                        "loss is {l} at iteration {step}; it was last read finite at iteration {last_finite_read} (read every {} iterations); stopping; {}",
                        cfg.log_every,
                        last_checkpoint(saved)
                    )));
                }
                last_finite_read = step;
                bar.set_message(format!("loss {l:.4}"));
            }
            bar.inc(1);
        }
        let train_loss = loss_sum.item()? / interval as f64;
        train_seconds += interval_start.elapsed().as_secs_f64();
        trained_iters += interval;
        if !train_loss.is_finite() {
            bar.abandon();
            return Err(Error::Invalid(format!(
                "mean training loss of iterations {}..={step} is {train_loss}; stopping; {}",
                step + 1 - interval,
                last_checkpoint(saved)
            )));
        }
        let val_loss = evaluate(&model, &corpus, &val_starts, t, eval_batch, device)?;
        let mut ck = resume::snapshot(it + 1, &params, &opt, &model, &config_json)?;
        if let Some(bad) = ck.first_non_finite()? {
            bar.abandon();
            return Err(Error::Invalid(format!(
                "after iteration {step} {bad}: the run has diverged (a smaller --lr or --clip-grad-norm may help); stopping without writing a checkpoint; {}",
                last_checkpoint(saved)
            )));
        }
        ck.metadata.insert("vocab".into(), vocab.clone());
        let routing = if routing_sums.is_empty() {
            None
        } else {
            Some(load_and_drop(&routing_sums)?)
        };
        let experts_per_token = if routing_sums.is_empty() {
            None
        } else {
            let mut kept = 0.0;
            for (k, _) in &routing_sums {
                kept += k.to_vec_f64()?.iter().sum::<f64>();
            }
            Some(kept / (routing_sums.len() as u64 * interval * (b * t) as u64) as f64)
        };
        let mut line = serde_json::json!({
            "iter": step, "lr": opt.lr(), "train_loss": train_loss, "val_loss": val_loss,
            "val_ppl": val_loss.exp(), "interval_seconds": interval_start.elapsed().as_secs_f64(),
        });
        if let Some((load, drop)) = &routing {
            line["expert_load"] = serde_json::json!(load);
            line["drop_rate"] = serde_json::json!(drop);
        }
        if let Some(e) = experts_per_token {
            line["experts_per_token"] = serde_json::json!(e);
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(|e| Error::Io(format!("{}: {e}", metrics_path.display())))?;
        writeln!(f, "{line}").map_err(|e| Error::Io(format!("{}: {e}", metrics_path.display())))?;
        ck.save(&ckpt_path)?;
        saved = Some(step);
        // The evaluation's batches (its last one of another size) and the checkpoint's host
        // copies left blocks in the CPU buffer pool that the training step does not ask for:
        // hand them back, so that the process's memory does not grow with each evaluation.
        crate::backend::cpu::pool::trim();
        super::plot::draw(
            out.path(),
            &metrics_path,
            &format!("{} on {}", cfg.model.name(), cfg.data.name()),
        )?;
        if opts.progress {
            bar.println(format!(
                "iter {step}: train loss {train_loss:.4}, val loss {val_loss:.4} (ppl {:.2}), {:.1} s",
                val_loss.exp(),
                interval_start.elapsed().as_secs_f64()
            ));
        }
        last = (train_loss, val_loss);
        last_routing = routing;
        last_experts_per_token = experts_per_token;
    }
    bar.finish_and_clear();
    if start_interval >= intervals {
        last.1 = evaluate(&model, &corpus, &val_starts, t, eval_batch, device)?;
    }
    let ms_per_iter = if trained_iters > 0 {
        1e3 * train_seconds / trained_iters as f64
    } else {
        f64::NAN
    };
    let profile = recording.and_then(crate::profile::Recording::finish);
    Ok(LmSummary {
        device: device.to_string(),
        iters: opt.steps(),
        seconds: started.elapsed().as_secs_f64(),
        train_loss: last.0,
        val_loss: last.1,
        val_ppl: last.1.exp(),
        ms_per_iter,
        tokens_per_s: (b * t) as f64 / (ms_per_iter / 1e3),
        params: n_params,
        active_params_per_token: model.active_params_per_token(),
        expert_load: last_routing.as_ref().map(|r| r.0.clone()),
        drop_rate: last_routing.map(|r| r.1),
        experts_per_token: last_experts_per_token,
        vocab: corpus.vocab_size(),
        profile: profile.as_ref().map(crate::profile::Report::rows),
        gpu_profile: profile.and_then(|p| p.gpu),
    })
}

/// Loads a language model from a checkpoint written by [`run`]: its settings and vocabulary
/// from the metadata, its parameters (checked finite), on `device`.
///
/// # Errors
/// A file that is not a moegrad language-model checkpoint, or whose tensors do not fit the model
/// its metadata describes (each names the file and the item).
pub fn load_model(path: &Path, device: Device) -> Result<(Gpt, Vec<char>)> {
    let ck = crate::checkpoint::Checkpoint::load(path, device)?;
    let meta = |key: &str| {
        ck.metadata.get(key).ok_or_else(|| {
            Error::Io(format!(
                "{}: no {key} in the metadata: not a checkpoint of moegrad train --model gpt|moe-gpt",
                path.display()
            ))
        })
    };
    let cfg: TrainConfig = serde_json::from_str(meta("config")?).map_err(|e| {
        Error::Io(format!(
            "{}: the run configuration in the metadata is malformed: {e}",
            path.display()
        ))
    })?;
    if !cfg.model.is_lm() {
        return Err(Error::Io(format!(
            "{}: a checkpoint of --model {}, not of a language model",
            path.display(),
            cfg.model.name()
        )));
    }
    let vocab: Vec<char> = meta("vocab")?.chars().collect();
    if vocab.is_empty() || vocab.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Io(format!(
            "{}: the vocabulary in the metadata is not a sorted list of distinct characters",
            path.display()
        )));
    }
    if let Some(bad) = ck.first_non_finite()? {
        return Err(Error::Io(format!("{}: {bad}", path.display())));
    }
    let model = Gpt::new(&gpt_config(&cfg, vocab.len()), device)?;
    for (name, p) in model.named_params() {
        let t = ck
            .tensors
            .get(&name)
            .ok_or_else(|| Error::Io(format!("{}: parameter {name} is missing", path.display())))?;
        if t.shape() != p.get().shape() {
            return Err(Error::Io(format!(
                "{}: {name} has shape {:?}, but the model its metadata describes needs {:?}",
                path.display(),
                t.shape(),
                p.get().shape()
            )));
        }
        p.set(t.to_dtype(DType::F32)?)?;
    }
    Ok((model, vocab))
}
