//! The steps of one image-training run ([`super::run`]), each a method of [`Trainer`]: set up
//! (data, model, optimizer, output directory), resume, train one epoch, evaluate, log the
//! epoch's metrics line, checkpoint, report progress and summarise. `run` calls them in that
//! order, once per epoch, so the loop itself reads in a dozen lines.

use super::models::{self, TaskModel};
use super::observer::{Period, PeriodEnd, TrainObserver};
use super::out_dir::OutDir;
use super::{
    RunOptions, Splits, TrainConfig, TrainSummary, accuracy_json, evaluate, expert_usage,
    load_and_drop, load_data, make_optimizer, resume, train_step, truncate_metrics,
};
use crate::nn::Param;
use crate::optim::{Optimizer, Schedule};
use crate::{DType, Device, Error, Result, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// A run set up and ready for its epochs: the data, the model and its optimizer, the output
/// directory (claimed and locked) and the counters the epochs advance.
pub(super) struct Trainer<'a> {
    cfg: &'a TrainConfig,
    /// what the run reports to: progress, finished epochs, notes
    obs: &'a mut dyn TrainObserver,
    device: Device,
    data: Splits,
    model: Box<dyn TaskModel>,
    params: Vec<(String, Param)>,
    /// the number of trainable parameters
    param_count: usize,
    opt: Box<dyn Optimizer>,
    schedule: Schedule,
    steps_per_epoch: u64,
    out: OutDir,
    ckpt_path: PathBuf,
    metrics_path: PathBuf,
    config_json: String,
    /// the epoch after which this run's last checkpoint was written (a resumed run continues
    /// the checkpoint's run), or None while this run has written none
    saved_epoch: Option<usize>,
    /// optimizer steps taken so far
    step: u64,
    /// the last step at which the loss was read back and finite (for the NaN message)
    last_finite_read: u64,
}

/// What one epoch's training steps leave on the device (read back once, by
/// [`Trainer::evaluate`]).
pub(super) struct EpochTotals {
    started: Instant,
    /// the task loss summed over the epoch's examples
    loss_sum: Tensor,
    /// kept and routed assignments per expert, summed over the epoch (MoE models)
    kept_sum: Option<(Tensor, Tensor)>,
    /// tokens routed over the epoch (examples × gates), for experts per token
    routed_tokens: usize,
    /// the router's own metrics (e.g. DSelect-k's saturated fraction): summed over the epoch
    /// on the device with a count of values
    router_metric_sums: Vec<(&'static str, Tensor, usize)>,
}

/// The figures of one finished epoch, read back to the host.
pub(super) struct EpochResult {
    started: Instant,
    pub(super) train_loss: f64,
    pub(super) test_loss: f64,
    pub(super) acc: Vec<f64>,
    /// MoE: (load per expert, drop rate)
    pub(super) routing: Option<(Vec<f64>, f64)>,
    pub(super) experts_per_token: Option<f64>,
    router_metric_sums: Vec<(&'static str, Tensor, usize)>,
}

impl EpochResult {
    /// The stand-in before any epoch has run (a run resumed at its last epoch runs none).
    pub(super) fn none(tasks: usize) -> EpochResult {
        EpochResult {
            started: Instant::now(),
            train_loss: f64::NAN,
            test_loss: f64::NAN,
            acc: vec![f64::NAN; tasks],
            routing: None,
            experts_per_token: None,
            router_metric_sums: Vec::new(),
        }
    }
}

impl<'a> Trainer<'a> {
    /// Loads the data, builds the model, optimizer and schedule, and claims the output
    /// directory (only once the data and the model are known to be good, so bad input leaves
    /// `--out` as it was).
    pub(super) fn set_up(
        cfg: &'a TrainConfig,
        opts: &RunOptions,
        obs: &'a mut dyn TrainObserver,
    ) -> Result<Trainer<'a>> {
        let device = Device::from_name(&cfg.device)?;
        let data = load_data(cfg)?;
        if data.train.is_empty() || data.test.is_empty() {
            return Err(Error::Invalid("the training or test split is empty".into()));
        }
        models::check_memory(cfg, data.side, data.tasks, cfg.batch.min(data.train.len()))?;
        let model = match &data.bank {
            Some(bank) => models::build_synthetic_b(cfg, bank, device)?,
            None => models::build(cfg, data.side, data.tasks, device)?,
        };
        let params = model.named_params();
        let param_count = params.iter().map(|(_, p)| p.get().numel()).sum();
        let opt = make_optimizer(cfg)?;
        let steps_per_epoch = data.train.batches_per_epoch(cfg.batch) as u64;
        let schedule = Schedule::from_name(
            &cfg.schedule,
            cfg.lr,
            cfg.min_lr,
            cfg.warmup_steps,
            steps_per_epoch * cfg.schedule_length_epochs() as u64,
        )?;
        if let Some(w) = cfg.warmup_warning(steps_per_epoch.saturating_mul(cfg.epochs as u64)) {
            obs.note(&format!("moegrad: warning: {w}"));
        }

