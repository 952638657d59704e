//! The estimators the lab compares, and how each one's draws are made with
//! [`GradientProbe`]: which router runs, on which logits, and what the router's gradient is
//! an estimate of.
//!
//! | name | router run by the probe | expectation approximates | experts per token |
//! |---|---|---|---|
//! | `sparsemixer` (hybrid), `sparsemixer-1st`, `sparsemixer-2rd` | itself, jitter r | ∇₀ + ∇₁ (the tape's `2∇̂`), under the *masked* π | 1 |
//! | `sparsemixer-v2` | itself, `top=1` | ∇₀ (no ×2, third-order rule), masked π | 1 |
//! | `st` | itself | ∇₀ (first order) | n |
//! | `gumbel-st` | itself, τ = 1 | ∇₀ (a relaxation, biased) | n |
//! | `reinforce` | itself, with its running baseline; each token's own loss is its reward | ∇₀ (unbiased) | 1 |
//! | `reinmax` | itself, τ = 1 | ∇₀ + ∇₁ (second order; exact for linear g) | n |
//! | `switch` | `sparsemixer-1st`, mask off, gradient halved | ∇₁ (unbiased) | 1 |
//! | `switch-jitter` (not in the default list) | `switch`, jitter r | — (D = argmax θ⊙u, not D ∼ π) | 1 |
//!
//! **`switch`.** The Switch router's gradient is plain backprop through the one expert that
//! ran, i.e. the ∇₁ term only. In the lab that rule is applied under the lab's own sampling
//! `D ∼ π`, so its expectation is exactly ∇₁ and it can be compared with the others on one
//! objective. The probe gets it from `sparsemixer-1st`, whose router gradient with c ≡ 1 is
//! exactly twice plain autograd of `y = π_D f_D` (tested in `tests/routers_sparsemixer.rs`):
//! halved, and with the
//! mask switched off by feeding the logits shifted by `b = 3·max|θ| + 1` with r = ½ (the softmax,
//! the Gumbel-max sample and the gradient are shift-invariant; every shifted logit then passes
//! `θ* − θ_j ≤ r(|θ*| + |θ_j|)`). The shipped `switch` router picks `D = argmax θ ⊙ u`, u ∼
//! U(1−r, 1+r) (SparseMixer Eq. 8), which is not a draw from π; its numbers are available as
//! `switch-jitter` and answer a different question (how far the deployed rule is from ∇).
//!
//! **`sparsemixer-v2`** fits the same objective: it samples one expert from the same masked π,
//! and its forward scale c ∈ {⅓, 1} is a quadrature of `g(π_D f_D) − g(0)`, the summand of ∇₀;
//! without SparseMixer's ×2 its expectation approximates ∇₀ alone, so against ∇ = ∇₀ + ∇₁ it
//! carries a ∇₁-sized bias, like ST and REINFORCE. `bias_nabla0` in the report shows how well it
//! does what it sets out to do.
//!
//! **The dense problem** (`--problem dense`, [`Objective::Dense`]) asks another question of the
//! routers that run k experts per token: how close does each one's router gradient come to the
//! gradient of the MoE that runs all n (`L = Σ_t g(Σ_i π_{t,i} f_{t,i})`, [`super::dense_gradient`])?
//!
//! | name | router run by the probe | reference | experts per token |
//! |---|---|---|---|
//! | `softmax` | itself (dense) | ∇ dense (exact: a check) | n |
//! | `topk-unnorm` | itself, k | ∇ dense | k |
//! | `topk` | itself, k (renormalised over the k) | ∇ dense | k |
//! | `default-moe` | itself, k, β = 0: each unselected expert answers the mean of its outputs over the tokens that chose it (the EMA's fixed point on a fixed problem) | ∇ dense | k |
//! | `sparsemixer-v2` | itself, `top=2` (GRIN's production setting) | ∇ dense | ≤ 2 |
//! | `remoe` | itself (ReLU gates) | its own loss's exact gradient ([`super::relu_gradient`]) | the open gates |
//!
//! **The top-2 sampled problem** (`--problem top2`, [`Objective::Top2`]) is the sampled layer at
//! top 2: two experts drawn without replacement, the second from the softmax over the rest, each
//! weighted by its own probability ([`super::top2_expected_loss`], enumerated over the n(n−1)
//! ordered pairs; its gradient by central differences, [`super::top2_gradient`]). Its estimator
//! is `sparsemixer-v2` with `top=2`, GRIN's production setting: the same layer drawn under
//! SparseMixer's mask, each draw with the third-order rule and no factor 2, so, as at top 1, its
//! expectation aims at the part of the gradient through the choices (no ∇₀/∇₁ split is computed
//! for two draws: `bias` is against the whole gradient).

use super::GradientProbe;
use crate::moe::RouterConfig;
use crate::{Device, Error, Result, Tensor};

