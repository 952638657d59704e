//! The settings of a training run (`moegrad train`), checked before anything runs.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// MNIST digits, 10 classes
    Mnist,
    /// two overlaid digits, two 10-class tasks
    Multimnist,
    /// DSelect-k's generator B: a known mixture of 4 experts among 16 frozen ones, one binary
    /// task (see `data::synthetic`)
    #[serde(rename = "synthetic-b")]
    SyntheticB,
}

/// Which model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// a multi-layer perceptron on the flattened image
    Mlp,
    /// a LeNet-style convolutional network
    Cnn,
    /// an MoE layer of MLP experts on the flattened image
    #[serde(rename = "moe-mlp")]
    MoeMlp,
    /// an MoE layer of the MOESART CNN experts
    #[serde(rename = "moe-cnn")]
    MoeCnn,
    /// multi-gate MoE: one router per task over shared CNN experts, a tower per task
    #[serde(rename = "mmoe-cnn")]
    MmoeCnn,
}

impl ModelKind {
    /// True for the MoE models.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            ModelKind::MoeMlp | ModelKind::MoeCnn | ModelKind::MmoeCnn
        )
    }
}

/// Which optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with momentum 0.9
    Sgd,
    /// Adam
    Adam,
    /// AdamW (weight decay 0.01 unless set)
    Adamw,
}

/// Everything a run needs; serialised into the checkpoint's metadata and `metrics.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainConfig {
    /// dataset
    pub data: DataKind,
    /// directory holding the MNIST IDX files
    pub data_dir: PathBuf,
    /// model
    pub model: ModelKind,
    /// passes over the training set
    pub epochs: usize,
    /// examples per step
    pub batch: usize,
    /// peak learning rate
    pub lr: f64,
    /// optimizer
    pub optimizer: OptimizerKind,
    /// weight decay (L2 for SGD/Adam, decoupled for AdamW)
    pub weight_decay: f64,
    /// learning-rate schedule: constant or cosine
    pub schedule: String,
    /// the cosine schedule's length in epochs, fixed up front so that a run trained in parts
    /// (`--epochs 1`, then `--resume --epochs 2`) follows the same rates as one run of this
    /// length; 0 (the default): the length of this invocation, `epochs`
    #[serde(default)]
    pub schedule_epochs: usize,
    /// linear warm-up steps
    pub warmup_steps: u64,
    /// clip the global gradient norm to this value (0: off)
    pub clip_grad_norm: f64,
    /// seed of initialisation, shuffling and data composition
    pub seed: u64,
    /// auto, cpu or gpu
    pub device: String,
    /// output directory (metrics.jsonl, checkpoint.safetensors, curves.svg)
    pub out: PathBuf,
    /// use only the first N training examples (0: all)
    pub train_limit: usize,
    /// use only the first N test examples (0: all)
    pub test_limit: usize,
    /// read the loss back every this many steps (progress bar and NaN check)
    pub log_every: usize,
    /// MoE router name
    pub router: String,
    /// MoE: number of experts
    pub experts: usize,
    /// MoE: experts per token
    pub k: usize,
    /// MoE: hidden width of each MLP expert of `moe-mlp` (default 128; XMoE's small experts
    /// use a fraction of it)
    #[serde(default = "default_expert_hidden")]
    pub expert_hidden: usize,
    /// MoE: capacity factor γ in training (0: dropless)
    pub capacity_factor: f64,
    /// MoE: capacity factor in evaluation (0: dropless)
    pub eval_capacity_factor: f64,
    /// MoE: Switch balance-loss coefficient α
    pub balance_loss: f64,
    /// MoE: router z-loss coefficient
    pub z_loss: f64,
    /// MoE: router-specific options (`--router-opt key=value`)
    pub router_options: std::collections::BTreeMap<String, String>,
}

