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
    /// task (see `data::SyntheticB`)
    #[serde(rename = "synthetic-b")]
    SyntheticB,
    /// the bundled Shakespeare text, for the language models (`data/text.rs`)
    Shakespeare,
    /// a user's UTF-8 text file (`--data-file`), for the language models
    Text,
}

impl DataKind {
    /// The name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            DataKind::Mnist => "mnist",
            DataKind::Multimnist => "multimnist",
            DataKind::SyntheticB => "synthetic-b",
            DataKind::Shakespeare => "shakespeare",
            DataKind::Text => "text",
        }
    }

    /// True for the text datasets.
    pub fn is_text(self) -> bool {
        matches!(self, DataKind::Shakespeare | DataKind::Text)
    }
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
    /// a character-level GPT (`lm/gpt.rs`)
    Gpt,
    /// a GPT whose feed-forward blocks are MoE layers
    #[serde(rename = "moe-gpt")]
    MoeGpt,
    /// the Llama-style decoder, dense (`lm/decoder.rs`, transformers' `LlamaForCausalLM`)
    Llama,
    /// every feed-forward block an MoE of SwiGLU experts (`MixtralForCausalLM`)
    Mixtral,
    /// MoE blocks with a gated shared expert, q/k/v biases (`Qwen2MoeForCausalLM`)
    #[serde(rename = "qwen2-moe")]
    Qwen2Moe,
    /// MoE blocks, q/k RMSNorm (`OlmoeForCausalLM`)
    Olmoe,
    /// DeepSeek-V3's routing, shared experts and latent attention (`DeepseekV3ForCausalLM`)
    #[serde(rename = "deepseek-moe")]
    DeepseekMoe,
}

impl ModelKind {
    /// The name as the command line spells it (`moe-mlp`).
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::MoeMlp => "moe-mlp",
            ModelKind::MoeCnn => "moe-cnn",
            ModelKind::MmoeCnn => "mmoe-cnn",
            ModelKind::Gpt => "gpt",
            ModelKind::MoeGpt => "moe-gpt",
            ModelKind::Llama => "llama",
            ModelKind::Mixtral => "mixtral",
            ModelKind::Qwen2Moe => "qwen2-moe",
            ModelKind::Olmoe => "olmoe",
            ModelKind::DeepseekMoe => "deepseek-moe",
        }
    }

    /// The decoder family of the Llama-style models (None for the others).
    pub fn family(self) -> Option<crate::lm::Family> {
        crate::lm::Family::from_name(self.name())
    }

    /// True for the language models, trained by iterations on text (`lm/train.rs`).
    pub fn is_lm(self) -> bool {
        matches!(self, ModelKind::Gpt | ModelKind::MoeGpt) || self.family().is_some()
    }

    /// True for the MoE models.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            ModelKind::MoeMlp | ModelKind::MoeCnn | ModelKind::MmoeCnn | ModelKind::MoeGpt
        ) || self.family().is_some_and(|f| f.is_moe())
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
    /// directory holding the MNIST IDX files and the Shakespeare text; `<bundled>`
    /// ([`crate::data::bundled::BUNDLED_DIR`], the default) is the copy built into the binary
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
    /// `f32`, or `f16-mixed` (GPU only: see [`super::Precision`])
    #[serde(default)]
    pub precision: super::Precision,
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
    /// MoE: how the load is balanced (`--balance`, `--balance-scope`, `--balance-window`,
    /// `--balance-rate`; the Switch loss at batch scope for metadata written before it existed)
    #[serde(default)]
    pub balancing: crate::moe::Balancing,
    /// MoE: router z-loss coefficient
    pub z_loss: f64,
    /// MoE: router-specific options (`--router-opt key=value`)
    pub router_options: std::collections::BTreeMap<String, String>,
    /// MoE: warn of collapsed routing when a layer's dead experts (no token over an epoch or
    /// evaluation interval) reach this fraction of its experts (default 0.5; above 1: never)
    #[serde(default = "default_collapse_dead")]
    pub collapse_dead: f64,
    /// MoE: warn of collapsed routing when one expert serves more than this fraction of a
    /// layer's tokens over an epoch or evaluation interval (default 0.9; 1 or more: never)
    #[serde(default = "default_collapse_share")]
    pub collapse_share: f64,
    /// `--data text`: the text file
    #[serde(default)]
    pub data_file: Option<PathBuf>,
    /// language models: training iterations (a multiple of `eval_every`)
    #[serde(default)]
    pub iters: usize,
    /// language models: evaluate and checkpoint every this many iterations
    #[serde(default)]
    pub eval_every: usize,
    /// language models: fixed validation windows per evaluation
    #[serde(default)]
    pub eval_windows: usize,
    /// language models: transformer blocks
    #[serde(default)]
    pub layers: usize,
    /// language models: attention heads
    #[serde(default)]
    pub heads: usize,
    /// language models: model width
    #[serde(default)]
    pub d_model: usize,
    /// language models: context length in characters
    #[serde(default)]
    pub block: usize,
    /// `moe-gpt`: an MoE feed-forward in every this-many-th block (1: all)
    #[serde(default)]
    pub moe_every: usize,
    /// the cosine schedule's final learning rate
    #[serde(default)]
    pub min_lr: f64,
    /// language models: `char`, `bpe:N` or the path of a `tokenizer.json`
    /// ([`crate::data::TokenizerSpec`]); `char` for metadata written before the setting existed
    #[serde(default = "default_tokenizer")]
    pub tokenizer: String,
    /// Llama-style models: key/value heads (0: as many as `heads`)
    #[serde(default)]
    pub kv_heads: usize,
    /// MoE layers: shared experts every token uses (0: none)
    #[serde(default)]
    pub shared_experts: usize,
    /// MoE layers: null experts, which output zero at no cost (0: none; `MoeConfig::null_experts`)
    #[serde(default)]
    pub null_experts: usize,
    /// MoE layers: hidden width of each shared expert (0: `expert_hidden`)
    #[serde(default)]
    pub shared_hidden: usize,
    /// MoE layers: scale the shared experts by a sigmoid gate (Qwen2-MoE)
    #[serde(default)]
    pub shared_gate: bool,
    /// language models: the model's architecture as a transformers `config.json`, for a model
    /// imported from Hugging Face (`moegrad import`) or one whose shape comes from another
    /// checkpoint (`--init-from`). When set, it fixes the sizes, norms, rotary base and MoE
    /// layout (and `--layers`, `--heads`, `--kv-heads`, `--d-model` must agree with it); the
    /// router and its options, capacities, balance and z-loss weights and the seed still come
    /// from the settings above. None: the family's preset at the sizes above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<serde_json::Value>,
    /// language models: start from this checkpoint's parameters (a moegrad run or a `moegrad
    /// import`): the same family continues from it, a dense `llama` becomes an MoE model
    /// (`mixtral`, `qwen2-moe`) whose experts are copies of its FFNs (sparse upcycling)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
}

