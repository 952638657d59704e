//! The `moegrad` command line: `info` (device report), `train` (a training run), `compare` (a
//! grid of training runs aggregated into one table of mean ± standard error), `bench`
//! (measured workloads) and `estimators` (the estimator lab: router-gradient estimators against
//! the exact gradient of a small problem).
//! Every error is printed as one line on stderr with a non-zero exit status.

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use moegrad::train::{DataKind, ModelKind, OptimizerKind, RunOptions, TrainConfig};
use moegrad::{Device, Result};
use std::path::PathBuf;
use std::process::ExitCode;

/// Counts heap bytes so `bench moe` can report peak memory.
#[global_allocator]
static ALLOC: moegrad::memory::CountingAllocator = moegrad::memory::CountingAllocator;

#[derive(Parser)]
#[command(
    name = "moegrad",
    version,
    about = "Tape-based autodiff on wgpu for Mixture-of-Experts training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands (parsed once, so the size difference between variants does not matter).
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Print the device moegrad would use, the GPU adapter, its limits and optional features.
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Train a model on MNIST, MultiMNIST or synthetic-b (epochs), or a character-level GPT on
    /// text (iterations), with a progress bar, metrics, plots and checkpoints.
    Train(TrainArgs),
    /// Run a grid of `train` runs (routers × seeds × other settings), each cell in its own
    /// directory under --out, and print one table of mean ± standard error per group of cells
    /// that differ only in the seed. Every flag that is not one of compare's own is a `train`
    /// flag shared by all cells (`moegrad train --help` lists them): `moegrad compare --data
    /// mnist --model moe-mlp --routers topk,softmax --seeds 1,2 --epochs 1`. A second
    /// invocation with the same --out reads the finished cells instead of running them again
    /// (an interrupted cell runs again); adding routers, seeds or values adds only the new
    /// cells.
    Compare(CompareArgs),
    /// Sample text from a language model trained with `train --model gpt|moe-gpt` (the
    /// vocabulary and the model's settings come from the checkpoint).
    Generate(GenerateArgs),
    /// Measure router-gradient estimators (bias, variance, cosine, cost) against the exact
    /// gradient of a small MoE problem, found by enumerating every expert choice
    /// (docs/estimators.md).
    Estimators(EstimatorArgs),
    /// Run a benchmark and print its figures.
    Bench {
        /// Which workload.
        #[arg(value_enum)]
        workload: Workload,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Devices to measure: auto (CPU, plus the GPU when there is one), cpu or gpu.
        #[arg(long, default_value = "auto")]
        device: String,
        /// Square matrix sizes for the matmul workload, separated by spaces or commas
        /// (`--sizes 512 1024` or `--sizes 512,1024`).
        #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = vec![256, 512, 1024])]
        sizes: Vec<usize>,
        /// Tokens per step for the moe workload.
        #[arg(long, default_value_t = 4096)]
        tokens: usize,
        /// train workload: use only the first N training examples (0: all 8,000 of the bundled
        /// MNIST subset).
        #[arg(long, default_value_t = 0)]
        examples: usize,
        /// train workload: examples per step.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// train workload: directory with the MNIST IDX files.
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
    },
}

