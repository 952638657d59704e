//! The language models as a [`Task`] of the one training loop (`train/trainer.rs`): a
//! character-level GPT trained by iterations on random windows of a text, one evaluation
//! interval (`--eval-every` iterations) per period, evaluated on fixed validation windows,
//! with the vocabulary stored in each checkpoint, summarised as an [`LmSummary`].

use super::gpt::Gpt;
use super::train::{LmSummary, evaluate, gpt_config, make_optimizer, text_path};
use crate::checkpoint::Checkpoint;
use crate::data::text::CharCorpus;
use crate::optim::Optimizer;
use crate::train::TaskModel;
use crate::train::task::{Batch, Evaluation, PeriodResult, RunEnd, Task};
use crate::train::{Period, TrainConfig};
use crate::{Device, Error, Result, Tensor};
use std::path::Path;
use std::time::Instant;

/// A language-model run: its corpus, its model and the fixed validation windows.
pub(super) struct LmTask<'a> {
    cfg: &'a TrainConfig,
    device: Device,
    corpus: CharCorpus,
    model: Gpt,
    /// the vocabulary, stored in each checkpoint's metadata
    vocab: String,
    /// the starts of the fixed validation windows
    val_starts: Vec<usize>,
    /// the batch size of evaluation
    eval_batch: usize,
}

impl<'a> LmTask<'a> {
    /// Loads the corpus and builds the model (checking its settings and memory). `cfg` is
    /// already validated as a language-model run.
    pub(super) fn new(cfg: &'a TrainConfig) -> Result<LmTask<'a>> {
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
        let vocab: String = corpus.vocab.iter().collect();
        let val_starts = corpus.val_windows(cfg.eval_windows, cfg.block, cfg.seed);
        Ok(LmTask {
            cfg,
            device,
            corpus,
            model,
            vocab,
            val_starts,
            eval_batch: cfg.batch.max(32),
        })
    }

    /// The mean validation loss on the fixed windows.
    fn validation_loss(&self) -> Result<f64> {
        evaluate(
            &self.model,
            &self.corpus,
            &self.val_starts,
            self.cfg.block,
            self.eval_batch,
            self.device,
        )
    }
}

impl Task for LmTask<'_> {
    type Summary = LmSummary;
    const PERIOD: Period = Period::Interval;

