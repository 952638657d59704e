//! The estimator lab (`moegrad estimators`): how well does each router-gradient estimator
//! approximate the exact gradient of a small MoE problem?
//!
//! The pieces, in the order a run uses them:
//! 1. [`Problem`] (`problem.rs`): a seeded problem, SparseMixer's simplified layer
//!    `y_t = π_{t,D} f_{t,D}`, `D ∼ π_t = softmax(θ_t)`, with fixed expert outputs and a
//!    per-token loss from [`Loss`] (`loss.rs`).
//! 2. [`exact_gradient`] (`exact.rs`): the exact gradient of
//!    `L(θ) = Σ_t Σ_D π_{t,D} g(π_{t,D} f_{t,D})` by enumerating every expert choice, with its
//!    parts ∇₀ and ∇₁ (SparseMixer Eq. 2; Liu et al., "Sparse Backpropagation for MoE
//!    Training", 2023).
//! 3. [`LabEstimator`] (`estimators.rs`): each estimator's draws, made by
//!    [`GradientProbe`] (f64 on the CPU, fixed seed).
//! 4. [`run_lab`]: M draws per estimator, reduced to the statistics of [`EstimatorStats`]
//!    ([`run_lab_with_progress`] reports each draw to a [`LabProgress`]); the command line
//!    (`moegrad-cli`) draws them.
//!
//! # The statistics
//! With `ĝ_m` the m-th draw (`[T·n]`), `ḡ = (1/M) Σ_m ĝ_m` their mean and `∇` the exact gradient,
//! every figure is relative to `‖∇‖`:
//!
//! * `bias = ‖ḡ − ∇‖ / ‖∇‖`;
//! * `variance = (1/(M−1)) Σ_m ‖ĝ_m − ḡ‖² / ‖∇‖²`: the trace of the covariance of **one** draw
//!   (not of the mean), normalised;
//! * `bias_se = √(variance / M)`: the size of the Monte Carlo noise in `ḡ`, also relative to
//!   `‖∇‖`. A bias within about 2·`bias_se` cannot be told from noise (the measured bias of an
//!   unbiased estimator is about `bias_se`, not 0);
//! * `cosine = cos(ḡ, ∇)`, the direction of the mean estimate; `mean_cosine = (1/M) Σ_m cos(ĝ_m, ∇)`,
//!   the direction of a single draw (what one training step sees);
//! * `bias_nabla0`, `bias_nabla1`: `‖ḡ − ∇₀‖/‖∇‖` and `‖ḡ − ∇₁‖/‖∇‖`, to tell which part an
//!   estimator follows;
//! * `experts_per_token`: the experts the probe's routing evaluated per token, the cost.

mod estimators;
mod exact;
mod loss;
mod probe;
mod problem;

pub use estimators::{
    DENSE_ESTIMATOR_NAMES, ESTIMATOR_NAMES, EXTRA_ESTIMATOR_NAMES, LabEstimator, Objective,
    TOP2_ESTIMATOR_NAMES, Target,
};
pub use exact::{
    ExactGradient, dense_gradient, exact_gradient, expected_loss, relu_gradient,
    top2_expected_loss, top2_gradient,
};
pub use loss::{LOSS_NAMES, Loss, LossKind};
pub use probe::{GradientEstimate, GradientProbe, estimate_router_gradient};
pub use problem::{Problem, ProblemConfig};

use crate::moe::routers::{MaskRule, sparsemixer_mask};
use crate::{Error, Result, Tensor};
use std::time::Instant;

/// The largest `|--logit-offset|` per unit of `--scale`: beyond it, f64 logits keep fewer than
/// about six significant digits of their spread (see `LabConfig::validate`).
pub const MAX_OFFSET_PER_SCALE: f64 = 1e9;