/// `moegrad train` options (each maps onto a field of `TrainConfig`).
#[derive(clap::Args)]
struct TrainArgs {
    /// Dataset: mnist, multimnist (two overlaid digits, two tasks), synthetic-b (DSelect-k's
    /// generator B: 4 true experts hidden among 16 frozen ones; reports which ones the gate
    /// selects), shakespeare (data/shakespeare-10-plays.txt.gz, for --model gpt|moe-gpt) or text
    /// (--data-file, any UTF-8 text, plain or .gz).
    #[arg(long, value_enum, default_value = "mnist")]
    data: DataArg,
    /// The text file of --data text.
    #[arg(long)]
    data_file: Option<PathBuf>,
    /// Directory with the MNIST IDX files (bundled subset in data/, or the full MNIST files).
    #[arg(long, default_value = "data")]
    data_dir: PathBuf,
    /// Model: mlp, cnn, moe-mlp, moe-cnn or mmoe-cnn (multi-gate, MultiMNIST); gpt or moe-gpt
    /// (a character-level GPT, every --moe-every-th feed-forward an MoE layer) for text
    /// [default: cnn; moe-mlp for synthetic-b; gpt for text]. The language models take nanoGPT's
    /// "baby" Shakespeare defaults for every setting not given: --batch 12, --lr 1e-3,
    /// --optimizer adamw, --weight-decay 0.1 (matrices only), --schedule cosine to --min-lr
    /// 1e-4, --warmup-steps 100, --clip-grad-norm 1, --expert-hidden 256.
    #[arg(long, value_enum)]
    model: Option<ModelArg>,
    /// Passes over the training set (with --resume: the total, counting the epochs already
    /// trained).
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Examples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    lr: f64,
    /// Optimizer: sgd (momentum 0.9), adam or adamw.
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: OptimizerArg,
    /// Weight decay (L2 for sgd/adam, decoupled for adamw; adamw defaults to 0.01).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    weight_decay: f64,
    /// Learning-rate schedule: constant or cosine. The cosine decays to 0 over --epochs, or
    /// over --schedule-epochs when given.
    #[arg(long, default_value = "constant")]
    schedule: String,
    /// Length of the cosine schedule in epochs, fixed up front for a run trained in parts:
    /// `--epochs 1 --schedule-epochs 2`, then `--resume --epochs 2 --schedule-epochs 2`, ends
    /// exactly where `--epochs 2` does. Without it the cosine spans --epochs, and --resume
    /// refuses a changed --epochs (it would change the rates of the steps already taken)
    /// unless given --allow-config-change epochs [default: --epochs].
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    schedule_epochs: usize,
    /// Steps of linear learning-rate warm-up.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Clip the global gradient norm to this value (0 turns clipping off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    clip_grad_norm: f64,
    /// Seed of initialisation, shuffling and MultiMNIST composition.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// auto (GPU when there is one), cpu or gpu.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Output directory for metrics.jsonl, checkpoint.safetensors and curves.svg. It is locked
    /// while the run writes it; one that holds an earlier run's files needs --resume or
    /// --overwrite.
    #[arg(long, default_value = "runs/latest")]
    out: PathBuf,
    /// Use only the first N training examples (0: all).
    #[arg(long, default_value_t = 0)]
    train_limit: usize,
    /// Use only the first N test examples (0: all).
    #[arg(long, default_value_t = 0)]
    test_limit: usize,
    /// Read the loss back every N steps (progress bar, NaN check).
    #[arg(long, default_value_t = 20)]
    log_every: usize,
    /// MoE router (every name in `moegrad::moe::ROUTER_NAMES`; see docs/routers.md).
    #[arg(long, default_value = "topk",
          value_parser = clap::builder::PossibleValuesParser::new(moegrad::moe::ROUTER_NAMES))]
    router: String,
    /// MoE: number of experts [default: 8; 16 for synthetic-b].
    #[arg(long)]
    experts: Option<usize>,
    /// MoE: experts per token [default: 2; 4 for synthetic-b].
    #[arg(long)]
    k: Option<usize>,
    /// MoE: hidden width of each MLP expert (`--model moe-mlp`); small experts as in XMoE.
    #[arg(long, default_value_t = 128)]
    expert_hidden: usize,
    /// MoE: capacity factor γ in training (0: dropless).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    capacity_factor: f64,
    /// MoE: capacity factor in evaluation (0: dropless).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    eval_capacity_factor: f64,
    /// MoE: Switch load-balancing loss coefficient α.
    #[arg(long, default_value_t = 0.01, allow_negative_numbers = true)]
    balance_loss: f64,
    /// MoE: router z-loss coefficient.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    z_loss: f64,
    /// MoE: a router-specific setting as key=value (repeatable), e.g. `--router-opt tau=0.5`;
    /// docs/routers.md lists each router's options.
    #[arg(long = "router-opt", value_name = "KEY=VALUE")]
    router_opt: Vec<String>,
    /// Continue the run in OUT from its checkpoint.safetensors, up to --epochs in total. The
    /// settings must be the checkpoint's (the error lists those that differ), except --out,
    /// --device, --data-dir, --log-every, and --epochs unless a cosine schedule spans it (see
    /// --schedule-epochs).
    #[arg(long)]
    resume: bool,
    /// With --resume, accept deliberate changes of these settings (comma-separated, as
    /// flag names without --): epochs, lr, weight-decay, schedule, schedule-epochs,
    /// warmup-steps, clip-grad-norm, batch, train-limit, test-limit, balance-loss, z-loss,
    /// capacity-factor, eval-capacity-factor.
    #[arg(long, value_name = "SETTING[,SETTING]", value_delimiter = ',')]
    allow_config_change: Vec<String>,
    /// Start a new run in an --out that holds an earlier run's files (metrics.jsonl,
    /// checkpoint.safetensors, plots), deleting them once the new run is set up; other files
    /// there are kept.
    #[arg(long)]
    overwrite: bool,
    /// Language models: training iterations (a multiple of --eval-every).
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Language models: evaluate, log and checkpoint every N iterations.
    #[arg(long, default_value_t = 250)]
    eval_every: usize,
    /// Language models: validation windows per evaluation (fixed by --seed).
    #[arg(long, default_value_t = 480)]
    eval_windows: usize,
    /// Language models: transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Language models: attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Language models: model width.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Language models: context length in characters.
    #[arg(long, default_value_t = 64)]
    block: usize,
    /// moe-gpt: an MoE feed-forward in every N-th block (1: every block; 2 alternates dense
    /// and MoE as Switch and GShard do).
    #[arg(long, default_value_t = 1)]
    moe_every: usize,
    /// The final learning rate of the cosine schedule [default: 0; 1e-4 for the language models].
    #[arg(long, allow_negative_numbers = true)]
    min_lr: Option<f64>,
    /// Print the final metrics as one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// At the end, print the wall time per op, forward and backward separately, summed over
    /// the training steps (top 15, with calls and share of the step time; on the GPU also the
    /// GPU time per kernel where the adapter has timestamp queries); with --json, all of it as
    /// `profile` (and `gpu_profile`). MOEGRAD_PROFILE=1 does the same for any command.
    #[arg(long)]
    profile: bool,
}

