//! `moegrad train`: its flags ([`TrainArgs`], each mapping onto a field of `TrainConfig`), how
//! they become a `TrainConfig`, and the run with its one-line summary.

use super::*;

/// `moegrad train` options (each maps onto a field of `TrainConfig`).
#[derive(clap::Args)]
pub(super) struct TrainArgs {
    /// Dataset: mnist, multimnist (two overlaid digits, two tasks), synthetic-b (DSelect-k's
    /// generator B: 4 true experts hidden among 16 frozen ones; reports which ones the gate
    /// selects), shakespeare (ten plays, bundled, for --model gpt|moe-gpt) or text
    /// (--data-file, any UTF-8 text, plain or .gz).
    #[arg(long, value_enum, default_value = "mnist")]
    data: DataArg,
    /// The text file of --data text.
    #[arg(long)]
    data_file: Option<PathBuf>,
    /// Directory with the MNIST IDX files (the full MNIST files, say, under their standard names)
    /// and shakespeare-10-plays.txt.gz. The default, `<bundled>`, is the copy of data/ built into
    /// moegrad (10,000 MNIST digits, ten plays), so no files are needed.
    #[arg(long, default_value = moegrad::data::bundled::BUNDLED_DIR)]
    data_dir: PathBuf,
    /// Model: mlp, cnn, moe-mlp, moe-cnn or mmoe-cnn (multi-gate, MultiMNIST); gpt or moe-gpt
    /// (a character-level GPT, every --moe-every-th feed-forward an MoE layer) for text
    /// [default: cnn; moe-mlp for synthetic-b; gpt for text]. The language models take nanoGPT's
    /// "baby" Shakespeare defaults for every setting not given: --batch 12, --lr 1e-3,
    /// --optimizer adamw, --weight-decay 0.1 (matrices only), --schedule cosine to --min-lr
    /// 1e-4, --warmup-steps 100, --clip-grad-norm 1, --expert-hidden 256. The Llama-style
    /// families llama, mixtral, qwen2-moe, olmoe and deepseek-moe (transformers' architectures:
    /// RMSNorm, rotary positions, grouped-query or latent attention, SwiGLU) take the same, and
    /// their family's MoE settings (router, experts, k, expert width, balance loss, shared
    /// experts; docs/families.md) for the MoE flags not given.
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
    /// Arithmetic: f32, or f16-mixed (GPU only, on adapters with shader-f16, which `moegrad
    /// info` lists): activations and the big products in f16 with f32 sums, parameters,
    /// optimizer, router and losses in f32, and a dynamic loss scale on the device.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16-mixed"])]
    precision: String,
    /// Seed of initialisation, shuffling and MultiMNIST composition.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// auto (GPU when there is one), cpu or gpu.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Output directory for metrics.jsonl, checkpoint.safetensors and curves.svg. It is locked
    /// while the run writes it; one that holds an earlier run's files needs --resume or
    /// --overwrite. Without it, each run gets a new directory runs/<model>-<date>-<time> (UTC),
    /// printed at the start, and runs/latest points to it; --resume without --out continues
    /// runs/latest.
    #[arg(long)]
    out: Option<PathBuf>,
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
    /// MoE: how the experts' load is balanced: aux (the Switch loss, weight --balance-loss),
    /// aux-free (DeepSeek-V3's selection-only bias, moved by ±--balance-rate after each batch),
    /// quantile (Quantile Balancing: the bias solved from each batch), none. docs/routers.md,
    /// "Balancing".
    #[arg(long, default_value = "aux", value_parser = moegrad::moe::BalanceMethod::NAMES)]
    balance: String,
    /// MoE: the tokens the aux loss counts over: batch, sequence (each sequence of a language
    /// model on its own, averaged) or global (counts over --balance-window batches).
    #[arg(long, default_value = "batch", value_parser = ["batch", "sequence", "global"])]
    balance_scope: String,
    /// MoE: training batches per window of --balance-scope global.
    #[arg(long, default_value_t = 8)]
    balance_window: usize,
    /// MoE: the aux-free bias's update rate u (DeepSeek-V3's 0.001; in the units of the scores
    /// the router selects by).
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    balance_rate: f64,
    /// MoE: null experts (AdaMoE, MoE++): N extra experts the router may pick that output zero
    /// at no cost, so tokens use between 0 and k real experts (reported as
    /// real_experts_per_token); token-choice routers only.
    #[arg(long, default_value_t = 0)]
    null_experts: usize,
    /// MoE: router z-loss coefficient.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    z_loss: f64,
    /// MoE: warn (on stderr, each epoch or evaluation interval) that routing has collapsed when
    /// a layer's dead experts, which received no token over the interval, reach this fraction
    /// of its experts; above 1 never warns.
    #[arg(long, default_value_t = 0.5)]
    collapse_dead: f64,
    /// MoE: warn that routing has collapsed when one expert serves more than this fraction of
    /// a layer's tokens over the interval (balanced: k/n); 1 or more never warns.
    #[arg(long, default_value_t = 0.9)]
    collapse_share: f64,
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
    /// Language models: context length in tokens.
    #[arg(long, default_value_t = 64)]
    block: usize,
    /// Language models: how text becomes tokens. `char`: one token per character (the sorted
    /// distinct characters of the text); `bpe:N`: a byte-level BPE of at most N tokens
    /// (257 to 65536), trained with Hugging Face's tokenizers on the training split (the first
    /// 90% of the characters) at the start of the run; or the path of a Hugging Face
    /// tokenizer.json. The checkpoint holds the tokenizer, and the validation loss is also
    /// reported in bits per character, which compares across tokenizers.
    #[arg(long, default_value = "char", value_name = "char|bpe:N|PATH.json")]
    tokenizer: String,
    /// moe-gpt: an MoE feed-forward in every N-th block (1: every block; 2 alternates dense
    /// and MoE as Switch and GShard do).
    #[arg(long, default_value_t = 1)]
    moe_every: usize,
    /// Llama-style models: key/value heads, dividing --heads (grouped-query attention)
    /// [default: --heads].
    #[arg(long, default_value_t = 0)]
    kv_heads: usize,
    /// MoE layers of the Llama-style models: shared experts every token uses besides its routed
    /// ones [default: the family's: 1 for qwen2-moe and deepseek-moe, else 0].
    #[arg(long)]
    shared_experts: Option<usize>,
    /// Hidden width of each shared expert [default: the family's].
    #[arg(long)]
    shared_hidden: Option<usize>,
    /// Scale the shared experts by a sigmoid gate, true or false [default: the family's: true
    /// for qwen2-moe].
    #[arg(long)]
    shared_gate: Option<bool>,
    /// Language models: start from this checkpoint's parameters (a training run's or a
    /// `moegrad import`'s checkpoint.safetensors) instead of a random draw, with its tokenizer
    /// and shape. With the checkpoint's --model (the default) the model trains on; from a dense
    /// llama, --model mixtral or qwen2-moe upcycles it: each expert a copy (or a slice, when
    /// --expert-hidden divides the dense width) of its layer's FFN, the router drawn fresh
    /// (docs/families.md).
    #[arg(long, value_name = "CHECKPOINT")]
    init_from: Option<PathBuf>,
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
    Llama,
    Mixtral,
    Qwen2Moe,
    Olmoe,
    DeepseekMoe,
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
    pub(super) fn config(&self, given: &[String]) -> moegrad::Result<TrainConfig> {
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
        c.precision = image.precision;
        c.out = image.out.clone();
        c.log_every = image.log_every;
        // the Llama-style families keep their preset's MoE settings unless a flag says otherwise
        let family = image.model.family().is_some();
        if !family || has("--router") {
            c.router = image.router.clone();
        }
        // a router's options belong to it: another router starts from none
        if !family || has("--router") || has("--router-opt") {
            c.router_options = image.router_options.clone();
        }
        if !family || has("--experts") {
            c.experts = image.experts;
        }
        if !family || has("--k") {
            c.k = image.k;
        }
        if !family || has("--balance-loss") {
            c.balance_loss = image.balance_loss;
        }
        if !family
            || [
                "--balance",
                "--balance-scope",
                "--balance-window",
                "--balance-rate",
            ]
            .iter()
            .any(|f| has(f))
        {
            c.balancing = image.balancing;
        }
        c.kv_heads = self.kv_heads;
        c.null_experts = image.null_experts;
        if let Some(n) = self.shared_experts {
            c.shared_experts = n;
        }
        if let Some(h) = self.shared_hidden {
            c.shared_hidden = h;
        }
        if let Some(g) = self.shared_gate {
            c.shared_gate = g;
        }
        c.capacity_factor = image.capacity_factor;
        c.eval_capacity_factor = image.eval_capacity_factor;
        c.z_loss = image.z_loss;
        c.collapse_dead = image.collapse_dead;
        c.collapse_share = image.collapse_share;
        c.schedule_epochs = image.schedule_epochs;
        c.iters = self.iters;
        c.eval_every = self.eval_every;
        c.eval_windows = self.eval_windows;
        c.layers = self.layers;
        c.heads = self.heads;
        c.d_model = self.d_model;
        c.block = self.block;
        c.moe_every = self.moe_every;
        c.tokenizer = image.tokenizer.clone();
        c.init_from = self.init_from.clone();
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
                ModelArg::Llama => ModelKind::Llama,
                ModelArg::Mixtral => ModelKind::Mixtral,
                ModelArg::Qwen2Moe => ModelKind::Qwen2Moe,
                ModelArg::Olmoe => ModelKind::Olmoe,
                ModelArg::DeepseekMoe => ModelKind::DeepseekMoe,
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
            precision: moegrad::train::Precision::from_name(&self.precision)?,
            seed: self.seed,
            device: self.device.clone(),
            out: self
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from(RUNS_DIR).join("latest")),
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
            balancing: moegrad::moe::Balancing {
                method: moegrad::moe::BalanceMethod::parse(&self.balance)?,
                scope: moegrad::moe::BalanceScope::parse(&self.balance_scope)?,
                window: self.balance_window,
                rate: self.balance_rate,
            },
            z_loss: self.z_loss,
            null_experts: self.null_experts,
            collapse_dead: self.collapse_dead,
            collapse_share: self.collapse_share,
            router_options: moegrad::moe::parse_router_options(&self.router_opt)?,
            min_lr: self.min_lr.unwrap_or(0.0),
            tokenizer: self.tokenizer.clone(),
            ..TrainConfig::default()
        })
    }
}

