//! The steps of one language-model run ([`super::train::run`]), each a method of [`LmTrainer`],
//! as the image runs' `train/trainer.rs`: set up (corpus, model, optimizer, schedule, output
//! directory), resume, train one evaluation interval, evaluate, log the interval's metrics line,
//! checkpoint, report progress and summarise. `run` calls them in that order, once per
//! interval, so the loop itself reads in a dozen lines.

use super::gpt::Gpt;
use super::train::{
    LmSummary, add_routing, evaluate, gpt_config, load_and_drop, make_optimizer, text_path,
    train_step,
};
use crate::checkpoint::Checkpoint;
use crate::data::text::CharCorpus;
use crate::nn::Param;
use crate::optim::{Adam, Optimizer, Schedule, ScheduleKind};
use crate::train::observer::{Period, PeriodEnd, TrainObserver};
use crate::train::out_dir::OutDir;
use crate::train::{RunOptions, TrainConfig, resume};
use crate::{DType, Device, Error, Result, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// A language-model run set up and ready for its intervals: the corpus, the model and its
/// optimizer, the output directory (claimed and locked) and the counters the intervals advance.
pub(super) struct LmTrainer<'a> {
    cfg: &'a TrainConfig,
    /// what the run reports to: progress, finished intervals, notes
    obs: &'a mut dyn TrainObserver,
    device: Device,
    corpus: CharCorpus,
    model: Gpt,
    params: Vec<(String, Param)>,
    /// the number of trainable parameters
    param_count: usize,
    opt: Adam,
    schedule: Schedule,
    /// iterations per evaluation interval (`--eval-every`)
    interval: u64,
    out: OutDir,
    ckpt_path: PathBuf,
    metrics_path: PathBuf,
    config_json: String,
    /// the vocabulary, stored in each checkpoint's metadata
    vocab: String,
    /// the starts of the fixed validation windows
    val_starts: Vec<usize>,
    /// the batch size of evaluation
    eval_batch: usize,
    /// the iteration after which this run's last checkpoint was written (a resumed run
    /// continues the checkpoint's run), or None while this run has written none
    saved: Option<u64>,
    /// the optimizer steps taken so far (the run's iteration number)
    step: u64,
    /// the last iteration whose loss was read back finite
    last_finite_read: u64,
    /// time spent in training iterations (not evaluation or checkpoints), and their number
    train_seconds: f64,
    trained_iters: u64,
}

/// What one interval's iterations leave on the device, summed; nothing is read back yet.
pub(super) struct IntervalTotals {
    /// Σ cross-entropy over the interval's iterations, f32
    loss_sum: Tensor,
    /// per MoE layer, the per-expert (kept, routed) counts summed over the interval
    routing_sums: Vec<(Tensor, Tensor)>,
    /// when the interval started
    started: Instant,
}

/// The figures of one evaluated interval.
pub(super) struct IntervalResult {
    /// mean training cross-entropy of the interval's iterations
    train_loss: f64,
    /// mean validation cross-entropy on the fixed windows
    val_loss: f64,
    /// expert load per MoE layer and the overall drop rate (MoE models)
    routing: Option<(Vec<Vec<f64>>, f64)>,
    /// mean number of experts a token was sent to (MoE models)
    experts_per_token: Option<f64>,
    /// when the interval started
    started: Instant,
}

impl IntervalResult {
    /// The result before any interval: losses NaN, no routing.
    pub(super) fn none() -> IntervalResult {
        IntervalResult {
            train_loss: f64::NAN,
            val_loss: f64::NAN,
            routing: None,
            experts_per_token: None,
            started: Instant::now(),
        }
    }
}