/// `moegrad compare` options; the other flags (after `--`, or mixed in with these) are `train`
/// flags shared by every cell.
#[derive(clap::Args)]
struct CompareArgs {
    /// A grid file (TOML, or JSON for a name ending in .json): `routers`, `seeds`, `metric`,
    /// `target`, a `[train]` table of fixed flags, a `[set]` table of axes and `[[variants]]`
    /// (several flags per point); see experiments/*.toml. Flags given here as well replace the
    /// file's: `--grid FILE --seeds 1 --epochs 1` is a quick trial of a shipped grid.
    #[arg(long)]
    grid: Option<PathBuf>,
    /// The router axis, comma-separated (`--routers topk,softmax,moesart`).
    #[arg(long, value_name = "R1,R2,...")]
    routers: Option<String>,
    /// The seed axis, comma-separated (`--seeds 1,2,3`): cells that differ only in the seed
    /// are one group (mean ± s.e.).
    #[arg(long, value_name = "S1,S2,...")]
    seeds: Option<String>,
    /// Any other train flag as an axis (repeatable): `--set k=2,4 --set expert-hidden=64,128`.
    #[arg(long = "set", value_name = "FLAG=V1,V2")]
    set: Vec<String>,
    /// Cells run at once, as separate processes sharing the cores. On a small machine one job
    /// with all threads is usually faster than several.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Also report the steps (and epochs) each group needed to reach METRIC=VALUE, e.g.
    /// `val_loss=2.0` or `test_accuracy=0.9` (accuracies from below, losses from above).
    #[arg(long, value_name = "METRIC=VALUE")]
    target: Option<String>,
    /// The final metric of the bar chart, and of the learning curves when the runs log it
    /// [default: test_loss; val_loss for the language models].
    #[arg(long)]
    metric: Option<String>,
    /// The grid's directory: one subdirectory per cell (metrics.jsonl, checkpoint, cell.json,
    /// train.log), table.md, table.csv, table.json and the figures.
    #[arg(long, default_value = "runs/compare")]
    out: PathBuf,
    /// Run the cells that failed in an earlier invocation again (by default their recorded
    /// failure is reported).
    #[arg(long)]
    retry_failed: bool,
    /// Do not draw the figures.
    #[arg(long)]
    no_plot: bool,
    /// Check every cell and list them (directory, state, train flags) without running any.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as one JSON object on stdout instead of the markdown table.
    #[arg(long)]
    json: bool,
    /// The train flags every cell shares (compare puts them here; `--` before them is optional).
    #[arg(last = true, value_name = "TRAIN FLAGS", allow_hyphen_values = true)]
    train: Vec<String>,
}

/// `moegrad generate` options.
#[derive(clap::Args)]
struct GenerateArgs {
    /// The checkpoint of a language-model run (its out/checkpoint.safetensors).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The text to continue (every character must be in the model's vocabulary; `\n` and
    /// `\t` stand for a newline and a tab) [default: a newline].
    #[arg(long, default_value = "\\n")]
    prompt: String,
    /// Characters to generate.
    #[arg(long, default_value_t = 300)]
    tokens: usize,
    /// Softmax temperature (> 0).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Sample among the K most likely characters (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// auto, cpu or gpu.
    #[arg(long, default_value = "auto")]
    device: String,
}

/// `moegrad estimators` options (each maps onto a field of `LabConfig`).
#[derive(clap::Args)]
struct EstimatorArgs {
    /// Number of experts n (at least 2).
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Width d of each expert's output.
    #[arg(long, default_value_t = 4)]
    dim: usize,
    /// Tokens T (each with its own logits and expert outputs).
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Per-token loss g: linear, quadratic (½‖Ay − b‖²) or logistic (softplus).
    #[arg(long, default_value = "logistic")]
    loss: String,
    /// Draws M per estimator (at least 2).
    #[arg(long, default_value_t = 4000)]
    samples: usize,
    /// Seed of the problem and of every estimator's noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Standard deviation of the logits.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    scale: f64,
    /// Constant added to every logit (π unchanged; loosens SparseMixer's mask).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    logit_offset: f64,
    /// Standard deviation ε of the expert outputs.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    eps: f64,
    /// SparseMixer's jitter r in [0, 1): its mask keeps expert j iff θ* − θ_j ≤ r(|θ*| + |θ_j|).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    jitter: f64,
    /// Comma-separated estimators (default: all but switch-jitter).
    #[arg(long, value_delimiter = ',',
          default_values_t = moegrad::estimator_lab::ESTIMATOR_NAMES.iter().map(|s| s.to_string()))]
    estimators: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Where to write the figure (bias against spread, per estimator).
    #[arg(long, default_value = "estimators.svg")]
    plot: PathBuf,
    /// Do not write the figure.
    #[arg(long)]
    no_plot: bool,
}

impl EstimatorArgs {
    fn config(&self) -> moegrad::Result<moegrad::estimator_lab::LabConfig> {
        use moegrad::estimator_lab::{LabConfig, ProblemConfig};
        Ok(LabConfig {
            problem: ProblemConfig {
                tokens: self.tokens,
                experts: self.experts,
                dim: self.dim,
                loss: self.loss.parse()?,
                scale: self.scale,
                offset: self.logit_offset,
                eps: self.eps,
                seed: self.seed,
            },
            samples: self.samples,
            jitter: self.jitter,
            estimators: self
                .estimators
                .iter()
                .map(|s| s.trim().to_string())
                .collect(),
        })
    }
}