/// Where runs given no `--out` go.
const RUNS_DIR: &str = "runs";

/// The output directory of a run given no `--out`: `runs/latest` (resolved to the directory it
/// points to) for `--resume`, else a new `runs/<model>-<date>-<time>`.
fn default_out(cfg: &TrainConfig, resume: bool) -> PathBuf {
    let root = PathBuf::from(RUNS_DIR);
    let latest = root.join("latest");
    if resume {
        return match std::fs::read_link(&latest) {
            Ok(target) => root.join(target),
            Err(_) => latest,
        };
    }
    moegrad::train::out_dir::default_run_dir(&root, cfg.model.name())
}

/// Runs `moegrad train`: validates the settings, prints their warnings, trains (an image model
/// by epochs or a language model by iterations) and prints the summary.
/// Ctrl-C during `train`: the first finishes the epoch or evaluation interval and writes its
/// checkpoint, the second stops at the next step, the third ends the process at once (see
/// `moegrad::train::interrupt`).
fn stop_on_ctrl_c() {
    let installed = ctrlc::set_handler(|| match moegrad::train::interrupt::request_stop() {
        1 => eprintln!(
            "\nmoegrad: Ctrl-C: finishing this epoch (evaluation interval for a language model) and writing its checkpoint; press Ctrl-C again to stop at the next step without one"
        ),
        2 => eprintln!("\nmoegrad: Ctrl-C: stopping at the next step"),
        _ => std::process::exit(130),
    });
    if let Err(e) = installed {
        eprintln!("moegrad: note: Ctrl-C will end the run at once ({e})");
    }
}

