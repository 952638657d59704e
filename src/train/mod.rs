//! Training (`moegrad train`): load the data, build the model, run the epochs, evaluate, and
//! write `metrics.jsonl` and `checkpoint.safetensors` to the output directory (the command line
//! adds the progress bars and `curves.svg` through its [`TrainObserver`]).
//!
//! Inside an epoch nothing is read back from the device except the loss every `log_every` steps
//! (for the progress report and the NaN check). A checkpoint is written after each epoch whose loss,
//! parameters and optimizer state are all finite, so when a NaN stops the run the last good
//! checkpoint is still there. `--resume` restores parameters, optimizer state, the routers' noise
//! counters and the epoch counter after checking that the checkpoint belongs to this run
//! ([`resume`]); because the data order depends only on (seed, epoch), and a cosine schedule's
//! length is fixed by `--schedule-epochs`, the resumed run ends exactly where an uninterrupted
//! one would. The output directory is locked for the run and a fresh run does not overwrite an
//! earlier run's record unless asked to ([`out_dir`]).
//!
//! [`run`] is the one training loop (`trainer.rs`, shared with the language models of
//! [`crate::lm`]) run on the image task (`image.rs`); it reports progress, finished epochs and
//! notes to a [`TrainObserver`] ([`run_observed`]; [`run`]'s prints nothing).
//!
//! Every item has one path. Most are `moegrad::train::Item` (the files are private); three
//! groups keep a module as their namespace because their names read as that module's:
//! [`interrupt`] (`interrupt::request_stop`), [`out_dir`] (`out_dir::OutDir`,
//! `out_dir::LOCK_FILE`) and [`resume`] (`resume::FORMAT`, `resume::restore`).

mod config;
mod image;
pub mod interrupt;
mod models;
mod moe_settings;
mod observer;
pub mod out_dir;
mod precision;
pub mod resume;
mod step;
pub(crate) mod task;
mod torch_export;
pub(crate) mod trainer;
mod worker;

pub use config::{
    DataKind, IMAGE_FLAGS, LM_FLAGS, MAX_EVAL_WINDOWS, MOE_FLAGS, ModelKind, OptimizerKind,
    TINY_LR, TrainConfig,
};
pub(crate) use models::capacity;
pub use models::{
    MemoryEstimate, ModelOutput, MoeModel, MultiHead, TaskModel, build as build_model,
    build_synthetic_b, check_memory, memory_estimate,
};
pub use precision::Precision;

use crate::data::{Dataset, Mnist, SyntheticB, multimnist};
use crate::optim::{Adam, Optimizer, Sgd};
use crate::{DType, Device, Error, Result, Tensor};
pub use observer::{Period, PeriodEnd, Silent, TrainObserver};
use serde::Serialize;
use std::path::Path;
pub use step::{StepOutput, task_loss, train_step, train_step_mixed};
pub use torch_export::{TORCH_MODEL_PY, TORCH_ROUTERS, TorchExportReport, export_torch};
pub use worker::on_worker_thread;