        let out = OutDir::claim(&cfg.out, opts.resume, opts.overwrite)?;
        if let Some(line) = out.link_latest(opts.latest_link.as_deref())? {
            obs.note(&format!("moegrad: {line}"));
        }
        for note in &out.notes {
            obs.note(&format!("moegrad: note: {note}"));
        }
        let ckpt_path = out.path().join("checkpoint.safetensors");
        let metrics_path = out.path().join("metrics.jsonl");
        let config_json = serde_json::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        Ok(Trainer {
            cfg,
            obs,
            device,
            data,
            model,
            params,
            param_count,
            opt,
            schedule,
            steps_per_epoch,
            out,
            ckpt_path,
            metrics_path,
            config_json,
            saved_epoch: None,
            step: 0,
            last_finite_read: 0,
        })
    }

    /// The number of tasks (one accuracy each).
    pub(super) fn tasks(&self) -> usize {
        self.data.tasks
    }

    /// With `opts.resume`, restores the checkpoint in `--out` (see [`resume::restore`]) and
    /// cuts `metrics.jsonl` to its epochs; with `opts.overwrite`, clears the earlier run's
    /// files. Returns the first epoch to train; sets the step counter from the optimizer.
    pub(super) fn resume(&mut self, opts: &RunOptions, allowed: &[String]) -> Result<usize> {
        let mut start_epoch = 0;
        if opts.resume {
            let target = resume::ResumeTarget {
                cfg: self.cfg,
                allowed,
                device: self.device,
                model: self.model.as_ref(),
                params: &self.params,
                steps_per_epoch: self.steps_per_epoch,
            };
            start_epoch = resume::restore(&self.ckpt_path, &target, self.opt.as_mut())?;
            self.saved_epoch = Some(start_epoch);
            truncate_metrics(&self.metrics_path, start_epoch)?;
        } else if opts.overwrite {
            self.out.set_aside_previous_run()?;
        }
        self.step = self.opt.steps();
        self.last_finite_read = self.step;
        Ok(start_epoch)
    }

    /// Where the last good checkpoint is, for the messages of a run that stops.
    fn last_checkpoint(&self) -> String {
        match self.saved_epoch {
            Some(e) => format!(
                "the last good checkpoint, written after epoch {e}, is kept at {}",
                self.ckpt_path.display()
            ),
            None => "no checkpoint has been written by this run yet".to_string(),
        }
    }