/// Prints the lab's report as a table.
fn print_lab(r: &moegrad::estimator_lab::LabReport) {
    let c = &r.config;
    let p = &c.problem;
    println!(
        "estimator lab: T = {} tokens, n = {} experts, d = {}, loss {}, logits {} + {}·z, experts {}·z, seed {}, M = {} draws",
        p.tokens, p.experts, p.dim, p.loss, p.offset, p.scale, p.eps, p.seed, c.samples
    );
    println!(
        "exact gradient (enumerated): L = {:.6}, |∇| = {:.4e}, |∇₀| = {:.4e}, |∇₁| = {:.4e}; SparseMixer's mask (jitter {}) keeps {:.2} of {} experts per token",
        r.exact_loss,
        r.exact_norm,
        r.nabla0_norm,
        r.nabla1_norm,
        c.jitter,
        r.mask_kept_per_token,
        p.experts
    );
    println!(
        "{:<16} {:>6} {:>9} {:>9} {:>10} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "estimator",
        "aims",
        "bias",
        "±s.e.",
        "variance",
        "cosine",
        "cos/draw",
        "vs ∇₀",
        "vs ∇₁",
        "experts",
        "ms/draw"
    );
    for e in &r.estimators {
        println!(
            "{:<16} {:>6} {:>9.4} {:>9.4} {:>10.4e} {:>8.4} {:>9.4} {:>9.4} {:>9.4} {:>8.2} {:>8.3}",
            e.name,
            e.target.label(),
            e.bias,
            e.bias_se,
            e.variance,
            e.cosine,
            e.mean_cosine,
            e.bias_nabla0,
            e.bias_nabla1,
            e.experts_per_token,
            e.ms_per_draw
        );
    }
    println!(
        "bias, ±s.e. (= √(variance/M)), variance (trace of one draw's covariance), vs ∇₀/∇₁ are relative to |∇| (squared for variance); cosine is of the mean estimate, cos/draw the mean per-draw cosine"
    );
}

#[derive(Clone, Copy, ValueEnum)]
enum DataArg {
    Mnist,
    Multimnist,
    #[value(name = "synthetic-b")]
    SyntheticB,
    Shakespeare,
    Text,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelArg {
    Mlp,
    Cnn,
    MoeMlp,
    MoeCnn,
    MmoeCnn,
    Gpt,
    MoeGpt,
}

#[derive(Clone, Copy, ValueEnum)]
enum OptimizerArg {
    Sgd,
    Adam,
    Adamw,
}

impl TrainArgs {
    /// The run's settings; `given` lists the flags set on the command line (a language model
    /// takes its own defaults for the others, see [`TrainConfig::language_model`]).
    fn config(&self, given: &[String]) -> moegrad::Result<TrainConfig> {
        let image = self.image_config()?;
        if !image.model.is_lm() {
            return Ok(image);
        }
        let has = |flag: &str| given.iter().any(|g| g == flag);
        let mut c = TrainConfig::language_model(image.model);
        c.data = image.data;
        c.data_dir = image.data_dir.clone();
        c.data_file = self.data_file.clone();
        c.seed = image.seed;
        c.device = image.device.clone();
        c.out = image.out.clone();
        c.log_every = image.log_every;
        c.router = image.router.clone();
        c.router_options = image.router_options.clone();
        c.experts = image.experts;
        c.k = image.k;
        c.capacity_factor = image.capacity_factor;
        c.eval_capacity_factor = image.eval_capacity_factor;
        c.balance_loss = image.balance_loss;
        c.z_loss = image.z_loss;
        c.schedule_epochs = image.schedule_epochs;
        c.iters = self.iters;
        c.eval_every = self.eval_every;
        c.eval_windows = self.eval_windows;
        c.layers = self.layers;
        c.heads = self.heads;
        c.d_model = self.d_model;
        c.block = self.block;
        c.moe_every = self.moe_every;
        if let Some(m) = self.min_lr {
            c.min_lr = m;
        }
        if has("--batch") {
            c.batch = image.batch;
        }
        if has("--lr") {
            c.lr = image.lr;
            c.min_lr = c.min_lr.min(c.lr);
        }
        if has("--optimizer") {
            c.optimizer = image.optimizer;
        }
        if has("--weight-decay") {
            c.weight_decay = image.weight_decay;
        }
        if has("--schedule") {
            c.schedule = image.schedule.clone();
        }
        if has("--warmup-steps") {
            c.warmup_steps = image.warmup_steps;
        }
        if has("--clip-grad-norm") {
            c.clip_grad_norm = image.clip_grad_norm;
        }
        if has("--expert-hidden") {
            c.expert_hidden = image.expert_hidden;
        }
        Ok(c.with_lm_intervals())
    }