/// The final figures of a run (`--json` prints this object).
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    /// "cpu" or "gpu"
    pub device: String,
    /// epochs completed
    pub epochs: usize,
    /// wall-clock seconds of this invocation (training and evaluation)
    pub seconds: f64,
    /// mean training loss of the last epoch (summed over tasks)
    pub train_loss: f64,
    /// mean test loss (summed over tasks)
    pub test_loss: f64,
    /// test accuracy in [0, 1]: a number for one task, a list for MultiMNIST
    pub test_accuracy: serde_json::Value,
    /// optimizer steps taken in total
    pub steps: u64,
    /// trainable parameters
    pub params: usize,
    /// MoE: fraction of kept assignments per expert over the last epoch
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<f64>>,
    /// MoE: the routing diagnostics of the last epoch (`moe::RoutingDiagnostics`: load/ideal,
    /// dead experts, entropy, logits, per layer and across layers)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<crate::moe::RoutingDiagnostics>,
    /// MoE: fraction of routed assignments dropped by capacity over the last epoch
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_rate: Option<f64>,
    /// MoE: kept assignments per token (per example and gate) over the last epoch's training
    /// steps: k for a top-k router without drops, variable for threshold routing and DSelect-k
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts_per_token: Option<f64>,
    /// synthetic-b: per expert, the fraction of test examples whose gate gives it a nonzero
    /// weight (after training)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_selection_rate: Option<Vec<f64>>,
    /// synthetic-b: per expert, its mean gate weight over the test examples (sums to the mean
    /// total weight, 1 for gates on the simplex)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_mean_weight: Option<Vec<f64>>,
    /// synthetic-b: the experts the gate selects: those whose mean weight is at least half an
    /// equal share of the k choices, `1/(2k)`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selected_experts: Option<Vec<usize>>,
    /// synthetic-b: where the true experts sit in the bank
    #[serde(skip_serializing_if = "Option::is_none")]
    pub true_experts: Option<Vec<usize>>,
    /// with [`RunOptions::profile`]: wall time per op and pass, summed over the training steps,
    /// longest first, then `other` (see [`crate::profile`])
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Vec<crate::profile::ProfileRow>>,
    /// with [`RunOptions::profile`] on the GPU: GPU time per kernel (timestamp queries)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_profile: Option<crate::profile::GpuProfile>,
}

/// Options of the invocation that are not part of the run's identity.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// continue from `out/checkpoint.safetensors` (which must belong to this run)
    pub resume: bool,
    /// start afresh in an `out` that holds an earlier run's files; they are set aside and
    /// deleted once the new run has written its first checkpoint (without it such an `out` is
    /// refused)
    pub overwrite: bool,
    /// settings a resumed run may change from the checkpoint's (`lr`, `epochs`, ...; see
    /// [`resume::CHANGEABLE_SETTINGS`])
    pub allow_config_change: Vec<String>,
    /// record the wall time per op over the training steps ([`crate::profile`]); the summary
    /// then carries it
    pub profile: bool,
    /// once the run has claimed its output directory, point `<this>/latest` at it and say so
    /// (the command line's default `--out`, see [`out_dir::point_latest`])
    pub latest_link: Option<std::path::PathBuf>,
}

impl RunOptions {
    /// Checks the options against each other; returns the allowed changes as field names.
    pub(crate) fn check(&self) -> Result<Vec<String>> {
        if self.resume && self.overwrite {
            return Err(Error::Invalid(
                "--resume continues the run in --out and --overwrite replaces it: pass one of them"
                    .into(),
            ));
        }
        if !self.resume && !self.allow_config_change.is_empty() {
            return Err(Error::Invalid(format!(
                "--allow-config-change {} applies to --resume only",
                self.allow_config_change.join(",")
            )));
        }
        resume::parse_allowed_changes(&self.allow_config_change)
    }
}

/// The data of an image run, as [`run`] loads it ([`load_data`]; `moegrad bench train` reads it
/// too).
pub struct Splits {
    /// the training examples (the first `train_limit` of them when that is set)
    pub train: Dataset,
    /// the test examples (the first `test_limit` of them when that is set)
    pub test: Dataset,
    /// the side of the square images (0 for synthetic-b, whose examples are vectors)
    pub side: usize,
    /// the number of classification tasks (2 for MultiMNIST, else 1)
    pub tasks: usize,
    /// generator B's frozen expert bank (synthetic-b only)
    pub bank: Option<SyntheticB>,
}