    /// Trains one epoch: a step per batch, the loss read back every `--log-every` steps (and
    /// at the epoch's last step) for the bar and the NaN check, everything else summed on
    /// the device.
    pub(super) fn train_epoch(&mut self, epoch: usize) -> Result<EpochTotals> {
        let cfg = self.cfg;
        let device = self.device;
        let started = Instant::now();
        let steps = self.steps_per_epoch;
        self.obs
            .period_start(Period::Epoch, epoch + 1, cfg.epochs, steps);
        let mut loss_sum = Tensor::zeros(&[], DType::F32, device)?;
        let mut kept_sum: Option<(Tensor, Tensor)> = None;
        let mut routed_tokens = 0usize;
        let mut router_metric_sums: Vec<(&'static str, Tensor, usize)> = Vec::new();
        let order = self.data.train.order(cfg.seed, epoch, true);
        for (i, ids) in order.chunks(cfg.batch).enumerate() {
            if super::interrupt::stop_now() {
                self.obs.stopped();
                return Err(Error::Interrupted(format!(
                    "stopped at step {} (epoch {}, batch {}) on a second request; {}; the same command with --resume continues from it",
                    self.step,
                    epoch + 1,
                    i + 1,
                    self.last_checkpoint()
                )));
            }
            let _step = crate::profile::step();
            self.opt.set_lr(self.schedule.lr(self.step));
            let b = self.data.train.batch(ids, device)?;
            let out = train_step(
                self.model.as_ref(),
                &self.params,
                self.opt.as_mut(),
                &b.x,
                &b.y,
                cfg.clip_grad_norm,
            )?;
            let (loss, task) = (out.loss, out.task_loss);
            if let Some(stats) = &out.routing {
                for (name, v) in &stats.metrics {
                    let v = v.detach().to_dtype(DType::F32)?;
                    match router_metric_sums.iter_mut().find(|(n, _, _)| n == name) {
                        Some((_, sum, count)) => {
                            *sum = sum.add(&v)?;
                            *count += 1;
                        }
                        None => router_metric_sums.push((name, v, 1)),
                    }
                }
                routed_tokens += stats.tokens;
                kept_sum = Some(match kept_sum {
                    Some((k, r)) => (
                        stats.kept_per_expert.add(&k)?,
                        stats.routed_per_expert.add(&r)?,
                    ),
                    None => (
                        stats.kept_per_expert.clone(),
                        stats.routed_per_expert.clone(),
                    ),
                });
            }
            self.step += 1;
            loss_sum =
                crate::no_grad(|| loss_sum.add(&task.detach().mul_scalar(ids.len() as f64)?))?;
            if (i + 1) % cfg.log_every == 0 || i + 1 == self.steps_per_epoch as usize {
                let l = loss.item()?;
                if !l.is_finite() {
                    self.obs.stopped();
                    return Err(self.non_finite_loss(l, epoch, i));
                }
                self.last_finite_read = self.step;
                let rate = ((i + 1) * cfg.batch) as f64 / started.elapsed().as_secs_f64().max(1e-9);
                self.obs
                    .step(Some(&format!("loss {l:.4} · {rate:.0} img/s")));
            } else {
                self.obs.step(None);
            }
        }
        Ok(EpochTotals {
            started,
            loss_sum,
            kept_sum,
            routed_tokens,
            router_metric_sums,
        })
    }

    /// The error of a loss `l` read non-finite at batch `i` of `epoch`, saying between which
    /// steps it became so and where the last good checkpoint is.
    fn non_finite_loss(&self, l: f64, epoch: usize, i: usize) -> Error {
        let (step, last_finite_read) = (self.step, self.last_finite_read);
        let when = if last_finite_read + 1 == step {
            format!("it first became non-finite at step {step}")
        } else {
            format!(
                "it was last read finite {}, so it first became non-finite at one of steps {}..={step}",
                if last_finite_read == 0 {
                    "before any step".to_string()
                } else {
                    format!("at step {last_finite_read}")
                },
                last_finite_read + 1
            )
        };
        Error::Invalid(format!(
            "loss is {l} at step {step} (epoch {}, batch {}); the loss is read every {} (--log-every) and at the end of each epoch: {when}. Stopping; {}",
            epoch + 1,
            i + 1,
            if self.cfg.log_every == 1 {
                "step".to_string()
            } else {
                format!("{} steps", self.cfg.log_every)
            },
            self.last_checkpoint()
        ))
    }

    /// Reads the epoch's totals back, evaluates on the test split and takes the checkpoint of
    /// the epoch; stops the run when the training loss, a parameter or the optimizer state is
    /// not finite (nothing non-finite is ever written, neither to the checkpoint nor to the
    /// metrics).
    pub(super) fn evaluate(
        &self,
        epoch: usize,
        totals: EpochTotals,
    ) -> Result<(EpochResult, crate::checkpoint::Checkpoint)> {
        let cfg = self.cfg;
        let train_loss = totals.loss_sum.item()? / self.data.train.len() as f64;
        if !train_loss.is_finite() {
            return Err(Error::Invalid(format!(
                "mean training loss of epoch {} is {train_loss}; stopping; {}",
                epoch + 1,
                self.last_checkpoint()
            )));
        }
        let model = self.model.as_ref();
        let (test_loss, acc) = evaluate(model, &self.data.test, cfg.batch.max(256), self.device)?;
        // the loss can stay finite while a parameter or the optimizer state is not (an
        // infinite Adam second moment, say)
        let ck = resume::snapshot(
            epoch + 1,
            &self.params,
            self.opt.as_ref(),
            model,
            &self.config_json,
        )?;
        if let Some(bad) = ck.first_non_finite()? {
            return Err(Error::Invalid(format!(
                "after epoch {} (step {}) {bad}: the run has diverged (a smaller --lr, --clip-grad-norm or smaller loss coefficients may help); stopping without writing a checkpoint; {}",
                epoch + 1,
                self.step,
                self.last_checkpoint()
            )));
        }
        let routing = match &totals.kept_sum {
            Some((k, r)) => Some(load_and_drop(k, r)?),
            None => None,
        };
        let experts_per_token = match &totals.kept_sum {
            Some((k, _)) => {
                Some(k.to_vec_f64()?.iter().sum::<f64>() / totals.routed_tokens.max(1) as f64)
            }
            None => None,
        };
        let result = EpochResult {
            started: totals.started,
            train_loss,
            test_loss,
            acc,
            routing,
            experts_per_token,
            router_metric_sums: totals.router_metric_sums,
        };
        Ok((result, ck))
    }

    /// Appends the epoch's line to `metrics.jsonl`.
    pub(super) fn log(&self, epoch: usize, r: &EpochResult) -> Result<()> {
        let mut line = serde_json::json!({
            "epoch": epoch + 1, "step": self.step, "lr": self.opt.lr(), "train_loss": r.train_loss, "test_loss": r.test_loss,
            "test_accuracy": accuracy_json(&r.acc), "epoch_seconds": r.started.elapsed().as_secs_f64(),
        });
        if let Some((load, drop)) = &r.routing {
            line["expert_load"] = serde_json::json!(load);
            line["drop_rate"] = serde_json::json!(drop);
        }
        if let Some(e) = r.experts_per_token {
            line["experts_per_token"] = serde_json::json!(e);
        }
        if !r.router_metric_sums.is_empty() {
            let mut metrics = serde_json::Map::new();
            for (name, sum, count) in &r.router_metric_sums {
                let mean = sum.item()? / *count as f64;
                metrics.insert(name.to_string(), serde_json::json!(mean));
            }
            line["router_metrics"] = serde_json::Value::Object(metrics);
        }
        let path = &self.metrics_path;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        writeln!(f, "{line}").map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }

    /// Writes the epoch's checkpoint.
    pub(super) fn checkpoint(
        &mut self,
        epoch: usize,
        ck: crate::checkpoint::Checkpoint,
    ) -> Result<()> {
        ck.save(&self.ckpt_path)?;
        self.out.first_checkpoint_written()?;
        self.saved_epoch = Some(epoch + 1);
        Ok(())
    }

    /// Tells the observer the epoch is finished, with its line of figures (the command line
    /// prints it and redraws `curves.svg` and, for MoE models, `expert_load.svg`).
    pub(super) fn report(&mut self, epoch: usize, r: &EpochResult) -> Result<()> {
        let accs: Vec<String> = r.acc.iter().map(|a| format!("{:.2}%", 100.0 * a)).collect();
        let moe = match &r.routing {
            Some((load, drop)) => {
                let l: Vec<String> = load.iter().map(|v| format!("{:.0}", 100.0 * v)).collect();
                format!(
                    ", expert load % [{}], drop rate {:.2}%",
                    l.join(" "),
                    100.0 * drop
                )
            }
            None => String::new(),
        };
        let line = format!(
            "epoch {}/{}: train loss {:.4}, test loss {:.4}, test accuracy {}{moe}, {:.1} s",
            epoch + 1,
            self.cfg.epochs,
            r.train_loss,
            r.test_loss,
            accs.join(" / "),
            r.started.elapsed().as_secs_f64()
        );
        let title = format!("{:?} {:?}", self.cfg.model, self.cfg.data);
        self.obs.period_end(&PeriodEnd {
            period: Period::Epoch,
            number: epoch + 1,
            total: self.cfg.epochs,
            line: &line,
            out: self.out.path(),
            metrics: &self.metrics_path,
            title: &title,
            moe: r.routing.is_some(),
        })
    }

    /// The run's summary from its last epoch (`last`), with the synthetic-b expert usage
    /// measured on the test split and the profile of `recording`.
    pub(super) fn summary(
        &mut self,
        started: Instant,
        recording: Option<crate::profile::Recording>,
        last: EpochResult,
    ) -> Result<TrainSummary> {
        let cfg = self.cfg;
        let (expert_selection_rate, expert_mean_weight, selected_experts, true_experts) =
            match &self.data.bank {
                Some(bank) => {
                    let (rate, weight) = expert_usage(
                        self.model.as_ref(),
                        &self.data.test,
                        cfg.batch.max(256),
                        self.device,
                    )?;
                    // an expert is selected when it holds at least half of an equal share of
                    // the k choices: a gate can put all its mass on the true experts while the
                    // others keep tiny nonzero weights (DSelect-k before its selectors saturate)
                    let share = 0.5 / cfg.k.max(1) as f64;
                    let selected = (0..weight.len()).filter(|&e| weight[e] >= share).collect();
                    self.obs.note(&format!(
                        "synthetic-b: the gate selects experts {selected:?} (mean weight ≥ 1/(2k)); the true experts are {:?}",
                        bank.true_experts
                    ));
                    (
                        Some(rate),
                        Some(weight),
                        Some(selected),
                        Some(bank.true_experts.clone()),
                    )
                }
                None => (None, None, None, None),
            };
        let profile = recording.and_then(crate::profile::Recording::finish);
        Ok(TrainSummary {
            device: self.device.to_string(),
            epochs: cfg.epochs,
            seconds: started.elapsed().as_secs_f64(),
            train_loss: last.train_loss,
            test_loss: last.test_loss,
            test_accuracy: accuracy_json(&last.acc),
            steps: self.opt.steps(),
            params: self.param_count,
            expert_load: last.routing.as_ref().map(|r| r.0.clone()),
            drop_rate: last.routing.map(|r| r.1),
            experts_per_token: last.experts_per_token,
            expert_selection_rate,
            expert_mean_weight,
            selected_experts,
            true_experts,
            profile: profile.as_ref().map(crate::profile::Report::rows),
            gpu_profile: profile.and_then(|p| p.gpu),
        })
    }
}