impl<'a> LmTrainer<'a> {
    /// Loads the corpus, builds the model (checking its settings and memory), the optimizer
    /// and the schedule, and claims `--out` (printing its notes and the warm-up warning with
    /// `--progress`). `cfg` is already validated as a language-model run.
    pub(super) fn set_up(
        cfg: &'a TrainConfig,
        opts: &RunOptions,
        obs: &'a mut dyn TrainObserver,
    ) -> Result<LmTrainer<'a>> {
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
        let param_count = model.num_params();
        let opt = make_optimizer(cfg, &model)?;
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
        if let Some(line) = out.link_latest(opts.latest_link.as_deref())? {
            obs.note(&format!("moegrad: {line}"));
        }
        for note in &out.notes {
            obs.note(&format!("moegrad: note: {note}"));
        }
        if let Some(w) = cfg.warmup_warning(cfg.iters as u64) {
            obs.note(&format!("moegrad: warning: {w}"));
        }
        let ckpt_path = out.path().join("checkpoint.safetensors");
        let metrics_path = out.path().join("metrics.jsonl");
        let config_json = serde_json::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        let vocab: String = corpus.vocab.iter().collect();
        let val_starts = corpus.val_windows(cfg.eval_windows, cfg.block, cfg.seed);
        Ok(LmTrainer {
            cfg,
            obs,
            device,
            corpus,
            model,
            params,
            param_count,
            opt,
            schedule,
            interval,
            out,
            ckpt_path,
            metrics_path,
            config_json,
            vocab,
            val_starts,
            eval_batch: cfg.batch.max(32),
            saved: None,
            step: 0,
            last_finite_read: 0,
            train_seconds: 0.0,
            trained_iters: 0,
        })
    }

    /// The number of evaluation intervals of the whole run (`--iters / --eval-every`).
    pub(super) fn intervals(&self) -> usize {
        self.cfg.iters / self.cfg.eval_every
    }

    /// With `opts.resume`, restores the checkpoint in `--out` (see [`resume::restore`]) and
    /// cuts `metrics.jsonl` to its intervals; with `opts.overwrite`, clears the earlier run's
    /// files. Returns the first interval to train; sets the step counter from the optimizer and
    /// draws the progress bar (with `--progress`) over the iterations left.
    pub(super) fn resume(&mut self, opts: &RunOptions, allowed: &[String]) -> Result<usize> {
        let mut start_interval = 0;
        if opts.resume {
            self.check_vocabulary()?;
            let target = resume::ResumeTarget {
                cfg: self.cfg,
                allowed,
                device: self.device,
                model: &self.model,
                params: &self.params,
                steps_per_epoch: self.interval,
            };
            start_interval = resume::restore(&self.ckpt_path, &target, &mut self.opt)?;
            self.saved = Some(start_interval as u64 * self.interval);
            crate::train::truncate_metrics(&self.metrics_path, start_interval)?;
        } else if opts.overwrite {
            self.out.set_aside_previous_run()?;
        }
        let left = (self.intervals() - start_interval) as u64 * self.interval;
        self.obs.run_start(Period::Interval, left);
        self.step = self.opt.steps();
        self.last_finite_read = self.step;
        Ok(start_interval)
    }

    /// A resumed run's text must have the checkpoint's vocabulary (its embedding and output
    /// layer are sized by it): says so, with both sizes and the new symbols, when it changed.
    fn check_vocabulary(&self) -> Result<()> {
        let Ok(meta) = Checkpoint::read_metadata(&self.ckpt_path) else {
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
            self.ckpt_path.display(),
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

    /// Where the last good checkpoint is, for the messages of a run that stops.
    fn last_checkpoint(&self) -> String {
        match self.saved {
            Some(it) => format!(
                "the last good checkpoint, written after iteration {it}, is kept at {}",
                self.ckpt_path.display()
            ),
            None => "no checkpoint has been written by this run yet".to_string(),
        }
    }

    /// Trains one evaluation interval: `--eval-every` steps on random windows, the loss read
    /// back every `--log-every` iterations for the bar and the NaN check, everything else
    /// summed on the device.
    pub(super) fn train_interval(&mut self) -> Result<IntervalTotals> {
        let cfg = self.cfg;
        let device = self.device;
        let (b, t) = (cfg.batch, cfg.block);
        let mut loss_sum = Tensor::zeros(&[], DType::F32, device)?;
        let mut routing_sums: Vec<(Tensor, Tensor)> = Vec::new();
        let started = Instant::now();
        for _ in 0..self.interval {
            if crate::train::interrupt::stop_now() {
                self.obs.stopped();
                return Err(Error::Interrupted(format!(
                    "stopped at iteration {} on a second request; {}; the same command with --resume continues from it",
                    self.step,
                    self.last_checkpoint()
                )));
            }
            let _step = crate::profile::step();
            self.opt.set_lr(self.schedule.lr(self.step));
            let (x, y) = self.corpus.train_batch(b, t, cfg.seed, self.step);
            let x = Tensor::from_i32(x, &[b, t], device)?;
            let y = Tensor::from_i32(y, &[b * t], device)?;
            let out = train_step(
                &self.model,
                &self.params,
                &mut self.opt,
                &x,
                &y,
                cfg.clip_grad_norm,
            )?;
            let (loss, ce) = (out.loss, out.cross_entropy);
            add_routing(&mut routing_sums, &out.routing)?;
            self.step += 1;
            loss_sum = crate::no_grad(|| loss_sum.add(&ce.detach().to_dtype(DType::F32)?))?;
            if self.step.is_multiple_of(cfg.log_every as u64) {
                let l = loss.item()?;
                if !l.is_finite() {
                    self.obs.stopped();
                    return Err(Error::Invalid(format!(
                        "loss is {l} at iteration {}; it was last read finite at iteration {} (read every {} iterations); stopping; {}",
                        self.step,
                        self.last_finite_read,
                        cfg.log_every,
                        self.last_checkpoint()
                    )));
                }
                self.last_finite_read = self.step;
                self.obs.step(Some(&format!("loss {l:.4}")));
            } else {
                self.obs.step(None);
            }
        }
        Ok(IntervalTotals {
            loss_sum,
            routing_sums,
            started,
        })
    }

    /// Reads the interval's sums back (stopping on a non-finite training loss), measures the
    /// validation loss and takes the checkpoint of interval `it` (stopping, before anything is
    /// written, when a parameter or optimizer state is not finite).
    pub(super) fn evaluate(
        &mut self,
        it: usize,
        totals: IntervalTotals,
    ) -> Result<(IntervalResult, Checkpoint)> {
        let IntervalTotals {
            loss_sum,
            routing_sums,
            started,
        } = totals;
        let (interval, step) = (self.interval, self.step);
        let train_loss = loss_sum.item()? / interval as f64;
        self.train_seconds += started.elapsed().as_secs_f64();
        self.trained_iters += interval;
        if !train_loss.is_finite() {
            self.obs.stopped();
            return Err(Error::Invalid(format!(
                "mean training loss of iterations {}..={step} is {train_loss}; stopping; {}",
                step + 1 - interval,
                self.last_checkpoint()
            )));
        }
        let val_loss = self.validation_loss()?;
        let mut ck = resume::snapshot(
            it + 1,
            &self.params,
            &self.opt,
            &self.model,
            &self.config_json,
        )?;
        if let Some(bad) = ck.first_non_finite()? {
            self.obs.stopped();
            return Err(Error::Invalid(format!(
                "after iteration {step} {bad}: the run has diverged (a smaller --lr or --clip-grad-norm may help); stopping without writing a checkpoint; {}",
                self.last_checkpoint()
            )));
        }
        ck.metadata.insert("vocab".into(), self.vocab.clone());
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
            let tokens = (self.cfg.batch * self.cfg.block) as u64;
            Some(kept / (routing_sums.len() as u64 * interval * tokens) as f64)
        };
        let result = IntervalResult {
            train_loss,
            val_loss,
            routing,
            experts_per_token,
            started,
        };
        Ok((result, ck))
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

    /// Appends the interval's line to `metrics.jsonl`.
    pub(super) fn log(&self, r: &IntervalResult) -> Result<()> {
        let mut line = serde_json::json!({
            "iter": self.step, "lr": self.opt.lr(), "train_loss": r.train_loss,
            "val_loss": r.val_loss, "val_ppl": r.val_loss.exp(),
            "interval_seconds": r.started.elapsed().as_secs_f64(),
        });
        if let Some((load, drop)) = &r.routing {
            line["expert_load"] = serde_json::json!(load);
            line["drop_rate"] = serde_json::json!(drop);
        }
        if let Some(e) = r.experts_per_token {
            line["experts_per_token"] = serde_json::json!(e);
        }
        let path = &self.metrics_path;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        writeln!(f, "{line}").map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }

    /// Writes the interval's checkpoint and redraws the plots from `metrics.jsonl`.
    pub(super) fn checkpoint(&mut self, ck: Checkpoint) -> Result<()> {
        ck.save(&self.ckpt_path)?;
        self.out.first_checkpoint_written()?;
        self.saved = Some(self.step);
        // The evaluation's batches (its last one of another size) and the checkpoint's host
        // copies left blocks in the CPU buffer pool that the training step does not ask for:
        // hand them back, so that the process's memory does not grow with each evaluation.
        crate::backend::cpu::pool::trim();
        Ok(())
    }

    /// Tells the observer interval `it` is finished, with its line of figures (the command
    /// line prints it above the bar and redraws the plots from `metrics.jsonl`).
    pub(super) fn report(&mut self, it: usize, r: &IntervalResult) -> Result<()> {
        let line = format!(
            "iter {}: train loss {:.4}, val loss {:.4} (ppl {:.2}), {:.1} s",
            self.step,
            r.train_loss,
            r.val_loss,
            r.val_loss.exp(),
            r.started.elapsed().as_secs_f64()
        );
        let cfg = self.cfg;
        let title = format!("{} on {}", cfg.model.name(), cfg.data.name());
        self.obs.period_end(&PeriodEnd {
            period: Period::Interval,
            number: it + 1,
            total: self.intervals(),
            line: &line,
            out: self.out.path(),
            metrics: &self.metrics_path,
            title: &title,
            moe: r.routing.is_some(),
        })
    }

    /// The run's summary from its last interval (`last`; when the run had no interval left to
    /// train, the validation loss is measured here) and the profile of `recording`.
    pub(super) fn summary(
        &mut self,
        started: Instant,
        recording: Option<crate::profile::Recording>,
        trained_any: bool,
        last: IntervalResult,
    ) -> Result<LmSummary> {
        self.obs.finished();
        let val_loss = if trained_any {
            last.val_loss
        } else {
            self.validation_loss()?
        };
        let ms_per_iter = if self.trained_iters > 0 {
            1e3 * self.train_seconds / self.trained_iters as f64
        } else {
            f64::NAN
        };
        let tokens_per_iter = (self.cfg.batch * self.cfg.block) as f64;
        let profile = recording.and_then(crate::profile::Recording::finish);
        Ok(LmSummary {
            device: self.device.to_string(),
            iters: self.opt.steps(),
            seconds: started.elapsed().as_secs_f64(),
            train_loss: last.train_loss,
            val_loss,
            val_ppl: val_loss.exp(),
            ms_per_iter,
            tokens_per_s: tokens_per_iter / (ms_per_iter / 1e3),
            params: self.param_count,
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
            profile: profile.as_ref().map(crate::profile::Report::rows),
            gpu_profile: profile.and_then(|p| p.gpu),
        })
    }
}
