//! The image models as a [`Task`] of the one training loop: MNIST, MultiMNIST or synthetic-b,
//! trained in epochs (a pass over the training split in an order fixed by seed and epoch),
//! evaluated on the test split (loss and accuracy per task), summarised as a [`TrainSummary`]
//! (with, for synthetic-b, which experts the gate selects).

use super::models::{self, TaskModel};
use super::task::{Batch, Evaluation, PeriodResult, RunEnd, Task};
use super::{Period, Splits, TrainConfig, TrainSummary, evaluate, expert_usage, make_optimizer};
use crate::optim::Optimizer;
use crate::{Device, Error, Result};
use std::time::Instant;

/// An image run: its data, its model and the order of the current epoch.
pub(super) struct ImageTask<'a> {
    cfg: &'a TrainConfig,
    device: Device,
    data: Splits,
    model: Box<dyn TaskModel>,
    /// the training examples in the current epoch's order
    order: Vec<usize>,
}

impl<'a> ImageTask<'a> {
    /// Loads the data and builds the model (checking its memory first).
    pub(super) fn new(cfg: &'a TrainConfig) -> Result<ImageTask<'a>> {
        let device = Device::from_name(&cfg.device)?;
        let data = super::load_data(cfg)?;
        if data.train.is_empty() || data.test.is_empty() {
            return Err(Error::Invalid("the training or test split is empty".into()));
        }
        models::check_memory(cfg, data.side, data.tasks, cfg.batch.min(data.train.len()))?;
        let model = match &data.bank {
            Some(bank) => models::build_synthetic_b(cfg, bank, device)?,
            None => models::build(cfg, data.side, data.tasks, device)?,
        };
        Ok(ImageTask {
            cfg,
            device,
            data,
            model,
            order: Vec::new(),
        })
    }

    /// Accuracies as JSON: a number for one task, a list for several.
    fn accuracy_json(acc: &[f64]) -> serde_json::Value {
        if acc.len() == 1 {
            serde_json::json!(acc[0])
        } else {
            serde_json::json!(acc)
        }
    }
}

impl Task for ImageTask<'_> {
    type Summary = TrainSummary;
    const PERIOD: Period = Period::Epoch;

    fn model(&self) -> &dyn TaskModel {
        self.model.as_ref()
    }
    fn optimizer(&self) -> Result<Box<dyn Optimizer>> {
        make_optimizer(self.cfg)
    }
    fn tasks(&self) -> usize {
        self.data.tasks
    }
    fn periods(&self) -> usize {
        self.cfg.epochs
    }
    fn steps_per_period(&self) -> u64 {
        self.data.train.batches_per_epoch(self.cfg.batch) as u64
    }
    fn title(&self) -> String {
        format!("{:?} {:?}", self.cfg.model, self.cfg.data)
    }
    fn start_period(&mut self, period: usize) {
        self.order = self.data.train.order(self.cfg.seed, period, true);
    }
    fn batch(&self, i: usize, _step: u64) -> Result<Batch> {
        let b = self.cfg.batch;
        let ids = &self.order[i * b..((i + 1) * b).min(self.order.len())];
        let batch = self.data.train.batch(ids, self.device)?;
        Ok(Batch {
            x: batch.x,
            y: batch.y,
            weight: ids.len(),
        })
    }
    fn mean_train_loss(&self, loss_sum: f64) -> f64 {
        loss_sum / self.data.train.len() as f64
    }
    fn step_message(&self, loss: f64, i: usize, started: Instant) -> String {
        let rate = ((i + 1) * self.cfg.batch) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        format!("loss {loss:.4} · {rate:.0} img/s")
    }
    fn evaluate(&self) -> Result<Evaluation> {
        let batch = self.cfg.batch.max(256);
        let (loss, accuracy) = evaluate(self.model.as_ref(), &self.data.test, batch, self.device)?;
        Ok(Evaluation { loss, accuracy })
    }
    fn metrics_line(
        &self,
        r: &PeriodResult,
        number: usize,
        step: u64,
        lr: f64,
    ) -> serde_json::Value {
        serde_json::json!({
            "epoch": number, "step": step, "lr": lr, "train_loss": r.train_loss,
            "test_loss": r.eval.loss, "test_accuracy": Self::accuracy_json(&r.eval.accuracy),
            "epoch_seconds": r.started.elapsed().as_secs_f64(),
        })
    }
    fn report_line(&self, r: &PeriodResult, number: usize, _step: u64) -> String {
        let accs: Vec<String> = r
            .eval
            .accuracy
            .iter()
            .map(|a| format!("{:.2}%", 100.0 * a))
            .collect();
        let moe = match &r.routing {
            Some((loads, drop)) => {
                let l: Vec<String> = loads
                    .iter()
                    .flatten()
                    .map(|v| format!("{:.0}", 100.0 * v))
                    .collect();
                format!(
                    ", expert load % [{}], drop rate {:.2}%",
                    l.join(" "),
                    100.0 * drop
                )
            }
            None => String::new(),
        };
        format!(
            "epoch {number}/{}: train loss {:.4}, test loss {:.4}, test accuracy {}{moe}, {:.1} s",
            self.cfg.epochs,
            r.train_loss,
            r.eval.loss,
            accs.join(" / "),
            r.started.elapsed().as_secs_f64()
        )
    }
    fn summary(
        &mut self,
        run: RunEnd,
        _trained_any: bool,
        last: PeriodResult,
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
                    run.obs.note(&format!(
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
        let routing = last.diagnostics.clone();
        let (expert_load, drop_rate) = match last.routing {
            Some((loads, drop)) => (loads.into_iter().next(), Some(drop)),
            None => (None, None),
        };
        Ok(TrainSummary {
            device: self.device.to_string(),
            epochs: cfg.epochs,
            seconds: run.seconds,
            train_loss: last.train_loss,
            test_loss: last.eval.loss,
            test_accuracy: Self::accuracy_json(&last.eval.accuracy),
            steps: run.steps,
            params: run.params,
            expert_load,
            routing,
            drop_rate,
            experts_per_token: last.experts_per_token,
            expert_selection_rate,
            expert_mean_weight,
            selected_experts,
            true_experts,
            profile: run.profile.as_ref().map(crate::profile::Report::rows),
            gpu_profile: run.profile.and_then(|p| p.gpu),
        })
    }
}
