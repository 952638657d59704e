//! `moegrad estimators`: the estimator lab's flags, its run and its report table
//! (docs/estimators.md).

use super::*;
use std::path::Path;

/// `moegrad estimators` options (each maps onto a field of `LabConfig`).
#[derive(clap::Args)]
pub(super) struct EstimatorArgs {
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
    /// Standard deviation of a per-expert output component shared by every token (the part of
    /// an expert's output a running mean can stand in for, as Default MoE's does).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    shared: f64,
    /// SparseMixer's jitter r in [0, 1): its mask keeps expert j iff θ* − θ_j ≤ r(|θ*| + |θ_j|).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    jitter: f64,
    /// Comma-separated estimators (default: for the sampled problem all but switch-jitter; for
    /// the dense problem softmax, topk-unnorm, topk, default-moe, sparsemixer-v2, remoe).
    #[arg(long, value_delimiter = ',')]
    estimators: Vec<String>,
    /// The objective: sampled (SparseMixer's top-1 layer, y = π_D f_D, D ~ π), dense (the MoE
    /// that runs every expert, y = Σ π_i f_i, against which routers running --k experts are
    /// measured) or top2 (two experts sampled without replacement: sparsemixer-v2 at top 2).
    #[arg(long, default_value = "sampled", value_parser = ["sampled", "dense", "top2"])]
    problem: String,
    /// The dense problem: experts per token of the sparse routers.
    #[arg(long, default_value_t = 2)]
    k: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Where to write the figure (bias against spread, per estimator), an SVG file: its name
    /// must end in .svg.
    #[arg(long, default_value = DEFAULT_PLOT)]
    plot: PathBuf,
    /// Do not write the figure.
    #[arg(long)]
    no_plot: bool,
}

impl EstimatorArgs {
    fn config(&self) -> moegrad::Result<moegrad::estimator_lab::LabConfig> {
        use moegrad::estimator_lab::{LabConfig, Objective, ProblemConfig};
        let objective = Objective::parse(&self.problem)?;
        Ok(LabConfig {
            problem: ProblemConfig {
                tokens: self.tokens,
                experts: self.experts,
                dim: self.dim,
                loss: self.loss.parse()?,
                scale: self.scale,
                offset: self.logit_offset,
                eps: self.eps,
                shared: self.shared,
                seed: self.seed,
            },
            samples: self.samples,
            jitter: self.jitter,
            estimators: if self.estimators.is_empty() {
                objective.default_estimators()
            } else {
                self.estimators
                    .iter()
                    .map(|s| s.trim().to_string())
                    .collect()
            },
            objective,
            k: self.k,
        })
    }
}

/// A figure with four decimals, or `-` where it is not defined (NaN).
fn dash(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.4}")
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
    if c.objective == moegrad::estimator_lab::Objective::Dense {
        println!(
            "dense problem (y = Σ π_i f_i, every expert): L = {:.6}, |∇| = {:.4e}; the sparse routers run k = {} of {} experts per token (remoe: its own ReLU loss's gradient)",
            r.exact_loss, r.exact_norm, c.k, p.experts
        );
    } else if c.objective == moegrad::estimator_lab::Objective::Top2 {
        println!(
            "top-2 sampled problem (two experts drawn without replacement, enumerated over the n(n-1) pairs; gradient by central differences): L = {:.6}, |∇| = {:.4e}; SparseMixer's mask (jitter {}) keeps {:.2} of {} experts per token",
            r.exact_loss, r.exact_norm, c.jitter, r.mask_kept_per_token, p.experts
        );
    } else {
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
    }
    println!(
        "{:<16} {:>7} {:>9} {:>9} {:>10} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8}",
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
            "{:<16} {:>7} {:>9.4} {:>9.4} {:>10.4e} {:>8.4} {:>9.4} {:>9} {:>9} {:>8.2} {:>8.3}",
            e.name,
            e.target.label(),
            e.bias,
            e.bias_se,
            e.variance,
            e.cosine,
            e.mean_cosine,
            dash(e.bias_nabla0),
            dash(e.bias_nabla1),
            e.experts_per_token,
            e.ms_per_draw
        );
    }
    println!(
        "bias, ±s.e. (= √(variance/M)), variance (trace of one draw's covariance), vs ∇₀/∇₁ are relative to |∇| (squared for variance); cosine is of the mean estimate, cos/draw the mean per-draw cosine"
    );
}

/// Where the figure goes without `--plot`: beside the training runs, not in the working
/// directory.
const DEFAULT_PLOT: &str = "runs/estimators.svg";

/// Runs the estimator lab: checks the figure's path first, shows a progress bar on stderr
/// (hidden with `--json`, and by indicatif when stderr is not a terminal), prints the report,
/// and only then draws the figure, so a figure that cannot be written loses no results.
pub(super) fn run_estimators(args: &EstimatorArgs) -> Result<()> {
    use moegrad::estimator_lab::run_lab_with_progress;
    use moegrad_cli::plot::estimators as plot;
    let cfg = args.config()?;
    cfg.validate()?;
    if !args.no_plot {
        // the default's directory is made; a --plot's must exist
        if let Some(dir) = args
            .plot
            .parent()
            .filter(|_| args.plot == Path::new(DEFAULT_PLOT))
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| moegrad::Error::Io(format!("{}: {e}", dir.display())))?;
        }
        plot::check_writable(&args.plot)?;
        if !args
            .plot
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
        {
            return Err(moegrad::Error::Invalid(format!(
                "--plot {}: the figure is drawn as SVG; give a name ending in .svg (or --no-plot)",
                args.plot.display()
            )));
        }
    }
    let mut bar = moegrad_cli::progress::LabBar::new(args.json);
    let report = run_lab_with_progress(&cfg, &mut bar);
    bar.0.finish_and_clear();
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