/// The estimators `moegrad estimators` runs by default, in table order: the routers whose
/// registry entry has `estimator_lab: Some(row)` ([`crate::moe::LAB_ROUTER_NAMES`]).
pub const ESTIMATOR_NAMES: &[&str] = crate::moe::LAB_ROUTER_NAMES;

/// Estimators the lab also accepts, outside the default list.
pub const EXTRA_ESTIMATOR_NAMES: &[&str] = &["switch-jitter"];

/// The estimators of the dense problem (`--problem dense`), in table order (its default list).
pub const DENSE_ESTIMATOR_NAMES: &[&str] = &[
    "softmax",
    "topk-unnorm",
    "topk",
    "default-moe",
    "sparsemixer-v2",
    "remoe",
];

/// The estimators of the top-2 sampled problem (`--problem top2`).
pub const TOP2_ESTIMATOR_NAMES: &[&str] = &["sparsemixer-v2"];

/// Which objective the lab measures the estimators against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// SparseMixer's sampled top-1 layer, `L = Σ_t Σ_i π_i g(π_i f_i)` (the default)
    #[default]
    Sampled,
    /// the dense mixture `L = Σ_t g(Σ_i π_i f_i)`, for routers running k experts per token
    Dense,
    /// two experts sampled without replacement, `L = Σ_t Σ_{i≠j} π_i π'_j g(π_i f_i + π'_j f_j)`
    /// ([`super::top2_expected_loss`]), for SparseMixer-v2 at top 2
    Top2,
}

impl Objective {
    /// Reads `sampled` or `dense`.
    pub fn parse(s: &str) -> Result<Objective> {
        match s {
            "sampled" => Ok(Objective::Sampled),
            "dense" => Ok(Objective::Dense),
            "top2" => Ok(Objective::Top2),
            other => Err(Error::Invalid(format!(
                "--problem {other:?}: expected sampled, dense or top2"
            ))),
        }
    }
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Objective::Sampled => "sampled",
            Objective::Dense => "dense",
            Objective::Top2 => "top2",
        }
    }
    /// The estimators this objective accepts, in table order.
    pub fn estimators(self) -> Vec<&'static str> {
        match self {
            Objective::Sampled => ESTIMATOR_NAMES
                .iter()
                .chain(EXTRA_ESTIMATOR_NAMES)
                .copied()
                .collect(),
            Objective::Dense => DENSE_ESTIMATOR_NAMES.to_vec(),
            Objective::Top2 => TOP2_ESTIMATOR_NAMES.to_vec(),
        }
    }
    /// Its default list.
    pub fn default_estimators(self) -> Vec<String> {
        match self {
            Objective::Sampled => ESTIMATOR_NAMES.iter().map(|s| s.to_string()).collect(),
            Objective::Dense => DENSE_ESTIMATOR_NAMES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            Objective::Top2 => TOP2_ESTIMATOR_NAMES.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// Every estimator name the lab accepts, comma-separated (for error messages).
pub(super) fn known_estimators() -> String {
    ESTIMATOR_NAMES
        .iter()
        .chain(EXTRA_ESTIMATOR_NAMES)
        .copied()
        .collect::<Vec<_>>()
        .join(", ")
}

/// The quantity an estimator's expectation approximates (by design, before any bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// the full gradient ∇₀ + ∇₁
    Total,
    /// ∇₀ only
    Nabla0,
    /// ∇₁ only
    Nabla1,
    /// none of them (`switch-jitter` samples from another distribution)
    Other,
    /// the dense problem's gradient (`--problem dense`)
    Dense,
    /// the exact gradient of the router's own loss on the dense problem (`remoe`)
    Own,
}

impl Target {
    /// How the table prints it.
    pub fn label(self) -> &'static str {
        match self {
            Target::Total => "∇₀+∇₁",
            Target::Nabla0 => "∇₀",
            Target::Nabla1 => "∇₁",
            Target::Other => "-",
            Target::Dense => "∇ dense",
            Target::Own => "own ∇",
        }
    }
}

/// One estimator set up for drawing: the probe and how its output maps to an estimate.
pub struct LabEstimator {
    name: String,
    target: Target,
    probe: GradientProbe,
    /// added to every logit before the probe sees them
    shift: f64,
    /// multiplies the probe's gradient
    factor: f64,
}

impl LabEstimator {
    /// The estimator `name` of the sampled problem with `experts` experts and logits `logits`
    /// (`[T·n]`, to size `switch`'s shift), SparseMixer jitter `jitter`, noise seed `seed`.
    ///
    /// # Errors
    /// An unknown name (the message lists the accepted ones), or an error of the router.
    pub fn new(
        name: &str,
        experts: usize,
        logits: &[f64],
        jitter: f64,
        seed: u64,
    ) -> Result<LabEstimator> {
        let mut cfg = RouterConfig::new(experts, experts, 1);
        cfg.seed = seed;
        cfg.jitter = jitter;
        LabEstimator::sampled(name, cfg, logits)
    }