/// Loads the image data `cfg` names (`data`, `data_dir`, `seed`, `experts`, `train_limit`,
/// `test_limit`).
///
/// # Errors
/// Text data (for [`crate::lm::run`]), missing or malformed files (naming the file), or
/// non-square images.
pub fn load_data(cfg: &TrainConfig) -> Result<Splits> {
    let mnist = || Mnist::load(&cfg.data_dir);
    let mut bank = None;
    let limit = |d: Dataset, n: usize| -> Result<Dataset> {
        if n == 0 || n >= d.len() {
            return Ok(d);
        }
        let per: usize = d.sample_shape.iter().product();
        Dataset::new(
            d.features[..n * per].to_vec(),
            d.sample_shape,
            d.labels.iter().map(|l| l[..n].to_vec()).collect(),
        )
    };
    let (train, test, side, tasks) = match cfg.data {
        DataKind::Shakespeare | DataKind::Text => {
            return Err(Error::Invalid(format!(
                "--data {} is text, for the language models (lm::run)",
                cfg.data.name()
            )));
        }
        DataKind::Mnist => {
            let mnist = mnist()?;
            let side = mnist.train.rows;
            if mnist.train.cols != side {
                return Err(Error::Invalid(format!(
                    "{}: the images are {side}×{}; the models take square images",
                    cfg.data_dir.display(),
                    mnist.train.cols
                )));
            }
            let mk = |s: &crate::data::ImageSet| {
                Dataset::new(
                    s.images.clone(),
                    vec![1, s.rows, s.cols],
                    vec![s.labels.clone()],
                )
            };
            (mk(&mnist.train)?, mk(&mnist.test)?, side, 1)
        }
        DataKind::Multimnist => {
            let mnist = mnist()?;
            let tr = multimnist::compose(&mnist.train, cfg.seed)?;
            let te = multimnist::compose(&mnist.test, cfg.seed.wrapping_add(1))?;
            let side = multimnist::CANVAS;
            let mk = |s: multimnist::MultiImageSet| {
                Dataset::new(s.images, vec![1, side, side], s.labels.to_vec())
            };
            (mk(tr)?, mk(te)?, side, 2)
        }
        DataKind::SyntheticB => {
            let g = SyntheticB::generate(cfg.seed, cfg.experts, 10_000, 10_000)?;
            let (train, test) = (g.train.clone(), g.test.clone());
            bank = Some(g);
            (train, test, 0, 1)
        }
    };
    Ok(Splits {
        train: limit(train, cfg.train_limit)?,
        test: limit(test, cfg.test_limit)?,
        side,
        tasks,
        bank,
    })
}

/// The optimizer a run's settings ask for (`--optimizer`, `--lr`, `--weight-decay`).
///
/// # Errors
/// A learning rate or weight decay the optimizer rejects (named in the message).
pub fn make_optimizer(cfg: &TrainConfig) -> Result<Box<dyn Optimizer>> {
    Ok(match cfg.optimizer {
        OptimizerKind::Sgd => {
            let mut s = Sgd::with_momentum(cfg.lr, 0.9)?;
            s.weight_decay = cfg.weight_decay;
            Box::new(s)
        }
        OptimizerKind::Adam => {
            let mut a = Adam::new(cfg.lr)?;
            a.weight_decay = cfg.weight_decay;
            Box::new(a)
        }
        OptimizerKind::Adamw => Box::new(Adam::adamw(
            cfg.lr,
            if cfg.weight_decay > 0.0 {
                cfg.weight_decay
            } else {
                0.01
            },
        )?),
    })
}

/// Mean test loss and accuracy per task, with the values accumulated on the device.
pub fn evaluate(
    model: &dyn TaskModel,
    data: &Dataset,
    batch: usize,
    device: Device,
) -> Result<(f64, Vec<f64>)> {
    let _guard = crate::NoGradGuard::new();
    model.set_training(false);
    let tasks = data.labels.len();
    let mut loss_sum = Tensor::zeros(&[], DType::F32, device)?;
    let mut correct: Vec<Tensor> = (0..tasks)
        .map(|_| Tensor::zeros(&[], DType::F32, device))
        .collect::<Result<_>>()?;
    let order = data.order(0, 0, false);
    for ids in order.chunks(batch.max(1)) {
        let b = data.batch(ids, device)?;
        let logits = model.forward(&b.x)?.logits;
        loss_sum = loss_sum.add(&task_loss(&logits, &b.y)?.mul_scalar(ids.len() as f64)?)?;
        for t in 0..tasks {
            let pred = logits[t].argmax(-1, false)?.to_dtype(DType::F32)?;
            let hits = pred.eq(&b.y[t].to_dtype(DType::F32)?)?.sum_all()?;
            correct[t] = correct[t].add(&hits)?;
        }
    }
    model.set_training(true);
    let n = data.len().max(1) as f64;
    let acc = correct
        .iter()
        .map(|c| Ok(c.item()? / n))
        .collect::<Result<Vec<_>>>()?;
    Ok((loss_sum.item()? / n, acc))
}

