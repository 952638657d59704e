//! What the one training loop ([`super::trainer`]) needs to know of a job, as the [`Task`]
//! trait: its model and optimizer, its periods (epochs of an image model, evaluation intervals
//! of a language model) and their batches, its held-out evaluation, its metrics line and its
//! summary. `train/image.rs` implements it for the image models, `lm/task.rs` for the language
//! models; everything else (the output directory, resume, the steps, the NaN checks,
//! checkpoints, progress) is the trainer's, written once.

use super::Period;
use super::models::TaskModel;
use super::observer::TrainObserver;
use crate::checkpoint::Checkpoint;
use crate::optim::Optimizer;
use crate::{Result, Tensor};
use std::path::Path;
use std::time::Instant;

/// One training batch: the input, the targets (one tensor per task) and the weight of its mean
/// loss in the period's sum (the number of examples; 1 where every batch has the same size).
pub(crate) struct Batch {
    pub(crate) x: Tensor,
    pub(crate) y: Vec<Tensor>,
    pub(crate) weight: usize,
}

/// The held-out figures of a model after a period.
pub(crate) struct Evaluation {
    /// mean loss on the test split (image) or the validation windows (language)
    pub(crate) loss: f64,
    /// accuracy per task, in [0, 1] (image models; empty for a language model)
    pub(crate) accuracy: Vec<f64>,
}

/// The figures of one finished period, read back to the host.
pub(crate) struct PeriodResult {
    pub(crate) started: Instant,
    /// mean training loss over the period
    pub(crate) train_loss: f64,
    pub(crate) eval: Evaluation,
    /// MoE models: the expert load of each MoE layer and the drop rate over all of them
    pub(crate) routing: Option<(Vec<Vec<f64>>, f64)>,
    /// MoE models: kept assignments per routed token
    pub(crate) experts_per_token: Option<f64>,
    /// the routers' own metrics (e.g. DSelect-k's saturated fraction), each a mean over the
    /// period's steps and layers
    pub(crate) router_metrics: Vec<(&'static str, f64)>,
    /// MoE models: the routing diagnostics over the period (`moe::RoutingDiagnostics`)
    pub(crate) diagnostics: Option<crate::moe::RoutingDiagnostics>,
}

impl PeriodResult {
    /// The stand-in before any period has run (a run resumed at its last period runs none).
    pub(crate) fn none(tasks: usize) -> PeriodResult {
        PeriodResult {
            started: Instant::now(),
            train_loss: f64::NAN,
            eval: Evaluation {
                loss: f64::NAN,
                accuracy: vec![f64::NAN; tasks],
            },
            routing: None,
            experts_per_token: None,
            router_metrics: Vec::new(),
            diagnostics: None,
        }
    }
}

/// What the trainer knows at the end of a run, for the task's summary.
pub(crate) struct RunEnd<'a> {
    /// wall-clock seconds of this invocation
    pub(crate) seconds: f64,
    /// optimizer steps in total
    pub(crate) steps: u64,
    /// trainable parameters
    pub(crate) params: usize,
    /// seconds spent in training steps (not evaluation or checkpoints), and their number
    pub(crate) train_seconds: f64,
    pub(crate) trained_steps: u64,
    /// the op profile, with `--profile`
    pub(crate) profile: Option<crate::profile::Report>,
    /// where the summary's notes go
    pub(crate) obs: &'a mut dyn TrainObserver,
}

/// A training job as the trainer runs it (see the module docs).
pub(crate) trait Task {
    /// The figures a finished run returns.
    type Summary;
    /// What the run's periods are.
    const PERIOD: Period;
    /// The model trained.
    fn model(&self) -> &dyn TaskModel;
    /// Its optimizer, as the run's settings ask.
    fn optimizer(&self) -> Result<Box<dyn Optimizer>>;
    /// The number of tasks (accuracies) of the evaluation; 0 for a language model.
    fn tasks(&self) -> usize;
    /// The periods of the whole run.
    fn periods(&self) -> usize;
    /// Optimizer steps per period.
    fn steps_per_period(&self) -> u64;
    /// A title for the run's figures.
    fn title(&self) -> String;
    /// Checks, before the checkpoint is read, that `ckpt` can continue on this task's data.
    fn check_resume(&self, ckpt: &Path) -> Result<()> {
        let _ = ckpt;
        Ok(())
    }
    /// Period `period` (from 0) starts.
    fn start_period(&mut self, period: usize);
    /// The batch of step `i` of the period, the run's step `step`.
    fn batch(&self, i: usize, step: u64) -> Result<Batch>;
    /// The period's mean training loss from the weighted sum of its batches' losses.
    fn mean_train_loss(&self, loss_sum: f64) -> f64;
    /// The progress message of a loss `loss` read back after step `i` of the period.
    fn step_message(&self, loss: f64, i: usize, started: Instant) -> String;
    /// The held-out loss (and accuracies) of the model as it is.
    fn evaluate(&self) -> Result<Evaluation>;
    /// Adds what the task stores beside the trainer's in each checkpoint.
    fn annotate(&self, ck: &mut Checkpoint) {
        let _ = ck;
    }
    /// After a checkpoint is written.
    fn after_checkpoint(&self) {}
    /// The period's line of `metrics.jsonl` without the routing fields (the trainer adds them).
    fn metrics_line(
        &self,
        r: &PeriodResult,
        number: usize,
        step: u64,
        lr: f64,
    ) -> serde_json::Value;
    /// The period's line of figures for the user.
    fn report_line(&self, r: &PeriodResult, number: usize, step: u64) -> String;
    /// The run's summary from its last period (`last`; `trained_any` is false when the run had
    /// no period left to train).
    fn summary(
        &mut self,
        run: RunEnd,
        trained_any: bool,
        last: PeriodResult,
    ) -> Result<Self::Summary>;
}