    fn model(&self) -> &dyn TaskModel {
        &self.model
    }
    fn optimizer(&self) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(make_optimizer(self.cfg, &self.model)?))
    }
    fn tasks(&self) -> usize {
        0
    }
    fn periods(&self) -> usize {
        self.cfg.iters / self.cfg.eval_every
    }
    fn steps_per_period(&self) -> u64 {
        self.cfg.eval_every as u64
    }
    fn title(&self) -> String {
        format!("{} on {}", self.cfg.model.name(), self.cfg.data.name())
    }

    /// A resumed run's text must have the checkpoint's vocabulary (its embedding and output
    /// layer are sized by it): says so, with both sizes and the new symbols, when it changed.
    fn check_resume(&self, ckpt: &Path) -> Result<()> {
        let Ok(meta) = Checkpoint::read_metadata(ckpt) else {
            return Ok(()); // no checkpoint: resume::restore says so
        };
        let Some(saved) = meta.get("vocab") else {
            return Ok(());
        };
        if *saved == self.vocab {
            return Ok(());
        }
        let added: String = self.vocab.chars().filter(|c| !saved.contains(*c)).collect();
        let removed: String = saved.chars().filter(|c| !self.vocab.contains(*c)).collect();
        Err(Error::Invalid(format!(
            "--resume: the data's vocabulary changed since {} was written ({} → {} symbols{}{}): a character model cannot continue on other characters; train a new run on this text",
            ckpt.display(),
            saved.chars().count(),
            self.vocab.chars().count(),
            if added.is_empty() {
                String::new()
            } else {
                format!(", new: {added:?}")
            },
            if removed.is_empty() {
                String::new()
            } else {
                format!(", gone: {removed:?}")
            }
        )))
    }

    fn start_period(&mut self, _period: usize) {}

    /// `--batch` random windows of `--block` characters, fixed by the seed and the step.
    fn batch(&self, _i: usize, step: u64) -> Result<Batch> {
        let (b, t) = (self.cfg.batch, self.cfg.block);
        let (x, y) = self.corpus.train_batch(b, t, self.cfg.seed, step);
        Ok(Batch {
            x: Tensor::from_i32(x, &[b, t], self.device)?,
            y: vec![Tensor::from_i32(y, &[b * t], self.device)?],
            weight: 1,
        })
    }
    fn mean_train_loss(&self, loss_sum: f64) -> f64 {
        loss_sum / self.cfg.eval_every as f64
    }
    fn step_message(&self, loss: f64, _i: usize, _started: Instant) -> String {
        format!("loss {loss:.4}")
    }
    fn evaluate(&self) -> Result<Evaluation> {
        Ok(Evaluation {
            loss: self.validation_loss()?,
            accuracy: Vec::new(),
        })
    }
    fn annotate(&self, ck: &mut Checkpoint) {
        ck.metadata.insert("vocab".into(), self.vocab.clone());
    }
    fn after_checkpoint(&self) {
        // The evaluation's batches (its last one of another size) and the checkpoint's host
        // copies left blocks in the CPU buffer pool that the training step does not ask for:
        // hand them back, so that the process's memory does not grow with each evaluation.
        crate::backend::cpu::buffer_pool::trim();
    }
    fn metrics_line(
        &self,
        r: &PeriodResult,
        _number: usize,
        step: u64,
        lr: f64,
    ) -> serde_json::Value {
        serde_json::json!({
            "iter": step, "lr": lr, "train_loss": r.train_loss,
            "val_loss": r.eval.loss, "val_ppl": r.eval.loss.exp(),
            "interval_seconds": r.started.elapsed().as_secs_f64(),
        })
    }
    fn report_line(&self, r: &PeriodResult, _number: usize, step: u64) -> String {
        format!(
            "iter {step}: train loss {:.4}, val loss {:.4} (ppl {:.2}), {:.1} s",
            r.train_loss,
            r.eval.loss,
            r.eval.loss.exp(),
            r.started.elapsed().as_secs_f64()
        )
    }

    /// When the run had no interval left to train, the validation loss is measured here.
    fn summary(&mut self, run: RunEnd, trained_any: bool, last: PeriodResult) -> Result<LmSummary> {
        let val_loss = if trained_any {
            last.eval.loss
        } else {
            self.validation_loss()?
        };
        let ms_per_iter = if run.trained_steps > 0 {
            1e3 * run.train_seconds / run.trained_steps as f64
        } else {
            f64::NAN
        };
        let tokens_per_iter = (self.cfg.batch * self.cfg.block) as f64;
        Ok(LmSummary {
            device: self.device.to_string(),
            iters: run.steps,
            seconds: run.seconds,
            train_loss: last.train_loss,
            val_loss,
            val_ppl: val_loss.exp(),
            ms_per_iter,
            tokens_per_s: tokens_per_iter / (ms_per_iter / 1e3),
            params: run.params,
            // at the experts per token measured over the last interval where there is one
            // (threshold routing, DSelect-k and capacity drops make it differ from k)
            active_params_per_token: last
                .experts_per_token
                .map_or(self.model.active_params_per_token(), |e| {
                    self.model.active_params_at(e)
                }),
            expert_load: last.routing.as_ref().map(|r| r.0.clone()),
            drop_rate: last.routing.map(|r| r.1),
            experts_per_token: last.experts_per_token,
            vocab: self.corpus.vocab_size(),
            profile: run.profile.as_ref().map(crate::profile::Report::rows),
            gpu_profile: run.profile.and_then(|p| p.gpu),
        })
    }
}