/// Keeps the first `periods` lines of `metrics.jsonl` (a resumed run rewrites what follows).
pub(crate) fn truncate_metrics(path: &Path, periods: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .take(periods)
        .map(|l| format!("{l}\n"))
        .collect();
    crate::checkpoint::write_atomic(path, kept.as_bytes())
}

/// Runs a training job as configured.
///
/// The output directory is claimed first (see [`out_dir`]): locked against a concurrent run,
/// cleared of temporaries left by killed runs, and refused when it holds an earlier run's
/// record unless `opts.resume` or `opts.overwrite` is set. With `opts.resume` the checkpoint
/// there must belong to this run (see [`resume::restore`]).
pub fn run(cfg: &TrainConfig, opts: RunOptions) -> Result<TrainSummary> {
    run_observed(cfg, opts, &mut observer::Silent)
}

/// [`run`], reporting its steps, finished epochs and notes to `obs`.
pub fn run_observed(
    cfg: &TrainConfig,
    opts: RunOptions,
    obs: &mut (dyn TrainObserver + Send),
) -> Result<TrainSummary> {
    // on a rayon worker, so that each CPU kernel's parallel part starts without a hand-over
    crate::backend::cpu::on_worker_thread(|| run_on_this_thread(cfg, opts, obs))
}

/// [`run_observed`]'s body, on the calling thread.
fn run_on_this_thread(
    cfg: &TrainConfig,
    opts: RunOptions,
    obs: &mut dyn TrainObserver,
) -> Result<TrainSummary> {
    cfg.validate()?;
    if cfg.model.is_lm() {
        return Err(Error::Invalid(format!(
            "--model {} is trained by iterations: use moegrad::lm::run",
            cfg.model.name()
        )));
    }
    trainer::run_task(cfg, opts, || image::ImageTask::new(cfg), obs)
}

/// Per expert, the fraction of `data`'s examples routed to it with a nonzero weight, and its
/// mean gate weight over the examples, in evaluation mode (summed on the device, read back once).
pub fn expert_usage(
    model: &dyn TaskModel,
    data: &Dataset,
    batch: usize,
    device: Device,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let _guard = crate::NoGradGuard::new();
    model.set_training(false);
    let mut sums: Option<(Tensor, Tensor)> = None;
    for ids in data.order(0, 0, false).chunks(batch.max(1)) {
        let b = data.batch(ids, device)?;
        let stats = model
            .forward(&b.x)?
            .routing
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid("expert usage needs a model with an MoE layer".into()))?;
        sums = Some(match sums {
            None => (stats.kept_per_expert.clone(), stats.weight_per_expert()?),
            Some((k, w)) => (
                k.add(&stats.kept_per_expert)?,
                w.add(&stats.weight_per_expert()?)?,
            ),
        });
    }
    model.set_training(true);
    let n = data.len().max(1) as f64;
    let per_example =
        |t: &Tensor| -> Result<Vec<f64>> { Ok(t.to_vec_f64()?.iter().map(|v| v / n).collect()) };
    match sums {
        Some((k, w)) => Ok((per_example(&k)?, per_example(&w)?)),
        None => Ok((Vec::new(), Vec::new())),
    }
}
