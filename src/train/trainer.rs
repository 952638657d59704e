//! The one training loop, for image models and language models alike ([`run_task`]): set up
//! (optimizer, schedule, output directory), resume, then per period (an epoch or an evaluation
//! interval, [`super::Period`]) train its steps, evaluate, log its metrics line, checkpoint and
//! report, and finally summarise. What differs between the jobs (data, model, evaluation,
//! metrics, summary) is the [`Task`]'s; the steps are methods of [`Trainer`], so the loop itself
//! reads in a dozen lines.

use super::observer::{Period, PeriodEnd, TrainObserver};
use super::out_dir::OutDir;
use super::task::{PeriodResult, RunEnd, Task};
use super::{
    RunOptions, TrainConfig, interrupt, resume, train_step, train_step_mixed, truncate_metrics,
};
use crate::checkpoint::Checkpoint;
use crate::moe::{CollapseAlarm, RoutingDiagnostics, RoutingStats, RoutingWindow};
use crate::nn::Param;
use crate::optim::{LossScale, Optimizer, Schedule};
use crate::{DType, Device, Error, Result, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Runs the task `make_task` builds (loading its data and model) as configured: the loop of
/// the module docs.
pub(crate) fn run_task<T: Task>(
    cfg: &TrainConfig,
    opts: RunOptions,
    make_task: impl FnOnce() -> Result<T>,
    obs: &mut dyn TrainObserver,
) -> Result<T::Summary> {
    let allowed = opts.check()?;
    let started = Instant::now();
    let recording = opts.profile.then(crate::profile::start);
    let task = make_task()?;
    let mut trainer = Trainer::set_up(cfg, &opts, task, obs)?;
    let first = trainer.resume(&opts, &allowed)?;
    let periods = trainer.task.periods();
    let mut last = PeriodResult::none(trainer.task.tasks());
    for period in first..periods {
        let totals = trainer.train_period(period)?;
        let (result, checkpoint) = trainer.evaluate(period, totals)?;
        trainer.log(period, &result)?;
        trainer.checkpoint(period, checkpoint)?;
        trainer.report(period, &result)?;
        last = result;
        if interrupt::stop_after_checkpoint() && period + 1 < periods {
            let iteration = match T::PERIOD {
                Period::Epoch => String::new(),
                Period::Interval => {
                    format!(
                        " (iteration {})",
                        (period + 1) as u64 * trainer.steps_per_period
                    )
                }
            };
            return Err(Error::Interrupted(format!(
                "stopped after {} {} of {periods}{iteration} on request; its checkpoint is {}: the same command with --resume continues the run exactly",
                T::PERIOD.name(),
                period + 1,
                trainer.ckpt_path.display()
            )));
        }
    }
    trainer.summary(started, recording, first < periods, last)
}

/// A run set up and ready for its periods: the task, its optimizer and schedule, the output
/// directory (claimed and locked) and the counters the periods advance.
struct Trainer<'a, T: Task> {
    cfg: &'a TrainConfig,
    /// what the run reports to: progress, finished periods, notes
    obs: &'a mut dyn TrainObserver,
    device: Device,
    task: T,
    params: Vec<(String, Param)>,
    opt: Box<dyn Optimizer>,
    schedule: Schedule,
    steps_per_period: u64,
    out: OutDir,
    ckpt_path: PathBuf,
    metrics_path: PathBuf,
    config_json: String,
    /// the period after which this run's last checkpoint was written (a resumed run continues
    /// the checkpoint's run), or None while this run has written none
    saved: Option<usize>,
    /// optimizer steps taken so far
    step: u64,
    /// the last step at which the loss was read back and finite (for the NaN message)
    last_finite_read: u64,
    /// time spent in training steps (not evaluation or checkpoints), and their number
    train_seconds: f64,
    trained_steps: u64,
    /// `--precision f16-mixed`: the loss scale on the device (None in f32)
    loss_scale: Option<LossScale>,
}