/// Below this learning rate [`TrainConfig::warnings`] warns that training will barely move the
/// weights (a step of `1e-8` in an f32 weight of size 0.1 is below its rounding error).
pub const TINY_LR: f64 = 1e-8;

/// The flags that only the language models read.
pub const LM_FLAGS: &[&str] = &[
    "--iters",
    "--eval-every",
    "--eval-windows",
    "--layers",
    "--heads",
    "--d-model",
    "--block",
    "--moe-every",
    "--tokenizer",
];

/// The flags that only the image models read (a language model counts iterations and reads
/// the whole text).
pub const IMAGE_FLAGS: &[&str] = &["--epochs", "--train-limit", "--test-limit"];

/// The most validation windows an evaluation of a language model reads (`--eval-windows`):
/// 100,000 windows of `--block` characters are 6.4 million characters at the default block,
/// several times the bundled text's validation split.
pub const MAX_EVAL_WINDOWS: usize = 100_000;

/// The flags that only a model with an MoE layer reads, as the command line spells them.
pub const MOE_FLAGS: [&str; 14] = [
    "--router",
    "--experts",
    "--k",
    "--expert-hidden",
    "--capacity-factor",
    "--eval-capacity-factor",
    "--balance-loss",
    "--balance",
    "--balance-scope",
    "--balance-window",
    "--balance-rate",
    "--z-loss",
    "--router-opt",
    "--null-experts",
];

/// The hidden width of `moe-mlp`'s experts when none is given (also for metadata written
/// before the setting existed).
fn default_expert_hidden() -> usize {
    128
}

fn default_collapse_dead() -> f64 {
    0.5
}

fn default_collapse_share() -> f64 {
    0.9
}