/// Everything a lab run needs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LabConfig {
    /// the problem
    pub problem: ProblemConfig,
    /// draws per estimator M ≥ 2 (default 4000)
    pub samples: usize,
    /// SparseMixer's jitter r in [0, 1) (default 0.1, the router default): its mask keeps expert
    /// j iff `θ* − θ_j ≤ r(|θ*| + |θ_j|)`; also the jitter of `switch-jitter`
    pub jitter: f64,
    /// the estimators to run, in order (default [`ESTIMATOR_NAMES`]; for the dense problem
    /// [`DENSE_ESTIMATOR_NAMES`])
    pub estimators: Vec<String>,
    /// the objective: SparseMixer's sampled top-1 layer (default), the dense mixture or the
    /// sampled top-2 layer (`--problem`; see `estimators.rs`)
    pub objective: Objective,
    /// the dense problem: experts per token k of the sparse routers (default 2)
    pub k: usize,
}

impl Default for LabConfig {
    fn default() -> LabConfig {
        LabConfig {
            problem: ProblemConfig::default(),
            samples: 4000,
            jitter: 0.1,
            estimators: ESTIMATOR_NAMES.iter().map(|s| s.to_string()).collect(),
            objective: Objective::Sampled,
            k: 2,
        }
    }
}

impl LabConfig {
    /// Checks every setting; the error names the one at fault (as the command line spells it).
    pub fn validate(&self) -> Result<()> {
        let p = &self.problem;
        let bad = |msg: String| Err(Error::Invalid(msg));
        if p.experts < 2 {
            return bad(format!("--experts {}: need at least 2 experts", p.experts));
        }
        if p.tokens == 0 {
            return bad("--tokens 0: need at least 1 token".into());
        }
        if p.dim == 0 {
            return bad("--dim 0: the output width must be at least 1".into());
        }
        if p.tokens.saturating_mul(p.experts).saturating_mul(p.dim) > 1 << 22 {
            return bad(format!(
                "--tokens {} × --experts {} × --dim {}: too large for the lab (at most 4,194,304 expert outputs)",
                p.tokens, p.experts, p.dim
            ));
        }
        if self.samples < 2 {
            return bad(format!(
                "--samples {}: need at least 2 draws (the variance needs two)",
                self.samples
            ));
        }
        if !(p.scale.is_finite() && p.scale >= 0.0) {
            return bad(format!("--scale {}: must be finite and ≥ 0", p.scale));
        }
        if !p.offset.is_finite() {
            return bad(format!("--logit-offset {}: must be finite", p.offset));
        }
        // π is shift-invariant only in exact arithmetic: an f64 logit `offset + scale·z` keeps
        // about 16 significant digits, so the spread scale·z must not fall below ~1e-6 of the
        // offset or the softmax sees rounded logits (at 1e17 and scale 1 it sees none of z)
        if p.offset.abs() > MAX_OFFSET_PER_SCALE * p.scale.max(f64::MIN_POSITIVE) && p.offset != 0.0
        {
            return bad(format!(
                "--logit-offset {}: too large for --scale {}: f64 logits would lose the spread that sets π (|offset| must be at most {MAX_OFFSET_PER_SCALE:e} × scale)",
                p.offset, p.scale
            ));
        }
        if !(p.eps.is_finite() && p.eps > 0.0) {
            return bad(format!("--eps {}: must be finite and > 0", p.eps));
        }
        if !(p.shared.is_finite() && p.shared >= 0.0) {
            return bad(format!("--shared {}: must be finite and ≥ 0", p.shared));
        }
        if !(0.0..1.0).contains(&self.jitter) {
            return bad(format!("--jitter {}: must be in [0, 1)", self.jitter));
        }
        if self.estimators.is_empty() {
            return bad("--estimators: name at least one estimator".into());
        }
        let known = self.objective.estimators();
        for e in &self.estimators {
            if !known.contains(&e.as_str()) {
                return bad(format!(
                    "--estimators: unknown estimator {e:?} for --problem {}; expected one of {}",
                    self.objective.name(),
                    known.join(", ")
                ));
            }
        }
        if self.objective == Objective::Dense && !(1..=p.experts).contains(&self.k) {
            return bad(format!(
                "--k {}: the dense problem's routers run between 1 and --experts {} experts per token",
                self.k, p.experts
            ));
        }
        Ok(())
    }
}