pub(super) fn run_train(args: TrainArgs, matches: &ArgMatches) -> Result<()> {
    let given = flags_given(matches.subcommand_matches("train"));
    let mut cfg = args.config(&given)?;
    let given: Vec<&str> = given.iter().map(String::as_str).collect();
    if cfg.model.is_lm() {
        moegrad::lm::inherit_settings(&mut cfg, &given)?;
    } else if args.init_from.is_some() {
        cfg.init_from = args.init_from.clone();
    }
    cfg.validate()?;
    for w in cfg.warnings(&given) {
        eprintln!("moegrad: warning: {w}");
    }
    // without --out, a new directory per run, and runs/latest pointed at it once it is claimed
    let latest_link = (args.out.is_none() && !args.resume).then(|| PathBuf::from(RUNS_DIR));
    if args.out.is_none() {
        cfg.out = default_out(&cfg, args.resume);
    }
    stop_on_ctrl_c();
    let opts = RunOptions {
        resume: args.resume,
        overwrite: args.overwrite,
        allow_config_change: args.allow_config_change.clone(),
        profile: args.profile || moegrad::profile::requested_by_env(),
        latest_link,
    };
    if cfg.model.is_lm() {
        let mut observer = moegrad_cli::progress::CliObserver::new();
        let summary = moegrad::lm::run_observed(&cfg, opts, &mut observer)?;
        if args.json {
            print_json(&summary)?;
        } else {
            println!(
                "trained {} iterations on {} in {:.1} s ({:.1} ms/iter): validation loss {:.4} per token (perplexity {:.2}), {:.4} bits per character; outputs in {}",
                summary.iters,
                summary.device,
                summary.seconds,
                summary.ms_per_iter,
                summary.val_loss,
                summary.val_ppl,
                summary.val_bpc,
                cfg.out.display()
            );
            print_profile(summary.profile.as_deref(), summary.gpu_profile.as_ref());
        }
        return Ok(());
    }
    let mut observer = moegrad_cli::progress::CliObserver::new();
    let summary = moegrad::train::run_observed(&cfg, opts, &mut observer)?;
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
    Ok(())
}