/// The tokenizer when none is given: one id per character.
fn default_tokenizer() -> String {
    "char".into()
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: DataKind::Mnist,
            data_dir: PathBuf::from(crate::data::bundled::BUNDLED_DIR),
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
            precision: super::Precision::F32,
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
            balancing: Default::default(),
            z_loss: 0.0,
            router_options: Default::default(),
            collapse_dead: default_collapse_dead(),
            collapse_share: default_collapse_share(),
            data_file: None,
            iters: 0,
            eval_every: 0,
            eval_windows: 0,
            layers: 0,
            heads: 0,
            d_model: 0,
            block: 0,
            moe_every: 1,
            min_lr: 0.0,
            tokenizer: default_tokenizer(),
            kv_heads: 0,
            shared_experts: 0,
            null_experts: 0,
            shared_hidden: 0,
            shared_gate: false,
            architecture: None,
            init_from: None,
        }
    }
}

impl TrainConfig {
    /// nanoGPT's CPU "baby" Shakespeare setting for `--model gpt|moe-gpt`: 2000 iterations of
    /// batch 12 × block 64, 4 layers, 4 heads, d = 128; AdamW lr 1e-3, betas (0.9, 0.99), weight
    /// decay 0.1 on the matrices, cosine decay to 1e-4 after 100 warm-up steps, gradient clipping
    /// at 1.0; evaluation every 250 iterations on 480 fixed windows. For `moe-gpt`: 8 experts,
    /// top-2, expert hidden 256 (the dense MLP's 512 active per token), dropless.
    pub fn language_model(model: ModelKind) -> TrainConfig {
        TrainConfig {
            data: DataKind::Shakespeare,
            model,
            epochs: 8,
            batch: 12,
            lr: 1e-3,
            optimizer: OptimizerKind::Adamw,
            weight_decay: 0.1,
            schedule: "cosine".into(),
            warmup_steps: 100,
            clip_grad_norm: 1.0,
            expert_hidden: 256,
            iters: 2000,
            eval_every: 250,
            eval_windows: 480,
            layers: 4,
            heads: 4,
            d_model: 128,
            block: 64,
            moe_every: 1,
            min_lr: 1e-4,
            ..TrainConfig::default()
        }
        .with_family_preset()
    }

    /// For a Llama-style family, the MoE settings of its preset ([`crate::lm::DecoderConfig::baby`]):
    /// router and its options, experts, k, expert width, balance loss, shared experts. Other
    /// models are returned unchanged.
    fn with_family_preset(mut self) -> TrainConfig {
        let Some(family) = self.model.family() else {
            return self;
        };
        if let Some(m) = crate::lm::DecoderConfig::baby(family, 1).moe {
            self.set_moe(&m);
        }
        self
    }

    /// Takes an MoE layer's settings as the run's MoE flags: router and options, experts, k,
    /// expert width, balance-loss weight and shared experts.
    pub(crate) fn set_moe(&mut self, m: &crate::moe::MoeConfig) {
        self.router = m.router.clone();
        self.router_options = m.router_options.clone();
        self.experts = m.experts;
        self.k = m.k;
        self.expert_hidden = m.hidden;
        self.balance_loss = m.balance_loss;
        self.balancing = m.balancing;
        self.shared_experts = m.shared.count;
        self.null_experts = m.null_experts;
        self.shared_hidden = m.shared.hidden;
        self.shared_gate = m.shared.gate;
    }