/// The hidden width of `moe-mlp`'s experts when none is given (also for metadata written
/// before the setting existed).
fn default_expert_hidden() -> usize {
    128
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: DataKind::Mnist,
            data_dir: PathBuf::from("data"),
            model: ModelKind::Cnn,
            epochs: 5,
            batch: 64,
            lr: 1e-3,
            optimizer: OptimizerKind::Adam,
            weight_decay: 0.0,
            schedule: "constant".into(),
            schedule_epochs: 0,
            warmup_steps: 0,
            clip_grad_norm: 0.0,
            seed: 0,
            device: "auto".into(),
            out: PathBuf::from("runs/latest"),
            train_limit: 0,
            test_limit: 0,
            log_every: 20,
            router: "topk".into(),
            experts: 8,
            k: 2,
            expert_hidden: default_expert_hidden(),
            capacity_factor: 0.0,
            eval_capacity_factor: 0.0,
            balance_loss: 0.01,
            z_loss: 0.0,
            router_options: Default::default(),
        }
    }
}

impl TrainConfig {
    /// The number of epochs the learning-rate schedule spans: `schedule_epochs` when set,
    /// otherwise `epochs`.
    pub fn schedule_length_epochs(&self) -> usize {
        if self.schedule_epochs > 0 {
            self.schedule_epochs
        } else {
            self.epochs
        }
    }

    /// Checks every setting; the error names the one at fault.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.epochs == 0 {
            return bad("--epochs must be at least 1".into());
        }
        if self.batch == 0 {
            return bad("--batch must be at least 1, got 0".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "--lr must be a finite positive number, got {}",
                self.lr
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "--weight-decay must be finite and non-negative, got {}",
                self.weight_decay
            ));
        }
        if !(self.clip_grad_norm.is_finite() && self.clip_grad_norm >= 0.0) {
            return bad(format!(
                "--clip-grad-norm must be finite and non-negative, got {}",
                self.clip_grad_norm
            ));
        }
        if !["constant", "cosine"].contains(&self.schedule.as_str()) {
            return bad(format!(
                "--schedule {:?}: expected constant or cosine",
                self.schedule
            ));
        }
        if self.schedule_epochs > 0 {
            if self.schedule != "cosine" {
                return bad(format!(
                    "--schedule-epochs {} sets the length of --schedule cosine; it has no effect with --schedule {}",
                    self.schedule_epochs, self.schedule
                ));
            }
            if self.schedule_epochs < self.epochs {
                return bad(format!(
                    "--schedule-epochs {} is below --epochs {}: the cosine would reach its final rate 0 after epoch {} and the later epochs would not train",
                    self.schedule_epochs, self.epochs, self.schedule_epochs
                ));
            }
        }
        if !["auto", "cpu", "gpu"].contains(&self.device.as_str()) {
            return bad(format!(
                "--device {:?}: expected auto, cpu or gpu",
                self.device
            ));
        }
        if self.model.is_moe() {
            if !crate::moe::ROUTER_NAMES.contains(&self.router.as_str()) {
                return bad(format!(
                    "--router {:?}: expected one of {}",
                    self.router,
                    crate::moe::ROUTER_NAMES.join(", ")
                ));
            }
            if self.experts == 0 || self.k == 0 || self.k > self.experts {
                return bad(format!(
                    "--k {} must be between 1 and --experts {}",
                    self.k, self.experts
                ));
            }
            if self.expert_hidden == 0 {
                return bad("--expert-hidden must be at least 1, got 0".into());
            }
            for (name, v) in [
                ("--capacity-factor", self.capacity_factor),
                ("--eval-capacity-factor", self.eval_capacity_factor),
                ("--balance-loss", self.balance_loss),
                ("--z-loss", self.z_loss),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return bad(format!("{name} must be finite and non-negative, got {v}"));
                }
            }
        }
        if self.data == DataKind::SyntheticB {
            if self.model != ModelKind::MoeMlp {
                return bad(format!(
                    "--data synthetic-b trains a gate over frozen experts and a logistic unit (the DSelect-k experiment): use --model moe-mlp (the default for this data), not {:?}",
                    self.model
                ));
            }
            if self.experts < crate::data::synthetic::SYNTHETIC_B_TRUE {
                return bad(format!(
                    "--data synthetic-b needs --experts ≥ {} (the true experts are in the bank), got {}",
                    crate::data::synthetic::SYNTHETIC_B_TRUE,
                    self.experts
                ));
            }
        }
        if self.model == ModelKind::MmoeCnn && self.data != DataKind::Multimnist {
            return bad("--model mmoe-cnn is multi-task: use it with --data multimnist".into());
        }
        if self.log_every == 0 {
            return bad("--log-every must be at least 1".into());
        }
        Ok(())
    }
}