/// What one period's steps leave on the device (read back once, by [`Trainer::evaluate`]).
struct PeriodTotals {
    started: Instant,
    /// the task loss summed over the period's batches, each weighted by [`super::task::Batch`]
    loss_sum: Tensor,
    /// per MoE layer, the routing statistics summed over the period (`moe::RoutingWindow`)
    routing: RoutingWindow,
    /// the routers' own metrics: summed on the device, with a count of values
    router_metric_sums: Vec<(&'static str, Tensor, usize)>,
}

impl PeriodTotals {
    /// Adds one step's routing statistics (one entry per MoE layer).
    fn add_routing(&mut self, stats: &[RoutingStats]) -> Result<()> {
        for s in stats {
            for (name, v) in &s.metrics {
                let v = v.detach().to_dtype(DType::F32)?;
                match self
                    .router_metric_sums
                    .iter_mut()
                    .find(|(n, _, _)| n == name)
                {
                    Some((_, sum, count)) => {
                        *sum = sum.add(&v)?;
                        *count += 1;
                    }
                    None => self.router_metric_sums.push((name, v, 1)),
                }
            }
        }
        self.routing.add(stats)
    }
}

/// Expert load per layer and the drop rate over all of them, from the period's diagnostics.
fn load_and_drop(d: &RoutingDiagnostics) -> (Vec<Vec<f64>>, f64) {
    let kept: f64 = d.layers.iter().map(|l| l.kept_assignments).sum();
    let routed: f64 = d.layers.iter().map(|l| l.routed_assignments).sum();
    let drop = if routed > 0.0 {
        1.0 - kept / routed
    } else {
        0.0
    };
    (d.layers.iter().map(|l| l.load.clone()).collect(), drop)
}

impl<'a, T: Task> Trainer<'a, T> {
    /// Builds the optimizer and schedule of `task` and claims the output directory (only once
    /// the data and the model are known to be good, so bad input leaves `--out` as it was).
    fn set_up(
        cfg: &'a TrainConfig,
        opts: &RunOptions,
        task: T,
        obs: &'a mut dyn TrainObserver,
    ) -> Result<Trainer<'a, T>> {
        let device = Device::from_name(&cfg.device)?;
        cfg.precision.check(device)?;
        let loss_scale = match cfg.precision {
            super::Precision::F16Mixed => Some(LossScale::new(device)?),
            super::Precision::F32 => None,
        };
        let params = task.model().named_params();
        let opt = task.optimizer()?;
        let steps_per_period = task.steps_per_period();
        let schedule = Schedule::from_name(
            &cfg.schedule,
            cfg.lr,
            cfg.min_lr,
            cfg.warmup_steps,
            steps_per_period * cfg.schedule_length_epochs() as u64,
        )?;
        let total_steps = steps_per_period.saturating_mul(task.periods() as u64);
        if let Some(w) = cfg.warmup_warning(total_steps) {
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
            task,
            params,
            opt,
            schedule,
            steps_per_period,
            out,
            ckpt_path,
            metrics_path,
            config_json,
            saved: None,
            step: 0,
            last_finite_read: 0,
            train_seconds: 0.0,
            trained_steps: 0,
            loss_scale,
        })
    }

    /// The run's position after `periods` periods, in words: "epoch 2", or "iteration 40
    /// (evaluation interval 2)".
    fn position(&self, periods: usize) -> String {
        match T::PERIOD {
            Period::Epoch => format!("epoch {periods}"),
            Period::Interval => format!(
                "iteration {} (evaluation interval {periods})",
                periods as u64 * self.steps_per_period
            ),
        }
    }

    /// With `opts.resume`, restores the checkpoint in `--out` (see [`resume::restore`]) and
    /// cuts `metrics.jsonl` to its periods; with `opts.overwrite`, clears the earlier run's
    /// files. Returns the first period to train; sets the step counter from the optimizer.
    fn resume(&mut self, opts: &RunOptions, allowed: &[String]) -> Result<usize> {
        let mut first = 0;
        if opts.resume {
            self.task.check_resume(&self.ckpt_path)?;
            let target = resume::ResumeTarget {
                cfg: self.cfg,
                allowed,
                device: self.device,
                model: self.task.model(),
                params: &self.params,
                period: T::PERIOD,
                steps_per_period: self.steps_per_period,
            };
            first = resume::restore(
                &self.ckpt_path,
                &target,
                self.opt.as_mut(),
                self.loss_scale.as_mut(),
            )?;
            self.saved = Some(first);
            truncate_metrics(&self.metrics_path, first)?;
        } else if opts.overwrite {
            self.out.set_aside_previous_run()?;
        }
        self.step = self.opt.steps();
        self.last_finite_read = self.step;
        let left = (self.task.periods().saturating_sub(first)) as u64 * self.steps_per_period;
        self.obs.run_start(T::PERIOD, left);
        Ok(first)
    }

    /// Where the last good checkpoint is, for the messages of a run that stops.
    fn last_checkpoint(&self) -> String {
        match self.saved {
            Some(p) => format!(
                "the last good checkpoint, written after {}, is kept at {}",
                self.position(p),
                self.ckpt_path.display()
            ),
            None => "no checkpoint has been written by this run yet".to_string(),
        }
    }

    /// Trains one period: a step per batch, the loss read back every `--log-every` steps of
    /// the period (and at its last step) for the progress and the NaN check, everything else
    /// summed on the device.
    fn train_period(&mut self, period: usize) -> Result<PeriodTotals> {
        let cfg = self.cfg;
        let name = T::PERIOD.name();
        let steps = self.steps_per_period;
        self.obs
            .period_start(T::PERIOD, period + 1, self.task.periods(), steps);
        self.task.start_period(period);
        let mut totals = PeriodTotals {
            started: Instant::now(),
            loss_sum: Tensor::zeros(&[], DType::F32, self.device)?,
            routing: RoutingWindow::new(),
            router_metric_sums: Vec::new(),
        };
        for i in 0..steps as usize {
            if interrupt::stop_now() {
                self.obs.stopped();
                return Err(Error::Interrupted(format!(
                    "stopped at step {} ({name} {}, batch {}) on a second request; {}; the same command with --resume continues from it",
                    self.step,
                    period + 1,
                    i + 1,
                    self.last_checkpoint()
                )));
            }
            let _step = crate::profile::step();
            self.opt.set_lr(self.schedule.lr(self.step));
            let b = self.task.batch(i, self.step)?;
            let (model, opt) = (self.task.model(), self.opt.as_mut());
            let out = match &self.loss_scale {
                Some(scale) => train_step_mixed(
                    model,
                    &self.params,
                    opt,
                    &b.x,
                    &b.y,
                    cfg.clip_grad_norm,
                    scale,
                )?,
                None => train_step(model, &self.params, opt, &b.x, &b.y, cfg.clip_grad_norm)?,
            };
            totals.add_routing(&out.routing)?;
            self.step += 1;
            let task = out.task_loss.detach().to_dtype(DType::F32)?;
            totals.loss_sum = crate::no_grad(|| {
                let weighted = if b.weight == 1 {
                    task
                } else {
                    task.mul_scalar(b.weight as f64)?
                };
                totals.loss_sum.add(&weighted)
            })?;
            if self.device.is_gpu() {
                // the step's last kernels go to the queue now, so the device starts on them
                // while the host prepares the next batch, and every step submits at the same
                // point: the buffers its batch held return to the pool at the same moment each
                // step, so each step gets the same buffers and reuses the bind groups of the
                // step before (backend/gpu/bind_group_cache.rs)
                crate::gpu::flush()?;
            }
            if (i + 1) % cfg.log_every == 0 || i + 1 == steps as usize {
                let l = out.loss.item()?;
                if !l.is_finite() {
                    self.obs.stopped();
                    return Err(self.non_finite_loss(l, period, i));
                }
                self.last_finite_read = self.step;
                let mut message = self.task.step_message(l, i, totals.started);
                if !totals.routing.is_empty() {
                    // the routing so far in this period, read at the same cadence as the loss
                    message = format!("{message} · {}", totals.routing.read()?.short());
                }
                if let Some(scale) = &self.loss_scale {
                    message = format!(
                        "{message} · loss scale {} ({} skipped)",
                        scale.scale()?,
                        scale.skipped_steps()?
                    );
                }
                self.obs.step(Some(&message));
            } else {
                self.obs.step(None);
            }
        }
        Ok(totals)
    }

    /// The error of a loss `l` read non-finite at batch `i` of `period`, saying between which
    /// steps it became so and where the last good checkpoint is.
    fn non_finite_loss(&self, l: f64, period: usize, i: usize) -> Error {
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
        let name = T::PERIOD.name();
        Error::Invalid(format!(
            "loss is {l} at step {step} ({name} {}, batch {}); the loss is read every {} (--log-every) and at the end of each {name}: {when}. Stopping; {}",
            period + 1,
            i + 1,
            if self.cfg.log_every == 1 {
                "step".to_string()
            } else {
                format!("{} steps", self.cfg.log_every)
            },
            self.last_checkpoint()
        ))
    }

    /// Reads the period's totals back, evaluates the model and takes the checkpoint of the
    /// period; stops the run when the training loss, a parameter or the optimizer state is not
    /// finite (nothing non-finite is ever written, neither to the checkpoint nor to the metrics).
    fn evaluate(
        &mut self,
        period: usize,
        totals: PeriodTotals,
    ) -> Result<(PeriodResult, Checkpoint)> {
        let name = T::PERIOD.name();
        let train_loss = self.task.mean_train_loss(totals.loss_sum.item()?);
        // the period's training time ends once its steps are done: on the GPU, when the read
        // above has waited for them
        self.train_seconds += totals.started.elapsed().as_secs_f64();
        self.trained_steps += self.steps_per_period;
        if !train_loss.is_finite() {
            self.obs.stopped();
            return Err(Error::Invalid(format!(
                "mean training loss of {name} {} is {train_loss}; stopping; {}",
                period + 1,
                self.last_checkpoint()
            )));
        }
        let eval = self.task.evaluate()?;
        // the loss can stay finite while a parameter or the optimizer state is not (an
        // infinite Adam second moment, say)
        let mut ck = resume::snapshot(
            period + 1,
            &self.params,
            self.opt.as_ref(),
            self.task.model(),
            &self.config_json,
        )?;
        if let Some(bad) = ck.first_non_finite()? {
            self.obs.stopped();
            return Err(Error::Invalid(format!(
                "after {name} {} (step {}) {bad}: the run has diverged (a smaller --lr, --clip-grad-norm or smaller loss coefficients may help); stopping without writing a checkpoint; {}",
                period + 1,
                self.step,
                self.last_checkpoint()
            )));
        }
        if let Some(scale) = &self.loss_scale {
            for (name, t) in scale.state() {
                ck.tensors
                    .insert(format!("{}{name}", resume::LOSS_SCALE_PREFIX), t);
            }
        }
        self.task.annotate(&mut ck);
        let diagnostics = if totals.routing.is_empty() {
            None
        } else {
            Some(totals.routing.read()?)
        };
        let (routing, experts_per_token) = match &diagnostics {
            None => (None, None),
            Some(d) => {
                let kept: f64 = d.layers.iter().map(|l| l.kept_assignments).sum();
                let tokens: usize = d.layers.iter().map(|l| l.tokens).sum();
                (Some(load_and_drop(d)), Some(kept / tokens.max(1) as f64))
            }
        };
        let mut router_metrics = Vec::with_capacity(totals.router_metric_sums.len());
        for (name, sum, count) in &totals.router_metric_sums {
            router_metrics.push((*name, sum.item()? / *count as f64));
        }
        let result = PeriodResult {
            started: totals.started,
            train_loss,
            eval,
            routing,
            experts_per_token,
            router_metrics,
            diagnostics,
        };
        Ok((result, ck))
    }

    /// Appends the period's line to `metrics.jsonl`: the task's fields, then the routing ones.
    fn log(&self, period: usize, r: &PeriodResult) -> Result<()> {
        let mut line = self
            .task
            .metrics_line(r, period + 1, self.step, self.opt.lr());
        if let Some((load, drop)) = &r.routing {
            // an image model has one MoE layer: its load is one list
            line["expert_load"] = match (T::PERIOD, load.as_slice()) {
                (Period::Epoch, [one]) => serde_json::json!(one),
                _ => serde_json::json!(load),
            };
            line["drop_rate"] = serde_json::json!(drop);
        }
        if let Some(e) = r.experts_per_token {
            line["experts_per_token"] = serde_json::json!(e);
        }
        if let Some(scale) = &self.loss_scale {
            // f16-mixed: the loss scale now and the steps skipped on an overflow so far
            line["loss_scale"] = serde_json::json!(scale.scale()?);
            line["skipped_steps"] = serde_json::json!(scale.skipped_steps()?);
        }
        if let Some(d) = &r.diagnostics {
            line["routing"] = serde_json::to_value(d).map_err(|e| Error::Invalid(e.to_string()))?;
        }
        if !r.router_metrics.is_empty() {
            let metrics: serde_json::Map<String, serde_json::Value> = r
                .router_metrics
                .iter()
                .map(|(name, mean)| (name.to_string(), serde_json::json!(mean)))
                .collect();
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

    /// Writes the period's checkpoint.
    fn checkpoint(&mut self, period: usize, ck: Checkpoint) -> Result<()> {
        ck.save(&self.ckpt_path)?;
        self.out.first_checkpoint_written()?;
        self.saved = Some(period + 1);
        self.task.after_checkpoint();
        Ok(())
    }

    /// Tells the observer the period is finished, with its line of figures (the command line
    /// prints it and redraws the plots from `metrics.jsonl`).
    fn report(&mut self, period: usize, r: &PeriodResult) -> Result<()> {
        let mut line = self.task.report_line(r, period + 1, self.step);
        if let Some(d) = &r.diagnostics {
            line.push_str(&format!(" · {}", d.short()));
            let alarm = CollapseAlarm {
                dead_fraction: self.cfg.collapse_dead,
                top_share: self.cfg.collapse_share,
            };
            if let Some(warning) = alarm.check(d) {
                self.obs.note(&format!(
                    "moegrad: warning: {} {}: {warning}",
                    T::PERIOD.name(),
                    period + 1
                ));
            }
        }
        let title = self.task.title();
        self.obs.period_end(&PeriodEnd {
            period: T::PERIOD,
            number: period + 1,
            total: self.task.periods(),
            line: &line,
            out: self.out.path(),
            metrics: &self.metrics_path,
            title: &title,
            moe: r.routing.is_some(),
        })
    }

    /// The task's summary of the run, with the profile of `recording`.
    fn summary(
        mut self,
        started: Instant,
        recording: Option<crate::profile::Recording>,
        trained_any: bool,
        last: PeriodResult,
    ) -> Result<T::Summary> {
        self.obs.finished();
        let params = self.params.iter().map(|(_, p)| p.get().numel()).sum();
        let run = RunEnd {
            seconds: started.elapsed().as_secs_f64(),
            steps: self.opt.steps(),
            params,
            train_seconds: self.train_seconds,
            trained_steps: self.trained_steps,
            profile: recording.and_then(crate::profile::Recording::finish),
            obs: self.obs,
        };
        self.task.summary(run, trained_any, last)
    }
}