    /// For a language model, `epochs` is the number of evaluation intervals
    /// (`iters / eval_every`): what checkpoints, `--resume` and the schedule count in.
    pub fn with_lm_intervals(mut self) -> TrainConfig {
        if self.model.is_lm() && self.eval_every > 0 {
            self.epochs = self.iters / self.eval_every;
        }
        self
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

    /// Settings that are valid but would do nothing or nearly nothing, one message each (the
    /// caller prints them; `moegrad train` on stderr before it starts). `given` lists the flags
    /// set on the command line, spelled as there (`"--router"`), so that a setting left at its
    /// default is never warned about. Warns when
    ///
    /// * a flag of [`MOE_FLAGS`] is given to a model without an MoE layer (`mlp`, `cnn`);
    /// * `--expert-hidden` is given where no MLP expert reads it (`moe-cnn`, `mmoe-cnn`, and
    ///   synthetic-b, whose bank is fixed), or `--data-dir` with synthetic-b (generated data);
    /// * a flag of [`LM_FLAGS`] is given to an image model, or one of [`IMAGE_FLAGS`] to a
    ///   language model; `--data-file` without `--data text`; `--min-lr` without
    ///   `--schedule cosine`;
    /// * `--lr` is below [`TINY_LR`] (1e-8).
    ///
    /// A warm-up as long as the run needs the number of steps: see [`TrainConfig::warmup_warning`].
    ///
    /// # Example
    /// ```
    /// use moegrad::train::{ModelKind, TrainConfig};
    /// let cfg = TrainConfig { model: ModelKind::Cnn, ..TrainConfig::default() };
    /// let w = cfg.warnings(&["--router", "--lr"]);
    /// assert_eq!(w.len(), 1);
    /// assert!(w[0].contains("--router") && w[0].contains("no MoE layer"));
    /// // moe-gpt's MLP experts read --expert-hidden; mmoe-cnn's CNN experts do not
    /// let lm = TrainConfig { model: ModelKind::MoeGpt, ..TrainConfig::default() };
    /// assert!(lm.warnings(&["--expert-hidden"]).is_empty());
    /// let cnn = TrainConfig { model: ModelKind::MmoeCnn, ..TrainConfig::default() };
    /// assert_eq!(cnn.warnings(&["--expert-hidden"]).len(), 1);
    /// ```
    pub fn warnings(&self, given: &[&str]) -> Vec<String> {
        let mut out = Vec::new();
        let model = self.model.name();
        if !self.model.is_moe() {
            let ignored: Vec<&str> = MOE_FLAGS
                .iter()
                .copied()
                .filter(|f| given.contains(f))
                .collect();
            if !ignored.is_empty() {
                out.push(format!(
                    "{} ignored: --model {model} has no MoE layer (the MoE models are moe-mlp, moe-cnn, mmoe-cnn and moe-gpt)",
                    ignored.join(", ")
                ));
            }
        } else if given.contains(&"--expert-hidden") {
            if self.data == DataKind::SyntheticB {
                out.push(
                    "--expert-hidden ignored: synthetic-b's expert bank is fixed (10 → 4)".into(),
                );
            } else if matches!(self.model, ModelKind::MoeCnn | ModelKind::MmoeCnn) {
                out.push(format!(
                    "--expert-hidden ignored: --model {model} has CNN experts of a fixed shape (it sets the MLP experts of moe-mlp and moe-gpt)"
                ));
            }
        }
        let ignored_by = |flags: &[&'static str]| -> Vec<&'static str> {
            flags
                .iter()
                .copied()
                .filter(|f| given.contains(f))
                .collect()
        };
        if self.model.is_lm() {
            let ignored = ignored_by(IMAGE_FLAGS);
            if !ignored.is_empty() {
                out.push(format!(
                    "{} ignored: --model {model} is a language model, trained for --iters iterations over the whole text",
                    ignored.join(", ")
                ));
            }
        } else {
            let ignored = ignored_by(LM_FLAGS);
            if !ignored.is_empty() {
                out.push(format!(
                    "{} ignored: they set the language models (gpt, moe-gpt), not --model {model}",
                    ignored.join(", ")
                ));
            }
        }
        if self.data != DataKind::Text && given.contains(&"--data-file") {
            out.push(format!(
                "--data-file ignored: it is the text of --data text, not of --data {}",
                self.data.name()
            ));
        }
        if self.schedule != "cosine" && given.contains(&"--min-lr") {
            out.push(format!(
                "--min-lr ignored: it is where --schedule cosine ends, and the schedule is {}",
                self.schedule
            ));
        }
        if self.data == DataKind::SyntheticB && given.contains(&"--data-dir") {
            out.push("--data-dir ignored: synthetic-b generates its data from --seed".into());
        }
        if self.lr < TINY_LR {
            out.push(format!(
                "--lr {:e} is below {TINY_LR:e}: the weights will barely change",
                self.lr
            ));
        }
        out
    }

    /// A warning when the linear warm-up lasts the whole run (`--warmup-steps` ≥ the run's
    /// `total_steps`): the learning rate then reaches `--lr` only at the last step (equal
    /// lengths) or never, ending at `lr · total_steps / warmup_steps`.
    ///
    /// # Example
    /// ```
    /// use moegrad::train::TrainConfig;
    /// let cfg = TrainConfig { warmup_steps: 1_000_000, ..TrainConfig::default() };
    /// assert!(cfg.warmup_warning(500).unwrap().contains("--warmup-steps 1000000"));
    /// assert!(cfg.warmup_warning(2_000_000).is_none());
    /// assert!(cfg.warmup_warning(1_000_000).unwrap().contains("only at the last step"));
    /// ```
    pub fn warmup_warning(&self, total_steps: u64) -> Option<String> {
        (self.warmup_steps > 0 && self.warmup_steps >= total_steps).then(|| {
            let head = format!(
                "--warmup-steps {} is not shorter than the run's {total_steps} steps",
                self.warmup_steps
            );
            if self.warmup_steps == total_steps {
                format!(
                    "{head}: the learning rate reaches --lr {:e} only at the last step",
                    self.lr
                )
            } else {
                format!(
                    "{head}: the learning rate never reaches --lr {:e} (it ends at {:e})",
                    self.lr,
                    self.lr * total_steps as f64 / self.warmup_steps as f64
                )
            }
        })
    }

    /// Checks every setting; the error names the one at fault.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        for (flag, v) in [
            ("--collapse-dead", self.collapse_dead),
            ("--collapse-share", self.collapse_share),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!(
                    "{flag} {v} is not a fraction ≥ 0 (a value above 1 turns the warning off)"
                ));
            }
        }
        if self.model.is_lm() != self.data.is_text() {
            return bad(if self.model.is_lm() {
                format!(
                    "--model {} is a language model: use it with --data shakespeare or --data text --data-file PATH, not --data {}",
                    self.model.name(),
                    self.data.name()
                )
            } else {
                format!(
                    "--data {} is text: train it with --model gpt or moe-gpt, not {}",
                    self.data.name(),
                    self.model.name()
                )
            });
        }
        crate::data::TokenizerSpec::parse(&self.tokenizer)?;
        if !self.model.is_lm() && (self.init_from.is_some() || self.architecture.is_some()) {
            return bad(format!(
                "--init-from starts a language model from a checkpoint; --model {} is an image model",
                self.model.name()
            ));
        }
        if !self.model.is_lm() && self.tokenizer != "char" {
            return bad(format!(
                "--tokenizer {} sets how a language model (gpt, moe-gpt) reads text; --model {} reads images",
                self.tokenizer,
                self.model.name()
            ));
        }
        if self.model.is_lm() {
            if self.data == DataKind::Text && self.data_file.is_none() {
                return bad(
                    "--data text needs --data-file PATH (a UTF-8 text file, plain or .gz)".into(),
                );
            }
            if self.iters == 0
                || self.eval_every == 0
                || !self.iters.is_multiple_of(self.eval_every)
            {
                return bad(format!(
                    "--iters {} must be a positive multiple of --eval-every {} (evaluations and checkpoints come every --eval-every iterations)",
                    self.iters, self.eval_every
                ));
            }
            if self.eval_windows == 0 || self.eval_windows > MAX_EVAL_WINDOWS {
                return bad(format!(
                    "--eval-windows {} must be between 1 and {MAX_EVAL_WINDOWS}",
                    self.eval_windows
                ));
            }
            if self.layers == 0 || self.block == 0 || self.d_model == 0 || self.heads == 0 {
                return bad(format!(
                    "--layers, --block, --d-model and --heads must be at least 1, got {}, {}, {}, {}",
                    self.layers, self.block, self.d_model, self.heads
                ));
            }
            if self.kv_heads > 0 && !self.heads.is_multiple_of(self.kv_heads) {
                return bad(format!(
                    "--heads {} must be a multiple of --kv-heads {}",
                    self.heads, self.kv_heads
                ));
            }
            // (an architecture sets its own head width)
            if self.architecture.is_none() && !self.d_model.is_multiple_of(self.heads) {
                return bad(format!(
                    "--d-model {} must be a multiple of --heads {}",
                    self.d_model, self.heads
                ));
            }
            if self.model == ModelKind::MoeGpt
                && (self.moe_every == 0 || self.moe_every > self.layers)
            {
                return bad(format!(
                    "--moe-every {} must be between 1 and --layers {}",
                    self.moe_every, self.layers
                ));
            }
            if self.model.is_moe() && self.router == "expert-choice" {
                return bad("--router expert-choice cannot train a causal language model: it picks each expert's tokens from the whole batch, so a position's output would depend on later positions of its own sequence; use a token-choice router such as topk or switch".into());
            }
        }
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
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(format!(
                "--min-lr {} must lie in [0, --lr {}]",
                self.min_lr, self.lr
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
            super::moe_settings::validate(self)?;
        }
        if self.data == DataKind::SyntheticB {
            if self.model != ModelKind::MoeMlp {
                return bad(format!(
                    "--data synthetic-b trains a gate over frozen experts and a logistic unit (the DSelect-k experiment): use --model moe-mlp (the default for this data), not {:?}",
                    self.model
                ));
            }
            if self.experts < crate::data::SYNTHETIC_B_TRUE {
                return bad(format!(
                    "--data synthetic-b needs --experts ≥ {} (the true experts are in the bank), got {}",
                    crate::data::SYNTHETIC_B_TRUE,
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