/// One estimator's statistics (see the module docs for the definitions).
#[derive(Clone, Debug, serde::Serialize)]
pub struct EstimatorStats {
    /// the estimator's name
    pub name: String,
    /// what its expectation approximates by design
    pub target: Target,
    /// `‖ḡ − ∇‖ / ‖∇‖`
    pub bias: f64,
    /// Monte Carlo noise of the mean, `√(variance / M)`, relative to `‖∇‖`
    pub bias_se: f64,
    /// trace of one draw's covariance over `‖∇‖²`
    pub variance: f64,
    /// `cos(ḡ, ∇)`
    pub cosine: f64,
    /// mean over draws of `cos(ĝ_m, ∇)`
    pub mean_cosine: f64,
    /// `‖ḡ − ∇₀‖ / ‖∇‖` (NaN, `null` in JSON, on the dense problem)
    pub bias_nabla0: f64,
    /// `‖ḡ − ∇₁‖ / ‖∇‖` (NaN, `null` in JSON, on the dense problem)
    pub bias_nabla1: f64,
    /// experts evaluated per token (1 for sparse estimators, n for dense ones)
    pub experts_per_token: f64,
    /// wall-clock milliseconds per draw (routing, loss and backward of all T tokens)
    pub ms_per_draw: f64,
    /// the mean estimate ḡ, `[T·n]` (not serialised)
    #[serde(skip)]
    pub mean: Vec<f64>,
}

/// What a lab run measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LabReport {
    /// the settings
    pub config: LabConfig,
    /// `L(θ)`, the enumerated expected loss
    pub exact_loss: f64,
    /// `‖∇‖`, the norm every figure is relative to
    pub exact_norm: f64,
    /// `‖∇₀‖`
    pub nabla0_norm: f64,
    /// `‖∇₁‖`
    pub nabla1_norm: f64,
    /// experts per token SparseMixer's mask keeps at this jitter (n = no mask at all)
    pub mask_kept_per_token: f64,
    /// one entry per estimator, in the order asked for
    pub estimators: Vec<EstimatorStats>,
    /// the exact gradient and its parts (not serialised)
    #[serde(skip)]
    pub exact: ExactGradient,
}

/// Runs the lab: draws the problem, enumerates the exact gradient, and measures every
/// estimator of `cfg` with M draws each.
///
/// # Errors
/// Invalid settings (see [`LabConfig::validate`]), an exact gradient of zero (nothing to compare
/// with), or an error of a router.
pub fn run_lab(cfg: &LabConfig) -> Result<LabReport> {
    run_lab_with_progress(cfg, &mut NoProgress)
}

/// What the lab reports while it runs: how many draws it will take in all, which estimator it
/// measures, and each draw as it is taken (`moegrad estimators` draws a progress bar from them).
pub trait LabProgress {
    /// The lab starts: `draws` in all (estimators × draws per estimator).
    fn start(&mut self, draws: u64) {
        let _ = draws;
    }
    /// The lab starts measuring the estimator `name`.
    fn estimator(&mut self, name: &str) {
        let _ = name;
    }
    /// One draw is taken.
    fn draw(&mut self) {}
}

/// A [`LabProgress`] that reports nothing ([`run_lab`]'s).
pub struct NoProgress;

impl LabProgress for NoProgress {}