    /// The settings as the image models read the flags.
    fn image_config(&self) -> moegrad::Result<TrainConfig> {
        let synthetic = matches!(self.data, DataArg::SyntheticB);
        Ok(TrainConfig {
            data: match self.data {
                DataArg::Mnist => DataKind::Mnist,
                DataArg::Multimnist => DataKind::Multimnist,
                DataArg::SyntheticB => DataKind::SyntheticB,
                DataArg::Shakespeare => DataKind::Shakespeare,
                DataArg::Text => DataKind::Text,
            },
            data_dir: self.data_dir.clone(),
            model: match self.model.unwrap_or(match self.data {
                DataArg::SyntheticB => ModelArg::MoeMlp,
                DataArg::Shakespeare | DataArg::Text => ModelArg::Gpt,
                _ => ModelArg::Cnn,
            }) {
                ModelArg::Mlp => ModelKind::Mlp,
                ModelArg::Cnn => ModelKind::Cnn,
                ModelArg::MoeMlp => ModelKind::MoeMlp,
                ModelArg::MoeCnn => ModelKind::MoeCnn,
                ModelArg::MmoeCnn => ModelKind::MmoeCnn,
                ModelArg::Gpt => ModelKind::Gpt,
                ModelArg::MoeGpt => ModelKind::MoeGpt,
            },
            epochs: self.epochs,
            batch: self.batch,
            lr: self.lr,
            optimizer: match self.optimizer {
                OptimizerArg::Sgd => OptimizerKind::Sgd,
                OptimizerArg::Adam => OptimizerKind::Adam,
                OptimizerArg::Adamw => OptimizerKind::Adamw,
            },
            weight_decay: self.weight_decay,
            schedule: self.schedule.clone(),
            schedule_epochs: self.schedule_epochs,
            warmup_steps: self.warmup_steps,
            clip_grad_norm: self.clip_grad_norm,
            seed: self.seed,
            device: self.device.clone(),
            out: self.out.clone(),
            train_limit: self.train_limit,
            test_limit: self.test_limit,
            log_every: self.log_every,
            router: self.router.clone(),
            experts: self.experts.unwrap_or(if synthetic { 16 } else { 8 }),
            k: self.k.unwrap_or(if synthetic { 4 } else { 2 }),
            expert_hidden: self.expert_hidden,
            capacity_factor: self.capacity_factor,
            eval_capacity_factor: self.eval_capacity_factor,
            balance_loss: self.balance_loss,
            z_loss: self.z_loss,
            router_options: moegrad::moe::parse_router_options(&self.router_opt)?,
            min_lr: self.min_lr.unwrap_or(0.0),
            ..TrainConfig::default()
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Workload {
    /// f32 matmul GFLOP/s and per-op overhead, per device
    Matmul,
    /// one MoE layer's training step (T = 4096, d = 256, hidden 512, k = 2) for n = 2..64, and the dense softmax router
    Moe,
    /// one training epoch (training time only: no data loading, no evaluation) of cnn (mnist), moe-mlp (mnist, topk, 8 experts, k = 2) and mmoe-cnn (multimnist, topk, 8 experts, k = 4)
    Train,
    /// what one steady-state training step of moe-mlp, cnn, gpt and moe-gpt asks of the GPU:
    /// dispatches, submissions, host waits, buffers created, bytes moved (any adapter,
    /// lavapipe included)
    GpuStep,
    /// every benchmark (matmul, moe, gpu-step, train) in one JSON report (docs/gpu.md)
    All,
}

/// The expert counts `bench moe` measures: top-k over the first list, the dense softmax router
/// over the second.
const MOE_BENCH_EXPERTS: (&[usize], &[usize]) = (&[2, 4, 8, 16, 32, 64], &[2, 8, 64]);

/// The MoE benchmark's workload for `--tokens`.
fn moe_workload(tokens: usize) -> Result<moegrad::bench::MoeWorkload> {
    if tokens == 0 {
        return Err(moegrad::Error::Invalid(
            "--tokens must be at least 1".into(),
        ));
    }
    Ok(moegrad::bench::MoeWorkload {
        tokens,
        d: 256,
        hidden: 512,
        k: 2,
    })
}

/// Checks `--sizes` of the matmul benchmark.
fn check_sizes(sizes: &[usize]) -> Result<()> {
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(moegrad::Error::Invalid(format!(
            "--sizes {sizes:?}: every size must be at least 1"
        )));
    }
    Ok(())
}

fn bench_devices(name: &str) -> Result<Vec<Device>> {
    Ok(match name {
        "cpu" => vec![Device::cpu()],
        "gpu" => vec![Device::gpu()?],
        "auto" => {
            let mut v = vec![Device::cpu()];
            // the GPU when `auto` would train on it (a software adapter is not timed)
            match Device::choose() {
                Ok((Device::Gpu, _)) => v.push(Device::Gpu),
                Ok((_, why)) => eprintln!("moegrad: GPU not measured: {why}"),
                Err(e) => eprintln!("moegrad: GPU not measured: {e}"),
            }
            v
        }
        other => {
            return Err(moegrad::Error::Invalid(format!(
                "--device {other:?}: expected auto, cpu or gpu"
            )));
        }
    })
}

/// The flags of a subcommand's matches that were set on the command line (not left at their
/// defaults), spelled as there: `--expert-hidden` for the field `expert_hidden`.
fn flags_given(matches: Option<&ArgMatches>) -> Vec<String> {
    let Some(m) = matches else {
        return Vec::new();
    };
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| format!("--{}", id.as_str().replace('_', "-")))
        .collect()
}

/// Prints a result (a run's summary, a report, a benchmark) as one JSON object on stdout
/// (`--json`).
fn print_json(summary: &impl serde::Serialize) -> Result<()> {
    let text =
        serde_json::to_string(summary).map_err(|e| moegrad::Error::Invalid(e.to_string()))?;
    println!("{text}");
    Ok(())
}

/// Ops shown by `--profile` (the JSON has them all).
const PROFILE_TOP: usize = 15;

/// Prints a run's profile, if it has one, after a blank line.
fn print_profile(
    rows: Option<&[moegrad::profile::ProfileRow]>,
    gpu: Option<&moegrad::profile::GpuProfile>,
) {
    if let Some(rows) = rows {
        println!();
        print!("{}", moegrad::profile::table(rows, gpu, PROFILE_TOP));
    }
}

/// A clap error as one line: its first line (what was wrong), plus the allowed values when it
/// lists them.
fn clap_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .to_string();
    let values = lines
        .find(|l| l.contains("possible values"))
        .map(|l| format!(" {}", l.trim()))
        .unwrap_or_default();
    format!("{first}{values}")
}

/// `moegrad compare` takes its own flags mixed with train flags. This puts compare's own
/// flags (and their values) first and every other word after `--`, where clap collects them
/// as the train flags; other subcommands' words are returned unchanged.
fn compare_words_first(words: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if words.get(1).and_then(|w| w.to_str()) != Some("compare") {
        return words;
    }
    let cmd = Cli::command();
    let Some(sub) = cmd.find_subcommand("compare") else {
        return words;
    };
    // compare's long flags, and whether each takes a value
    let own: Vec<(String, bool)> = sub
        .get_arguments()
        .filter_map(|a| {
            let takes = a.get_action().takes_values();
            a.get_long().map(|l| (l.to_string(), takes))
        })
        .chain([("help".to_string(), false)])
        .collect();
    let mut front: Vec<std::ffi::OsString> = words[..2].to_vec();
    let mut train: Vec<std::ffi::OsString> = Vec::new();
    let mut rest = words[2..].iter();
    while let Some(w) = rest.next() {
        let text = w.to_string_lossy();
        if text == "--" {
            train.extend(rest.by_ref().cloned());
            break;
        }
        if text == "-h" {
            front.push(w.clone());
            continue;
        }
        let name = text
            .strip_prefix("--")
            .map(|n| n.split_once('=').map_or(n, |(a, _)| a));
        match name.and_then(|n| own.iter().find(|(l, _)| l == n)) {
            Some((_, takes)) => {
                front.push(w.clone());
                if *takes
                    && !text.contains('=')
                    && let Some(v) = rest.next()
                {
                    front.push(v.clone());
                }
            }
            None => train.push(w.clone()),
        }
    }
    front.push("--".into());
    front.extend(train);
    front
}

/// Parses and validates one cell's train flags exactly as `moegrad train` would (the same clap
/// parser, defaults and `TrainConfig::validate`), and builds its router once on a tiny input so
/// that a bad `--router-opt` is found too; returns the run's settings.
fn check_train_words(words: &[String]) -> Result<TrainConfig> {
    let argv = ["moegrad", "train"]
        .into_iter()
        .map(String::from)
        .chain(words.iter().cloned());
    let matches = Cli::command()
        .try_get_matches_from(argv)
        .map_err(|e| moegrad::Error::Invalid(clap_error_line(&e)))?;
    let cli = Cli::from_arg_matches(&matches)
        .map_err(|e| moegrad::Error::Invalid(clap_error_line(&e)))?;
    let Command::Train(args) = cli.command else {
        return Err(moegrad::Error::Invalid("not a train command".into()));
    };
    let given = flags_given(matches.subcommand_matches("train"));
    let cfg = args.config(&given)?;
    cfg.validate()?;
    if cfg.model.is_moe() {
        let mut router = moegrad::moe::RouterConfig::new(4, cfg.experts, cfg.k);
        router.options = cfg.router_options.clone();
        moegrad::moe::build_router(&cfg.router, &router, Device::cpu())?;
    }
    Ok(cfg)
}

/// Runs `moegrad compare`: the grid from the file and/or the flags, every cell checked before
/// any runs, then the report as a markdown table (or JSON) on stdout.
fn run_compare(args: &CompareArgs) -> Result<()> {
    use moegrad::compare::grid::{Grid, split_list};
    let routers = args.routers.as_deref().map(split_list);
    let seeds = args.seeds.as_deref().map(split_list);
    let mut grid = Grid::from_flags(&args.train, routers.as_deref(), seeds.as_deref(), &args.set)?;
    grid.metric = args.metric.clone();
    grid.target = args.target.clone();
    if let Some(path) = &args.grid {
        grid = Grid::from_file(path)?.overridden_by(grid);
    }
    if args.dry_run {
        let plan = moegrad::compare::plan(&grid, &args.out, &check_train_words)?;
        for (c, prior) in plan.cells.iter().zip(&plan.priors) {
            let state = match prior {
                moegrad::compare::resume::Prior::New => "new",
                moegrad::compare::resume::Prior::Finished(_) => "finished",
                moegrad::compare::resume::Prior::Interrupted(_) => "interrupted",
            };
            println!(
                "{:<11} {}  train {}",
                state,
                args.out.join(&c.name).display(),
                c.argv.join(" ")
            );
        }
        let to_run = plan
            .priors
            .iter()
            .filter(|p| p.needs_run(args.retry_failed))
            .count();
        println!(
            "{} cells checked, {to_run} to run; metric {}{}",
            plan.cells.len(),
            plan.metric,
            plan.target
                .as_ref()
                .map(|t| format!(", target {}", t.describe()))
                .unwrap_or_default()
        );
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| {
        moegrad::Error::Io(format!("compare: cannot find the moegrad executable: {e}"))
    })?;
    let opts = moegrad::compare::CompareOptions {
        out: args.out.clone(),
        jobs: args.jobs,
        retry_failed: args.retry_failed,
        progress: true,
        plots: !args.no_plot,
        exe,
    };
    let report = moegrad::compare::run(&grid, &opts, &check_train_words)?;
    if args.json {
        print_json(&moegrad::compare::table::json(&report))?;
    } else {
        print!("{}", moegrad::compare::table::markdown(&report));
        println!(
            "{} cells: {} run now, {} reused, {} failed{}; {:.1} s; tables and figures in {}",
            report.cells.len(),
            report.ran,
            report.reused,
            report.failed(),
            if report.interrupted() > 0 {
                format!(
                    ", {} interrupted (they run again next time)",
                    report.interrupted()
                )
            } else {
                String::new()
            },
            report.wall_seconds,
            report.out.display()
        );
    }
    Ok(())
}

/// Streams text from a language-model checkpoint to stdout.
fn run_generate(args: &GenerateArgs) -> Result<()> {
    use std::io::Write;
    let device = Device::from_name(&args.device)?;
    let (model, vocab) = moegrad::lm::train::load_model(&args.checkpoint, device)?;
    // `--prompt` takes the escapes \n and \t, so a newline can be typed
    let prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t");
    let opts = moegrad::lm::SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    // refuse a bad prompt before anything is printed
    moegrad::data::text::encode(&vocab, &prompt)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = write!(out, "{prompt}");
    moegrad::lm::generate(&model, &vocab, &prompt, &opts, device, |c| {
        let _ = write!(out, "{c}");
        let _ = out.flush();
    })?;
    let _ = writeln!(out);
    Ok(())
}

/// Runs the estimator lab: checks the figure's path first, shows a progress bar on stderr
/// (hidden with `--json`, and by indicatif when stderr is not a terminal), prints the report,
/// and only then draws the figure, so a figure that cannot be written loses no results.
fn run_estimators(args: &EstimatorArgs) -> Result<()> {
    use moegrad::estimator_lab::{plot, run_lab_with_progress};
    let cfg = args.config()?;
    cfg.validate()?;
    if !args.no_plot {
        plot::check_writable(&args.plot)?;
    }
    let bar = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg:16} [{bar:30}] {pos}/{len} draws ({elapsed}, ETA {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    };
    let report = run_lab_with_progress(&cfg, &bar);
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        print_json(&report)?;
    } else {
        print_lab(&report);
    }
    if !args.no_plot {
        plot::draw_estimators(&args.plot, &report)?;
        if !args.json {
            println!("figure: {}", args.plot.display());
        }
    }
    Ok(())
}

fn run(cli: Cli, matches: &ArgMatches) -> Result<()> {
    match cli.command {
        Command::Info { json } => {
            let r = moegrad::info::device_report()?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&r)
                        .map_err(|e| moegrad::Error::Invalid(e.to_string()))?
                );
            } else {
                println!("device:      {}  ({})", r.device, r.reason);
                match (&r.gpu, &r.gpu_error) {
                    (Some(g), _) => {
                        println!(
                            "gpu adapter: {} ({}, {}, driver {})",
                            g.name, g.backend, g.device_type, g.driver
                        );
                        println!("gpu limits:");
                        for (k, v) in &g.limits {
                            println!("  {k:<40} {v}");
                        }
                        println!(
                            "gpu optional features: {}",
                            if g.features.is_empty() {
                                "none".into()
                            } else {
                                g.features.join(", ")
                            }
                        );
                        println!(
                            "gpu matmul kernel:     {} (subgroups of {}..{} invocations)",
                            g.matmul_kernel, g.subgroup_sizes[0], g.subgroup_sizes[1]
                        );
                    }
                    (None, Some(e)) => println!("gpu adapter: none ({e})"),
                    (None, None) => println!("gpu adapter: none"),
                }
                println!(
                    "cpu:         {} threads, matmul by {}",
                    r.cpu_threads, r.cpu_gemm
                );
            }
        }
        Command::Train(args) => {
            let given = flags_given(matches.subcommand_matches("train"));
            let cfg = args.config(&given)?;
            cfg.validate()?;
            let given: Vec<&str> = given.iter().map(String::as_str).collect();
            for w in cfg.warnings(&given) {
                eprintln!("moegrad: warning: {w}");
            }
            let opts = RunOptions {
                resume: args.resume,
                progress: true,
                overwrite: args.overwrite,
                allow_config_change: args.allow_config_change.clone(),
                profile: args.profile || moegrad::profile::requested_by_env(),
            };
            if cfg.model.is_lm() {
                let summary = moegrad::lm::train::run(&cfg, opts)?;
                if args.json {
                    print_json(&summary)?;
                } else {
                    println!(
                        "trained {} iterations on {} in {:.1} s ({:.1} ms/iter): validation loss {:.4} (perplexity {:.2}); outputs in {}",
                        summary.iters,
                        summary.device,
                        summary.seconds,
                        summary.ms_per_iter,
                        summary.val_loss,
                        summary.val_ppl,
                        cfg.out.display()
                    );
                    print_profile(summary.profile.as_deref(), summary.gpu_profile.as_ref());
                }
                return Ok(());
            }
            let summary = moegrad::train::run(&cfg, opts)?;
            if args.json {
                print_json(&summary)?;
            } else {
                println!(
                    "trained {} epochs on {} in {:.1} s: test loss {:.4}, test accuracy {}; outputs in {}",
                    summary.epochs,
                    summary.device,
                    summary.seconds,
                    summary.test_loss,
                    summary.test_accuracy,
                    cfg.out.display()
                );
                print_profile(summary.profile.as_deref(), summary.gpu_profile.as_ref());
            }
        }
        Command::Estimators(args) => run_estimators(&args)?,
        Command::Compare(args) => run_compare(&args)?,
        Command::Generate(args) => run_generate(&args)?,
        Command::Bench {
            workload: Workload::Moe,
            json,
            device,
            tokens,
            ..
        } => {
            let w = moe_workload(tokens)?;
            let r = moegrad::bench::bench_moe(
                &bench_devices(&device)?,
                MOE_BENCH_EXPERTS.0,
                MOE_BENCH_EXPERTS.1,
                w,
            )?;
            if json {
                print_json(&r)?;
            } else {
                println!("{}", r.workload);
                println!(
                    "{:<6} {:<8} {:>4} {:>4} {:>10} {:>8} {:>8} {:>8} {:>12} {:>12} {:>8} {:>14}",
                    "device",
                    "router",
                    "n",
                    "k",
                    "step ms",
                    "fwd ms",
                    "bwd ms",
                    "adam ms",
                    "tokens/s",
                    "peak MB",
                    "grad MB",
                    "activation MB"
                );
                for m in &r.moe {
                    println!(
                        "{:<6} {:<8} {:>4} {:>4} {:>10.1} {:>8.1} {:>8.1} {:>8.1} {:>12.0} {:>12.1} {:>8.1} {:>14.1}",
                        m.device,
                        m.router,
                        m.n,
                        m.k,
                        m.step_ms,
                        m.forward_ms,
                        m.backward_ms,
                        m.optimizer_ms,
                        m.tokens_per_s,
                        m.peak_bytes as f64 / 1e6,
                        m.gradient_bytes as f64 / 1e6,
                        m.activation_bytes as f64 / 1e6
                    );
                }
            }
        }
        Command::Bench {
            workload: Workload::Train,
            json,
            device,
            examples,
            batch,
            data_dir,
            ..
        } => {
            let r =
                moegrad::bench::bench_train(&bench_devices(&device)?, &data_dir, examples, batch)?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "{:<6} {:<9} {:>6} {:>9} {:>9} {:>10} {:>11}",
                    "device", "model", "batch", "examples", "seconds", "ms/step", "examples/s"
                );
                for t in &r.train {
                    let steps = t.examples.div_ceil(t.batch.max(1)).max(1);
                    println!(
                        "{:<6} {:<9} {:>6} {:>9} {:>9.2} {:>10.1} {:>11.0}",
                        t.device,
                        t.model,
                        t.batch,
                        t.examples,
                        t.seconds,
                        1e3 * t.seconds / steps as f64,
                        t.examples as f64 / t.seconds.max(1e-9)
                    );
                }
            }
        }
        Command::Bench {
            workload: Workload::Matmul,
            json,
            device,
            sizes,
            ..
        } => {
            check_sizes(&sizes)?;
            let r = moegrad::bench::bench_matmul(&bench_devices(&device)?, &sizes)?;
            if json {
                print_json(&r)?;
            } else {
                println!("{:<8} {:>6} {:>10}", "device", "size", "GFLOP/s");
                for m in &r.matmul {
                    println!("{:<8} {:>6} {:>10.1}", m.device, m.size, m.gflops);
                }
                for o in &r.op_overhead_us {
                    println!("{:<8} per-op overhead {:>8.2} µs", o.device, o.us);
                }
            }
        }
        Command::Bench {
            workload: Workload::GpuStep,
            json,
            device,
            ..
        } => {
            if device != "auto" && device != "gpu" {
                return Err(moegrad::Error::Invalid(format!(
                    "bench gpu-step counts GPU work: --device {device} does not apply (use gpu or leave it out)"
                )));
            }
            let r = moegrad::bench::gpu_step::bench_gpu_step(
                &moegrad::bench::gpu_step::GPU_STEP_MODELS,
            )?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "{:<8} {:>10} {:>8} {:>10} {:>15} {:>14} {:>16} {:>10}",
                    "model",
                    "dispatches",
                    "submits",
                    "host waits",
                    "buffers created",
                    "uploaded bytes",
                    "downloaded bytes",
                    "GPU ms"
                );
                for m in &r.gpu_step {
                    println!(
                        "{:<8} {:>10} {:>8} {:>10} {:>15} {:>14} {:>16} {:>10}",
                        m.model,
                        m.dispatches,
                        m.submits,
                        m.host_waits,
                        m.buffers_created,
                        m.uploaded_bytes,
                        m.downloaded_bytes,
                        m.gpu_ms.map_or("-".to_string(), |ms| format!("{ms:.2}"))
                    );
                }
            }
        }
        Command::Bench {
            workload: Workload::All,
            json,
            device,
            sizes,
            tokens,
            examples,
            batch,
            data_dir,
        } => {
            check_sizes(&sizes)?;
            let w = moe_workload(tokens)?;
            let r = moegrad::bench::bench_all(
                &bench_devices(&device)?,
                &sizes,
                MOE_BENCH_EXPERTS.0,
                MOE_BENCH_EXPERTS.1,
                w,
                (&data_dir, examples, batch),
            )?;
            if json {
                print_json(&r)?;
            } else {
                // one report, meant to be saved and sent: the text form is the same JSON,
                // indented
                let text = serde_json::to_string_pretty(&r)
                    .map_err(|e| moegrad::Error::Invalid(e.to_string()))?;
                println!("{text}");
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // parsed through `ArgMatches` so that `train` can tell flags given from defaults
    let parsed = Cli::command()
        .try_get_matches_from(compare_words_first(std::env::args_os().collect()))
        .and_then(|m| Cli::from_arg_matches(&m).map(|c| (c, m)));
    let (cli, matches) = match parsed {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => {
            eprintln!("moegrad: {}", clap_error_line(&e));
            return ExitCode::from(2);
        }
    };
    // MOEGRAD_PROFILE=1: a profile of any command, printed on stderr at the end (`train`
    // takes it over and reports it with its results)
    if moegrad::profile::requested_by_env() {
        moegrad::profile::enable();
    }
    let result = run(cli, &matches);
    if let Some(report) = moegrad::profile::disable() {
        eprint!("{}", report.table(PROFILE_TOP));
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moegrad: {e}");
            ExitCode::FAILURE
        }
    }
}