    /// The estimator `name` of the dense problem (see the module docs): `experts` experts of
    /// output width `dim`, `k` per token, SparseMixer jitter `jitter`, noise seed `seed`.
    ///
    /// # Errors
    /// A name outside [`DENSE_ESTIMATOR_NAMES`], or an error of the router (e.g. k > n).
    pub fn dense(
        name: &str,
        experts: usize,
        dim: usize,
        k: usize,
        jitter: f64,
        seed: u64,
    ) -> Result<LabEstimator> {
        let mut cfg = RouterConfig::new(experts, experts, k);
        cfg.d_out = dim;
        cfg.seed = seed;
        cfg.jitter = jitter;
        let target = match name {
            "softmax" | "topk-unnorm" | "topk" | "default-moe" | "sparsemixer-v2" => Target::Dense,
            "remoe" => Target::Own,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown estimator {other:?} for --problem dense; expected one of {}",
                    DENSE_ESTIMATOR_NAMES.join(", ")
                )));
            }
        };
        match name {
            // β = 0: the defaults are this draw's means, the EMA's fixed point on a fixed problem
            "default-moe" => {
                cfg.options.insert("beta".into(), "0".into());
            }
            // GRIN's production setting
            "sparsemixer-v2" => {
                cfg.options.insert("top".into(), "2".into());
            }
            _ => {}
        }
        Ok(LabEstimator {
            name: name.to_string(),
            target,
            probe: GradientProbe::new(name, &cfg, Device::cpu())?,
            shift: 0.0,
            factor: 1.0,
        })
    }

    /// The estimator `name` of the top-2 sampled problem: `sparsemixer-v2` with `top=2`, whose
    /// backward (the third-order rule for each of its two draws, no factor 2) aims at the part of
    /// the gradient through the choices, as at top 1.
    ///
    /// # Errors
    /// A name outside [`TOP2_ESTIMATOR_NAMES`], or an error of the router.
    pub fn top2(name: &str, experts: usize, jitter: f64, seed: u64) -> Result<LabEstimator> {
        if !TOP2_ESTIMATOR_NAMES.contains(&name) {
            return Err(Error::Invalid(format!(
                "unknown estimator {name:?} for --problem top2; expected one of {}",
                TOP2_ESTIMATOR_NAMES.join(", ")
            )));
        }
        let mut cfg = RouterConfig::new(experts, experts, 2);
        cfg.seed = seed;
        cfg.jitter = jitter;
        cfg.options.insert("top".into(), "2".into());
        Ok(LabEstimator {
            name: name.to_string(),
            target: Target::Nabla0,
            probe: GradientProbe::new(name, &cfg, Device::cpu())?,
            shift: 0.0,
            factor: 1.0,
        })
    }

    fn sampled(name: &str, mut cfg: RouterConfig, logits: &[f64]) -> Result<LabEstimator> {
        let (router, target, shift, factor) = match name {
            "sparsemixer" | "sparsemixer-1st" | "sparsemixer-2rd" | "reinmax" => {
                (name, Target::Total, 0.0, 1.0)
            }
            "sparsemixer-v2" | "st" | "gumbel-st" | "reinforce" => (name, Target::Nabla0, 0.0, 1.0),
            "switch" => {
                cfg.jitter = 0.5;
                let m = logits.iter().fold(0.0f64, |a, v| a.max(v.abs()));
                ("sparsemixer-1st", Target::Nabla1, 3.0 * m + 1.0, 0.5)
            }
            "switch-jitter" => ("switch", Target::Other, 0.0, 1.0),
            other => {
                return Err(Error::Invalid(format!(
                    "unknown estimator {other:?}; expected one of {}",
                    known_estimators()
                )));
            }
        };
        Ok(LabEstimator {
            name: name.to_string(),
            target,
            probe: GradientProbe::new(router, &cfg, Device::cpu())?,
            shift,
            factor,
        })
    }

    /// The lab's name of the estimator.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What its expectation approximates.
    pub fn target(&self) -> Target {
        self.target
    }

    /// One draw: the estimate of `∂L/∂θ` (`[T·n]`) and the experts evaluated per token.
    /// `logits` `[T, n]` and `outputs` `[T, n, d]` are the problem's tensors, `loss` its
    /// tensor loss; each call uses fresh noise (reproducibly, from the seed).
    ///
    /// # Errors
    /// Any error of the probe or the loss.
    pub fn draw(
        &self,
        logits: &Tensor,
        outputs: &Tensor,
        loss: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<(Vec<f64>, f64)> {
        let est = if self.shift != 0.0 {
            self.probe
                .estimate(&logits.add_scalar(self.shift)?, outputs, loss)?
        } else {
            self.probe.estimate(logits, outputs, loss)?
        };
        let mut g = est.grad.to_vec_f64()?;
        if self.factor != 1.0 {
            g.iter_mut().for_each(|v| *v *= self.factor);
        }
        Ok((g, est.experts_per_token))
    }
}