/// [`run_lab`], telling `progress` the number of draws (estimators × draws), each estimator as
/// it starts and each draw (`moegrad estimators` passes a bar drawn on stderr, whose elapsed
/// time and ETA say how long a run of hours has left).
///
/// # Errors
/// As [`run_lab`].
pub fn run_lab_with_progress(cfg: &LabConfig, progress: &mut dyn LabProgress) -> Result<LabReport> {
    cfg.validate()?;
    progress.start((cfg.estimators.len() as u64).saturating_mul(cfg.samples as u64));
    let problem = Problem::new(&cfg.problem);
    let exact = match cfg.objective {
        Objective::Sampled => exact_gradient(&problem),
        Objective::Dense => dense_gradient(&problem),
        Objective::Top2 => top2_gradient(&problem),
    };
    // `remoe`'s reference on the dense problem: its own loss's gradient
    let own = (cfg.objective == Objective::Dense).then(|| relu_gradient(&problem));
    let exact_norm = norm(&exact.total);
    if !(exact_norm > 0.0 && exact_norm.is_finite()) {
        return Err(Error::Invalid(format!(
            "the exact gradient has norm {exact_norm}: nothing to compare the estimators with (try another --seed or a larger --eps)"
        )));
    }
    let logits = problem.logits_tensor()?;
    let outputs = problem.outputs_tensor()?;
    // per token: the score-function router takes each token's loss as its reward
    let loss = |y: &Tensor| problem.loss.per_token(y);
    let mut estimators = Vec::with_capacity(cfg.estimators.len());
    for name in &cfg.estimators {
        progress.estimator(name);
        let est = match cfg.objective {
            Objective::Sampled => LabEstimator::new(
                name,
                cfg.problem.experts,
                &problem.logits,
                cfg.jitter,
                cfg.problem.seed,
            )?,
            Objective::Dense => LabEstimator::dense(
                name,
                cfg.problem.experts,
                cfg.problem.dim,
                cfg.k,
                cfg.jitter,
                cfg.problem.seed,
            )?,
            Objective::Top2 => {
                LabEstimator::top2(name, cfg.problem.experts, cfg.jitter, cfg.problem.seed)?
            }
        };
        let reference = match (&own, est.target()) {
            (Some(own), Target::Own) => own,
            _ => &exact,
        };
        estimators.push(measure(
            &est,
            cfg.samples,
            reference,
            &logits,
            &outputs,
            &loss,
            &mut *progress,
        )?);
    }
    let keep = crate::no_grad(|| sparsemixer_mask(&logits, cfg.jitter, MaskRule::Paper))?;
    let mask_kept_per_token = keep.to_vec_f64()?.iter().sum::<f64>() / cfg.problem.tokens as f64;
    Ok(LabReport {
        config: cfg.clone(),
        exact_loss: exact.loss,
        exact_norm,
        nabla0_norm: norm(&exact.nabla0),
        nabla1_norm: norm(&exact.nabla1),
        mask_kept_per_token,
        estimators,
        exact,
    })
}

/// M draws of one estimator, reduced (Welford's running mean and sum of squared deviations).
fn measure(
    est: &LabEstimator,
    samples: usize,
    exact: &ExactGradient,
    logits: &Tensor,
    outputs: &Tensor,
    loss: &dyn Fn(&Tensor) -> Result<Tensor>,
    progress: &mut dyn LabProgress,
) -> Result<EstimatorStats> {
    let p = exact.total.len();
    let exact_norm = norm(&exact.total);
    let mut mean = vec![0.0; p];
    let mut sq_dev = 0.0;
    let mut cos_sum = 0.0;
    let mut experts = 0.0;
    let start = Instant::now();
    for m in 0..samples {
        let (g, e) = est.draw(logits, outputs, loss)?;
        experts += e;
        cos_sum += cosine(&g, &exact.total);
        let k = (m + 1) as f64;
        for (mu, x) in mean.iter_mut().zip(&g) {
            let delta = x - *mu;
            *mu += delta / k;
            sq_dev += delta * (x - *mu);
        }
        progress.draw();
    }
    let ms_per_draw = start.elapsed().as_secs_f64() * 1e3 / samples as f64;
    let m = samples as f64;
    let variance = sq_dev / (m - 1.0) / (exact_norm * exact_norm);
    let rel = |target: &[f64]| dist(&mean, target) / exact_norm;
    Ok(EstimatorStats {
        name: est.name().to_string(),
        target: est.target(),
        bias: rel(&exact.total),
        bias_se: (variance / m).sqrt(),
        variance,
        cosine: cosine(&mean, &exact.total),
        mean_cosine: cos_sum / m,
        // the dense problem has no ∇₀/∇₁ split
        bias_nabla0: if exact.nabla0.is_empty() {
            f64::NAN
        } else {
            rel(&exact.nabla0)
        },
        bias_nabla1: if exact.nabla1.is_empty() {
            f64::NAN
        } else {
            rel(&exact.nabla1)
        },
        experts_per_token: experts / m,
        ms_per_draw,
        mean,
    })
}

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn dist(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// `cos(a, b)`, 0 when either is zero.
fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let (na, nb) = (norm(a), norm(b));
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        loss::dot(a, b) / (na * nb)
    }
}
